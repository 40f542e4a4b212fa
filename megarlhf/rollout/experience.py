"""Experience making: one call turns prompts into an :class:`~megarlhf.algos.Experience`.

:meth:`ExperienceMaker.make` reads as the recipe: sample (``rollout.sampling``), score the
samples with the reward (``rollout.scoring``) and the score rules, keep informative groups
(DAPO), score them with the reference, the actor and the critic, then the pure arithmetic of
``algos`` - KL, shaped rewards, advantages, the mismatch correction - into one batch.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from megarlhf import algos
from megarlhf.config import PPOConfig, RolloutConfig
from megarlhf.models import moe
from megarlhf.inference.generate import Generation
from megarlhf.rollout.remote import RemoteRollout
from megarlhf.rollout.sampling import Sampler, dynamic_sampling
from megarlhf.rollout.scoring import Scorer, fed_tokens
from megarlhf.algos.seeds import derive_seed


@dataclass
class Sampled:
    """A sampled batch before its experience passes: the generation (cut after each stop
    token), whether each row stopped, the shaped scores, the sampling's metrics, and the
    token positions its reward-model passes computed (``Scorer.padding``). A batch sampled
    ahead of its update (``ppo.max_staleness``) waits as one of these; it is saved with
    the checkpoint as :meth:`state_dict`."""

    gen: Generation
    has_stop: torch.Tensor
    scores: torch.Tensor
    metrics: dict
    padding: dict

    def state_dict(self) -> dict:
        """Tensors, numbers and strings only (a checkpoint loads them with
        ``weights_only``)."""
        return {"gen": self.gen.state_dict(),
                "has_stop": self.has_stop, "scores": self.scores,
                "metrics": dict(self.metrics), "padding": dict(self.padding)}

    @classmethod
    def from_state_dict(cls, state: dict) -> "Sampled":
        return cls(gen=Generation.from_state(state["gen"]), has_stop=state["has_stop"],
                   scores=state["scores"], metrics=dict(state["metrics"]),
                   padding=dict(state["padding"]))


@dataclass
class ExperienceMaker:
    ppo: PPOConfig
    rollout: RolloutConfig
    sampler: Sampler
    scorer: Scorer
    # rollout.placement.mode=split: the rollout ranks sample
    remote: RemoteRollout | None = None

    def make(self, prompts: list[list[int]], *, seed: int, kl_coef: float,
             refill: Callable[[int], list[list[int]]] | None = None
             ) -> tuple[algos.Experience, Generation, dict]:
        """One experience batch from ``prompts`` (each repeated ``group_size`` times, one
        group after the other), sampled by the current actor. ``refill(round)`` gives more
        prompts for dynamic sampling."""
        return self.score(self.sample(prompts, seed=seed, refill=refill), kl_coef=kl_coef)

    def sample(self, prompts: list[list[int]], *, seed: int,
               refill: Callable[[int], list[list[int]]] | None = None,
               version: int = 0, sampled: tuple[Generation, dict] | None = None) -> Sampled:
        """Steps 1-2 of :meth:`make`: sample ``prompts`` with the actor as it is now (policy
        ``version``, recorded on every response token), score the samples with the reward
        and keep informative groups (DAPO). ``sampled``: the (generation, metrics) of the
        first round, already sampled (by the rollout ranks)."""
        ppo = self.ppo
        t0 = time.perf_counter()
        self.scorer.take_padding_fraction()  # count this batch's passes only
        # 1. sample and score the samples
        gen, has_stop, scores, metrics = self._sample(prompts, seed, sampled)
        # 2. DAPO's dynamic sampling: informative groups only
        if ppo.dynamic_sampling:
            if refill is None:
                raise ValueError("ppo.dynamic_sampling needs a prompt refill")
            gen, has_stop, scores, more = dynamic_sampling(
                gen, has_stop, scores, group_size=ppo.group_size,
                max_rounds=ppo.max_sampling_rounds, pad_id=self.sampler.pad_id,
                sample_more=lambda round_: self._sample(
                    refill(round_), derive_seed("refill", seed, round_)))
            metrics.update(more)
        # sampling only; the reward model's passes are timing/reward (+ _refills)
        metrics["timing/rollout"] = (time.perf_counter() - t0 - metrics["timing/reward"]
                                     - metrics.get("timing/reward_refills", 0.0))
        # every token's version: the rollout ranks record their own under rollout.placement.partial
        # (a batch can change weights part-way); else all are ``version``'s
        mask = gen.fed_mask_BT.long()
        gen = dataclasses.replace(gen, versions_BT=mask * version if gen.versions_BT is None
                                  else gen.versions_BT * mask)
        metrics.update(self.scorer.reward.take_counts())  # a programmatic reward's failures
        padding = dict(self.scorer.padding)
        self.scorer.padding.clear()
        return Sampled(gen, has_stop, scores, metrics, padding)

    def score(self, sampled: Sampled, *, kl_coef: float
              ) -> tuple[algos.Experience, Generation, dict]:
        """Steps 3-6 of :meth:`make`: the experience passes of the current reference, actor
        and critic over a sampled batch, and the learning targets."""
        ppo, r = self.ppo, self.rollout
        gen, has_stop, scores = sampled.gen, sampled.has_stop, sampled.scores
        metrics = dict(sampled.metrics)
        self.scorer.padding.clear()  # the batch's reward passes, then its passes here
        self.scorer.padding.update(sampled.padding)
        t1 = time.perf_counter()
        # 3. the trained tokens: DeepSpeed-Chat drops responses of <= 1 token; here they stay
        # in the batch (fixed batch arithmetic) with no trainable tokens
        mask = gen.model_mask_BT().float()  # multi-turn: not the environment's tokens
        short = mask.sum(dim=1) < r.min_response_tokens
        mask[short] = 0.0
        # 4. the reference, the actor (old log-probs: recomputed, or the sampler's) and the
        # critic score the batch
        ref_lp = self.scorer.reference_logprobs(gen)
        rollout_lp = gen.logprobs_BT * mask
        routing = None  # the experts the updates replay (rollout.routing_replay r2 / r3)
        if self.rollout.recompute_logprobs:
            actor_lp, routing = self.scorer.actor_logprobs(gen)
            old_lp = actor_lp * mask
            if gen.routing_BLSK is not None and self.rollout.routing_replay != "r3":
                metrics.update(moe.take_mismatch(self.scorer.actor.layout))
        else:
            old_lp = rollout_lp.clone()
        if gen.routing_BLSK is not None:  # a mixture of experts: how the rollout spread it
            metrics.update(moe.load_metrics(gen.routing_BLSK, fed_tokens(gen),
                                            self.scorer.actor.spec.model))
        if self.scorer.critic is not None:
            values = self.scorer.values(gen) * mask
        else:
            values = torch.zeros_like(mask)
        # on-policy distillation: the teacher scores the student's tokens
        teacher_lp = self.scorer.teacher_logprobs(gen) * mask if ppo.teacher.enabled else None
        # 5. the learning targets and the mismatch correction (no megatron code: without
        # the CPU backend's mode)
        targets = algos.learning_targets(
            logprobs_BT=old_lp, ref_logprobs_BT=ref_lp, values_BT=values, scores_B=scores,
            mask_BT=mask, kl_estimator=ppo.kl.estimator,
            kl_coef=kl_coef if ppo.kl_reward_on else 0.0,
            clip_reward_value=ppo.clip_reward_value, whiten_rewards=ppo.whiten_rewards,
            whiten_unbiased=ppo.whiten_unbiased, estimator=ppo.advantage_estimator,
            gamma=ppo.gamma, lam=ppo.lam, group_size=ppo.group_size,
            whiten_advantages=ppo.whiten_advantages, group_norm=ppo.grpo_normalization,
            turn_rewards_BT=None if gen.env_rewards_BT is None
            else gen.episode_rewards()[1], teacher_logprobs_BT=teacher_lp,
            teacher_coef=ppo.teacher.coef if ppo.teacher.kl_in == "reward" else 0.0)
        policy_mask, is_weights, corr = algos.mismatch_correction(
            old_lp, rollout_lp, mask, is_cap=ppo.correction.is_cap,
            mask_low=ppo.correction.mask_low, mask_high=ppo.correction.mask_high)
        metrics.update(corr)
        exp = algos.Experience(
            prompt_tokens_BP=gen.prompt_tokens_BP, prompt_mask_BP=gen.prompt_mask_BP,
            response_tokens_BT=gen.response_tokens_BT, response_mask_BT=mask,
            rollout_logprobs_BT=rollout_lp, old_logprobs_BT=old_lp, ref_logprobs_BT=ref_lp,
            values_BT=values, scores_B=scores, policy_mask_BT=policy_mask,
            is_weights_BT=is_weights,
            routing_BLSK=routing, versions_BT=gen.versions_BT,
            fed_mask_BT=None if gen.observation_BT is None else gen.fed_mask_BT,
            teacher_logprobs_BT=teacher_lp, **targets)
        # 6. what it was
        metrics.update(rollout_metrics(exp, gen, has_stop, short, rollout_lp, old_lp,
                                       self.scorer.ref_cache))
        if exp.teacher_kl_BT is not None:  # KL(student || teacher), k1, summed per response
            metrics["objective/teacher_kl"] = float(exp.teacher_kl_BT.sum()) / len(exp)
        metrics["perf/padding_fraction/experience"] = self.scorer.take_padding_fraction()
        metrics["timing/experience"] = time.perf_counter() - t1
        return exp, gen, metrics

    def _sample(self, prompts: list[list[int]], seed: int,
                sampled: tuple[Generation, dict] | None = None
                ) -> tuple[Generation, torch.Tensor, torch.Tensor, dict]:
        """Rollout (unless ``sampled``), truncation and the shaped score: (generation,
        has_stop, score, timings)."""
        if sampled is None:
            sampled = (self.remote or self.sampler).rollout(prompts, seed)
        gen, metrics = sampled
        gen, has_stop = self.sampler.finalize(gen)
        ppo = self.ppo
        start = time.perf_counter()
        # (a teacher alone: ppo.teacher.task_reward=false, no task reward)
        scores = self.scorer.reward_scores(gen) if ppo.teacher.task_reward \
            else torch.zeros(gen.response_tokens_BT.shape[0])
        metrics["timing/reward"] = time.perf_counter() - start
        bad = int((~torch.isfinite(scores)).sum())
        metrics["rollout/nonfinite_scores"] = float(bad)
        if bad and dist.get_rank() == 0:
            print(f"[ppo] warning: {bad} of {len(scores)} rewards are not finite (NaN/inf): "
                  "their samples give non-finite losses and skipped steps", flush=True)
        scores = algos.shape_scores(
            scores, has_stop, gen.fed_mask_BT.sum(dim=1),
            missing_stop_penalty=ppo.missing_stop_penalty, missing_stop_mode=ppo.missing_stop_mode,
            max_len=self.rollout.max_new_tokens, overlong_buffer=ppo.overlong_buffer,
            overlong_penalty_value=ppo.overlong_penalty)
        return gen, has_stop, scores, metrics


def rollout_metrics(exp: algos.Experience, gen: Generation, has_stop: torch.Tensor,
                    short: torch.Tensor, rollout_lp: torch.Tensor, old_lp: torch.Tensor,
                    ref_cache) -> dict[str, float]:
    """``rollout/*`` and ``objective/*`` of one experience batch."""
    mask = exp.response_mask_BT
    gap = (rollout_lp - old_lp).abs() * mask
    num_tokens, num_rows = float(mask.sum()), len(exp)
    return {
        "rollout/logprob_diff_mean": float(gap.sum()) / max(num_tokens, 1.0),
        "rollout/logprob_diff_max": float(gap.max()),
        "rollout/response_len_mean": num_tokens / num_rows,
        "rollout/eos_fraction": float(has_stop.float().mean()),
        "rollout/short_responses_masked": float(short.sum()),
        "objective/score": float(exp.scores_B.mean()),
        "objective/kl": float(exp.kl_BT.sum()) / num_rows,
        "rollout/ref_cache_hit_rate": ref_cache.hit_rate if ref_cache else 0.0,
    }
