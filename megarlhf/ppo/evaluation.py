"""Evaluation during PPO: greedy responses to held-out prompts (or the environment's
episodes), scored by the gold reward when one is known and by the reward model."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarlhf.rollout.episodes import episode_metrics
from megarlhf.inference.generate import SamplingParams, generate
from megarlhf.inference.reshard import release_inference_weights
from megarlhf.rollout.sampling import decode_sample
from megarlhf.rewards.verifiers import gold_on_some_ranks


def make_evaluator(cfg, sampler, eval_ds, tokenizer, gold_fn):
    """Greedy responses to held-out prompts: gold score (when known), reward-model score
    and length. Runs on the inference layout (weights resharded first)."""

    def evaluate(step: int, resharder=None, prefix: str = "eval/") -> dict:
        """Greedy responses of the actor (or of the model ``resharder`` copies in)."""
        if eval_ds is None:
            return {}
        prompts = eval_ds.prompts[:cfg.ppo.num_eval_prompts]
        (resharder or sampler.resharder)()
        inf = sampler.inference_layout
        mine_idx = inf.strided_share(len(prompts))
        params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, greedy=True,
                                temperature=cfg.rollout.temperature,
                                stop_token_ids=sampler.stop_token_ids,
                                stop_at_eos=cfg.rollout.stop_at_eos)
        if sampler.episodes is not None:  # the environment's episodes, greedy
            return _evaluate_episodes(cfg, sampler, [prompts[i] for i in mine_idx], mine_idx,
                                      params, tokenizer, prefix)
        gen = generate(sampler.inference_model, [prompts[i] for i in mine_idx], params,
                       eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                       true_vocab=sampler.actor.spec.model.vocab_size)
        if sampler.release_inference:
            release_inference_weights(sampler.inference_model)
        local = torch.zeros(3, dtype=torch.float64)
        if inf.tp_rank == 0:
            local[1] = float(gen.fed_mask_BT.sum())
            local[2] = len(mine_idx)
        if gold_fn:  # every rank: a failed call stops them all
            local[0] = gold_on_some_ranks(gold_fn, [
                decode_sample(gen, b, tokenizer.decode) for b in range(len(mine_idx))]
                if inf.tp_rank == 0 else None)
        dist.all_reduce(local)
        out = {f"{prefix}response_len": float(local[1] / local[2])}
        if gold_fn:
            out[f"{prefix}gold_score"] = float(local[0] / local[2])
        return out

    return evaluate


def _evaluate_episodes(cfg, sampler, rows: list, indices: list[int], params, tokenizer,
                       prefix: str) -> dict:
    """Greedy episodes of the environment on this replica's held-out ``rows``: the mean
    return (every turn's reward; the environment's verdict is its gold score), the mean
    model tokens and turns. A collective of the world."""
    stats: dict = {}
    inf = sampler.inference_layout
    if rows:
        gen = sampler.episodes.sample(sampler.inference_model, rows, indices, 0, params=params,
                                      eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                                      true_vocab=sampler.actor.spec.model.vocab_size,
                                      stats=stats)
    if sampler.release_inference:
        release_inference_weights(sampler.inference_model)
    local = torch.zeros(3, dtype=torch.float64)
    if inf.tp_rank == 0 and rows:
        local[0] = float(gen.env_rewards_BT.sum())
        local[1] = float(gen.model_mask_BT().sum())
        local[2] = len(rows)
    counts = episode_metrics(stats, cfg.rollout.rewards.on_error)
    dist.all_reduce(local)
    n = max(float(local[2]), 1.0)
    return {f"{prefix}gold_score": float(local[0]) / n,
            f"{prefix}response_len": float(local[1]) / n,
            f"{prefix}turns": counts["rollout/turns_mean"]}
