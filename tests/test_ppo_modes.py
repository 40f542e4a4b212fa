"""PPO modes against loop references (issue 14).

A tiny SFT policy (checkpoints at steps 3 and 6: the actor starts at 6, the reference is
3, so the KL to the reference is not zero at the first iteration) and reward model; then
one worker process runs a PPO iteration per mode and the tests recompute what each mode
must have done from the experience it logged:

- the no-op gate: one epoch, one mini-batch, so the update starts at the old policy and
  approx-KL and clip fraction are exactly 0 - for every estimator, stopping at EOS or not;
- ``stop_at_eos=false``: trained tokens end at the first EOS, the missing-stop rule holds;
- the KL in the reward (RLOO) and as a loss term (GRPO) change the update, by the formula;
- GRPO's token-level normalisation, the decoupled loss, the mismatch correction and PPO-ptx
  against plain loops over the experience; dynamic sampling keeps informative groups;
- the critic from the reward model predicts the normalised score at its first step;
- 2 processes (DP=2) follow 1 process.
"""

import json
import os

import pytest
import torch

from conftest import ROOT, WORKERS, run_cli, torchrun
from megarlhf.data.synthetic import write_jsonl

pytestmark = pytest.mark.slow

GRPO = ["ppo.advantage_estimator=grpo", "ppo.group_size=2", "ppo.rollout_batch_size=16",
        "ppo.kl.init_coef=0", "ppo.kl.controller=fixed"]
RLOO = ["ppo.advantage_estimator=rloo", "ppo.group_size=2", "ppo.rollout_batch_size=16"]
RPP = ["ppo.advantage_estimator=reinforce_pp"]
ESTIMATORS = {"gae": [], "grpo": GRPO + ["ppo.kl.loss_coef=0.5"], "rloo": RLOO, "rpp": RPP}
NO_STOP = ["rollout.stop_at_eos=false"]
# Packed micro-batches (issue 39), the updates' at another budget than the experience
# passes', so each sample's neighbours change between its old log-prob and its update.
PACK = ["ppo.max_tokens_per_micro_batch=96", "rollout.forward_max_tokens_per_micro_batch=160"]


def cases(out) -> dict:
    ptx = ["ppo.ptx_coef=0.5", f"data.ptx_path={out}/ptx.jsonl", "ppo.ptx_batch_size=16"]
    table = {}
    for name, extra in ESTIMATORS.items():
        table[f"{name}_stop"] = extra
        table[f"{name}_nostop"] = extra + NO_STOP
        table[f"{name}_packed"] = extra + PACK
    table.update({
        "rloo_beta0": RLOO + ["ppo.kl.init_coef=0"],
        "rpp_beta0": RPP + ["ppo.kl.init_coef=0", "rollout.ref_cache_size=0"],
        "grpo_nokl": GRPO,
        "grpo_token": GRPO + ["ppo.kl.loss_coef=0.5", "ppo.grpo_normalization=token"],
        "decoupled": ["ppo.policy_loss=decoupled", "ppo.correction.behavior_weight_cap=1.0000001"],
        "correction": ["ppo.correction.is_cap=1.0000001", "ppo.correction.mask_low=0.9999999",
                       "ppo.correction.mask_high=1.0000001"],
        "bypass": ["rollout.recompute_logprobs=false"],
        "ptx": ptx,
        "dynamic": RLOO + ["ppo.reward_checkpoint=null",
                           "rollout.rewards.fn=megarlhf.data.synthetic:gold_reward_pair",
                           "ppo.dynamic_sampling=true", "ppo.max_sampling_rounds=3",
                           "ppo.overlong_buffer=4"],
    })
    table = {name: {"overrides": extra, "iterations": 1} for name, extra in table.items()}
    # DP=2 against 1 process: two iterations, two mini-batches, with the KL loss and ptx.
    table["dp"] = {"overrides": ["ppo.mini_batch_size=16", "ppo.kl.loss_coef=0.1", *ptx],
                   "iterations": 2}
    table["dp_packed"] = {"overrides": table["dp"]["overrides"] + PACK, "iterations": 2}
    return table


@pytest.fixture(scope="module")
def setup(tiny_checkpoints):
    out, task, common = tiny_checkpoints
    # Short pretraining rows, so no ptx row is cut to the experience batch's length.
    write_jsonl(str(out / "ptx.jsonl"), [{"prompt": "words: red", "response": w}
                                         for w in ("red", "blue cat", "two", "green")] * 8)
    base = [f"data.train_path={task['prompts']}", f"data.eval_path={task['eval_prompts']}",
            f"ppo.sft_checkpoint={out}/sft-tiny/checkpoints/step_0000006",
            f"roles.reference.checkpoint={out}/sft-tiny/checkpoints/step_0000003",
            f"ppo.reward_checkpoint={out}/rm-tiny/checkpoints", "ppo.ppo_epochs=1",
            "ppo.rollout_batch_size=32", "ppo.mini_batch_size=32", "ppo.micro_batch_size=8",
            "ppo.max_tokens_per_micro_batch=null", *common]  # padded, but where a case packs
    table = cases(out)
    for case in table.values():
        case["overrides"] = base + case["overrides"]
    path = out / "cases.json"
    path.write_text(json.dumps(table))
    worker = os.path.join(WORKERS, "ppo_modes.py")
    torchrun(worker, 1, str(path), str(out))
    (out / "dp.json").write_text(json.dumps({k: table[k] for k in ("dp", "dp_packed")}))
    torchrun(worker, 2, str(out / "dp.json"), str(out))
    return out, base, task


def load(setup, name, world=1):
    out = setup[0]
    return torch.load(out / f"{name}.world{world}.pt", weights_only=False)


def masked_mean(x, mask):
    return float((x * mask).sum() / mask.sum())


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
@pytest.mark.parametrize("stop", ["stop", "nostop", "packed"])
def test_first_mini_batch_is_a_no_op(setup, estimator, stop):
    """An update at the old policy: ratio 1 on every token (the trainer recomputes exactly
    what it trains on), so approx-KL and clip fraction are exactly 0; the sampler agrees
    to fp32 rounding. Packed, too: the updates regroup the samples into other micro-batches
    than the old log-prob pass's, and a sample's numbers do not depend on its
    neighbours."""
    run = load(setup, f"{estimator}_{stop}")
    m = run["metrics"][0]
    assert m["ppo/policy/approxkl"] == 0.0 and m["ppo/policy/clipfrac"] == 0.0, m
    assert m["rollout/logprob_diff_max"] < 1e-5
    assert m["rollout_corr/kl"] < 1e-10
    exp = run["experience"]
    # pg loss at ratio 1 is -mean(A) over the trained tokens
    want = -masked_mean(exp["advantages_BT"], exp["policy_mask_BT"])
    assert m["ppo/policy/pg_loss"] == pytest.approx(want, abs=1e-6)
    assert not torch.equal(run["before"], run["after"])  # it did train


def test_no_eos_stop_trains_the_truncated_response(setup):
    """stop_at_eos=false samples past EOS; the trained response ends at the first stop
    token, and samples without one get the missing-stop score."""
    run = load(setup, "gae_nostop")
    exp, finished = run["experience"], run["finished"]
    tokens, mask = exp["response_tokens_BT"], exp["response_mask_BT"]
    eos = run["eos_id"]
    for b in range(tokens.shape[0]):
        n = int(mask[b].sum())
        stops = (tokens[b, :n] == eos).nonzero().flatten().tolist()
        assert stops in ([], [n - 1]), (b, tokens[b], mask[b])  # nothing after the stop
        assert bool(finished[b]) == (stops == [n - 1])
        assert exp["rollout_logprobs_BT"][b, n:].abs().sum() == 0
        assert exp["old_logprobs_BT"][b, n:].abs().sum() == 0
        if not finished[b]:
            assert float(exp["scores_B"][b]) == -1.0  # ppo.missing_stop_penalty
    assert finished.any() and run["metrics"][0]["rollout/eos_fraction"] > 0
    # with stop_at_eos=true the sampler stopped there itself: same shapes of truth
    stop = load(setup, "gae_stop")["experience"]
    assert (stop["response_tokens_BT"][stop["response_mask_BT"] == 0] != eos).all()


def _whiten(x, mask):
    n = mask.sum()
    mean = (x * mask).sum() / n
    var = (((x - mean) ** 2) * mask).sum() / (n - 1)
    return (x - mean) * torch.rsqrt(var + 1e-8) * mask


def test_kl_in_the_reward_shapes_rloo_advantages(setup):
    """RLOO with the KL in the reward (TRL's RLOO): sequence reward = score - beta x sum KL,
    baseline = mean of the other samples; beta 0 gives other advantages and another update."""
    run, zero = load(setup, "rloo_stop"), load(setup, "rloo_beta0")
    exp = run["experience"]
    mask = exp["response_mask_BT"]
    beta = 0.3  # configs/demo/ppo.yaml's init_kl_coef, the first iteration's value
    reward = exp["scores_B"] - beta * exp["kl_BT"].sum(dim=1)
    groups = reward.view(-1, 2)
    adv = (groups - groups.flip(1)).reshape(-1)  # k=2: the other sample is the baseline
    want = _whiten(adv.unsqueeze(1) * mask, mask)
    torch.testing.assert_close(exp["advantages_BT"], want, rtol=1e-4, atol=1e-5)
    assert exp["kl_BT"].abs().sum() > 0  # actor (step 6) != reference (step 3)
    assert not torch.equal(exp["advantages_BT"], zero["experience"]["advantages_BT"])
    assert not torch.equal(run["after"], zero["after"])


def test_kl_in_the_reward_shapes_reinforce_pp_returns(setup):
    """REINFORCE++: whitened returns of r_t = -beta KL_t (+ the clipped score at the last
    token); beta 0 gives another update."""
    run, zero = load(setup, "rpp_stop"), load(setup, "rpp_beta0")
    exp = run["experience"]
    mask = exp["response_mask_BT"]
    rewards = -0.3 * exp["kl_BT"] * mask
    last = mask.sum(1).long() - 1
    for b in range(len(last)):
        if last[b] >= 0:
            rewards[b, last[b]] += exp["scores_B"][b].clamp(-5, 5)
    returns = rewards.flip(1).cumsum(1).flip(1) * mask
    torch.testing.assert_close(exp["advantages_BT"], _whiten(returns, mask), rtol=1e-4,
                               atol=1e-5)
    assert not torch.equal(run["after"], zero["after"])


def test_reference_cache_size_zero_turns_it_off(setup):
    """rollout.ref_cache_size=0 (the rpp_beta0 case) builds no reference log-prob cache,
    and the reference still scores every row; the other runs hold one of the default size."""
    off, on = load(setup, "rpp_beta0"), load(setup, "rpp_stop")
    assert off["ref_cache_capacity"] == 0 and on["ref_cache_capacity"] == 4096
    assert off["metrics"][0]["rollout/ref_cache_hit_rate"] == 0.0
    ref, mask = off["experience"]["ref_logprobs_BT"], off["experience"]["response_mask_BT"]
    assert ((ref < 0) == (mask > 0)).all()  # a log-prob on every response token


def test_kl_loss_term_is_grpos(setup):
    """GRPO with kl_loss_coef: loss = pg loss + coef x mean k3(policy, reference); at the old
    policy the k3 term is the experience's. Without it the update is another one."""
    run, nokl = load(setup, "grpo_stop"), load(setup, "grpo_nokl")
    exp, m = run["experience"], run["metrics"][0]
    mask = exp["policy_mask_BT"]
    log_r = exp["ref_logprobs_BT"] - exp["old_logprobs_BT"]
    k3 = masked_mean(torch.expm1(log_r) - log_r, mask)
    assert m["ppo/policy/kl_loss"] == pytest.approx(k3, rel=1e-4, abs=1e-7)
    assert m["ppo/policy/loss"] == pytest.approx(m["ppo/policy/pg_loss"] + 0.5 * k3, abs=1e-6)
    assert k3 > 1e-4
    assert torch.equal(exp["response_tokens_BT"], nokl["experience"]["response_tokens_BT"])
    assert not torch.equal(run["after"], nokl["after"])
    assert "ppo/policy/kl_loss" not in nokl["metrics"][0]


def test_grpo_token_normalisation_end_to_end(setup):
    exp = load(setup, "grpo_token")["experience"]
    mask, scores = exp["response_mask_BT"], exp["scores_B"].double()
    for g in range(len(scores) // 2):
        rows = slice(2 * g, 2 * g + 2)
        m = mask[rows].double()
        per_token = scores[rows].unsqueeze(1) * m
        mean = per_token.sum() / m.sum()
        std = ((((scores[rows].unsqueeze(1) - mean) * m) ** 2).sum() / m.sum()).sqrt()
        want = (scores[rows].unsqueeze(1) - mean) / (std + 1e-5) * m
        torch.testing.assert_close(exp["advantages_BT"][rows].double(), want, rtol=1e-4,
                                   atol=1e-5)


def test_decoupled_loss_against_a_loop(setup):
    """Clip around the proximal (recomputed) log-probs, weight exp(proximal - behaviour),
    tokens above the cap dropped; at the first mini-batch the ratio is 1, so the loss is
    -sum(A w) over kept tokens / all tokens."""
    run = load(setup, "decoupled")
    exp, m = run["experience"], run["metrics"][0]
    mask = exp["policy_mask_BT"]
    w = torch.exp(exp["old_logprobs_BT"] - exp["rollout_logprobs_BT"])
    kept = (mask > 0) & (w <= 1.0000001)
    want = float((-exp["advantages_BT"] * torch.where(kept, w, 0.0)).sum() / mask.sum())
    assert m["ppo/policy/pg_loss"] == pytest.approx(want, rel=1e-5, abs=1e-7)
    capped = float(((mask > 0) & ~kept).sum() / mask.sum())
    assert m["ppo/policy/behavior_capped_frac"] == pytest.approx(capped)
    assert m["ppo/policy/approxkl"] == 0.0


def test_mismatch_correction_against_a_loop(setup):
    run = load(setup, "correction")
    exp, m = run["experience"], run["metrics"][0]
    mask = exp["response_mask_BT"]
    log_r = (exp["old_logprobs_BT"] - exp["rollout_logprobs_BT"]) * mask
    r = torch.exp(log_r)
    torch.testing.assert_close(exp["is_weights_BT"],
                               torch.where(mask > 0, r.clamp(max=1.0000001), 1.0))
    seq = torch.exp(log_r.sum(1) / mask.sum(1).clamp(min=1))
    keep = (seq >= 0.9999999) & (seq <= 1.0000001)
    torch.testing.assert_close(exp["policy_mask_BT"], mask * keep.unsqueeze(1))
    has = mask.sum(1) > 0
    assert m["rollout_corr/masked_fraction"] == pytest.approx(
        float((~keep & has).sum() / has.sum()))
    pm = exp["policy_mask_BT"]
    want = float((-exp["advantages_BT"] * exp["is_weights_BT"] * pm).sum() / pm.sum())
    assert m["ppo/policy/pg_loss"] == pytest.approx(want, rel=1e-5, abs=1e-7)
    for key in ("rollout_corr/kl", "rollout_corr/ratio_max", "rollout_corr/ratio_min"):
        assert key in m


def test_bypass_uses_the_samplers_logprobs(setup):
    exp = load(setup, "bypass")["experience"]
    assert torch.equal(exp["old_logprobs_BT"], exp["rollout_logprobs_BT"])


def test_ptx_loss_is_the_pretraining_nll(setup):
    run = load(setup, "ptx")
    m, exp = run["metrics"][0], run["experience"]
    # mini-batch 0's ptx rows under the initial actor, by the plain scoring step
    assert m["ppo/ptx/loss"] == pytest.approx(run["ptx_reference_nll"], rel=1e-5)
    assert m["ppo/policy/approxkl"] == 0.0  # the ptx rows do not disturb the PPO rows
    base = load(setup, "gae_stop")
    assert torch.equal(exp["response_tokens_BT"], base["experience"]["response_tokens_BT"])
    assert not torch.equal(run["after"], base["after"])


def test_dynamic_sampling_keeps_informative_groups(setup):
    run = load(setup, "dynamic")
    exp, m = run["experience"], run["metrics"][0]
    groups = exp["scores_B"].view(-1, 2)
    informative = groups[:, 0] != groups[:, 1]
    assert len(exp["scores_B"]) == 32
    short = int(m["rollout/dynamic_sampling_shortfall"])
    assert int((~informative).sum()) == short
    assert m["rollout/dynamic_sampling_groups_seen"] >= 16
    assert m["rollout/dynamic_sampling_rounds"] >= 1
    # overlong shaping: no response reaches max_new_tokens - 4 without paying for it
    lengths = exp["response_mask_BT"].sum(1)
    assert m["rollout/dynamic_sampling_kept_fraction"] == pytest.approx(1 - short / 16)
    assert lengths.max() <= 10


def test_critic_from_the_reward_model_predicts_the_normalised_score(setup):
    """The reward model's score normalisation (gain, bias) is folded into the critic's head:
    before any update the critic's output after the last token is the normalised score the
    reward model gives (the same network), the scale the returns are built on."""
    run = load(setup, "gae_stop")
    torch.testing.assert_close(run["critic_last"], run["rm_score"], rtol=1e-4, atol=1e-5)
    assert run["rm_score"].std() > 0.1


def follows(one, two):
    """Two runs' metrics (but timings, speeds and memory) and final weights agree."""
    for it, (a, b) in enumerate(zip(one["metrics"], two["metrics"], strict=True)):
        for key, value in a.items():
            if key.startswith(("timing/", "perf/", "memory/")):  # memory differs by layout
                continue
            assert abs(value - b[key]) <= 1e-5 + 1e-4 * abs(value), (it, key, value, b[key])
    torch.testing.assert_close(one["after"], two["after"], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["dp", "dp_packed"])
def test_two_processes_with_dp2_follow_one_process(setup, name):
    """Packed, the two ranks' shares are balanced by token count, not halves."""
    follows(load(setup, name, 1), load(setup, name, 2))


def test_packed_ppo_follows_padded_ppo(setup):
    """Two iterations (two mini-batches, the KL loss, PPO-ptx) packed and padded: the same
    run to rounding; and the share of computed positions that were padding, lower."""
    padded, packed = load(setup, "dp"), load(setup, "dp_packed")
    follows(padded, packed)
    for phase in ("experience", "train"):
        key = f"perf/padding_fraction/{phase}"
        for a, b in zip(padded["metrics"], packed["metrics"]):
            assert 0.0 <= b[key] < a[key] < 1.0, (key, a[key], b[key])


# ------------------------------------------------------------------ EMA and SIGKILL resume

def ppo_cli(setup, name, extra=()):
    out, base, _ = setup
    return ["ppo", "configs/demo/ppo.yaml", *base, f"run.name={name}", "ppo.ema_decay=0.5",
            "ppo.num_iterations=4", "checkpoint.save_interval=1", "checkpoint.keep_last=2",
            "ppo.eval_interval=2", "ppo.num_eval_prompts=8", "logging.sample_table_interval=0",
            "ppo.mini_batch_size=16", "ppo.ppo_epochs=2", *extra]


def records(out, name):
    from megarlhf.engine.metrics import read_metrics
    return {r["step"]: r for r in read_metrics(os.path.join(out, name))}


@pytest.mark.parametrize("batching", [pytest.param("padded", marks=pytest.mark.extended),
                                      "packed"])
def test_sigkill_mid_iteration_resumes_exactly_with_ema(setup, batching):
    """Killed with SIGKILL in iteration 3 (after iteration 2's checkpoint) and rerun with the
    same command, the run continues exactly as the uninterrupted one: iteration numbers,
    metrics (KL controller, reference-log-prob cache, data position, RNG) and the EMA actor,
    bitwise - with padded and with packed micro-batches (whose grouping is a function of
    the batch alone). The EMA is a role of the checkpoint: evaluated, scored, exported."""
    import signal
    import subprocess
    import sys
    import time

    out = setup[0]
    pack = PACK if batching == "packed" else []
    full_name, killed_name = f"full_{batching}", f"killed_{batching}"
    run_cli(*ppo_cli(setup, full_name, pack))
    argv = [sys.executable, "-m", "megarlhf.cli", *ppo_cli(setup, killed_name, pack)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env, cwd=ROOT)
    latest = out / killed_name / "checkpoints" / "latest"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if latest.exists() and latest.read_text() >= "iter_000002":
            break
        time.sleep(0.05)
    time.sleep(0.3)  # into iteration 3
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    resumed = run_cli(*ppo_cli(setup, killed_name, pack))
    assert "resumed iter_00000" in resumed.stdout
    full, killed = records(out, full_name), records(out, killed_name)
    assert sorted(full) == sorted(killed) == [0, 1, 2, 3, 4]
    for step in (3, 4):
        for key, value in full[step].items():
            if not key.startswith(("timing/", "perf/")):
                assert killed[step][key] == value, (step, key, value, killed[step][key])
    assert "eval/ema/gold_score" in full[4] and "rollout/ref_cache_hit_rate" in full[4]
    assert full[4]["objective/kl_coef"] != full[1]["objective/kl_coef"]  # adaptive, moving
    if batching == "packed":
        assert full[4]["perf/padding_fraction/train"] < 0.2
        return

    # The EMA role: scored from the checkpoint (bitwise the same after the resume), unlike
    # the actor; exported to Hugging Face.
    seqs = out / "seqs.jsonl"
    seqs.write_text("\n".join(json.dumps({"tokens": t}) for t in ([3, 7, 9, 11], [5, 6, 7])))
    scores = {}
    for name, role in (("full_padded", "ema"), ("killed_padded", "ema"),
                       ("full_padded", "actor")):
        dest = out / f"score_{name}_{role}.jsonl"
        run_cli("score", "--config", "configs/sft_tiny.yaml", "--input", str(seqs),
                "--output", str(dest), "--ckpt-role", role,
                f"checkpoint.load={out}/{name}/checkpoints", f"tokenizer.path={setup[2]['tokenizer']}")
        scores[name, role] = dest.read_text()
    assert scores["full_padded", "ema"] == scores["killed_padded", "ema"]
    assert scores["full_padded", "ema"] != scores["full_padded", "actor"]
    hf = out / "ema_hf"
    import subprocess as sp
    sp.run([sys.executable, "tools/convert_megatron_to_hf.py", "--config",
            "configs/sft_tiny.yaml", "--out", str(hf), "--ckpt", f"{out}/full_padded/checkpoints",
            "--role", "ema"], check=True, capture_output=True, cwd=ROOT)
    assert (hf / "config.json").exists()
