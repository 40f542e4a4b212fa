"""Experience making: one call turns prompts into an :class:`~megarlhf.algos.Experience`.

1. reshard the actor into the inference layout and sample (each inference replica takes a
   share of the prompts; the samples are then gathered so every training rank sees them);
2. bring the reference and reward models on, score the batch once (log-prob cache for
   sequences seen before), and offload them again;
3. critic values, old log-probs (the sampler's, or recomputed by the training-layout
   actor), KL-shaped rewards, GAE and global advantage whitening.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from megarlhf import algos
from megarlhf.config import Config
from megarlhf.data.batching import prompt_response_batch
from megarlhf.engine.schedule import forward_only
from megarlhf.engine.steps import make_sequence_step
from megarlhf.parallel.launch import ParallelLayout
from megarlhf.rollout.generate import Generation, SamplingParams, generate
from megarlhf.rollout.reshard import Resharder


# ------------------------------------------------------------------ offloading

class Offloader:
    """Moves a frozen model's parameters off the accelerator between phases and back.

    On GPU the copies live in pinned CPU memory and the device storage is released; on
    CPU the same mechanism swaps the parameter storage for an empty tensor and back, so
    the code path (and its correctness) is exercised everywhere."""

    def __init__(self, chunks: list, enabled: bool):
        self.params = [p for chunk in chunks for p in chunk.parameters()]
        self.enabled = enabled
        self.stash: list[torch.Tensor] | None = None

    def offload(self) -> None:
        if not self.enabled or self.stash is not None:
            return
        pin = torch.cuda.is_available()
        self.stash = []
        for p in self.params:
            host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
            host.copy_(p.data)
            self.stash.append(host)
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def reload(self) -> None:
        if self.stash is None:
            return
        device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
        for p, host in zip(self.params, self.stash):
            p.data = host.to(device, non_blocking=True)
        self.stash = None

    @property
    def offloaded(self) -> bool:
        return self.stash is not None


# ------------------------------------------------------------------ frozen-model cache

class SequenceCache:
    """Per-sequence outputs of a frozen model (reference log-probs, reward scores), keyed
    by the token sequence; a sequence is never scored twice. Can be saved and reloaded
    (e.g. DPO reference log-probs computed offline)."""

    def __init__(self, path: str | None = None):
        self.store: dict[str, torch.Tensor] = {}
        self.hits = self.misses = 0
        if path and os.path.exists(path):
            self.store = torch.load(path, weights_only=True)

    @staticmethod
    def key(tokens: list[int]) -> str:
        return hashlib.sha1(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes()).hexdigest()

    def get(self, tokens: list[int]) -> torch.Tensor | None:
        value = self.store.get(self.key(tokens))
        if value is None:
            self.misses += 1
        else:
            self.hits += 1
        return value

    def put(self, tokens: list[int], value: torch.Tensor) -> None:
        self.store[self.key(tokens)] = value.detach().clone()

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def save(self, path: str) -> None:
        tmp = path + ".tmp"
        torch.save(self.store, tmp)
        os.replace(tmp, path)


# ------------------------------------------------------------------ batching

def sequence_batches(gen: Generation, rows: list[int], micro_batch_size: int,
                     pad_id: int) -> list[dict]:
    """Prompt+response micro-batches (attention mask for the left padding, position ids
    counting real tokens), topped up to full micro-batches with copies of row 0."""
    rows = rows + [rows[0]] * (-len(rows) % micro_batch_size)
    out = []
    for start in range(0, len(rows), micro_batch_size):
        idx = torch.tensor(rows[start:start + micro_batch_size])
        out.append(prompt_response_batch(gen.prompt_tokens_BP[idx], gen.prompt_mask_BP[idx],
                                         gen.response_tokens_BT[idx],
                                         gen.response_mask_BT[idx], pad_id))
    return out


# ------------------------------------------------------------------ the maker

@dataclass
class RewardSource:
    """A reward model (frozen value-model chunks with its normalisation) or a
    programmatic reward ``fn(prompt_text, response_text) -> float`` by import path."""

    chunks: list | None = None
    gain: float = 1.0
    bias: float = 0.0
    fn: Callable | None = None
    decode: Callable | None = None  # token ids -> text, for ``fn``


def load_reward_fn(path: str) -> Callable:
    """``package.module:function`` -> the function."""
    if ":" not in path:
        raise ValueError(f"reward function {path!r} must look like 'package.module:function'")
    module, name = path.split(":", 1)
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot import reward function {path!r}: {err}") from None
    if not callable(fn):
        raise ValueError(f"reward function {path!r} is not callable")
    return fn


@dataclass
class ExperienceMaker:
    cfg: Config
    layout: ParallelLayout  # training layout (actor, critic, reference, reward model)
    inference_layout: ParallelLayout
    actor_chunks: list  # bare chunks of the trained actor
    inference_model: object
    reference_chunks: list
    reward: RewardSource
    critic_chunks: list | None
    eos_id: int
    pad_id: int
    offload: bool = True
    micro_batch_size: int = 4
    ref_cache: SequenceCache | None = field(default_factory=SequenceCache)

    def __post_init__(self):
        self.resharder = Resharder(self.actor_chunks, self.inference_model)
        self.ref_offloader = Offloader(self.reference_chunks, self.offload)
        self.rm_offloader = Offloader(self.reward.chunks or [], self.offload)
        self.ref_offloader.offload()
        self.rm_offloader.offload()

    def restore_frozen_models(self) -> None:
        """Bring the reference and reward models back (e.g. before handing them elsewhere)."""
        self.ref_offloader.reload()
        self.rm_offloader.reload()

    # -- 1. rollout
    def rollout(self, prompts: list[list[int]], seed: int) -> tuple[Generation, dict]:
        stats = self.resharder()
        inf = self.inference_layout
        indices = list(range(inf.dp_rank, len(prompts), inf.dp_size))
        mine = [prompts[i] for i in indices]
        r = self.cfg.rollout
        params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                                top_k=r.top_k, top_p=r.top_p, greedy=r.greedy,
                                stop_token_ids=tuple(r.stop_token_ids))
        # One seed per (iteration, prompt): samples do not depend on the layout, and TP
        # peers of a replica (same gathered logits) draw the same tokens.
        start = time.perf_counter()
        gen = generate(self.inference_model, mine, params, eos_id=self.eos_id,
                       pad_id=self.pad_id, true_vocab=self.cfg.model.vocab_size,
                       stop_at_eos=r.stop_at_eos,
                       row_seeds=[seed * 1000003 + i for i in indices])
        seconds = time.perf_counter() - start
        gen = _gather_generations(gen, prompts, inf, self.pad_id)
        return gen, {"timing/reshard": stats.seconds, "perf/reshard_bytes": stats.bytes_received,
                     "timing/generate": seconds}

    # -- forward-only passes on the training layout, rows of this DP rank
    def _score(self, chunks: list, kind: str, gen: Generation, rows: list[int]) -> list[dict]:
        P = gen.prompt_tokens_BP.shape[1]
        batches = sequence_batches(gen, rows, self.micro_batch_size, self.pad_id)
        step = make_sequence_step(kind, prompt_len=P, tp_group=self.layout.tp_group,
                                  true_vocab=self.cfg.model.vocab_size,
                                  temperature=self.cfg.rollout.temperature)
        for c in chunks:
            c.eval()
        outs = forward_only(chunks, step, batches, seq_length=batches[0]["tokens"].shape[1],
                            micro_batch_size=self.micro_batch_size)
        return _broadcast_from_last_stage(outs, len(batches), self.layout, kind, P,
                                          gen.response_tokens_BT.shape[1],
                                          self.micro_batch_size)[:len(rows)]

    def _reference_logprobs(self, gen: Generation, rows: list[int]) -> torch.Tensor:
        T = gen.response_tokens_BT.shape[1]
        out = torch.zeros(len(rows), T)
        keys = [gen_sequence(gen, r) for r in rows]
        missing = []
        for i, key in enumerate(keys):
            hit = self.ref_cache.get(key) if self.ref_cache is not None else None
            if hit is None:
                missing.append(i)
            else:
                out[i, :hit.numel()] = hit
        # Every rank of the replica must agree on what to compute: the cache is filled
        # identically on all of them, so their miss lists agree.
        if missing:
            self.ref_offloader.reload()
            scored = self._score(self.reference_chunks, "lm", gen, [rows[i] for i in missing])
            self.ref_offloader.offload()
            for i, res in zip(missing, scored):
                n = int(gen.response_mask_BT[rows[i]].sum())
                out[i] = res * gen.response_mask_BT[rows[i]]
                if self.ref_cache is not None:
                    self.ref_cache.put(keys[i], out[i, :n])
        return out

    def _scores(self, gen: Generation, rows: list[int]) -> torch.Tensor:
        if self.reward.fn is not None:
            return torch.tensor([float(self.reward.fn(*decode_sample(gen, r, self.reward.decode)))
                                 for r in rows])
        self.rm_offloader.reload()
        scored = self._score(self.reward.chunks, "value", gen, rows)
        self.rm_offloader.offload()
        raw = torch.stack([x["last"] for x in scored])
        return algos.normalize_scores(raw, self.reward.gain, self.reward.bias)

    # -- the whole thing
    def make(self, prompts: list[list[int]], *, seed: int, kl_coef: float
             ) -> tuple[algos.Experience, Generation, dict]:
        t0 = time.perf_counter()
        gen, metrics = self.rollout(prompts, seed)
        metrics["timing/rollout"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        rows = _rank_rows(len(prompts), self.layout)
        mask = gen.response_mask_BT[rows].float()
        # DeepSpeed-Chat drops responses of <= 1 token; here they stay in the batch (fixed
        # batch arithmetic) with no trainable tokens.
        short = mask.sum(dim=1) < self.cfg.rollout.min_response_tokens
        mask[short] = 0.0
        responses, mask_trunc, has_stop = algos.truncate_after_stop(
            gen.response_tokens_BT[rows], mask, sorted(set(self.cfg.rollout.stop_token_ids)
                                                       | {self.eos_id}), self.pad_id)
        ref_lp = self._reference_logprobs(gen, rows)
        scores = self._scores(gen, rows)
        ppo = self.cfg.ppo
        if ppo.missing_stop_penalty is not None and self.cfg.rollout.stop_at_eos:
            scores = algos.apply_missing_stop_rule(scores, has_stop, ppo.missing_stop_penalty,
                                                   ppo.missing_stop_mode)
        rollout_lp = gen.logprobs_BT[rows]
        if self.cfg.rollout.recompute_logprobs:
            old_lp = torch.stack(self._score(self.actor_chunks, "lm", gen, rows)) * mask
        else:
            old_lp = rollout_lp.clone()
        if self.critic_chunks is not None:
            values = torch.stack([v["values"] for v in
                                  self._score(self.critic_chunks, "value", gen, rows)]) * mask
        else:
            values = torch.zeros_like(mask)
        kl = algos.kl_per_token(old_lp, ref_lp, mask, ppo.kl_estimator)
        rewards, non_score = algos.shape_rewards(scores, kl, mask, kl_coef,
                                                 ppo.clip_reward_value)
        reduce_fn = _dp_sum(self.layout)
        if ppo.whiten_rewards:
            rewards = algos.masked_whiten(rewards, mask, shift_mean=False,
                                          unbiased=ppo.whiten_unbiased,
                                          reduce_fn=reduce_fn) * mask
        if ppo.advantage_estimator == "gae":
            advantages, returns = algos.gae(rewards, values, mask, ppo.gamma, ppo.lam)
        elif ppo.advantage_estimator == "reinforce_pp":
            advantages = algos.reinforce_pp_advantages(rewards, mask, ppo.gamma,
                                                       ppo.whiten_unbiased, reduce_fn)
            returns = advantages.clone()
        else:  # group baselines on the sequence score; samples of a prompt are adjacent
            group_fn = algos.grpo_advantages if ppo.advantage_estimator == "grpo" \
                else algos.rloo_advantages
            advantages = algos.broadcast_to_tokens(group_fn(scores, ppo.group_size), mask)
            returns = advantages.clone()
        if ppo.whiten_advantages and ppo.advantage_estimator in ("gae", "rloo"):
            advantages = algos.masked_whiten(advantages, mask, unbiased=ppo.whiten_unbiased,
                                             reduce_fn=reduce_fn) * mask
        exp = algos.Experience(
            prompt_tokens_BP=gen.prompt_tokens_BP[rows], prompt_mask_BP=gen.prompt_mask_BP[rows],
            response_tokens_BT=responses, response_mask_BT=mask,
            rollout_logprobs_BT=rollout_lp, old_logprobs_BT=old_lp, ref_logprobs_BT=ref_lp,
            values_BT=values, scores_B=scores, kl_BT=kl, rewards_BT=rewards,
            advantages_BT=advantages, returns_BT=returns)
        gap = (rollout_lp - old_lp).abs() * mask
        sums = torch.tensor([gap.sum(), mask.sum(), float(gap.max()), scores.sum(),
                             len(rows), kl.sum(), float(has_stop.sum()), float(short.sum())],
                            dtype=torch.float64)
        maxes = sums[2:3].clone()
        if dist.is_initialized():
            dist.all_reduce(sums)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        tp_pp = self.layout.tp_size * self.layout.pp_size  # ranks holding copies of a row
        n_tokens, n_rows = sums[1] / tp_pp, sums[4] / tp_pp
        metrics.update({
            "rollout/logprob_diff_mean": float(sums[0] / tp_pp / n_tokens.clamp(min=1)),
            "rollout/logprob_diff_max": float(maxes[0]),
            "rollout/response_len_mean": float(n_tokens / n_rows),
            "rollout/eos_fraction": float(sums[6] / tp_pp / n_rows),
            "rollout/short_responses_masked": float(sums[7] / tp_pp),
            "objective/score": float(sums[3] / tp_pp / n_rows),
            "objective/kl": float(sums[5] / tp_pp / n_rows),
            "rollout/ref_cache_hit_rate": self.ref_cache.hit_rate if self.ref_cache else 0.0,
            "timing/experience": time.perf_counter() - t1,
        })
        return exp, gen, metrics


def decode_sample(gen: Generation, row: int, decode: Callable) -> tuple[str, str]:
    """(prompt text, response text without the stop token)."""
    prompt = gen.prompt_tokens_BP[row][gen.prompt_mask_BP[row] == 1].tolist()
    response = gen.response_tokens_BT[row][gen.response_mask_BT[row] == 1].tolist()
    if response and bool(gen.finished_B[row]):
        response = response[:-1]
    return decode(prompt), decode(response)


def gen_sequence(gen: Generation, row: int) -> list[int]:
    prompt = gen.prompt_tokens_BP[row][gen.prompt_mask_BP[row] == 1].tolist()
    response = gen.response_tokens_BT[row][gen.response_mask_BT[row] == 1].tolist()
    return prompt + response


def _rank_rows(num: int, layout: ParallelLayout) -> list[int]:
    per_rank = algos.exact_div(num, layout.dp_size, "rollout batch", "the data-parallel size")
    return list(range(layout.dp_rank * per_rank, (layout.dp_rank + 1) * per_rank))


def _dp_sum(layout: ParallelLayout):
    if layout.dp_size == 1:
        return None

    def reduce_fn(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, group=layout.dp_group)
        return t
    return reduce_fn


def _gather_generations(gen: Generation, prompts: list[list[int]], inf: ParallelLayout,
                        pad_id: int) -> Generation:
    """Every rank gets every sample, in prompt order (replica r generated prompts r::dp)."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, gen)
    # One copy per replica: the TP rank 0 of each.
    replicas = {}
    for rank, part in enumerate(parts):
        replicas.setdefault(rank // inf.tp_size, part)
    dp = inf.dp_size
    ordered = [None] * len(prompts)
    for r in range(dp):
        part = replicas[r]
        for j, i in enumerate(range(r, len(prompts), dp)):
            ordered[i] = (part, j)
    P = max(p.prompt_tokens_BP.shape[1] for p in replicas.values())
    T = max(p.response_tokens_BT.shape[1] for p in replicas.values())

    def take(name, width, left):
        out = []
        for part, j in ordered:
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
        response_mask_BT=take("response_mask_BT", T, False),
        logprobs_BT=take("logprobs_BT", T, False),
        finished_B=torch.stack([part.finished_B[j] for part, j in ordered]))


def _broadcast_from_last_stage(outs: list, num_batches: int, layout: ParallelLayout, kind: str,
                               P: int, T: int, micro_batch_size: int) -> list:
    """Per-row results of a forward-only pass, on every rank of the pipeline."""
    rows = num_batches * micro_batch_size
    if kind == "value":
        buf = torch.zeros(rows, T + 1)
        if layout.is_last_stage:
            buf = torch.cat([torch.cat([o["values"], o["last"].unsqueeze(-1)], dim=1)
                             for o in outs])
    else:
        buf = torch.zeros(rows, T)
        if layout.is_last_stage:
            buf = torch.cat([o["logprobs"] for o in outs])
    if layout.pp_size > 1:
        src = dist.get_global_rank(layout.pg_collection.pp, layout.pp_size - 1)
        dist.broadcast(buf, src=src, group=layout.pg_collection.pp)
    if kind == "value":
        return [{"values": row[:T], "last": row[T]} for row in buf]
    return list(buf)
