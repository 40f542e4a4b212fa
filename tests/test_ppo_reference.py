"""Real PPO iterations against independent references (issue 34).

One worker process (tests/workers/ppo_trace.py) runs one iteration of every case below
on the tiny SFT policy (actor from step 6, reference from step 3, so the KL to the
reference is not zero) and logs everything it saw. The tests recompute it without
calling ``megarlhf.algos``:

- the trained tokens and scores from the sampler's output (stop token, missing-stop rule,
  overlong ramp, short responses);
- the sampler's, the actor's and the reference's log-probs with transformers, on the
  checkpoints converted to Hugging Face;
- per-token KL (every estimator), shaped rewards (clip, whitening), GAE advantages and
  returns, REINFORCE++ returns and the group baselines (GRPO in three normalisations,
  RLOO) with the plain loops of ``reference_loops``;
- every micro-batch's policy and value loss, clip fractions and approx-KL, from the
  experience's old log-probs and the policy's own log-probs before each step - after the
  policy has moved, where a loss that never clips shows;
- that each optimizer step lowers its mini-batch's loss (actor and critic), and the EMA
  actor against a loop over the actor's weights after every step;
- PPO-ptx's pretraining rows, their NLL and its scale; DAPO's dynamic sampling (the
  groups kept over rounds); stop-token ids besides EOS;
- across three iterations, what one iteration hands the next (``three_iterations``).

Every field of the ppo and rollout sections that changes the math has a case here (see
``settings_table``; tests/README.md shows it).
"""

import itertools
import os

import pytest
import torch

import reference_loops as loops
from conftest import ROOT, WORKERS, tiny_hf, torchrun

pytestmark = pytest.mark.slow

# What the reference assumes of every case unless the case says otherwise: the settings
# of configs/demo/ppo.yaml and the schema's defaults, written out here on their own.
DEFAULTS = dict(estimator="gae", kl_estimator="k1", beta=0.3, clip_reward=5.0,
                whiten_rewards=False, whiten_advantages=True, unbiased=True, gamma=1.0,
                lam=0.95, group_size=1, group_norm="sequence", clip_eps=0.2, dual_clip=None,
                agg="token_mean", value_clip=0.2, value_coef=0.5, kl_loss_coef=0.0,
                kl_loss_estimator="k3", entropy_coef=0.0, penalty=-1.0, mode="replace",
                max_len=10, buffer=0, overlong=1.0, min_tokens=0, stop=True, recompute=True,
                decoupled=False, behaviour_cap=None, kl_in_reward=None, temperature=1.0,
                top_k=0, top_p=1.0, is_cap=None, mask_low=None, mask_high=None,
                kl_controller="adaptive", kl_target=6.0, kl_horizon=100, warmup=0,
                staleness=0, ptx_coef=0.0, ptx_rows=None, stop_ids=[], dynamic=False,
                rounds=4, iterations=1, prompts=None)
# Each setting's config field (iterations and prompts are the trace's: how many iterations
# it runs, and the first how many of the task's prompts it trains on).
FIELDS = dict(estimator="ppo.advantage_estimator", kl_estimator="ppo.kl.estimator",
              beta="ppo.kl.init_coef", clip_reward="ppo.clip_reward_value",
              whiten_rewards="ppo.whiten_rewards", whiten_advantages="ppo.whiten_advantages",
              unbiased="ppo.whiten_unbiased", gamma="ppo.gamma", lam="ppo.lam",
              group_size="ppo.group_size", group_norm="ppo.grpo_normalization",
              clip_eps="ppo.clip_eps", dual_clip="ppo.dual_clip", agg="ppo.loss_agg",
              value_clip="ppo.cliprange_value", value_coef="ppo.value_loss_coef",
              kl_loss_coef="ppo.kl.loss_coef", kl_loss_estimator="ppo.kl.loss_estimator",
              entropy_coef="ppo.entropy_coef", penalty="ppo.missing_stop_penalty",
              mode="ppo.missing_stop_mode", max_len="rollout.max_new_tokens",
              buffer="ppo.overlong_buffer", overlong="ppo.overlong_penalty",
              min_tokens="rollout.min_response_tokens", stop="rollout.stop_at_eos",
              recompute="rollout.recompute_logprobs", behaviour_cap="ppo.correction.behavior_weight_cap",
              kl_in_reward="ppo.kl.in_reward", temperature="rollout.temperature",
              top_k="rollout.top_k", top_p="rollout.top_p", is_cap="ppo.correction.is_cap",
              mask_low="ppo.correction.mask_low", mask_high="ppo.correction.mask_high",
              kl_controller="ppo.kl.controller", kl_target="ppo.kl.target",
              kl_horizon="ppo.kl.horizon", warmup="ppo.critic_warmup_iterations",
              staleness="ppo.max_staleness", ptx_coef="ppo.ptx_coef",
              ptx_rows="ppo.ptx_batch_size", stop_ids="rollout.stop_token_ids",
              dynamic="ppo.dynamic_sampling", rounds="ppo.max_sampling_rounds")
GROUPS = dict(group_size=2, extra=["ppo.rollout_batch_size=16"])
GRPO = dict(GROUPS, estimator="grpo", beta=0.0, kl_controller="fixed")
CASES = {
    "gae_k1": dict(extra=["ppo.ema_decay=0.9"]),
    "gae_k3_nostop": dict(kl_estimator="k3", stop=False, whiten_rewards=True, unbiased=False,
                          clip_reward=0.5, gamma=0.9, lam=0.8, penalty=0.5, mode="subtract"),
    "gae_k2": dict(kl_estimator="k2", whiten_advantages=False, dual_clip=1.5, value_clip=None,
                   entropy_coef=0.01, value_coef=0.7, clip_eps=0.1),
    # a critic that stays within the value clip's range, where the clip's sign shows
    "gae_abs_nostop": dict(kl_estimator="abs", stop=False, min_tokens=3,
                           agg="seq_mean_token_mean", buffer=4, overlong=0.5,
                           extra=["optimizer.critic_lr=2e-5"]),
    # the log-probs of logits / temperature; the draw from the top-k / top-p tokens only
    "gae_temperature_top": dict(temperature=0.7, top_k=6, top_p=0.9),
    "grpo_sequence": dict(GRPO, kl_loss_coef=0.5),
    "grpo_token_nostop": dict(GRPO, group_norm="token", stop=False, kl_loss_coef=0.5),
    "grpo_center": dict(GRPO, group_norm="center", kl_loss_coef=0.2, kl_loss_estimator="k2",
                        agg="seq_mean_token_sum"),
    # GRPO with the KL in the reward (off by default for GRPO): taken off the score
    "grpo_kl_in_reward": dict(GRPO, beta=0.2, kl_in_reward=True),
    "rloo_stop": dict(GROUPS, estimator="rloo"),
    "rloo_nostop": dict(GROUPS, estimator="rloo", stop=False),
    "rpp_stop": dict(estimator="reinforce_pp"),
    "rpp_nostop": dict(estimator="reinforce_pp", stop=False, gamma=0.95),
    "bypass": dict(recompute=False),
    "decoupled": dict(decoupled=True, behaviour_cap=1.0000001,
                      extra=["ppo.policy_loss=decoupled"]),
    # PPO-ptx (24 pretraining rows, 8 per actor mini-batch: the cursor wraps inside the
    # iteration), and responses that also stop at "blue" or "black"
    "ptx_stop_ids": dict(ptx_coef=0.5, ptx_rows=8, stop_ids=[5, 8]),
    # DAPO's dynamic sampling on the synthetic task's gold reward (half-points: groups
    # tie), with the overlong ramp: uninformative groups dropped, refilled over rounds
    "rloo_dynamic": dict(GROUPS, estimator="rloo", dynamic=True, rounds=3, buffer=4,
                         extra=[*GROUPS["extra"], "ppo.reward_checkpoint=null",
                                "rollout.rewards.fn=megarlhf.data.synthetic:gold_reward_pair"]),
    # Three iterations over 40 prompts (an epoch ends inside the second batch): what one
    # iteration hands the next - the KL controller, the critic-only warm-up, batches
    # sampled one version behind (the mismatch correction then has a real gap to correct,
    # with the plain PPO loss), the EMA, the data order over epochs.
    "three_iterations": dict(iterations=3, prompts=40, staleness=1, warmup=1, kl_target=2.0,
                             kl_horizon=40, is_cap=1.1, mask_low=0.97, mask_high=1.03,
                             extra=["ppo.ema_decay=0.9", "ppo.policy_loss=ppo",
                                    "optimizer.critic_lr=2e-5"]),
}
# MEGARLHF_TRACE_CASES=a,b runs only those cases (tests/mutants.py uses it).
SELECTED = [c for c in os.environ.get("MEGARLHF_TRACE_CASES", "").split(",") if c] or list(CASES)
CRITIC_FREE = ("grpo", "rloo", "reinforce_pp")


def settings(name: str) -> dict:
    return {**DEFAULTS, **{k: v for k, v in CASES[name].items() if k != "extra"}}


def overrides(name: str) -> list[str]:
    s, out = CASES[name], []
    for key, value in s.items():
        if key in FIELDS:
            text = "null" if value is None else str(value).lower() if isinstance(value, bool) \
                else "[" + ",".join(map(str, value)) + "]" if isinstance(value, list) \
                else str(value)
            out.append(f"{FIELDS[key]}={text}")
    return out + list(s.get("extra", []))


def kl_in_reward(s: dict) -> bool:
    """ppo.kl.in_reward as the schema resolves None: on but for GRPO."""
    return s["estimator"] != "grpo" if s["kl_in_reward"] is None else s["kl_in_reward"]


# PPO-ptx's pretraining rows: 24 distinct (prompt, response) pairs of the task's words
PTX_WORDS = ("blue", "river", "fast", "black", "bird", "three")
PTX_ROWS = [{"prompt": f"words: {a} {b}", "response": f"{b} {a}"}
            for a in PTX_WORDS for b in PTX_WORDS if a != b][:24]


@pytest.fixture(scope="module")
def traced(tiny_checkpoints, tmp_path_factory):
    """{case: its trace}: the trace's ``iterations`` (one dict per iteration, see
    workers/ppo_trace.py), the tokenized ``prompts`` and the ``seed``."""
    import json

    out, task, common = tiny_checkpoints
    folder = tmp_path_factory.mktemp("trace")
    base = [f"data.train_path={task['prompts']}", f"data.eval_path={task['eval_prompts']}",
            f"ppo.sft_checkpoint={out}/sft-tiny/checkpoints/step_0000006",
            f"roles.reference.checkpoint={out}/sft-tiny/checkpoints/step_0000003",
            f"ppo.reward_checkpoint={out}/rm-tiny/checkpoints", *common,
            f"run.output_dir={folder}"]
    cases = {}
    for name in SELECTED:
        s = settings(name)
        mine = list(base)
        if s["prompts"]:
            lines = open(task["prompts"]).readlines()[:s["prompts"]]
            (folder / f"{name}-prompts.jsonl").write_text("".join(lines))
            mine[0] = f"data.train_path={folder / f'{name}-prompts.jsonl'}"
        if s["ptx_coef"]:
            (folder / f"{name}-ptx.jsonl").write_text(
                "".join(json.dumps(row) + "\n" for row in PTX_ROWS))
            mine.append(f"data.ptx_path={folder / f'{name}-ptx.jsonl'}")
        cases[name] = {"overrides": mine + overrides(name), "iterations": s["iterations"]}
    (folder / "cases.json").write_text(json.dumps(cases))
    torchrun(os.path.join(WORKERS, "ppo_trace.py"), 1, str(folder / "cases.json"), str(folder))
    return {name: torch.load(folder / f"{name}.pt", weights_only=False) for name in SELECTED}


def iterations(traced, name):
    """(iteration, its trace) of the case."""
    return list(enumerate(traced[name]["iterations"]))


@pytest.fixture(scope="module")
def hf_models(tiny_checkpoints):
    """The actor's and the reference's checkpoints converted to Hugging Face, loaded by
    transformers: the log-prob oracle."""
    transformers = pytest.importorskip("transformers")
    out = tiny_checkpoints[0]
    return {name: transformers.AutoModelForCausalLM.from_pretrained(
        tiny_hf(out, step), torch_dtype=torch.float32).eval()
            for name, step in (("actor", 6), ("reference", 3))}


def close(got, want, tol=1e-6, what=""):
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want,
                                                                          dtype=torch.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = (got - want).abs().max().item() if got.numel() else 0.0
    assert err <= tol * max(1.0, want.abs().max().item()), (what, err)


def by_name(names):
    return pytest.mark.parametrize("name", [n for n in names if n in SELECTED])


def stop_ids(run, s) -> list[int]:
    return [run["eos_id"], *s["stop_ids"]]  # the tiny tokenizer has no other end tokens


def sampled_rows(run, s) -> tuple[dict, list[float]]:
    """The sampler's output behind the experience's rows, before truncation, and the raw
    scores: the batch's (``raw``, ``raw_scores``); with dynamic sampling the rows that
    :func:`dynamic_selection` keeps from every round."""
    if not s["dynamic"]:
        return run["raw"], [float(x) for x in run["raw_scores"]]
    picked = dynamic_selection(run, s)["rows"]
    rounds = run["samplings"]
    out = {}
    for key, pad in (("prompt_tokens_BP", run["pad_id"]), ("prompt_mask_BP", 0),
                     ("response_tokens_BT", run["pad_id"]), ("fed_mask_BT", 0)):
        width = max(r["raw"][key].shape[1] for r in rounds)
        out[key] = torch.stack([torch.nn.functional.pad(
            rounds[i]["raw"][key][j], (0, width - rounds[i]["raw"][key].shape[1]),
            value=pad) for i, j in picked])
    return out, [float(rounds[i]["raw_scores"][j]) for i, j in picked]


def dynamic_selection(run, s) -> dict:
    """DAPO's dynamic sampling as a loop over the iteration's rollouts (``samplings``, in
    order): each round's shaped scores from its raw output, a group kept when its scores
    are not all equal, another round while fewer groups are kept than the batch has and
    rounds remain; the batch is the first kept groups, topped up with dropped ones in
    order. Returns the (round, row) of each experience row and what the metrics count."""
    k = s["group_size"]
    kept, dropped, seen = [], [], 0
    rounds = run["samplings"]
    needed = len(rounds[0]["raw_scores"]) // k
    for i, r in enumerate(rounds):
        cut, stopped = loops.truncated_lengths(r["raw"]["response_tokens_BT"],
                                               r["raw"]["fed_mask_BT"], stop_ids(run, s))
        scores = [loops.shaped_score(float(x), st, n, penalty=s["penalty"], mode=s["mode"],
                                     max_len=s["max_len"], buffer=s["buffer"],
                                     overlong=s["overlong"])
                  for x, st, n in zip(r["raw_scores"], stopped, cut, strict=True)]
        for g in range(len(scores) // k):
            group = [(i, g * k + j) for j in range(k)]
            (kept if len(set(scores[g * k:(g + 1) * k])) > 1 else dropped).append(group)
        seen += len(scores) // k
        if len(kept) >= needed or i + 1 == s["rounds"]:
            assert i + 1 == len(rounds), "sampled again after the batch was full"
            break
    shortfall = max(needed - len(kept), 0)
    groups = (kept + dropped[:shortfall])[:needed]
    return {"rows": [row for group in groups for row in group], "rounds": len(rounds),
            "shortfall": shortfall, "seen": seen, "kept": min(len(kept), needed) / needed,
            "dropped": len(dropped)}


# ------------------------------------------------------------------ what is trained

@by_name(CASES)
def test_trained_tokens_and_scores_follow_the_rules(traced, name):
    """From the sampler's own output: each response is cut after its first stop token,
    short ones train on nothing, and the score is the reward model's with the missing-stop
    rule and the overlong ramp applied."""
    for it, run in iterations(traced, name):
        trained_tokens_and_scores(run, settings(name))


def trained_tokens_and_scores(run, s):
    exp = run["experience"]
    raw, raw_scores = sampled_rows(run, s)
    cut, stopped = loops.truncated_lengths(raw["response_tokens_BT"],
                                           raw["fed_mask_BT"], stop_ids(run, s))
    B, T = exp["response_tokens_BT"].shape
    assert len(cut) == B
    trained = [0 if n < s["min_tokens"] else n for n in cut]
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in trained])
    assert torch.equal(exp["response_mask_BT"], mask)
    for b in range(B):
        n = cut[b]
        assert exp["response_tokens_BT"][b, :n].tolist() == \
            raw["response_tokens_BT"][b, :n].tolist()
        assert (exp["response_tokens_BT"][b, n:] == run["pad_id"]).all()
        prompt = raw["prompt_tokens_BP"][b][raw["prompt_mask_BP"][b] == 1]
        assert torch.equal(exp["prompt_tokens_BP"][b][exp["prompt_mask_BP"][b] == 1], prompt)
    want = [loops.shaped_score(r, st, n, penalty=s["penalty"], mode=s["mode"],
                               max_len=s["max_len"], buffer=s["buffer"],
                               overlong=s["overlong"])
            for r, st, n in zip(raw_scores, stopped, cut, strict=True)]
    close(exp["scores_B"], want, 1e-6, "scores")
    assert any(stopped) and (s["stop"] or not all(stopped))
    if s["stop_ids"]:  # the case exercises them: some responses end at one, not at EOS
        last = [int(raw["response_tokens_BT"][b, n - 1]) for b, n in enumerate(cut)]
        assert any(st and tok in s["stop_ids"] for st, tok in zip(stopped, last, strict=True))
    if s["min_tokens"]:
        assert 0 < sum(n < s["min_tokens"] for n in cut) < B  # the case exercises it


def hf_logprobs(model, run, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
                ) -> torch.Tensor:
    """(B, T) log-probs of every response token under ``model`` at ``temperature``, each
    row scored alone without padding, 0 after the row's end (its stop token; short rows
    included). With ``top_k`` / ``top_p``: checks that every token the sampler drew is
    among the ``top_k`` most likely and inside the nucleus (the tokens more likely than it
    hold less than ``top_p``)."""
    exp = run["experience"]
    B, T = exp["response_tokens_BT"].shape
    out = torch.zeros(B, T, dtype=torch.float64)
    n = loops.lengths(run["gen"]["fed_mask_BT"])
    for b in range(B):
        if not n[b]:
            continue
        prompt = exp["prompt_tokens_BP"][b][exp["prompt_mask_BP"][b] == 1].tolist()
        response = exp["response_tokens_BT"][b, :n[b]].tolist()
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0].double()
        logp = torch.log_softmax(logits / temperature, -1)
        for t, tok in enumerate(response):
            row = logp[len(prompt) - 1 + t]
            out[b, t] = row[tok]
            above = row > row[tok] + 1e-6  # more likely than the drawn token, beyond rounding
            if top_k:
                assert int(above.sum()) < top_k, (b, t, "drawn outside the top-k")
            if top_p < 1.0:
                assert float(row[above].exp().sum()) < top_p + 1e-6, (b, t, "outside top-p")
    return out


@by_name(CASES)
def test_logprobs_against_transformers(traced, hf_models, name):
    """The reference's log-probs are the reference checkpoint's, the old log-probs the
    actor's (recomputed, or the sampler's in bypass mode), the sampler's the actor's: all
    against transformers on the converted checkpoints, at the rollout's temperature; the
    sampler drew only from the top-k / top-p tokens. After the first iteration the actor
    has moved: its log-probs are checked while it is the converted step-6 checkpoint
    (the batches that version 0 sampled, for the sampler's)."""
    s = settings(name)
    for it, run in iterations(traced, name):
        exp = run["experience"]
        T = s["temperature"]
        trained = exp["response_mask_BT"]  # short responses: no trainable token
        ref = hf_logprobs(hf_models["reference"], run, T)
        close(exp["ref_logprobs_BT"], ref, 1e-5, "reference")
        version = max(0, it - s["staleness"])  # the policy that sampled the batch
        if version == 0:
            actor = hf_logprobs(hf_models["actor"], run, T, s["top_k"], s["top_p"])
            close(exp["rollout_logprobs_BT"], actor * trained, 1e-5, "rollout")
            assert (actor - ref).abs().max() > 1e-2  # the two checkpoints differ
        if it == 0:
            close(exp["old_logprobs_BT"], actor * trained, 1e-5, "old")


# ------------------------------------------------------------------ the experience

@by_name(CASES)
def test_experience_against_plain_loops(traced, name):
    """KL per token, shaped rewards, advantages and returns recomputed from the logged
    log-probs, values and scores with plain loops (float64), at the KL coefficient the
    iteration started with; the mismatch correction's weights and mask from the
    trainer/sampler ratio."""
    s = settings(name)
    gaps = 0
    for it, run in iterations(traced, name):
        exp = run["experience"]
        if it == 0:
            assert run["kl_coef"] == pytest.approx(s["beta"])
        beta = run["kl_coef"] if kl_in_reward(s) else 0.0
        if s["estimator"] in CRITIC_FREE:
            assert not exp["values_BT"].any()
        else:
            assert exp["values_BT"].abs().sum() > 0
        want = loops.experience(
            old=exp["old_logprobs_BT"], ref=exp["ref_logprobs_BT"], values=exp["values_BT"],
            scores=exp["scores_B"], mask=exp["response_mask_BT"], estimator=s["estimator"],
            kl_estimator=s["kl_estimator"], beta=beta, clip_reward=s["clip_reward"],
            whiten_rewards=s["whiten_rewards"], whiten_advantages=s["whiten_advantages"],
            unbiased=s["unbiased"], gamma=s["gamma"], lam=s["lam"],
            group_size=s["group_size"], group_norm=s["group_norm"])
        close(exp["kl_BT"], want["kl"], 1e-6, "kl")
        close(exp["rewards_BT"], want["rewards"], 1e-6, "rewards")
        for key in ("advantages", "returns"):
            scale = max(1.0, max(abs(x) for row in want[key] for x in row))
            for b, tol in enumerate(row_tolerances(s, want["sequence_rewards"])):
                close(exp[key + "_BT"][b], want[key][b], tol * scale, (key, b))
        B = len(want["kl"])
        assert run["metrics"]["objective/kl"] == pytest.approx(
            sum(map(sum, want["kl"])) / B, rel=1e-6, abs=1e-9)
        assert sum(map(sum, want["kl"])) != 0 and any(map(any, want["advantages"]))
        mask, weights = loops.mismatch(exp["old_logprobs_BT"], exp["rollout_logprobs_BT"],
                                       exp["response_mask_BT"], is_cap=s["is_cap"],
                                       low=s["mask_low"], high=s["mask_high"])
        close(exp["policy_mask_BT"], mask, 0.0, "policy mask")
        close(exp["is_weights_BT"], weights, 1e-6, "importance weights")
        gap = (exp["old_logprobs_BT"] - exp["rollout_logprobs_BT"]).abs().max() > 1e-3
        if s["is_cap"] and gap:  # sampled by a policy that has moved since
            assert any(w == s["is_cap"] for row in weights for w in row)  # the cap bites
            assert mask != loops.rows(exp["response_mask_BT"])  # and the band drops some
            gaps += 1
    # three_iterations: batch 2 was sampled by version 1, before the actor's first update
    assert gaps == (1 if s["staleness"] else 0)


def row_tolerances(s, sequence) -> list[float]:
    """Each row's tolerance: 1e-6, but in a GRPO group whose sequence rewards (the KL in
    them summed in fp32) nearly tie, (s - mean) / (std + 1e-6) divides the fp32 rounding
    of s and of the mean (a few 6e-8 |s|) by the small std: that quotient is the bound
    (seen: 2.4e-5 where two scores of -1 differed by 3.5e-3 of KL)."""
    out = [1e-6] * len(sequence)
    if s["estimator"] != "grpo" or s["group_norm"] == "center" or not kl_in_reward(s):
        return out
    k = s["group_size"]
    for g in range(0, len(sequence), k):
        group = sequence[g:g + k]
        mean = sum(group) / k
        std = (sum((x - mean) ** 2 for x in group) / (k - 1)) ** 0.5
        bound = 4 * 6e-8 * max(abs(x) for x in group) / (std + 1e-6)
        out[g:g + k] = [max(1e-6, bound)] * k
    return out


# ------------------------------------------------------------------ the updates

def experience_rows(run) -> dict:
    """Each experience row's full token sequence (padding as the micro-batches carry it)
    -> the rows holding it."""
    exp = run["experience"]
    full = torch.cat([exp["prompt_tokens_BP"], exp["response_tokens_BT"]], 1)
    mask = torch.cat([exp["prompt_mask_BP"], exp["response_mask_BT"].long()], 1)
    full = full.masked_fill(mask == 0, run["pad_id"])
    table: dict = {}
    for b, seq in enumerate(full.tolist()):
        table.setdefault(tuple(seq), []).append(b)
    return table


EXP_FIELDS = ("old_logprobs_BT", "rollout_logprobs_BT", "ref_logprobs_BT", "advantages_BT",
              "returns_BT", "values_BT", "policy_mask_BT", "is_weights_BT", "response_mask_BT")


def match_rows(run, batch, table, used) -> list[int]:
    """The experience rows of a micro-batch, by their tokens; rows with equal tokens must
    agree on everything the losses read (else the match would be ambiguous)."""
    exp = run["experience"]
    out = []
    for seq in batch["tokens"].tolist():
        free = [b for b in table[tuple(seq)] if b not in used]
        assert free, "a micro-batch row that is not in the experience (or used twice)"
        for other in free[1:]:
            for f in EXP_FIELDS:
                assert torch.equal(exp[f][free[0]], exp[f][other]), ("ambiguous rows", f)
        used.add(free[0])
        out.append(free[0])
    return out


def loop_losses(run, s, call, rows, i, outputs) -> dict:
    """The loop's sums for micro-batch ``i`` of ``call`` at the role's ``outputs``."""
    exp = run["experience"]
    pick = {f: loops.rows(exp[f][rows]) for f in EXP_FIELDS}
    if call["role"] == "critic":
        return loops.value_loss(new=loops.rows(outputs[i]["values"]), old=pick["values_BT"],
                                returns=pick["returns_BT"], mask=pick["response_mask_BT"],
                                clip=s["value_clip"], coef=s["value_coef"], agg=s["agg"])
    new = loops.rows(outputs[i]["logprobs"])
    out = loops.policy_loss(new=new, old=pick["old_logprobs_BT"],
                            advantages=pick["advantages_BT"], mask=pick["policy_mask_BT"],
                            weights=pick["is_weights_BT"], clip_eps=s["clip_eps"],
                            dual_clip=s["dual_clip"], agg=s["agg"],
                            behaviour=pick["rollout_logprobs_BT"] if s["decoupled"] else None,
                            behaviour_cap=s["behaviour_cap"])
    loss = out["pg_loss_sum"]
    mask = pick["policy_mask_BT"]
    if s["entropy_coef"]:
        ent = loops.rows(outputs[i]["entropy"])
        e_total, _ = loops._aggregate([[-s["entropy_coef"] * x for x in r] for r in ent],
                                      mask, s["agg"])
        loss += e_total
    if s["kl_loss_coef"]:
        kl = [[loops.kl_token(n, r, s["kl_loss_estimator"]) for n, r in zip(nr, rr, strict=True)]
              for nr, rr in zip(new, pick["ref_logprobs_BT"], strict=True)]
        k_total, _ = loops._aggregate(kl, mask, s["agg"])
        loss += s["kl_loss_coef"] * k_total
        out["kl_loss_sum"] = loops.kl_loss_sum(new=new, ref=pick["ref_logprobs_BT"],
                                               mask=mask, estimator=s["kl_loss_estimator"])
    out["loss_sum"] = loss
    return out


def walk(run, s):
    """(call, micro-batch index, experience rows, loop sums before the step, loop sums
    after it) for every micro-batch of every trained role's call, each epoch using every
    experience row once per role."""
    table = experience_rows(run)
    used: dict = {}
    B = len(run["experience"]["scores_B"])
    for call in run["calls"]:
        seen = used.setdefault(call["role"], set())
        if len(seen) == B:
            seen.clear()  # the next epoch
        for i, batch in enumerate(call["batches"]):
            if "ptx_loss_mask" in batch:  # PPO-ptx's rows: test_ptx_rows_and_loss...
                continue
            rows = match_rows(run, batch, table, seen)
            yield (call, i, rows, loop_losses(run, s, call, rows, i, call["before"]),
                   loop_losses(run, s, call, rows, i, call["after"]))


@by_name(CASES)
def test_every_micro_batch_loss_against_a_loop(traced, name):
    """Each micro-batch's logged loss sums, clip fraction and approx-KL equal the loop's,
    computed from the experience's old log-probs (recorded once, before the update) and
    the policy's log-probs at that moment; the micro-batches carry the experience's
    values; the logged metrics are those sums' ratios."""
    s = settings(name)
    for it, run in iterations(traced, name):
        micro_batch_losses(run, s)


def micro_batch_losses(run, s):
    exp = run["experience"]
    totals: dict = {}
    for call, i, rows, loop, _ in walk(run, s):
        batch, logged = call["batches"][i], call["logs"][i]
        for key in ("old_logprobs", "advantages", "ref_logprobs", "rollout_logprobs"):
            assert torch.equal(batch[key], exp[key + "_BT"][rows]), key
        for key, value in loop.items():
            assert logged[key] == pytest.approx(value, rel=1e-5, abs=1e-5), \
                (call["role"], i, key, logged[key], value)
        for key, value in loop.items():
            totals[call["role"], key] = totals.get((call["role"], key), 0.0) + value
    m = run["metrics"]
    t = lambda role, key: totals[role, key]  # noqa: E731
    if ("actor", "tokens") in totals:
        assert m["ppo/policy/clipfrac"] == pytest.approx(t("actor", "clipfrac_sum")
                                                         / t("actor", "tokens"), abs=1e-7)
        assert m["ppo/policy/approxkl"] == pytest.approx(t("actor", "approxkl_sum")
                                                         / t("actor", "tokens"), rel=1e-4,
                                                         abs=1e-7)
        assert m["ppo/policy/pg_loss"] == pytest.approx(t("actor", "pg_loss_sum")
                                                        / t("actor", "loss_count"), rel=1e-4,
                                                        abs=1e-6)
    else:
        assert "ppo/policy/pg_loss" not in m  # the critic's warm-up
    if s["estimator"] not in CRITIC_FREE:
        assert m["ppo/val/loss"] == pytest.approx(t("critic", "loss_sum")
                                                  / t("critic", "loss_count"), rel=1e-4)
        assert m["ppo/val/clipfrac"] == pytest.approx(t("critic", "clipfrac_sum")
                                                      / t("critic", "tokens"), abs=1e-7)


@by_name(CASES)
def test_the_policy_moves_and_the_clip_bites(traced, name):
    """The first micro-batch of each iteration is an update at the old policy (ratio 1:
    approx-KL and clip fraction 0; in bypass mode the sampler's log-probs are the old
    ones, equal to fp32 rounding); the later mini-batches see a policy that moved, and
    some of their tokens are clipped - in the loop and in what the loss logged. (An
    iteration of the critic's warm-up trains no actor.)"""
    s = settings(name)
    trained, clipped = 0, [0.0, 0.0]
    for it, run in iterations(traced, name):
        actor = [(c, i, loop) for c, i, _, loop, _ in walk(run, s) if c["role"] == "actor"]
        if it < s["warmup"]:
            assert not actor
            continue
        trained += 1
        first_call, _, first = actor[0]
        rounding = 0.0 if s["recompute"] else 1e-5 * first["tokens"]
        assert abs(first["approxkl_sum"]) <= rounding and first["clipfrac_sum"] == 0.0
        assert abs(first_call["logs"][0]["approxkl_sum"]) <= rounding
        assert first_call["logs"][0]["clipfrac_sum"] == 0.0
        later = [(c, i, loop) for c, i, loop in actor if c is not first_call]
        clipped[0] += sum(loop["clipfrac_sum"] for _, _, loop in later)
        clipped[1] += sum(c["logs"][i]["clipfrac_sum"] for c, i, _ in later)
        assert all(abs(c["logs"][i]["approxkl_sum"]) > 1e-4 for c, i, _ in later)
    assert trained == s["iterations"] - s["warmup"]
    assert clipped[0] > 0 and clipped[1] > 0  # the loop's and the loss's


@by_name(CASES)
def test_each_step_lowers_its_mini_batch_loss(traced, name):
    """The optimizer steps along the gradient of the loss that was logged: right after
    each step, the same mini-batch's loss (the loop's, at the new weights) is lower, for
    the actor and for the critic. Adam's first step moves every weight by about the
    learning rate whatever its gradient's size and may overshoot, so from each role's
    second step on; every step changes the weights of the models it trains, and the
    critic's warm-up leaves the actor's alone."""
    s = settings(name)
    steps: dict = {}
    for it, run in iterations(traced, name):
        per_call: dict = {}
        for call, _, _, before, after in walk(run, s):
            acc = per_call.setdefault(id(call), [call, 0.0, 0.0, 0.0])
            acc[1] += before["loss_sum"]
            acc[2] += after["loss_sum"]
            acc[3] += before["loss_count"]
        here: dict = {}
        for call, before, after, count in per_call.values():
            assert call["applied"]
            if s["ptx_coef"] and call["role"] == "actor":  # + coef x the mean ptx NLL
                before += ptx_sums(call, "ptx_before", s, count)["loss"]
                after += ptx_sums(call, "ptx_after", s, count)["loss"]
            if steps.get(call["role"], 0):
                assert after < before - 1e-6 * count, (it, call["role"], before, after)
            steps[call["role"]] = steps.get(call["role"], 0) + 1
            here[call["role"]] = here.get(call["role"], 0) + 1
        warm = it < s["warmup"]
        want = {} if warm else {"actor": 4}  # 2 epochs x 2 mini-batches
        if s["estimator"] not in CRITIC_FREE:
            want["critic"] = 4
        assert here == want, (it, here)
        for role, snaps in run["params"].items():
            assert len(snaps) == 5  # before the iteration, and after each step
            for a, b in itertools.pairwise(snaps):
                assert torch.equal(a, b) == (role == "actor" and warm), (it, role)


def ptx_sums(call, which, s, policy_count) -> dict:
    """PPO-ptx in one actor call, from the role's next-token log-probs (``which``: before
    or after the step): per micro-batch the NLL over its weighted positions and the
    weight's sum; the scale that makes the step's loss (policy loss sum / ``policy_count``)
    + ptx_coef x the NLL averaged over the call's ptx tokens, and that loss's ptx part
    times ``policy_count`` (``loss``, on the scale of the policy loss sums)."""
    ptx = [b for b in call["batches"] if "ptx_loss_mask" in b]
    assert len(ptx) == len(call[which]) and ptx
    nll, tokens = [], []
    for batch, out in zip(ptx, call[which], strict=True):
        weights = loops.rows(batch["ptx_loss_mask"][:, :-1])
        logp = loops.rows(out["logprobs"])
        nll.append(-sum(w * x for wr, xr in zip(weights, logp, strict=True)
                        for w, x in zip(wr, xr, strict=True)))
        tokens.append(sum(map(sum, weights)))
    scale = s["ptx_coef"] * policy_count / sum(tokens)
    return {"nll": nll, "tokens": tokens, "scale": scale, "loss": scale * sum(nll)}


@by_name([n for n in CASES if settings(n)["ptx_coef"]])
def test_ptx_rows_and_loss_against_loops(traced, hf_models, tiny_checkpoints, name):
    """PPO-ptx: the pretraining rows are the data file's, each tokenized with loss weights
    on exactly its response and EOS; every actor mini-batch carries ``ptx_batch_size`` of
    them, taken from one fixed shuffled order by a cursor that wraps; each ptx micro-batch
    logs the NLL and token count of a loop over the actor's next-token log-probs (the
    first ones also against transformers, before any step) and carries the scale that
    makes the step's loss PPO loss + ptx_coef x the mean ptx NLL; ppo/ptx/loss is the
    iteration's mean NLL."""
    import sentencepiece

    s = settings(name)
    sp = sentencepiece.SentencePieceProcessor(model_file=tiny_checkpoints[1]["tokenizer"])
    stream = []
    for it, run in iterations(traced, name):
        examples = run["ptx_examples"]
        assert len(examples) == len(PTX_ROWS)
        for (tokens, weights), row in zip(examples, PTX_ROWS, strict=True):
            targets = [tokens[t + 1] for t, w in enumerate(weights) if w]
            assert len(weights) == len(tokens) and targets[-1] == run["eos_id"]
            assert sp.decode(targets[:-1]) == row["response"]
            assert sp.decode(tokens[:len(tokens) - len(targets)]) == row["prompt"]
        padded = {}
        for i, (tokens, weights) in enumerate(examples):
            padded.setdefault(tuple(tokens), []).append((i, weights))
        nll = tokens = 0.0
        actor_calls = [c for c in run["calls"] if c["role"] == "actor"]
        for n_call, call in enumerate(actor_calls):
            count = sum(loop["loss_count"] for c, _, _, loop, _ in walk(run, s) if c is call)
            want = ptx_sums(call, "ptx_before", s, count)
            ptx = [(b, log) for b, log in zip(call["batches"], call["logs"], strict=True)
                   if "ptx_loss_mask" in b]
            assert sum(b["tokens"].shape[0] for b, _ in ptx) == s["ptx_rows"]
            for k, (batch, log) in enumerate(ptx):
                for row, mask in zip(batch["tokens"].tolist(),
                                     batch["ptx_loss_mask"].tolist(), strict=True):
                    while row and row[-1] == run["pad_id"]:
                        row.pop()
                    (i, weights), = padded[tuple(row)]
                    assert mask == weights + [0.0] * (len(mask) - len(weights))
                    stream.append(i)
                assert log["ptx_nll_sum"] == pytest.approx(want["nll"][k], rel=1e-5)
                assert log["ptx_tokens"] == want["tokens"][k]
                assert float(batch["ptx_scale"]) == pytest.approx(want["scale"], rel=1e-6)
            nll, tokens = nll + sum(want["nll"]), tokens + sum(want["tokens"])
            if it == 0 and n_call == 0:  # the step-6 checkpoint: against transformers
                batch, out = ptx[0][0], call["ptx_before"][0]
                for b, row in enumerate(batch["tokens"].tolist()):
                    with torch.no_grad():
                        logits = hf_models["actor"](torch.tensor([row])).logits[0].double()
                    logp = torch.log_softmax(logits, -1)[:-1].gather(
                        1, torch.tensor(row[1:])[:, None])[:, 0]
                    weights = batch["ptx_loss_mask"][b, :-1] > 0
                    close(out["logprobs"][b][weights], logp[weights], 1e-5, "ptx")
        assert run["metrics"]["ppo/ptx/loss"] == pytest.approx(nll / tokens, rel=1e-5)
    N = len(PTX_ROWS)
    assert len(stream) > N and sorted(stream[:N]) == list(range(N))  # one pass, then
    assert stream[N:] == stream[:len(stream) - N]  # the same order again
    assert stream[:N] != sorted(stream[:N])  # shuffled


@by_name([n for n in CASES if settings(n)["dynamic"]])
def test_dynamic_sampling_keeps_what_a_loop_keeps(traced, name):
    """DAPO's dynamic sampling: the rounds sampled, the groups kept (and topped up) and
    the metrics, against :func:`dynamic_selection` over the rollouts' own outputs; each
    refill round samples ``group_size`` copies of other prompts than the first round's.
    test_trained_tokens_and_scores_follow_the_rules checks the kept rows' tokens and
    scores, and the other tests their experience and updates."""
    s = settings(name)
    k = s["group_size"]
    for it, run in iterations(traced, name):
        want = dynamic_selection(run, s)
        m = run["metrics"]
        assert m["rollout/dynamic_sampling_rounds"] == want["rounds"]
        assert m["rollout/dynamic_sampling_shortfall"] == want["shortfall"]
        assert m["rollout/dynamic_sampling_groups_seen"] == want["seen"]
        assert m["rollout/dynamic_sampling_kept_fraction"] == pytest.approx(want["kept"])
        assert want["rounds"] > 1 and want["dropped"] > 0  # the case exercises it
        prompts = []
        for r in run["samplings"]:
            rows = [tuple(t for t, m in zip(toks, mask, strict=True) if m) for toks, mask in
                    zip(r["raw"]["prompt_tokens_BP"].tolist(),
                        r["raw"]["prompt_mask_BP"].tolist(), strict=True)]
            assert all(len(set(rows[g:g + k])) == 1 for g in range(0, len(rows), k))
            prompts.append(rows)
        assert all(p != prompts[0] for p in prompts[1:])


@by_name(["gae_k1", "three_iterations"])
def test_ema_actor_follows_a_loop_over_the_steps(traced, name):
    """The EMA actor against a loop over the actor's weights after every step that
    trained it, across iterations (none in the critic's warm-up)."""
    s = settings(name)
    snaps = []
    for it, run in iterations(traced, name):
        if not snaps:
            snaps.append(run["params"]["actor"][0])
        assert torch.equal(run["params"]["actor"][0], snaps[-1])  # carried over
        if it >= s["warmup"]:
            snaps += run["params"]["actor"][1:]
        want = loops.ema(snaps, 0.9)
        close(run["ema"], want, 1e-6, "ema")
        if len(snaps) > 1:  # the actor stepped: the average lags behind it
            assert not torch.allclose(run["ema"].double(), snaps[-1].double())
    assert len(snaps) == 1 + 4 * (s["iterations"] - s["warmup"])


@by_name(["bypass", "gae_k1", "decoupled"])
def test_old_logprobs_are_the_ones_the_mode_promises(traced, name):
    """Bypass: the sampler's log-probs are the old ones. Recompute (and the decoupled
    loss's proximal policy): the actor's own forward at its training layout before any
    update, bitwise what its first micro-batch saw."""
    run = traced[name]["iterations"][0]
    exp = run["experience"]
    mask = exp["response_mask_BT"]
    sampler = run["gen"]["logprobs_BT"] * mask
    assert torch.equal(exp["rollout_logprobs_BT"], sampler)
    if name == "bypass":
        assert torch.equal(exp["old_logprobs_BT"], sampler)
        return
    call = run["calls"][0]
    rows = match_rows(run, call["batches"][0], experience_rows(run), set())
    assert torch.equal(exp["old_logprobs_BT"][rows],
                       call["before"][0]["logprobs"] * exp["response_mask_BT"][rows])


# ------------------------------------------------------------------ across iterations

@by_name(["three_iterations"])
def test_what_one_iteration_hands_the_next(traced, name):
    """Across three iterations: the adaptive KL controller's coefficient against Ziegler
    et al.'s update from each iteration's logged KL; every trained token sampled by the
    policy max(0, i - k) and tagged with that version; the batches, read back from the
    sampler's own prompts, a stream that visits every prompt once per epoch in an order
    that changes between epochs; the critic's warm-up."""
    s = settings(name)
    trace = traced[name]
    runs = trace["iterations"]
    beta = s["beta"]
    n_steps = 32  # configs/demo/ppo.yaml's rollout_batch_size x group_size 1
    for it, run in enumerate(runs):
        assert run["kl_coef"] == pytest.approx(beta, rel=1e-6), it
        kl = run["metrics"]["objective/kl"]
        error = max(-0.2, min(0.2, kl / s["kl_target"] - 1.0))
        beta = beta * (1.0 + error * n_steps / s["kl_horizon"])
        assert run["kl_coef_after"] == pytest.approx(beta, rel=1e-6), it
        assert run["metrics"]["objective/kl_coef"] == pytest.approx(beta, rel=1e-6)
        exp = run["experience"]
        version = max(0, it - s["staleness"])
        trained = exp["response_mask_BT"] > 0
        assert (exp["versions_BT"][trained] == version).all(), it
    assert len({round(r["kl_coef"], 12) for r in runs}) == 3  # the controller moved
    # the data order: the prompts each batch sampled, in order, from the raw generations
    stream = []
    for run in runs:
        raw = run["raw"]
        for toks, mask in zip(raw["prompt_tokens_BP"].tolist(),
                              raw["prompt_mask_BP"].tolist(), strict=True):
            stream.append(tuple(t for t, m in zip(toks, mask, strict=True) if m))
    prompts = [tuple(p) for p in trace["prompts"]]
    N = len(prompts)
    assert N == s["prompts"] and len(stream) == 3 * 32 > 2 * N
    from collections import Counter
    epochs = [stream[e * N:(e + 1) * N] for e in range(len(stream) // N)]
    for e, epoch in enumerate(epochs):
        assert Counter(epoch) == Counter(prompts), f"epoch {e} is not one pass over the data"
    assert epochs[0] != epochs[1]  # reshuffled


# ------------------------------------------------------------------ which settings have a case

# Fields of the ppo and rollout sections that do not change the arithmetic of experience or
# of an update, each with why (and where it is checked instead). Every other field of the
# two sections changes it, and must have a case above with a value other than the schema's
# default - a new field fails test_every_setting_that_changes_the_math_has_a_case until it is
# given a case, or listed here with its reason.
NOT_MATH = {
    "ppo.rollout_batch_size": "how many prompts, not how each is computed",
    "ppo.mini_batch_size": "how many samples per optimizer step (the loss is each "
                           "mini-batch's own; the cases use 16 of 32)",
    "ppo.micro_batch_size": "gradient accumulation: the same loss in other slices "
                            "(test_layouts, test_ppo_modes: micro-batch sizes agree)",
    "ppo.max_tokens_per_micro_batch": "packing: the padded computation's losses "
                                      "(test_packing)",
    "ppo.ppo_epochs": "how many passes (the demo's 2: every case's second epoch)",
    "ppo.num_iterations": "how many iterations (three_iterations runs 3)",
    "ppo.critic_init": "where the critic's weights start, not what is computed with them",
    "ppo.gold_reward_fn": "evaluation only",
    "ppo.eval_interval": "evaluation only",
    "ppo.num_eval_prompts": "evaluation only",
    "ppo.policy_loss": "chosen by the decoupled case and three_iterations (ppo under "
                       "staleness); the setting 'decoupled' is the case's",
    "ppo.ema_decay": "gae_k1 and three_iterations (0.9): the EMA test",
    "rollout.tensor_parallel_size": "a layout: test_rollout / test_experience compare "
                                    "layouts with one process",
    "rollout.placement.mode": "where the rollout runs: test_async (split equals colocated)",
    "rollout.placement.ranks": "as rollout.placement.mode",
    "rollout.decode_slots": "continuous batching: test_async / test_rollout (the static "
                            "batch's samples)",
    "rollout.kv_cache": "where decode slots keep keys and values: test_decode_paths (the "
                        "static batch's samples on either cache)",
    "rollout.kv_block_tokens": "as rollout.kv_cache (test_decode_paths, test_memory)",
    "rollout.kv_cache_tokens": "as rollout.kv_cache: a small pool's preemptions sample the "
                               "same tokens (test_decode_paths, test_memory)",
    "rollout.placement.weight_checksum": "a check, no arithmetic",
    "rollout.placement.sync_timeout_minutes": "a deadline, no arithmetic",
    "rollout.placement.request_timeout_minutes": "a deadline, no arithmetic",
    "rollout.placement.partial": "timing of weight updates: test_async's partial rollouts (each "
                       "token's version and behaviour log-prob)",
    "rollout.placement.partial_kv": "as rollout.placement.partial (test_rollout)",
    "rollout.greedy": "the draw only (the argmax), the log-probs are the full "
                      "distribution's: test_rollout's greedy decoding against transformers",
    "rollout.rewards.fn": "where scores come from: test_verifiers (the same run from "
                         "workers, the trainer and a server)",
    "rollout.rewards.url": "as rollout.rewards.fn",
    "rollout.rewards.workers": "as rollout.rewards.fn",
    "rollout.rewards.timeout_s": "as rollout.rewards.fn",
    "rollout.rewards.batch": "as rollout.rewards.fn",
    "rollout.rewards.retries": "as rollout.rewards.fn",
    "rollout.rewards.on_error": "a failed reward's fate: test_verifiers",
    "rollout.rewards.error_score": "a failed reward's score: test_verifiers",
    "rollout.environment.name": "multi-turn: test_multiturn's experience against plain loops",
    "rollout.environment.max_turns": "multi-turn (as rollout.environment.name)",
    "rollout.environment.max_observation_tokens": "multi-turn (as rollout.environment.name)",
    "rollout.environment.tool_format": "multi-turn (as rollout.environment.name)",
    "rollout.judge.template": "the reward's source (a judge model): test_judge against "
                              "transformers, one sample at a time",
    "rollout.judge.chat": "the judge's prompt (as rollout.judge.template): test_judge",
    "rollout.judge.pattern": "the judge's parse (as rollout.judge.template): test_judge",
    "rollout.judge.labels": "the judge's parse (as rollout.judge.template): test_judge",
    "rollout.judge.max_new_tokens": "the judge's verdict length: test_judge",
    "rollout.judge.log_verdicts": "a log of the verdicts, not the math",
    "rollout.agent.entry": "multi-turn played by an agent: test_agents (the same episodes "
                           "and training as the environment's)",
    "rollout.agent.command": "multi-turn (as rollout.agent.entry): test_agents",
    "rollout.agent.model_name": "the endpoint's model name: test_agents",
    "rollout.agent.max_requests": "multi-turn (as rollout.environment.max_turns): test_agents",
    "rollout.agent.tool_format": "multi-turn (as rollout.environment.tool_format): test_agents",
    "rollout.agent.batch_wait_s": "which requests share a batch, not what is sampled (per-row "
                                  "seeds)",
    "rollout.offload_frozen_models": "where weights live: test_memory (offload changes "
                                     "nothing)",
    "rollout.forward_micro_batch_size": "slicing of the scoring passes (test_experience)",
    "rollout.forward_max_tokens_per_micro_batch": "packing of the scoring passes "
                                                  "(test_packing)",
    "rollout.routing_replay": "mixtures of experts: test_moe (r2 and r3 against a router "
                              "that flips)",
    "rollout.release_inference_weights": "memory only (test_memory)",
    "rollout.ref_cache_size": "a cache of the reference's log-probs: equal to scoring "
                              "again (test_ppo_modes)",
    "ppo.teacher.coef": "on-policy distillation: test_on_policy_distill (the teacher's KL "
                        "in the targets against a loop, for every estimator)",
    "ppo.teacher.kl_in": "on-policy distillation (as ppo.teacher.coef; the loss term is "
                         "ppo.kl.loss_coef's with the teacher's log-probs)",
    "ppo.teacher.loss_estimator": "as ppo.teacher.kl_in",
    "ppo.teacher.task_reward": "on-policy distillation: every score 0 "
                               "(test_on_policy_distill)",
}


def settings_table() -> tuple[dict[str, str], list[str], list[str]]:
    """From the config schema, every field of ppo and rollout -> the cases that set it to a
    value other than its default (read back from the config each case runs with,
    configs/demo/ppo.yaml plus its overrides), or why it does not change the math
    (NOT_MATH). Also the fields that change the math with no case the reference reads,
    and the NOT_MATH entries the schema does not have."""
    import dataclasses

    from megarlhf.config import load_config
    from megarlhf.config.ppo import PPOConfig, RolloutConfig

    def default(f):
        return f.default_factory() if f.default is dataclasses.MISSING else f.default

    loaded = {name: load_config(os.path.join(ROOT, "configs/demo/ppo.yaml"), overrides(name))
              for name in CASES}
    read = set(FIELDS.values())
    table, missing = {}, []
    def leaves(section: str, cls) -> list:  # (dotted section, field), into the subsections
        out = []
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(default(f)):
                out += leaves(f"{section}.{f.name}", type(default(f)))
            else:
                out.append((section, f))
        return out

    def value(cfg, dotted: str):
        for part in dotted.split("."):
            cfg = getattr(cfg, part)
        return cfg

    schema = leaves("ppo", PPOConfig) + leaves("rollout", RolloutConfig)
    for section, f in schema:
        dotted = f"{section}.{f.name}"
        if dotted in NOT_MATH:
            table[dotted] = "not traced: " + NOT_MATH[dotted]
            continue
        cases = [n for n, cfg in loaded.items() if value(cfg, dotted) != default(f)]
        table[dotted] = ", ".join(f"`{n}`" for n in cases)
        if not cases or dotted not in read:
            missing.append(f"{dotted} (default {default(f)!r}): "
                           + ("no case sets another value" if not cases
                              else f"set by {cases} but the reference does not read it"))
    stale = sorted(set(NOT_MATH) - {f"{sec}.{f.name}" for sec, f in schema})
    return table, missing, stale


def settings_markdown() -> str:
    """The table tests/README.md shows (``python tests/test_ppo_reference.py`` prints it)."""
    table, _, _ = settings_table()
    return "\n".join(["| field | traced by the cases / why not |", "|---|---|",
                      *(f"| `{k}` | {v} |" for k, v in table.items())])


def test_every_setting_that_changes_the_math_has_a_case():
    """From the config schema: every field of ppo and rollout is either listed in NOT_MATH
    with its reason or set by some case to a value other than its default, and the case's
    setting is one the reference reads (FIELDS); tests/README.md shows the table as it is."""
    table, missing, stale = settings_table()
    assert not stale, f"NOT_MATH lists fields the schema does not have: {stale}"
    assert not missing, "settings that change the math with no traced case:\n" + \
        "\n".join(missing)
    assert len(table) >= 80
    readme = open(os.path.join(ROOT, "tests/README.md")).read()
    assert settings_markdown() in readme, \
        "tests/README.md's settings table is stale: python tests/test_ppo_reference.py prints it"


if __name__ == "__main__":
    print(settings_markdown())
