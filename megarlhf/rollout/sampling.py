"""Sampling a rollout: the actor resharded into the inference layout, each inference
replica's share of the prompts sampled, every sample gathered on every rank, and each
response cut after its stop token.

Each rank ends with the whole batch: every role scores it at its own layout, and each
trained role takes its own data-parallel share when it learns.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from megarlhf import algos
from megarlhf.config import RolloutConfig
from megarlhf.models import moe
from megarlhf.roles.build import Role
from megarlhf.parallel.gather import gather_objects
from megarlhf.parallel.layout import RankLayout, run_of
from megarlhf.inference import static_kv
from megarlhf.inference.continuous import generate_continuous
from megarlhf.inference.paged_slots import generate_paged
from megarlhf.rollout.episodes import Episodes, episode_metrics
from megarlhf.rollout.hooks import RolloutHooks
from megarlhf.inference.generate import Generation, SamplingParams, generate
from megarlhf.inference.reshard import Resharder, release_inference_weights
from megarlhf.parallel import watchdog
from megarlhf.algos.seeds import derive_seed


@dataclass
class Sampler:
    settings: RolloutConfig  # the rollout section
    actor: Role  # trained; its chunks are resharded into ``inference_model``
    inference_layout: RankLayout
    inference_model: torch.nn.Module
    eos_id: int
    pad_id: int
    # phase hooks (memory accounting, trained-role offload)
    hooks: RolloutHooks | None = None
    # free the inference model's weights after each generation (the next reshard
    # rewrites them all): rollout.release_inference_weights
    release_inference: bool = False
    # the model's own end tokens besides EOS (data.tokenizer.Tokenizer.end_ids)
    end_ids: tuple[int, ...] = ()
    # multi-turn rollouts (rollout.environment.name)
    episodes: Episodes | None = None

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return stop_tokens(self.settings, self.end_ids)

    def __post_init__(self):
        self.resharder = Resharder(self.actor.chunks, self.inference_model)

    def rollout(self, prompts: list[list[int]], seed: int) -> tuple[Generation, dict]:
        """Reshard, sample this replica's prompts, gather: (generation, metrics)."""
        with watchdog.phase("resharding the actor into the rollout's model"):
            stats = self.resharder()
        inf = self.inference_layout
        indices = list(inf.run_share(len(prompts)))
        mine = [prompts[i] for i in indices]
        if self.hooks is not None:
            self.hooks.before_generate()
        start = time.perf_counter()
        gen_stats: dict = {}
        with watchdog.phase("generation"):
            gen = sample_share(self.settings, self.inference_model, mine, indices, seed,
                               eos_id=self.eos_id, pad_id=self.pad_id, end_ids=self.end_ids,
                               true_vocab=self.actor.spec.model.vocab_size, stats=gen_stats,
                               record_routing=self.actor.spec.model.moe.enabled,
                               episodes=self.episodes)
        seconds = time.perf_counter() - start
        if self.hooks is not None:
            self.hooks.after_generate(gen_stats["kv_cache_bytes"])
        if self.release_inference:
            release_inference_weights(self.inference_model)
        with watchdog.phase("gathering the generations"):
            gen = gather_generations(gen, prompts, inf, self.pad_id)
        metrics = {"timing/reshard": stats.seconds, "perf/reshard_bytes": stats.bytes_received,
                   "timing/generate": seconds, **idle_slots(gen_stats)}
        if self.episodes is not None:
            metrics.update(episode_metrics(gen_stats, self.settings.rewards.on_error))
        return gen, metrics

    def finalize(self, gen: Generation) -> tuple[Generation, torch.Tensor]:
        """Cut every response after its first stop token (the stop token stays): with
        ``rollout.stop_at_eos=false`` the sampler runs past EOS to the fixed length, and the
        truncated response is what is scored, trained and shown. Returns (the truncated
        generation, ``has_stop`` (B,): a stop token occurred)."""
        if gen.observation_BT is not None:  # multi-turn: every turn ends with its stop
            return gen, gen.finished_B
        stops = sorted(set(self.stop_token_ids) | {self.eos_id})
        tokens, mask, has_stop = algos.truncate_after_stop(
            gen.response_tokens_BT, gen.fed_mask_BT, stops, self.pad_id)
        return dataclasses.replace(
            gen, response_tokens_BT=tokens, fed_mask_BT=mask,
            logprobs_BT=gen.logprobs_BT * mask, finished_B=has_stop,
            versions_BT=None if gen.versions_BT is None else gen.versions_BT * mask), has_stop


def sample_share(r: RolloutConfig, model, prompts: list[list[int]], indices: list[int],
                 seed: int, *, eos_id: int, pad_id: int, end_ids: tuple[int, ...], true_vocab: int,
                 stats: dict, record_routing: bool = False,
                 interrupt: Callable[[], bool] | None = None, episodes=None) -> Generation:
    """A replica's share ``prompts`` (the batch's prompts ``indices``) sampled as the
    rollout samples: one static batch, or ``rollout.decode_slots`` rows at a time.
    ``interrupt``: new weights between decode steps (``rollout.placement.partial``).
    ``episodes`` (``rollout.environment.name``): the prompts are data rows, each played as
    an episode (``rollout.episodes.Episodes``). ``r``: the ``rollout`` section."""
    params = sampling_params(r, end_ids)
    stats["prompts"] = len(prompts)
    if episodes is not None:
        return episodes.sample(model, prompts, indices, seed, params=params, eos_id=eos_id,
                               pad_id=pad_id, true_vocab=true_vocab, stats=stats)
    seeds = row_seeds(seed, indices)
    partial = dict(interrupt=interrupt, recompute_kv=r.placement.partial_kv == "recompute")
    if r.decode_slots is not None and r.decode_slots < len(prompts):
        kw = dict(slots=r.decode_slots, eos_id=eos_id, pad_id=pad_id, true_vocab=true_vocab,
                  row_seeds=seeds, stats=stats, record_routing=record_routing, **partial)
        if r.kv_cache == "paged":
            reason = static_kv.unsupported(model, experts=True)
            if reason is None:
                return generate_paged(model, prompts, params, block_tokens=r.kv_block_tokens,
                                      cache_tokens=r.kv_cache_tokens, **kw)
            if r.kv_cache_tokens is not None:
                raise ValueError(f"rollout.kv_cache_tokens sizes the paged KV cache, which "
                                 f"cannot decode {reason}; unset it (such a model decodes on "
                                 "rollout.kv_cache=columns)")
        return generate_continuous(model, prompts, params, **kw)
    return generate(model, prompts, params, eos_id=eos_id, pad_id=pad_id, true_vocab=true_vocab,
                    row_seeds=seeds, stats=stats,
                    record_routing=record_routing, **partial)


def idle_slots(gen_stats: dict) -> dict[str, float]:
    """``rollout/idle_decode_slots``: the share of the rows fed at the decode steps of
    every replica that had already stopped, and ``perf/shared_prefill_fraction``: the
    share of the prompts sampled whose prefill was another row's, copied
    (``speedups.shared_prefill``) - TP peers count alike, so the shares are the
    replicas'; ``rollout/kv_preemptions_per_prompt``: the times a prompt gave its paged
    KV blocks back to wait again (``rollout.kv_cache_tokens``), per prompt sampled - a
    collective of the world the replicas are in."""
    counts = torch.tensor([gen_stats["idle_decode_slots"], gen_stats["decode_slots"],
                           gen_stats.get("shared_prefills", 0), gen_stats.get("prompts", 0),
                           gen_stats.get("kv_preemptions", 0)], dtype=torch.float64)
    dist.all_reduce(counts)
    per_prompt = (lambda c: float(c / counts[3]) if counts[3] else 0.0)  # noqa: E731
    return {"rollout/idle_decode_slots": float(counts[0] / counts[1]) if counts[1] else 0.0,
            "perf/shared_prefill_fraction": per_prompt(counts[2]),
            "rollout/kv_preemptions_per_prompt": per_prompt(counts[4])}


def stop_tokens(r: RolloutConfig, end_ids: tuple[int, ...]) -> tuple[int, ...]:
    """Every token that ends a response besides EOS: rollout.stop_token_ids and the
    model's end tokens (``data.tokenizer.Tokenizer.end_ids``)."""
    return tuple(dict.fromkeys((*r.stop_token_ids, *end_ids)))


def sampling_params(r: RolloutConfig, end_ids: tuple[int, ...]) -> SamplingParams:
    """The rollout's sampling settings (``rollout.*``)."""
    return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                          top_k=r.top_k, top_p=r.top_p, greedy=r.greedy,
                          stop_token_ids=stop_tokens(r, end_ids),
                          stop_at_eos=r.stop_at_eos)


def row_seeds(seed: int, indices: list[int]) -> list[int]:
    """One seed per (batch seed, prompt index): samples do not depend on the layout or on
    which process samples them, and TP peers of a replica (same gathered logits) draw the
    same tokens."""
    return [derive_seed("row", seed, i) for i in indices]


def dynamic_sampling(gen: Generation, has_stop: torch.Tensor, scores: torch.Tensor, *,
                     group_size: int, max_rounds: int, pad_id: int,
                     sample_more: Callable[[int], tuple]) -> tuple:
    """DAPO's dynamic sampling: keep the groups whose scores are not all equal
    (``algos.informative_groups``), calling ``sample_more(round)`` for another
    (generation, has_stop, scores, metrics) until the batch has as many groups as it
    started with (at most ``max_rounds`` rollouts); a batch still short is topped up with
    dropped groups, in order. Returns (generation, has_stop, scores, metrics)."""
    k = group_size
    needed = len(scores) // k
    kept: list = []
    dropped: list = []
    rounds, seen, reward_seconds = 1, 0, 0.0
    while True:
        informative = algos.informative_groups(scores, k)
        for g in range(informative.shape[0]):
            rows = [(gen, g * k + j, bool(has_stop[g * k + j]), float(scores[g * k + j]))
                    for j in range(k)]
            (kept if bool(informative[g]) else dropped).append(rows)
        seen += informative.shape[0]
        if len(kept) >= needed or rounds >= max_rounds:
            break
        gen, has_stop, scores, more = sample_more(rounds)
        reward_seconds += more["timing/reward"]
        rounds += 1
    shortfall = max(needed - len(kept), 0)
    groups = (kept + dropped[:shortfall])[:needed]
    rows = [row for group in groups for row in group]
    merged = merge_rows([(g, j) for g, j, _, _ in rows], pad_id)
    metrics = {"rollout/dynamic_sampling_rounds": float(rounds),
               "rollout/dynamic_sampling_kept_fraction": min(len(kept), needed) / needed,
               "rollout/dynamic_sampling_shortfall": float(shortfall),
               "rollout/dynamic_sampling_groups_seen": float(seen),
               "timing/reward_refills": reward_seconds}
    return (merged, torch.tensor([r[2] for r in rows]), torch.tensor([r[3] for r in rows]),
            metrics)


def decode_sample(gen: Generation, row: int, decode: Callable) -> tuple[str, str]:
    """(prompt text, response text without the stop token)."""
    prompt = gen.prompt_tokens_BP[row][gen.prompt_mask_BP[row] == 1].tolist()
    response = gen.response_tokens_BT[row][gen.fed_mask_BT[row] == 1].tolist()
    if response and bool(gen.finished_B[row]):
        response = response[:-1]
    return decode(prompt), decode(response)


def gen_sequence(gen: Generation, row: int) -> torch.Tensor:
    """Row ``row``'s prompt and response tokens, without padding."""
    return torch.cat((gen.prompt_tokens_BP[row][gen.prompt_mask_BP[row] == 1],
                      gen.response_tokens_BT[row][gen.fed_mask_BT[row] == 1]))


def gather_generations(gen: Generation, prompts: list[list[int]], inf: RankLayout,
                        pad_id: int) -> Generation:
    """Every rank gets every sample, in prompt order (replica r generated run r of the
    prompts, ``RankLayout.run_share``)."""
    # One copy per replica: the TP rank 0 of each.
    replicas = {}
    for rank, part in enumerate(gather_objects(gen)):
        replicas.setdefault(rank // inf.tp, part)
    dp = inf.dp
    ordered = [None] * len(prompts)
    for r in range(dp):
        part = replicas[r]
        for j, i in enumerate(run_of(len(prompts), dp, r)):
            ordered[i] = (part, j)
    return merge_rows(ordered, pad_id)


def merge_rows(rows: list[tuple[Generation, int]], pad_id: int) -> Generation:
    """One generation of the given (generation, row) pairs, in order: prompts left-padded
    and responses right-padded to the widest."""
    P = max(g.prompt_tokens_BP.shape[1] for g, _ in rows)
    T = max(g.response_tokens_BT.shape[1] for g, _ in rows)

    def take(name, width, left):
        out = []
        for part, j in rows:
            row = getattr(part, name)[j]
            pad = width - row.shape[0]
            fill = torch.full((pad,), pad_id if name.endswith("tokens_BP") or
                              name.endswith("tokens_BT") else 0, dtype=row.dtype)
            out.append(torch.cat([fill, row]) if left else torch.cat([row, fill]))
        return torch.stack(out)

    return Generation(
        prompt_tokens_BP=take("prompt_tokens_BP", P, True),
        prompt_mask_BP=take("prompt_mask_BP", P, True),
        response_tokens_BT=take("response_tokens_BT", T, False),
        fed_mask_BT=take("fed_mask_BT", T, False),
        logprobs_BT=take("logprobs_BT", T, False),
        finished_B=torch.stack([part.finished_B[j] for part, j in rows]),
        routing_BLSK=merge_routing(rows, P, T),
        **{name: None if any(getattr(part, name) is None for part, _ in rows)
           else take(name, T, False)
           for name in ("versions_BT", "observation_BT", "env_rewards_BT")})


def merge_routing(rows: list[tuple[Generation, int]], P: int, T: int) -> torch.Tensor | None:
    """The rows' recorded expert choices, laid out as their merged tokens: the prompt
    columns left-padded to ``P``, the response columns right-padded to ``T`` (padding
    positions as ``models.moe.unrouted``: those tokens are masked)."""
    if any(part.routing_BLSK is None for part, _ in rows):
        return None
    out = []
    for part, j in rows:
        row = part.routing_BLSK[j]  # (L, P_part + T_part, k)
        p = part.prompt_tokens_BP.shape[1]
        prompt, response = row[:, :p], row[:, p:]
        L, k = row.shape[0], row.shape[2]
        out.append(torch.cat([moe.unrouted(1, L, P - p, k)[0], prompt, response,
                              moe.unrouted(1, L, T - response.shape[1], k)[0]], dim=1))
    return torch.stack(out)
