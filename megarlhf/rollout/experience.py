"""Experience making: one call turns prompts into an :class:`~megarlhf.algos.Experience`.

1. reshard the actor into the inference layout and sample (each inference replica takes a
   share of the prompts; the samples are then gathered so every rank holds all of them);
2. bring the reference and reward models on, score the batch once at their own layouts
   (log-prob cache for sequences seen before), and offload them again;
3. critic values, old log-probs (the sampler's, or recomputed by the actor at its training
   layout), KL-shaped rewards, advantages (``algos.estimate_advantages``).

Every role scores through the one forward-only path (``engine.forward.forward_rows``) at
its own layout, so the experience batch is whole on every rank; each trained role takes
its own data-parallel share of it when it learns.
"""

from __future__ import annotations

import hashlib
import importlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from megarlhf import algos
from megarlhf.config import Config
from megarlhf.data.batching import prompt_response_batch
from megarlhf.engine.forward import forward_rows, stack_results
from megarlhf.engine.offload import Offloader
from megarlhf.engine.roles import Role
from megarlhf.engine.steps import make_sequence_step
from megarlhf.parallel import cpu_backend
from megarlhf.parallel.gather import gather_objects
from megarlhf.parallel.layout import RankLayout
from megarlhf.rollout.generate import Generation, SamplingParams, generate
from megarlhf.rollout.reshard import Resharder, release_inference_weights


# ------------------------------------------------------------------ frozen-model cache

class SequenceCache:
    """Reference log-probs of the ``capacity`` most recently used sequences of a PPO run,
    keyed by the token sequence (:meth:`key`): a sequence sampled again - twice in one
    batch (GRPO groups, short responses) or in a later iteration - is scored once. The
    least recently used go first, so the memory it holds and the copy saved with every
    checkpoint stay bounded (``rollout.ref_cache_size``); a resume restores it, so the
    resumed run scores as the unbroken one. Sampled responses rarely repeat (the demo:
    0.06% hits over 40 iterations), so nothing persists it across runs; offline data,
    where a cache pays, uses ``engine.logit_cache`` (DPO, distillation)."""

    def __init__(self, capacity: int = 4096):
        if capacity < 1:
            raise ValueError(f"SequenceCache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.store: OrderedDict[str, torch.Tensor] = OrderedDict()  # oldest use first
        self.hits = self.misses = 0

    @staticmethod
    def key(tokens) -> str:
        """SHA-1 of the sequence's token ids as int64 (prompt then response, no padding)."""
        ids = torch.as_tensor(tokens, dtype=torch.int64)
        return hashlib.sha1(ids.numpy().tobytes()).hexdigest()

    def get(self, key: str) -> torch.Tensor | None:
        value = self.store.get(key)
        if value is None:
            self.misses += 1
        else:
            self.hits += 1
            self.store.move_to_end(key)
        return value

    def put(self, key: str, value: torch.Tensor) -> None:
        self.store[key] = value.detach().clone()
        self.store.move_to_end(key)
        while len(self.store) > self.capacity:
            self.store.popitem(last=False)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def state_dict(self) -> dict:
        return {"store": dict(self.store), "hits": self.hits, "misses": self.misses}

    def load_state_dict(self, state: dict) -> None:
        """The saved entries in their order of use; where this run's capacity is smaller
        than the saving run's, the most recently used that fit."""
        entries = list(state["store"].items())
        self.store = OrderedDict(entries[max(0, len(entries) - self.capacity):])
        self.hits, self.misses = int(state["hits"]), int(state["misses"])


# ------------------------------------------------------------------ batching

def sequence_batch_fn(gen: Generation, pad_id: int) -> Callable[[list[int]], dict]:
    """Row indices -> one prompt+response micro-batch (attention mask for the left padding,
    position ids counting real tokens), every batch the full width P + T."""

    def make_batch(rows: list[int]) -> dict:
        idx = torch.tensor(rows)
        return prompt_response_batch(gen.prompt_tokens_BP[idx], gen.prompt_mask_BP[idx],
                                     gen.response_tokens_BT[idx], gen.response_mask_BT[idx],
                                     pad_id)

    return make_batch


# ------------------------------------------------------------------ the maker

@dataclass
class RewardSource:
    """A frozen reward-model role (with the normalisation stored in its checkpoint) or a
    programmatic reward ``fn(prompt_text, response_text) -> float`` by import path."""

    role: Role | None = None
    fn: Callable | None = None
    decode: Callable | None = None  # token ids -> text, for ``fn``

    @property
    def gain(self) -> float:
        return float(self.role.saved.get("score_gain", 1.0)) if self.role else 1.0

    @property
    def bias(self) -> float:
        return float(self.role.saved.get("score_bias", 0.0)) if self.role else 0.0


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
    actor: Role  # trained; its chunks are resharded into ``inference_model``
    inference_layout: RankLayout
    inference_model: object
    reference: Role
    reward: RewardSource
    critic: Role | None
    eos_id: int
    pad_id: int
    offload: bool = True  # frozen roles whose spec does not say (spec.offload None)
    micro_batch_size: int = 4
    ref_cache: SequenceCache | None = field(default_factory=SequenceCache)  # None: off
    # phase hooks (memory accounting, trained-role offload): before_generate(),
    # after_generate(kv_cache_bytes), during_pass() - see stages.ppo.PhaseHooks
    hooks: object | None = None
    # free the inference model's weights after each generation (the next reshard
    # rewrites them all): rollout.release_inference_weights
    release_inference: bool = False

    def __post_init__(self):
        self.resharder = Resharder(self.actor.chunks, self.inference_model)
        self.ref_offloader = Offloader(self.reference.chunks, self._offloads(self.reference))
        self.rm_offloader = Offloader(self.reward.role.chunks if self.reward.role else [],
                                      self._offloads(self.reward.role))
        self.ref_offloader.offload()
        self.rm_offloader.offload()

    def _offloads(self, role: Role | None) -> bool:
        if role is None or role.spec.offload is None:
            return self.offload
        return role.spec.offload == "all"

    def restore_frozen_models(self) -> None:
        """Bring the reference and reward models back (e.g. before handing them elsewhere)."""
        self.ref_offloader.reload()
        self.rm_offloader.reload()

    # -- 1. rollout
    def rollout(self, prompts: list[list[int]], seed: int) -> tuple[Generation, dict]:
        stats = self.resharder()
        inf = self.inference_layout
        indices = list(range(inf.dp_rank, len(prompts), inf.dp))
        mine = [prompts[i] for i in indices]
        r = self.cfg.rollout
        params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                                top_k=r.top_k, top_p=r.top_p, greedy=r.greedy,
                                stop_token_ids=tuple(r.stop_token_ids))
        # One seed per (iteration, prompt): samples do not depend on the layout, and TP
        # peers of a replica (same gathered logits) draw the same tokens.
        if self.hooks is not None:
            self.hooks.before_generate()
        start = time.perf_counter()
        gen_stats: dict = {}
        gen = generate(self.inference_model, mine, params, eos_id=self.eos_id,
                       pad_id=self.pad_id, true_vocab=self.actor.spec.model.vocab_size,
                       stop_at_eos=r.stop_at_eos,
                       row_seeds=[seed * 1000003 + i for i in indices], stats=gen_stats)
        seconds = time.perf_counter() - start
        if self.hooks is not None:
            self.hooks.after_generate(gen_stats["kv_cache_bytes"])
        if self.release_inference:
            release_inference_weights(self.inference_model)
        gen = gather_generations(gen, prompts, inf, self.pad_id)
        return gen, {"timing/reshard": stats.seconds, "perf/reshard_bytes": stats.bytes_received,
                     "timing/generate": seconds}

    # -- forward-only passes, each role at its own layout
    def _score(self, role: Role, gen: Generation, rows: list[int]) -> list[dict]:
        step = make_sequence_step(role.spec.kind, prompt_len=gen.prompt_tokens_BP.shape[1],
                                  tp_group=role.layout.tp_group,
                                  true_vocab=role.spec.model.vocab_size,
                                  temperature=self.cfg.rollout.temperature)
        if self.hooks is not None:
            self.hooks.during_pass()
        return forward_rows(role, rows, sequence_batch_fn(gen, self.pad_id), step,
                            micro_batch_size=self.micro_batch_size)

    def _reference_logprobs(self, gen: Generation) -> torch.Tensor:
        """The reference's log-probs of every sampled token: rows found in the cache, and
        rows repeating an earlier row of this batch, are not scored again."""
        B, T = gen.response_tokens_BT.shape
        if self.ref_cache is None:
            return self._score_reference(gen, list(range(B)))
        out = torch.zeros(B, T)
        first: dict[str, int] = {}  # key -> the batch row that scores it
        missing, repeats = [], []
        with cpu_backend.suspended():  # the cache's side: no megatron code
            keys = [SequenceCache.key(gen_sequence(gen, r)) for r in range(B)]
            for i, key in enumerate(keys):
                if key in first:
                    self.ref_cache.hits += 1
                    repeats.append(i)
                    continue
                hit = self.ref_cache.get(key)
                if hit is None:
                    first[key] = i
                    missing.append(i)
                else:
                    out[i, :hit.numel()] = hit
        # Every rank holds the same batch and the same cache, so all agree on the misses.
        if missing:
            scored = self._score_reference(gen, missing)
            with cpu_backend.suspended():
                for i in missing:
                    out[i] = scored[i]
                    self.ref_cache.put(keys[i], out[i, :int(gen.response_mask_BT[i].sum())])
        for i in repeats:
            out[i] = out[first[keys[i]]]
        return out

    def _score_reference(self, gen: Generation, rows: list[int]) -> torch.Tensor:
        """(B, T) with the reference's log-probs on ``rows`` (zero on padding and on the
        other rows), the reference loaded for the pass and offloaded after it."""
        out = torch.zeros(gen.response_tokens_BT.shape)
        self.ref_offloader.reload()
        scored = self._score(self.reference, gen, rows)
        self.ref_offloader.offload()
        with cpu_backend.suspended():
            for i, res in zip(rows, scored):
                out[i] = res["logprobs"] * gen.response_mask_BT[i]
        return out

    def _scores(self, gen: Generation) -> torch.Tensor:
        B = gen.response_tokens_BT.shape[0]
        if self.reward.fn is not None:
            return torch.tensor([float(self.reward.fn(*decode_sample(gen, r, self.reward.decode)))
                                 for r in range(B)])
        self.rm_offloader.reload()
        raw = stack_results(self._score(self.reward.role, gen, list(range(B))), "last")
        self.rm_offloader.offload()
        return algos.normalize_scores(raw, self.reward.gain, self.reward.bias)

    # -- what is trained
    def finalize(self, gen: Generation) -> tuple[Generation, torch.Tensor]:
        """Cut every response after its first stop token (the stop token stays): with
        ``rollout.stop_at_eos=false`` the sampler runs past EOS to the fixed length, and the
        truncated response is what is scored, trained and shown. Returns (the truncated
        generation, ``has_stop`` (B,): a stop token occurred)."""
        stops = sorted(set(self.cfg.rollout.stop_token_ids) | {self.eos_id})
        tokens, mask, has_stop = algos.truncate_after_stop(
            gen.response_tokens_BT, gen.response_mask_BT, stops, self.pad_id)
        return Generation(prompt_tokens_BP=gen.prompt_tokens_BP,
                          prompt_mask_BP=gen.prompt_mask_BP, response_tokens_BT=tokens,
                          response_mask_BT=mask, logprobs_BT=gen.logprobs_BT * mask,
                          finished_B=has_stop), has_stop

    # -- rewards
    def _sample(self, prompts: list[list[int]], seed: int
                ) -> tuple[Generation, torch.Tensor, torch.Tensor, dict]:
        """Rollout, truncation and the shaped score: (generation, has_stop, score, timings)."""
        gen, metrics = self.rollout(prompts, seed)
        gen, has_stop = self.finalize(gen)
        ppo = self.cfg.ppo
        start = time.perf_counter()
        scores = self._scores(gen)
        metrics["timing/reward"] = time.perf_counter() - start
        bad = int((~torch.isfinite(scores)).sum())
        metrics["rollout/nonfinite_scores"] = float(bad)
        if bad and dist.get_rank() == 0:
            print(f"[ppo] warning: {bad} of {len(scores)} rewards are not finite (NaN/inf): "
                  "their samples give non-finite losses and skipped steps", flush=True)
        if ppo.missing_stop_penalty is not None:
            scores = algos.apply_missing_stop_rule(scores, has_stop, ppo.missing_stop_penalty,
                                                   ppo.missing_stop_mode)
        scores = scores + algos.overlong_penalty(gen.response_mask_BT.sum(dim=1),
                                                 self.cfg.rollout.max_new_tokens,
                                                 ppo.overlong_buffer, ppo.overlong_penalty)
        return gen, has_stop, scores, metrics

    def _dynamic_sampling(self, gen, has_stop, scores, seed: int, refill: Callable
                          ) -> tuple[Generation, torch.Tensor, torch.Tensor, dict]:
        """DAPO's dynamic sampling: keep the groups whose scores are not all equal, sampling
        ``refill(round)`` prompts until the batch has as many groups as it started with
        (at most ``ppo.max_sampling_rounds`` rollouts); a batch still short is topped up
        with dropped groups, in order."""
        k, ppo = self.cfg.ppo.group_size, self.cfg.ppo
        needed = len(scores) // k
        kept: list = []
        dropped: list = []
        rounds, seen, reward_seconds = 1, 0, 0.0
        while True:
            spread = scores.view(-1, k)
            for g in range(spread.shape[0]):
                rows = [(gen, g * k + j, bool(has_stop[g * k + j]), float(scores[g * k + j]))
                        for j in range(k)]
                informative = bool(spread[g].max() > spread[g].min())
                (kept if informative else dropped).append(rows)
            seen += spread.shape[0]
            if len(kept) >= needed or rounds >= ppo.max_sampling_rounds:
                break
            gen, has_stop, scores, more = self._sample(refill(rounds), seed * 65537 + rounds)
            reward_seconds += more["timing/reward"]
            rounds += 1
        shortfall = max(needed - len(kept), 0)
        groups = (kept + dropped[:shortfall])[:needed]
        rows = [row for group in groups for row in group]
        merged = merge_rows([(g, j) for g, j, _, _ in rows], self.pad_id)
        metrics = {"rollout/dynamic_sampling_rounds": float(rounds),
                   "rollout/dynamic_sampling_kept_fraction": min(len(kept), needed) / needed,
                   "rollout/dynamic_sampling_shortfall": float(shortfall),
                   "rollout/dynamic_sampling_groups_seen": float(seen),
                   "timing/reward_refills": reward_seconds}
        return (merged, torch.tensor([r[2] for r in rows]),
                torch.tensor([r[3] for r in rows]), metrics)

    # -- the whole thing
    def make(self, prompts: list[list[int]], *, seed: int, kl_coef: float,
             refill: Callable[[int], list[list[int]]] | None = None
             ) -> tuple[algos.Experience, Generation, dict]:
        """One experience batch from ``prompts`` (each repeated ``group_size`` times, one
        group after the other). ``refill(round)`` gives more prompts for dynamic sampling."""
        ppo = self.cfg.ppo
        t0 = time.perf_counter()
        gen, has_stop, scores, metrics = self._sample(prompts, seed)
        if ppo.dynamic_sampling:
            if refill is None:
                raise ValueError("ppo.dynamic_sampling needs a prompt refill")
            gen, has_stop, scores, more = self._dynamic_sampling(gen, has_stop, scores, seed,
                                                                 refill)
            metrics.update(more)
        # sampling only; the reward model's passes are timing/reward (+ _refills)
        metrics["timing/rollout"] = (time.perf_counter() - t0 - metrics["timing/reward"]
                                     - metrics.get("timing/reward_refills", 0.0))
        t1 = time.perf_counter()
        rows = list(range(len(scores)))
        mask = gen.response_mask_BT.float()
        # DeepSpeed-Chat drops responses of <= 1 token; here they stay in the batch (fixed
        # batch arithmetic) with no trainable tokens.
        short = mask.sum(dim=1) < self.cfg.rollout.min_response_tokens
        mask[short] = 0.0
        ref_lp = self._reference_logprobs(gen)
        rollout_lp = gen.logprobs_BT * mask
        if self.cfg.rollout.recompute_logprobs:
            old_lp = stack_results(self._score(self.actor, gen, rows), "logprobs") * mask
        else:
            old_lp = rollout_lp.clone()
        if self.critic is not None:
            values = stack_results(self._score(self.critic, gen, rows), "values") * mask
        else:
            values = torch.zeros_like(mask)
        # the arithmetic from here on runs without the CPU backend's mode (no megatron code)
        with cpu_backend.suspended():
            # KL to the reference: in the reward (per token, or per sequence for the group
            # baselines) when ppo.kl_in_reward resolves on; the loss term is the actor's.
            kl = algos.kl_per_token(old_lp, ref_lp, mask, ppo.kl_estimator)
            beta = kl_coef if ppo.kl_reward_on else 0.0
            rewards, non_score = algos.shape_rewards(scores, kl, mask, beta,
                                                     ppo.clip_reward_value)
            if ppo.whiten_rewards:
                rewards = algos.masked_whiten(rewards, mask, shift_mean=False,
                                              unbiased=ppo.whiten_unbiased) * mask
            sequence_rewards = scores - beta * kl.sum(dim=1)
            advantages, returns = algos.estimate_advantages(
                ppo.advantage_estimator, scores_B=sequence_rewards, rewards_BT=rewards,
                values_BT=values, mask_BT=mask, gamma=ppo.gamma, lam=ppo.lam,
                group_size=ppo.group_size, whiten=ppo.whiten_advantages,
                unbiased=ppo.whiten_unbiased, group_norm=ppo.grpo_normalization)
            policy_mask, is_weights, corr = self._mismatch_correction(old_lp, rollout_lp, mask)
            metrics.update(corr)
            exp = algos.Experience(
                prompt_tokens_BP=gen.prompt_tokens_BP, prompt_mask_BP=gen.prompt_mask_BP,
                response_tokens_BT=gen.response_tokens_BT, response_mask_BT=mask,
                rollout_logprobs_BT=rollout_lp, old_logprobs_BT=old_lp, ref_logprobs_BT=ref_lp,
                values_BT=values, scores_B=scores, kl_BT=kl, rewards_BT=rewards,
                advantages_BT=advantages, returns_BT=returns, policy_mask_BT=policy_mask,
                is_weights_BT=is_weights)
        gap = (rollout_lp - old_lp).abs() * mask
        num_tokens, num_rows = float(mask.sum()), len(rows)
        metrics.update({
            "rollout/logprob_diff_mean": float(gap.sum()) / max(num_tokens, 1.0),
            "rollout/logprob_diff_max": float(gap.max()),
            "rollout/response_len_mean": num_tokens / num_rows,
            "rollout/eos_fraction": float(has_stop.float().mean()),
            "rollout/short_responses_masked": float(short.sum()),
            "objective/score": float(scores.mean()),
            "objective/kl": float(kl.sum()) / num_rows,
            "rollout/ref_cache_hit_rate": self.ref_cache.hit_rate if self.ref_cache else 0.0,
            "timing/experience": time.perf_counter() - t1,
        })
        return exp, gen, metrics



    def _mismatch_correction(self, old_lp: torch.Tensor, rollout_lp: torch.Tensor,
                             mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """The policy loss's mask and token weights from the trainer/sampler ratio
        r = p_train / p_rollout: truncated importance weights min(r, ppo.rollout_is_cap),
        and whole samples dropped when their per-token geometric-mean ratio leaves
        [ppo.rollout_mask_low, ppo.rollout_mask_high]. Returns (policy mask, weights,
        ``rollout_corr/*`` metrics)."""
        ppo = self.cfg.ppo
        log_r = (old_lp - rollout_lp) * mask
        valid = mask.bool()
        weights = torch.ones_like(mask)
        capped = torch.zeros((), dtype=torch.float32)
        if ppo.rollout_is_cap is not None:
            r = torch.exp(log_r)
            weights = torch.where(valid, r.clamp(max=ppo.rollout_is_cap), weights)
            capped = ((r > ppo.rollout_is_cap) & valid).float().sum()
        tokens = mask.sum(dim=1)
        seq_ratio = torch.exp(log_r.sum(dim=1) / tokens.clamp(min=1))
        keep = torch.ones_like(seq_ratio, dtype=torch.bool)
        if ppo.rollout_mask_low is not None:
            keep &= seq_ratio >= ppo.rollout_mask_low
        if ppo.rollout_mask_high is not None:
            keep &= seq_ratio <= ppo.rollout_mask_high
        n = max(float(mask.sum()), 1.0)
        token_r = torch.exp(log_r[valid]) if valid.any() else torch.ones(1)
        has_tokens = tokens > 0
        metrics = {
            # KL(rollout || train) from the sampler's samples: k3 and k1 per token
            "rollout_corr/kl": float(((torch.expm1(log_r) - log_r) * mask).sum()) / n,
            "rollout_corr/kl_k1": float((-log_r * mask).sum()) / n,
            "rollout_corr/ratio_max": float(token_r.max()),
            "rollout_corr/ratio_min": float(token_r.min()),
            "rollout_corr/masked_fraction":
                float((~keep & has_tokens).float().sum()) / max(float(has_tokens.sum()), 1.0),
            "rollout_corr/is_capped_fraction": float(capped) / n,
        }
        return mask * keep.unsqueeze(1).to(mask.dtype), weights, metrics


def decode_sample(gen: Generation, row: int, decode: Callable) -> tuple[str, str]:
    """(prompt text, response text without the stop token)."""
    prompt = gen.prompt_tokens_BP[row][gen.prompt_mask_BP[row] == 1].tolist()
    response = gen.response_tokens_BT[row][gen.response_mask_BT[row] == 1].tolist()
    if response and bool(gen.finished_B[row]):
        response = response[:-1]
    return decode(prompt), decode(response)


def gen_sequence(gen: Generation, row: int) -> torch.Tensor:
    """Row ``row``'s prompt and response tokens, without padding."""
    return torch.cat((gen.prompt_tokens_BP[row][gen.prompt_mask_BP[row] == 1],
                      gen.response_tokens_BT[row][gen.response_mask_BT[row] == 1]))


@cpu_backend.suspended()  # an object all-gather and row merging: no megatron code
def gather_generations(gen: Generation, prompts: list[list[int]], inf: RankLayout,
                        pad_id: int) -> Generation:
    """Every rank gets every sample, in prompt order (replica r generated prompts r::dp)."""
    # One copy per replica: the TP rank 0 of each.
    replicas = {}
    for rank, part in enumerate(gather_objects(gen)):
        replicas.setdefault(rank // inf.tp, part)
    dp = inf.dp
    ordered = [None] * len(prompts)
    for r in range(dp):
        part = replicas[r]
        for j, i in enumerate(range(r, len(prompts), dp)):
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
        response_mask_BT=take("response_mask_BT", T, False),
        logprobs_BT=take("logprobs_BT", T, False),
        finished_B=torch.stack([part.finished_B[j] for part, j in rows]))
