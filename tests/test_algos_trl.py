"""TRL as a numerical oracle (test-only dependency).

``trl.experimental.ppo.PPOTrainer`` (trl 1.12.0) computes rewards, advantages and losses
inline in ``train()``. ``trl_experience`` and ``trl_losses`` below are those lines, using
TRL's own helpers (``truncate_response``, ``first_true_indices``, ``masked_mean``,
``masked_whiten``); ``test_trl_source_still_has_these_lines`` fails if TRL changes them.

TRL conventions that megarlhf reproduces by the arguments it is given here, and where its
defaults intentionally differ:
- TRL adds the score one position *after* the last response token (``actual_end =
  sequence_length + 1``) and trains the value head on that extra position
  (``padding_mask_p1``). megarlhf puts the score on the last response token (DeepSpeed-Chat,
  OpenRLHF), so the value of the final real token is trained towards the score. Passing
  TRL's extended mask (``mask_p1``) to ``shape_rewards``/``gae``/``value_loss`` reproduces
  TRL exactly.
- TRL subtracts ``missing_eos_penalty``; megarlhf's default replaces the score by a fixed
  value (lm-human-preferences); ``mode="subtract"`` is TRL's.
- TRL does not clip scores; megarlhf clips to +-``clip_reward_value`` (5, DeepSpeed-Chat);
  ``None`` is TRL's.
- TRL's ``approxkl`` is 0.5 * mean(diff^2) over every position including padding (k2,
  diluted by padding); megarlhf reports masked k1 and k3.
"""

import glob
import inspect
import os
import warnings
import zipfile

import pytest
import torch

from megarlhf import algos

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from trl.experimental.ppo import ppo_trainer as trl_ppo
    from trl.experimental.utils import first_true_indices

PAD, STOP = 0, 2
B, T = 8, 10


def random_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    responses = torch.randint(3, 50, (B, T), generator=g)
    for b in range(B):  # most rows stop somewhere, some never do
        if b % 3 != 2:
            responses[b, torch.randint(0, T, (1,), generator=g)] = STOP
    rnd = lambda: torch.randn(B, T, generator=g, dtype=torch.float64)  # noqa: E731
    return dict(responses=responses, logprobs=rnd() - 3, ref_logprobs=rnd() - 3,
                values=rnd(), scores=torch.randn(B, generator=g, dtype=torch.float64) * 3,
                new_logprobs=rnd() * 0.1 - 3, vpred=rnd())


def trl_experience(inp, kl_coef, estimator, gamma, lam, whiten_rewards, penalty):
    """PPOTrainer.train(), 'Response Processing 1' through '6. compute advantages'."""
    responses = inp["responses"]
    logprobs, ref_logprobs = inp["logprobs"].clone(), inp["ref_logprobs"].clone()
    values, scores = inp["values"].clone(), inp["scores"].clone()
    postprocessed_responses = trl_ppo.truncate_response(STOP, PAD, responses)
    sequence_lengths = first_true_indices(postprocessed_responses == PAD) - 1
    contain_eos_token = torch.any(postprocessed_responses == STOP, dim=-1)
    scores[~contain_eos_token] -= penalty
    response_idxs = torch.arange(responses.shape[1]).repeat(responses.shape[0], 1)
    padding_mask = response_idxs > sequence_lengths.unsqueeze(1)
    logprobs = torch.masked_fill(logprobs, padding_mask, trl_ppo.INVALID_LOGPROB)
    ref_logprobs = torch.masked_fill(ref_logprobs, padding_mask, trl_ppo.INVALID_LOGPROB)
    sequence_lengths_p1 = sequence_lengths + 1
    padding_mask_p1 = response_idxs > (sequence_lengths_p1.unsqueeze(1))
    values = torch.masked_fill(values, padding_mask_p1, 0)
    logr = ref_logprobs - logprobs
    kl = -logr if estimator == "k1" else (logr.exp() - 1) - logr
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.clone()
    actual_start = torch.arange(rewards.size(0))
    actual_end = torch.where(sequence_lengths_p1 < rewards.size(1), sequence_lengths_p1,
                             sequence_lengths)
    rewards[actual_start, actual_end] += scores
    if whiten_rewards:
        rewards = trl_ppo.masked_whiten(rewards, mask=~padding_mask_p1, shift_mean=False)
        rewards = torch.masked_fill(rewards, padding_mask_p1, 0)
    lastgaelam = 0
    advantages_reversed = []
    gen_length = responses.shape[1]
    for t in reversed(range(gen_length)):
        nextvalues = values[:, t + 1] if t < gen_length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], axis=1)
    returns = advantages + values
    raw_advantages = advantages
    advantages = trl_ppo.masked_whiten(advantages, ~padding_mask)
    advantages = torch.masked_fill(advantages, padding_mask, 0)
    return dict(postprocessed=postprocessed_responses, padding_mask=padding_mask,
                padding_mask_p1=padding_mask_p1, scores=scores, kl=kl, rewards=rewards,
                values=values, raw_advantages=raw_advantages, advantages=advantages,
                returns=returns, logprobs=logprobs)


def trl_losses(inp, exp, cliprange, cliprange_value):
    """PPOTrainer.train(), the mini-batch loss lines (whole batch as one micro-batch)."""
    padding_mask, padding_mask_p1 = exp["padding_mask"], exp["padding_mask_p1"]
    new_logprobs = torch.masked_fill(inp["new_logprobs"], padding_mask, trl_ppo.INVALID_LOGPROB)
    vpred = torch.masked_fill(inp["vpred"], padding_mask_p1, 0)
    mb_values, mb_return, mb_advantage = exp["values"], exp["returns"], exp["advantages"]
    vpredclipped = torch.clamp(vpred, mb_values - cliprange_value, mb_values + cliprange_value)
    vf_losses1 = torch.square(vpred - mb_return)
    vf_losses2 = torch.square(vpredclipped - mb_return)
    vf_loss_max = torch.max(vf_losses1, vf_losses2)
    vf_loss = 0.5 * trl_ppo.masked_mean(vf_loss_max, ~padding_mask_p1)
    vf_clipfrac = trl_ppo.masked_mean((vf_losses2 > vf_losses1).float(), ~padding_mask_p1)
    logprobs_diff = new_logprobs - exp["logprobs"]
    ratio = torch.exp(logprobs_diff)
    pg_losses = -mb_advantage * ratio
    pg_losses2 = -mb_advantage * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss_max = torch.max(pg_losses, pg_losses2)
    pg_loss = trl_ppo.masked_mean(pg_loss_max, ~padding_mask)
    pg_clipfrac = trl_ppo.masked_mean((pg_losses2 > pg_losses).float(), ~padding_mask)
    return dict(vf_loss=vf_loss, vf_clipfrac=vf_clipfrac, pg_loss=pg_loss,
                pg_clipfrac=pg_clipfrac)


def megarlhf_experience(inp, kl_coef, estimator, gamma, lam, whiten_rewards, penalty):
    full = torch.ones(B, T, dtype=torch.float64)
    responses, mask, has_stop = algos.truncate_after_stop(inp["responses"], full, [STOP], PAD)
    scores = algos.apply_missing_stop_rule(inp["scores"], has_stop, penalty, mode="subtract")
    # TRL's convention: the score and the value targets extend one token past the end.
    last = algos.last_valid_index(mask)
    mask_p1 = (torch.arange(T).unsqueeze(0) <= (last + 1).unsqueeze(1)).to(torch.float64)
    kl = algos.kl_per_token(inp["logprobs"], inp["ref_logprobs"], mask, estimator)
    rewards, _ = algos.shape_rewards(scores, kl, mask_p1, kl_coef, clip_reward_value=None)
    if whiten_rewards:
        rewards = algos.masked_whiten(rewards, mask_p1, shift_mean=False) * mask_p1
    values = inp["values"] * mask_p1
    raw_advantages, returns = algos.gae(rewards, values, mask_p1, gamma, lam)
    advantages = algos.masked_whiten(raw_advantages, mask) * mask
    return dict(postprocessed=responses, mask=mask, mask_p1=mask_p1, scores=scores, kl=kl,
                rewards=rewards, values=values, raw_advantages=raw_advantages,
                advantages=advantages, returns=returns)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("estimator, gamma, lam, whiten_rewards", [
    ("k1", 1.0, 0.95, False), ("k3", 0.99, 0.9, True), ("k1", 0.9, 1.0, True)])
def test_experience_matches_trl(seed, estimator, gamma, lam, whiten_rewards):
    inp = random_inputs(seed)
    args = (0.05, estimator, gamma, lam, whiten_rewards, 1.5)
    ref, ours = trl_experience(inp, *args), megarlhf_experience(inp, *args)
    assert torch.equal(ref["postprocessed"], ours["postprocessed"])
    assert torch.equal(~ref["padding_mask"], ours["mask"].bool())
    assert torch.equal(~ref["padding_mask_p1"], ours["mask_p1"].bool())
    for key in ("scores", "kl", "rewards", "values", "raw_advantages", "advantages", "returns"):
        got = ours[key] if key != "kl" else ours[key] * ours["mask"]
        assert torch.allclose(got, ref[key].to(torch.float64), atol=1e-6, rtol=0), key
    assert (ref["advantages"].abs() > 0).any()


@pytest.mark.parametrize("seed", [0, 3])
def test_losses_match_trl(seed):
    inp = random_inputs(seed)
    ref_exp = trl_experience(inp, 0.05, "k1", 1.0, 0.95, False, 1.0)
    ref = trl_losses(inp, ref_exp, cliprange=0.2, cliprange_value=0.2)
    ours = megarlhf_experience(inp, 0.05, "k1", 1.0, 0.95, False, 1.0)
    total, count, pstats = algos.policy_loss(inp["new_logprobs"], inp["logprobs"],
                                             ours["advantages"], ours["mask"], clip_eps=0.2)
    assert torch.allclose(total / count, ref["pg_loss"], atol=1e-6, rtol=0)
    assert torch.allclose(pstats["clipfrac"], ref["pg_clipfrac"].double(), atol=1e-6)
    vpred = inp["vpred"] * ours["mask_p1"]
    total, count, vstats = algos.value_loss(vpred, ours["values"], ours["returns"],
                                            ours["mask_p1"], cliprange_value=0.2)
    assert torch.allclose(total / count, ref["vf_loss"], atol=1e-6, rtol=0)
    assert torch.allclose(vstats["clipfrac"], ref["vf_clipfrac"].double(), atol=1e-6)
    assert ref["pg_clipfrac"] > 0 and ref["vf_clipfrac"] > 0


def test_whitening_matches_trl():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 9, generator=g, dtype=torch.float64)
    mask = torch.rand(6, 9, generator=g) > 0.3
    for shift in (True, False):
        assert torch.allclose(algos.masked_whiten(x, mask, shift_mean=shift),
                              trl_ppo.masked_whiten(x, mask, shift_mean=shift), atol=1e-12)
    assert torch.allclose(algos.masked_var(x, mask), trl_ppo.masked_var(x, mask), atol=1e-12)
    assert torch.allclose(algos.masked_var(x, mask, unbiased=False),
                          trl_ppo.masked_var(x, mask, unbiased=False), atol=1e-12)


def test_trl_source_still_has_these_lines():
    """The oracle above copies PPOTrainer.train(); fail if TRL's lines change."""
    source = inspect.getsource(trl_ppo.PPOTrainer.train)
    for line in [
        "sequence_length = first_true_indices(postprocessed_response == processing_class.pad_token_id) - 1",
        "scores[~contain_eos_token] -= self.args.missing_eos_penalty",
        "padding_mask_p1 = response_idxs > (sequence_lengths_p1.unsqueeze(1))",
        "kl = -logr if args.kl_estimator == \"k1\" else (logr.exp() - 1) - logr",
        "actual_end = torch.where(sequence_lengths_p1 < rewards.size(1), sequence_lengths_p1, sequence_lengths)",
        "rewards = masked_whiten(rewards, mask=~padding_mask_p1, shift_mean=False)",
        "delta = rewards[:, t] + args.gamma * nextvalues - values[:, t]",
        "lastgaelam = delta + args.gamma * args.lam * lastgaelam",
        "advantages = masked_whiten(advantages, ~padding_mask)",
        "vf_loss = 0.5 * masked_mean(vf_loss_max, ~padding_mask_p1[micro_batch_inds])",
        "pg_losses2 = -mb_advantage * torch.clamp(ratio, 1.0 - args.cliprange, 1.0 + args.cliprange)",
        "pg_loss = masked_mean(pg_loss_max, ~padding_mask[micro_batch_inds])",
    ]:
        assert line in source, line


def load_trl_0114_kl_controller():
    """trl 0.11.4 cannot be installed beside trl 1.12.0; scripts/setup_env.sh keeps its
    wheel, and its AdaptiveKLController (plain numpy) is loaded from the source."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    wheels = glob.glob(os.path.join(root, ".venv", "oracles", "trl-0.11.4-*.whl"))
    assert wheels, "trl 0.11.4 wheel missing: run scripts/setup_env.sh (it downloads it)"
    source = zipfile.ZipFile(wheels[0]).read("trl/trainer/utils.py").decode()
    start = source.index("class AdaptiveKLController")
    end = source.index("class FixedKLController")
    namespace = {"np": __import__("numpy")}
    exec(compile(source[start:end], "trl-0.11.4/trl/trainer/utils.py", "exec"), namespace)
    return namespace["AdaptiveKLController"]


def test_adaptive_kl_controller_matches_trl_0114():
    TrlController = load_trl_0114_kl_controller()
    g = torch.Generator().manual_seed(0)
    theirs = TrlController(0.15, 6.0, 10000)
    ours = algos.AdaptiveKLController(0.15, 6.0, 10000)
    for step in range(200):
        kl = float(torch.rand(1, generator=g) * 14)
        n = int(torch.randint(1, 512, (1,), generator=g))
        theirs.update(kl, n)
        ours.update(kl, n)
        assert abs(float(theirs.value) - ours.value) <= 1e-15 * max(1.0, ours.value), step
