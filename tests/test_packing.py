"""Packed micro-batches (issue 39): the packing arithmetic against hand-checked cases, and
packed against padded passes at every layout against a single-process padded reference.

The multi-rank worker (``workers/packing_paths.py``) runs one synthetic rollout of
long-tailed lengths at TP=2, PP=2, PP=2 with VPP=2, DP=2, TP=2 x PP=2 and PP=2 x DP=2 (a
llama), and at one process and TP=2 x DP=2 (GPT-2, whose learned positions read the
position ids):
the experience passes (log-probs, entropy, values, last values), then one update of actor
and critic whose old log-probs are the packed pass's, regrouped at another token budget.
Sequence parallelism (issue 57) runs the same cases at TP=2 (the extended tier: with PP=2,
and with full recomputation at DP=2), micro-batches of odd lengths included, and a
Qwen3-MoE-shaped model trains at TP=2 x EP=2 with it against its own single process.
"""

import os
import random

import pytest
import torch

from conftest import WORKERS, torchrun
from megarlhf import algos
from megarlhf.config import ConfigError, load_config
from megarlhf.data.packing import (MIN_ROWS, balance, budget_groups, pack_prompt_response,
                                   pack_rows, pack_weighted, pad_packed, unpack)
from megarlhf.speedups.linears import FEW_ROWS

# ------------------------------------------------------------------ the arithmetic


def test_balance_shares_tokens_within_one_sequence():
    """Every sample in exactly one share, no share empty, and the heaviest share at most
    the longest sample above the lightest (the issue's "within one sequence"); the same
    split on every call (resume is bitwise)."""
    rng = random.Random(0)
    for _ in range(300):
        n, parts = rng.randint(1, 40), rng.randint(1, 6)
        lengths = [int(rng.paretovariate(1.2) * 10) for _ in range(n)]
        shares = balance(lengths, parts)
        assert sorted(i for s in shares for i in s) == list(range(n))
        if n >= parts:
            assert all(shares)
        tokens = [sum(lengths[i] for i in s) for s in shares]
        assert max(tokens) - min(tokens) <= max(lengths)
        assert shares == balance(list(lengths), parts)
        assert all(s == sorted(s) for s in shares)


def test_balance_by_hand():
    # longest first: 9 -> share 0, 5 -> 1, 4 -> 1 (5 < 9), 3 -> 1 (9 = 9: fewer samples? no,
    # share 0 has 1, share 1 has 2 -> share 0 by tokens 9 vs 9, samples 1 < 2)
    assert balance([3, 9, 4, 5], 2) == [[0, 1], [2, 3]]
    assert balance([1, 1, 1, 1], 4) == [[0], [1], [2], [3]]
    assert balance([5], 2) == [[0], []]


def test_budget_groups_respect_the_budget():
    rng = random.Random(1)
    for _ in range(300):
        n = rng.randint(1, 30)
        lengths = [rng.randint(1, 50) for _ in range(n)]
        budget = rng.randint(50, 200)
        idx = sorted(rng.sample(range(n), rng.randint(1, n)))
        groups = budget_groups(idx, lengths, budget)
        assert sorted(i for g in groups for i in g) == idx
        assert all(sum(lengths[i] for i in g) <= budget for g in groups)
        # first-fit decreasing opens a new micro-batch only when the sample fits nowhere:
        # at most one micro-batch is under half full
        assert sum(sum(lengths[i] for i in g) * 2 <= budget for g in groups) <= 1
    assert budget_groups([0, 1, 2], [30, 30, 30], 60) == [[0, 1], [2]]


def test_a_sequence_over_the_budget_is_an_error_naming_the_setting():
    with pytest.raises(ValueError, match=r"61 tokens exceeds ppo.max_tokens_per_micro_batch=60"):
        budget_groups([0, 1], [10, 61], 60, what="ppo.max_tokens_per_micro_batch")


def batch_of(prompts, responses, T=6):
    """Left-padded prompts and right-padded responses, as a rollout holds them."""
    P = max(len(p) for p in prompts)
    tok_p = torch.zeros(len(prompts), P, dtype=torch.long)
    mask_p = torch.zeros(len(prompts), P, dtype=torch.long)
    tok_r = torch.zeros(len(prompts), T, dtype=torch.long)
    mask_r = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        tok_p[b, P - len(p):] = torch.tensor(p)
        mask_p[b, P - len(p):] = 1
        tok_r[b, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask_r[b, :len(r)] = 1
    return tok_p, mask_p, tok_r, mask_r


def test_packed_row_by_hand():
    prompts, responses = [[11, 12], [21, 22, 23], [31]], [[13, 14, 15], [], [32]]
    lm = pack_prompt_response(*batch_of(prompts, responses), kind="lm", pad_id=0)
    real = [11, 12, 13, 14, 15, 21, 22, 23, 31, 32]
    L = max(len(real), MIN_ROWS)
    assert lm["tokens"][0, :10].tolist() == real and lm["tokens"].shape == (1, L)
    assert lm["tokens"][0, 10:].eq(0).all()  # the padding segment
    assert lm["cu_seqlens"].tolist() == [0, 5, 8, 10, L]
    assert lm["position_ids"][0, :10].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1]
    assert lm["position_ids"][0, 10:].eq(0).all()  # padding: inside any position table
    # the outputs that predict each response token: 12 -> 13, 13 -> 14, 14 -> 15, 31 -> 32
    assert lm["keep"][:4].tolist() == [1, 2, 3, 8]
    assert lm["targets"][0, :4].tolist() == [13, 14, 15, 32]
    assert lm["unpack"][:4].tolist() == [0, 1, 2, 2 * 6 + 0]
    assert len(lm["keep"]) == MIN_ROWS and lm["unpack"][4:].eq(-1).all()
    value = pack_prompt_response(*batch_of(prompts, responses), kind="value")
    # each sample's states before its response tokens, then its last token's
    assert value["keep"][:7].tolist() == [1, 2, 3, 4, 7, 8, 9]
    assert value["last_keep"].tolist() == [3, 4, 6]
    assert value["unpack"][:7].tolist() == [0, 1, 2, -1, -1, 12, -1]


def test_unpack_puts_outputs_in_the_padded_grid_and_passes_gradients():
    batch = pack_prompt_response(*batch_of([[5, 6], [7]], [[8, 9], [10]], T=3), kind="lm")
    out = torch.arange(1.0, len(batch["keep"]) + 1).view(1, -1).requires_grad_()
    grid = unpack(out, batch)
    assert grid.tolist() == [[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]]
    grid.sum().backward()
    assert out.grad[0, :3].tolist() == [1.0, 1.0, 1.0] and out.grad[0, 3:].eq(0).all()


def test_pad_packed_adds_one_segment():
    batch = pack_prompt_response(*batch_of([[5] * 40, [7] * 30], [[8] * 3, [1]]), kind="lm")
    padded = pad_packed(batch, 90)
    assert padded["tokens"].shape == (1, 90)
    assert padded["cu_seqlens"].tolist() == batch["cu_seqlens"].tolist() + [90]
    assert padded["position_ids"][0, 74:].eq(0).all()


def test_min_rows_is_above_the_short_matmul_way():
    """Below FEW_ROWS rows ``speedups.linears`` multiplies the other way round, and a
    sample's outputs then depend on its neighbours (data.packing's docstring)."""
    assert MIN_ROWS > FEW_ROWS


def test_packed_rows_by_hand():
    """``pack_rows`` (the supervised stages): kept outputs land in their row's grid
    columns in order; ``pack_weighted`` keeps the positions of nonzero weight (each
    predicts the next token) and carries the weights into the grid."""
    batch = pack_rows([[1, 2, 3], [4, 5]], [[2], [0, 1]])
    assert batch["tokens"][0, :5].tolist() == [1, 2, 3, 4, 5]
    assert batch["cu_seqlens"].tolist() == [0, 3, 5, MIN_ROWS]
    assert batch["keep"][:3].tolist() == [2, 3, 4] and batch["grid"] == (2, 2)
    assert batch["unpack"][:3].tolist() == [0, 2, 3] and batch["unpack"][3:].eq(-1).all()
    assert batch["targets"][0, :3].tolist() == [4, 5, 0]  # 3's "next" is the next row's
    assert unpack(torch.arange(1.0, MIN_ROWS + 1).view(1, -1), batch).tolist() == \
        [[1.0, 0.0], [2.0, 3.0]]
    # (tokens, weights): weights[t] weighs predicting tokens[t + 1]
    weighted = pack_weighted([([7, 8, 9, 10], [0, 1, 0.5, 0]), ([11, 12], [1, 0])])
    assert weighted["keep"][:3].tolist() == [1, 2, 4]
    assert weighted["targets"][0, :3].tolist() == [9, 10, 12]
    assert weighted["loss_mask"].tolist() == [[1.0, 0.5], [1.0, 0.0]]
    with pytest.raises(ValueError, match="outside its 2 tokens"):
        pack_rows([[1, 2]], [[2]])


def test_an_empty_prompt_cannot_be_packed():
    with pytest.raises(ValueError, match="empty prompt"):
        pack_prompt_response(torch.zeros(1, 2, dtype=torch.long),
                             torch.zeros(1, 2, dtype=torch.long),
                             torch.ones(1, 2, dtype=torch.long),
                             torch.ones(1, 2, dtype=torch.long), kind="lm")


# ------------------------------------------------------------------ the settings

def test_budget_below_the_longest_sample_is_refused_before_any_work():
    from megarlhf.config.rules import check_ppo
    from megarlhf.config.written import Written

    for field in ("ppo.max_tokens_per_micro_batch", "rollout.forward_max_tokens_per_micro_batch"):
        cfg = load_config(None, ["data.max_prompt_len=100", "rollout.max_new_tokens=50",
                                 f"{field}=149", "ppo.sft_checkpoint=/x",
                                 "rollout.rewards.fn=a:b"])
        with pytest.raises(ConfigError, match=rf"{field}=149 cannot hold the longest sample.*"
                                              r"at least 150"):
            check_ppo(cfg, Written(frozenset()))
    cfg = load_config(None, ["rollout.forward_max_tokens_per_micro_batch=512",
                             "rollout.forward_micro_batch_size=4", "ppo.sft_checkpoint=/x",
                             "rollout.rewards.fn=a:b"])
    with pytest.raises(ConfigError, match="forward_micro_batch_size has no effect"):
        check_ppo(cfg, Written(frozenset({"rollout.forward_micro_batch_size"})))
    # the experience passes inherit the updates' budget
    cfg = load_config(None, ["ppo.max_tokens_per_micro_batch=512",
                             "rollout.forward_micro_batch_size=4", "ppo.sft_checkpoint=/x",
                             "rollout.rewards.fn=a:b"])
    with pytest.raises(ConfigError, match=r"no effect: the experience passes are packed "
                                          r"\(ppo.max_tokens_per_micro_batch is set\)"):
        check_ppo(cfg, Written(frozenset({"rollout.forward_micro_batch_size",
                                          "ppo.max_tokens_per_micro_batch"})))
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        load_config(None, ["ppo.max_tokens_per_micro_batch=0"])


def test_every_pass_packs_by_default_at_the_padded_micro_batchs_bound():
    """The ``auto`` budgets (the default): micro-batch size x the longest sample the config
    allows - PPO's prompt + response (an environment's episode: data.max_seq_len), the
    experience passes' own micro-batch size, a supervised pair twice a sequence, the cache
    its own rows - and ``null`` (padded), a number, data.packing as written. Catches a
    default that stops packing, a budget sized by the wrong length or micro-batch size
    (one too small refuses its own longest sample; too large breaks the memory bound)."""
    from megarlhf.config.rules import check_ppo, check_supervised
    from megarlhf.config.written import Written
    from megarlhf.data.budgets import cache_budget, forward_budget, train_budget, update_budget

    ppo = ["data.max_prompt_len=100", "rollout.max_new_tokens=50", "ppo.micro_batch_size=3",
           "ppo.sft_checkpoint=/x", "rollout.rewards.fn=a:b", "ppo.critic_init=sft"]
    cfg = load_config(None, ppo)
    assert (update_budget(cfg), forward_budget(cfg)) == (450, 450)
    cfg = load_config(None, ppo + ["rollout.forward_micro_batch_size=8"])
    assert (update_budget(cfg), forward_budget(cfg)) == (450, 1200)
    check_ppo(cfg, Written(frozenset({"rollout.forward_micro_batch_size"})))  # it has effect
    env = ppo[:4] + ["rollout.environment.name=a:b", "ppo.critic_init=sft"]
    cfg = load_config(None, env + ["data.max_seq_len=300"])
    assert update_budget(cfg) == 900
    with pytest.raises(ConfigError, match=r"=899 cannot hold the longest sample, "
                                          r"data.max_seq_len \(an environment's episode\)"):
        check_ppo(load_config(None, env + ["data.max_seq_len=900",
                                           "ppo.max_tokens_per_micro_batch=899"]),
                  Written(frozenset()))
    cfg = load_config(None, ppo + ["ppo.max_tokens_per_micro_batch=null"])
    assert (update_budget(cfg), forward_budget(cfg)) == (None, None)
    cfg = load_config(None, ppo + ["ppo.max_tokens_per_micro_batch=500"])
    assert (update_budget(cfg), forward_budget(cfg)) == (500, 500)
    train = ["data.max_prompt_len=32", "data.max_seq_len=64", "train.micro_batch_size=2",
             "cache.micro_batch_size=5"]
    cfg = load_config(None, train)
    assert (train_budget(cfg), train_budget(cfg, sequences=2), cache_budget(cfg)) \
        == (128, 256, 320)
    check_supervised(load_config(None, train + ["data.packing=true"]))  # auto yields to it
    assert train_budget(load_config(None, train + ["data.packing=true"])) is None
    cfg = load_config(None, train + ["train.max_tokens_per_micro_batch=null"])
    assert (train_budget(cfg), cache_budget(cfg)) == (None, None)
    assert cache_budget(load_config(None, train + ["train.max_tokens_per_micro_batch=99"])) \
        == 99
    assert load_config(None, []).ppo.max_tokens_per_micro_batch == "auto"
    with pytest.raises(ConfigError, match="ppo.max_tokens_per_micro_batch='most'"):
        load_config(None, ["ppo.max_tokens_per_micro_batch=most"])


def test_supervised_packing_settings_are_checked_before_any_work(tmp_path):
    """``train.max_tokens_per_micro_batch`` (sft, rm, dpo, distill): refused beside
    data.packing (train.micro_batch_size is not: the shipped configs set it, and packed
    it is unused, as ppo.micro_batch_size); a sample (a pair: both sequences) over
    the budget is named with the setting; a global batch under the DP size refused."""
    from megarlhf.config.rules import check_supervised
    from megarlhf.stages.rm import pair_tokens
    from megarlhf.stages.supervised import StepPlan, check_budget

    with pytest.raises(ConfigError, match="both pack: choose one"):
        check_supervised(load_config(None, ["data.packing=true",
                                            "train.max_tokens_per_micro_batch=256"]))
    check_supervised(load_config(None, ["train.max_tokens_per_micro_batch=256",
                                        "train.micro_batch_size=2"]))
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        load_config(None, ["train.max_tokens_per_micro_batch=0"])
    cfg = load_config(None, ["train.max_tokens_per_micro_batch=20"])
    pairs = [([1] * 3, [2] * 4, [3] * 5), ([1] * 5, [2] * 6, [3] * 7)]  # 15 and 23 tokens
    with pytest.raises(ValueError, match=r"=20 cannot hold training pair 2, 23 tokens.*"
                                         r"at least 23"):
        check_budget(cfg, pairs, pair_tokens, "training pair")
    check_budget(cfg, pairs[:1], pair_tokens, "training pair")
    StepPlan(4, 1, 4, 10, 1, None, max_tokens=64).validate()  # 4 samples / 4 ranks
    with pytest.raises(ValueError, match="leaves a data-parallel rank without samples"):
        StepPlan(3, 1, 4, 10, 1, None, max_tokens=64).validate()
    assert "packed micro-batches of at most 64" in StepPlan(6, 1, 4, 10, 1, None,
                                                            max_tokens=64).describe()


def test_packed_batch_sizes_need_only_a_sample_per_rank():
    sizes = algos.BatchSizes(12, 6, 4, 4, max_tokens=512).validate()  # 6 / 4 ranks: fine
    assert "packed micro-batches of at most 512 tokens" in sizes.describe()
    with pytest.raises(ValueError, match="below the data-parallel size"):
        algos.BatchSizes(12, 2, 4, 4, max_tokens=512).validate()
    with pytest.raises(ValueError, match="not divisible"):
        algos.BatchSizes(12, 6, 4, 4).validate()  # padded: 6 samples over 4 ranks


# ------------------------------------------------------------------ packed = padded

TOL = 1e-6  # fp32; relative above 1


class Layouts(dict):
    """Results by case (arch, tp, pp, vpp, dp); a world's worker runs the first time one
    of its cases is asked for (a test of one-process cases runs one process)."""

    def __init__(self, out: str):
        super().__init__()
        self.out, self.ran = out, set()

    def __missing__(self, case):
        world = case[1] * case[2] * case[4]
        if world in self.ran:
            raise KeyError(case)
        self.ran.add(world)
        torchrun(os.path.join(WORKERS, "packing_paths.py"), world, self.out)
        self.update(torch.load(os.path.join(self.out, f"packing_world{world}.pt"),
                               weights_only=False))
        return self[case]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    return Layouts(str(tmp_path_factory.mktemp("packing")))


# "+sp": sequence parallelism; "+full": full recomputation too (issue 57)
CASES = [("llama", 1, 1, 1, 1), ("llama", 2, 1, 1, 1), ("llama", 1, 2, 1, 1),
         ("llama", 1, 2, 2, 1), ("llama", 1, 1, 1, 2), ("llama", 2, 2, 1, 1),
         ("llama", 1, 2, 1, 2), ("gpt2", 1, 1, 1, 1), ("gpt2", 2, 1, 1, 2),
         ("llama+sp", 2, 1, 1, 1), ("llama+sp", 2, 2, 1, 1), ("llama+sp+full", 2, 1, 1, 2),
         ("qwen3moe", 1, 1, 1, 1), ("qwen3moe+sp+ep2", 2, 1, 1, 1)]
IDS = "{}-tp{}-pp{}-vpp{}-dp{}".format
# the 4-process combinations (TP=2 x PP=2, PP=2 x DP=2, SP x PP=2, SP x recomputation x
# DP=2, GPT-2 at TP=2 x DP=2) in the extended tier: the fast tier keeps every dimension
# alone (and never starts the 4-process worker)
TIERED = [pytest.param(c, marks=pytest.mark.extended if c[1] * c[2] * c[4] == 4 else ())
          for c in CASES]


def reference(layouts, case) -> dict:
    """The single-process padded run of the case's architecture."""
    return layouts[(case[0].split("+")[0], 1, 1, 1, 1)]


def close(a, b, what):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    gap = float(((a - b).abs() / b.abs().clamp(min=1.0)).max())
    assert gap <= TOL, f"{what}: packed differs from the padded reference by {gap:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("case", TIERED, ids=lambda c: IDS(*c))
def test_packed_passes_equal_the_single_process_padded_ones(layouts, case):
    ref, got = reference(layouts, case), layouts[case]
    on, marked = got["sequence_parallel"]
    assert on == ("+sp" in case[0]) and (marked > 0) == on, got["sequence_parallel"]
    for key in ("logprobs", "entropy", "values", "last"):
        close(got["forward"][True][key], ref["forward"][False][key], key)
    # the same layout's padded pass too (the worker's long tail: most positions padding)
    assert got["forward"][False]["padding_fraction"] > 0.7
    assert got["forward"][True]["padding_fraction"] < got["forward"][False]["padding_fraction"]


@pytest.mark.slow
@pytest.mark.parametrize("case", TIERED, ids=lambda c: IDS(*c))
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_packed_update_equals_the_padded_one(layouts, case, role):
    """Every loss as the metrics report it (its sum over the mini-batch over the loss
    count), the token counts, the global gradient norm (against one padded process), and
    each parameter shard's gradient (against the padded update at the same layout)."""
    ref, got = reference(layouts, case)[role], layouts[case][role]
    logs, want = got["packed"]["logs"], ref["padded"]["logs"]
    assert set(logs) == set(want)
    assert logs["tokens"] == want["tokens"] and logs["loss_count"] == want["loss_count"]
    for key, value in logs.items():
        # approx-KL to the old log-probs, which the packed pass computed: 0 packed (the
        # no-op test), a sum of rounding differences padded
        if key.endswith("_sum") and key not in ("approxkl_sum", "clipfrac_sum"):
            close(value / logs["loss_count"], want[key] / want["loss_count"], key)
    close(got["packed"]["norm"], ref["padded"]["norm"], "gradient norm")
    assert got["grad_gap"] <= TOL * max(1.0, got["grad_scale"]), got
    assert got["grad_scale"] > 0.01  # the update had gradients to compare


@pytest.mark.slow
@pytest.mark.parametrize("case", TIERED, ids=lambda c: IDS(*c))
def test_packed_update_at_the_old_policy_is_a_no_op(layouts, case):
    """Old log-probs from the packed experience pass, the update packed at another budget
    (other micro-batches, other neighbours): the ratio is exactly 1."""
    logs = layouts[case]["actor"]["packed"]["logs"]
    assert logs["approxkl_sum"] == 0.0 and logs["clipfrac_sum"] == 0.0, logs


@pytest.mark.slow
@pytest.mark.parametrize("case", TIERED, ids=lambda c: IDS(*c))
@pytest.mark.parametrize("task", ["sft", "rm", "dpo", "distill"])
def test_packed_supervised_losses_equal_the_padded_ones(layouts, case, task):
    """SFT, the reward model's pairwise loss, DPO and distillation on the micro-batches
    ``stages.supervised.micro_batches`` packs (shares balanced by tokens, whole pairs per
    micro-batch) against padded ones of 2 samples in one process: every summed log, the
    gradient norm, and each gradient shard against the padded pass at the same layout."""
    ref = reference(layouts, case)["supervised"][task]
    got = layouts[case]["supervised"][task]
    logs, want = got["packed"]["logs"], ref["padded"]["logs"]
    assert set(logs) == set(want)
    count = "pairs" if "pairs" in want else "tokens"
    assert logs[count] == want[count] > 0
    for key, value in logs.items():
        close(value / logs[count], want[key] / want[count], f"{task} {key}")
    close(got["packed"]["norm"], ref["padded"]["norm"], f"{task} gradient norm")
    assert got["grad_gap"] <= TOL * max(1.0, got["grad_scale"]), got
    assert got["grad_scale"] > 0.01
