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
  actor against a loop over the actor's weights after every step.
"""

import itertools
import os
import subprocess
import sys

import pytest
import torch

import reference_loops as loops
from conftest import ROOT, WORKERS, torchrun

pytestmark = pytest.mark.slow

# What the reference assumes of every case unless the case says otherwise: the settings
# of configs/demo/ppo.yaml and the schema's defaults, written out here on their own.
DEFAULTS = dict(estimator="gae", kl_estimator="k1", beta=0.3, clip_reward=5.0,
                whiten_rewards=False, whiten_advantages=True, unbiased=True, gamma=1.0,
                lam=0.95, group_size=1, group_norm="sequence", clip_eps=0.2, dual_clip=None,
                agg="token_mean", value_clip=0.2, value_coef=0.5, kl_loss_coef=0.0,
                kl_loss_estimator="k3", entropy_coef=0.0, penalty=-1.0, mode="replace",
                max_len=10, buffer=0, overlong=1.0, min_tokens=0, stop=True, recompute=True,
                decoupled=False, behaviour_cap=None)
# Each setting's config field.
FIELDS = dict(estimator="ppo.advantage_estimator", kl_estimator="ppo.kl_estimator",
              beta="ppo.init_kl_coef", clip_reward="ppo.clip_reward_value",
              whiten_rewards="ppo.whiten_rewards", whiten_advantages="ppo.whiten_advantages",
              unbiased="ppo.whiten_unbiased", gamma="ppo.gamma", lam="ppo.lam",
              group_size="ppo.group_size", group_norm="ppo.grpo_normalization",
              clip_eps="ppo.clip_eps", dual_clip="ppo.dual_clip", agg="ppo.loss_agg",
              value_clip="ppo.cliprange_value", value_coef="ppo.value_loss_coef",
              kl_loss_coef="ppo.kl_loss_coef", kl_loss_estimator="ppo.kl_loss_estimator",
              entropy_coef="ppo.entropy_coef", penalty="ppo.missing_stop_penalty",
              mode="ppo.missing_stop_mode", max_len="rollout.max_new_tokens",
              buffer="ppo.overlong_buffer", overlong="ppo.overlong_penalty",
              min_tokens="rollout.min_response_tokens", stop="rollout.stop_at_eos",
              recompute="rollout.recompute_logprobs", behaviour_cap="ppo.behavior_weight_cap")
GROUPS = dict(group_size=2, extra=["ppo.rollout_batch_size=16"])
GRPO = dict(GROUPS, estimator="grpo", beta=0.0, extra=GROUPS["extra"] + [
    "ppo.kl_controller=fixed"])
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
    "grpo_sequence": dict(GRPO, kl_loss_coef=0.5),
    "grpo_token_nostop": dict(GRPO, group_norm="token", stop=False, kl_loss_coef=0.5),
    "grpo_center": dict(GRPO, group_norm="center", kl_loss_coef=0.2, kl_loss_estimator="k2",
                        agg="seq_mean_token_sum"),
    "rloo_stop": dict(GROUPS, estimator="rloo"),
    "rloo_nostop": dict(GROUPS, estimator="rloo", stop=False),
    "rpp_stop": dict(estimator="reinforce_pp"),
    "rpp_nostop": dict(estimator="reinforce_pp", stop=False, gamma=0.95),
    "bypass": dict(recompute=False),
    "decoupled": dict(decoupled=True, behaviour_cap=1.0000001,
                      extra=["ppo.policy_loss=decoupled"]),
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
                else str(value)
            out.append(f"{FIELDS[key]}={text}")
    return out + list(s.get("extra", []))


@pytest.fixture(scope="module")
def traced(tiny_checkpoints, tmp_path_factory):
    import json

    out, task, common = tiny_checkpoints
    folder = tmp_path_factory.mktemp("trace")
    base = [f"data.train_path={task['prompts']}", f"data.eval_path={task['eval_prompts']}",
            f"ppo.sft_checkpoint={out}/sft-tiny/checkpoints/step_0000006",
            f"roles.reference.checkpoint={out}/sft-tiny/checkpoints/step_0000003",
            f"ppo.reward_checkpoint={out}/rm-tiny/checkpoints", *common,
            f"run.output_dir={folder}"]
    cases = {name: {"overrides": base + overrides(name)} for name in SELECTED}
    (folder / "cases.json").write_text(json.dumps(cases))
    torchrun(os.path.join(WORKERS, "ppo_trace.py"), 1, str(folder / "cases.json"), str(folder))
    return {name: torch.load(folder / f"{name}.pt", weights_only=False) for name in SELECTED}


@pytest.fixture(scope="module")
def hf_models(tiny_checkpoints):
    """The actor's and the reference's checkpoints converted to Hugging Face, loaded by
    transformers: the log-prob oracle."""
    transformers = pytest.importorskip("transformers")
    out = tiny_checkpoints[0]
    models = {}
    for name, step in (("actor", 6), ("reference", 3)):
        dest = out / f"hf-{name}"
        if not dest.exists():  # converted once per folder (tests/mutants.py shares one)
            tmp = out / f".hf-{name}-{os.getpid()}"
            subprocess.run([sys.executable, "tools/convert_megatron_to_hf.py", "--config",
                            "configs/sft_tiny.yaml", "--out", str(tmp), "--ckpt",
                            f"{out}/sft-tiny/checkpoints/step_{step:07d}"],
                           check=True, capture_output=True, cwd=ROOT)
            os.replace(tmp, dest)
        models[name] = transformers.AutoModelForCausalLM.from_pretrained(
            str(dest), torch_dtype=torch.float32).eval()
    return models


def close(got, want, tol=1e-6, what=""):
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want,
                                                                          dtype=torch.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = (got - want).abs().max().item() if got.numel() else 0.0
    assert err <= tol * max(1.0, want.abs().max().item()), (what, err)


def by_name(names):
    return pytest.mark.parametrize("name", [n for n in names if n in SELECTED])


def stop_ids(run) -> list[int]:
    return [run["eos_id"]]  # no case sets rollout.stop_token_ids


# ------------------------------------------------------------------ what is trained

@by_name(CASES)
def test_trained_tokens_and_scores_follow_the_rules(traced, name):
    """From the sampler's own output: each response is cut after its first stop token,
    short ones train on nothing, and the score is the reward model's with the missing-stop
    rule and the overlong ramp applied."""
    run, s = traced[name], settings(name)
    raw, exp = run["raw"], run["experience"]
    cut, stopped = loops.truncated_lengths(raw["response_tokens_BT"],
                                           raw["response_mask_BT"], stop_ids(run))
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
    want = [loops.shaped_score(float(r), st, n, penalty=s["penalty"], mode=s["mode"],
                               max_len=s["max_len"], buffer=s["buffer"],
                               overlong=s["overlong"])
            for r, st, n in zip(run["raw_scores"], stopped, cut, strict=True)]
    close(exp["scores_B"], want, 1e-6, "scores")
    assert any(stopped) and (s["stop"] or not all(stopped))
    if s["min_tokens"]:
        assert 0 < sum(n < s["min_tokens"] for n in cut) < B  # the case exercises it


def hf_logprobs(model, run) -> torch.Tensor:
    """(B, T) log-probs of every response token under ``model``, each row scored alone
    without padding, 0 after the row's end (its stop token; short rows included)."""
    exp = run["experience"]
    B, T = exp["response_tokens_BT"].shape
    out = torch.zeros(B, T, dtype=torch.float64)
    n = loops.lengths(run["gen"]["response_mask_BT"])
    for b in range(B):
        if not n[b]:
            continue
        prompt = exp["prompt_tokens_BP"][b][exp["prompt_mask_BP"][b] == 1].tolist()
        response = exp["response_tokens_BT"][b, :n[b]].tolist()
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0].double()
        logp = torch.log_softmax(logits, -1)
        for t, tok in enumerate(response):
            out[b, t] = logp[len(prompt) - 1 + t, tok]
    return out


@by_name(CASES)
def test_logprobs_against_transformers(traced, hf_models, name):
    """The reference's log-probs are the reference checkpoint's, the old log-probs the
    actor's (recomputed, or the sampler's in bypass mode), the sampler's the actor's: all
    against transformers on the converted checkpoints."""
    run = traced[name]
    exp = run["experience"]
    actor, ref = hf_logprobs(hf_models["actor"], run), hf_logprobs(hf_models["reference"], run)
    trained = exp["response_mask_BT"]  # short responses: no trainable token
    close(exp["ref_logprobs_BT"], ref, 1e-5, "reference")
    close(exp["old_logprobs_BT"], actor * trained, 1e-5, "old")
    close(exp["rollout_logprobs_BT"], actor * trained, 1e-5, "rollout")
    assert (actor - ref).abs().max() > 1e-2  # the two checkpoints differ


# ------------------------------------------------------------------ the experience

@by_name(CASES)
def test_experience_against_plain_loops(traced, name):
    """KL per token, shaped rewards, advantages and returns recomputed from the logged
    log-probs, values and scores with plain loops (float64)."""
    run, s = traced[name], settings(name)
    exp = run["experience"]
    assert run["kl_coef"] == pytest.approx(s["beta"] if s["estimator"] != "grpo" else 0.0)
    if s["estimator"] in CRITIC_FREE:
        assert not exp["values_BT"].any()
    else:
        assert exp["values_BT"].abs().sum() > 0
    want = loops.experience(
        old=exp["old_logprobs_BT"], ref=exp["ref_logprobs_BT"], values=exp["values_BT"],
        scores=exp["scores_B"], mask=exp["response_mask_BT"], estimator=s["estimator"],
        kl_estimator=s["kl_estimator"], beta=s["beta"], clip_reward=s["clip_reward"],
        whiten_rewards=s["whiten_rewards"], whiten_advantages=s["whiten_advantages"],
        unbiased=s["unbiased"], gamma=s["gamma"], lam=s["lam"], group_size=s["group_size"],
        group_norm=s["group_norm"])
    close(exp["kl_BT"], want["kl"], 1e-6, "kl")
    close(exp["rewards_BT"], want["rewards"], 1e-6, "rewards")
    close(exp["advantages_BT"], want["advantages"], 1e-6, "advantages")
    close(exp["returns_BT"], want["returns"], 1e-6, "returns")
    B = len(want["kl"])
    assert run["metrics"]["objective/kl"] == pytest.approx(
        sum(map(sum, want["kl"])) / B, rel=1e-6, abs=1e-9)
    assert sum(map(sum, want["kl"])) != 0 and any(map(any, want["advantages"]))


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
            rows = match_rows(run, batch, table, seen)
            yield (call, i, rows, loop_losses(run, s, call, rows, i, call["before"]),
                   loop_losses(run, s, call, rows, i, call["after"]))


@by_name(CASES)
def test_every_micro_batch_loss_against_a_loop(traced, name):
    """Each micro-batch's logged loss sums, clip fraction and approx-KL equal the loop's,
    computed from the experience's old log-probs (recorded once, before the update) and
    the policy's log-probs at that moment; the micro-batches carry the experience's
    values; the logged metrics are those sums' ratios."""
    run, s = traced[name], settings(name)
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
    assert m["ppo/policy/clipfrac"] == pytest.approx(t("actor", "clipfrac_sum")
                                                     / t("actor", "tokens"), abs=1e-7)
    assert m["ppo/policy/approxkl"] == pytest.approx(t("actor", "approxkl_sum")
                                                     / t("actor", "tokens"), rel=1e-4, abs=1e-7)
    assert m["ppo/policy/pg_loss"] == pytest.approx(t("actor", "pg_loss_sum")
                                                    / t("actor", "loss_count"), rel=1e-4,
                                                    abs=1e-6)
    if s["estimator"] not in CRITIC_FREE:
        assert m["ppo/val/loss"] == pytest.approx(t("critic", "loss_sum")
                                                  / t("critic", "loss_count"), rel=1e-4)
        assert m["ppo/val/clipfrac"] == pytest.approx(t("critic", "clipfrac_sum")
                                                      / t("critic", "tokens"), abs=1e-7)


@by_name(CASES)
def test_the_policy_moves_and_the_clip_bites(traced, name):
    """The first micro-batch is an update at the old policy (ratio 1: approx-KL and clip
    fraction 0; in bypass mode the sampler's log-probs are the old ones, equal to fp32
    rounding); the later mini-batches see a policy that moved, and some of their tokens
    are clipped - in the loop and in what the loss logged."""
    run, s = traced[name], settings(name)
    actor = [(c, i, loop) for c, i, _, loop, _ in walk(run, s) if c["role"] == "actor"]
    first_call, _, first = actor[0]
    rounding = 0.0 if s["recompute"] else 1e-5 * first["tokens"]
    assert abs(first["approxkl_sum"]) <= rounding and first["clipfrac_sum"] == 0.0
    assert abs(first_call["logs"][0]["approxkl_sum"]) <= rounding
    assert first_call["logs"][0]["clipfrac_sum"] == 0.0
    later = [(c, i, loop) for c, i, loop in actor if c is not first_call]
    assert sum(loop["clipfrac_sum"] for _, _, loop in later) > 0
    assert sum(c["logs"][i]["clipfrac_sum"] for c, i, _ in later) > 0
    assert all(abs(c["logs"][i]["approxkl_sum"]) > 1e-4 for c, i, _ in later)


@by_name(CASES)
def test_each_step_lowers_its_mini_batch_loss(traced, name):
    """The optimizer steps along the gradient of the loss that was logged: right after
    each step, the same mini-batch's loss (the loop's, at the new weights) is lower, for
    the actor and for the critic. Adam's first step moves every weight by about the
    learning rate whatever its gradient's size and may overshoot, so from the second step
    on; every step changes both models' weights."""
    run, s = traced[name], settings(name)
    per_call: dict = {}
    for call, _, _, before, after in walk(run, s):
        acc = per_call.setdefault(id(call), [call, 0.0, 0.0, 0.0])
        acc[1] += before["loss_sum"]
        acc[2] += after["loss_sum"]
        acc[3] += before["loss_count"]
    steps: dict = {}
    for call, before, after, count in per_call.values():
        assert call["applied"]
        if steps.setdefault(call["role"], 0):
            assert after < before - 1e-6 * count, (call["role"], before, after)
        steps[call["role"]] += 1
    assert steps == ({"actor": 4} if s["estimator"] in CRITIC_FREE
                     else {"actor": 4, "critic": 4})  # 2 epochs x 2 mini-batches
    for role, snaps in run["params"].items():
        assert len(snaps) == 5  # before the iteration, and after each step
        for a, b in itertools.pairwise(snaps):
            assert not torch.equal(a, b), role


@by_name(["gae_k1"])
def test_ema_actor_follows_a_loop_over_the_steps(traced, name):
    run = traced[name]
    want = loops.ema(run["params"]["actor"], 0.9)
    close(run["ema"], want, 1e-6, "ema")
    assert not torch.allclose(run["ema"].double(), run["params"]["actor"][-1].double())


@by_name(["bypass", "gae_k1", "decoupled"])
def test_old_logprobs_are_the_ones_the_mode_promises(traced, name):
    """Bypass: the sampler's log-probs are the old ones. Recompute (and the decoupled
    loss's proximal policy): the actor's own forward at its training layout before any
    update, bitwise what its first micro-batch saw."""
    run = traced[name]
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
