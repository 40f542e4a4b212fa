"""Scoring a rollout: the forward-only passes of the four roles over the sampled
sequences, each role at its own layout through the one forward path
(``engine.forward.forward_rows``) - the reference's log-probs (cached for sequences seen
before), the reward model's score, the critic's values, the actor's own log-probs - with
the frozen roles brought on for their pass and offloaded after it."""

from __future__ import annotations

import contextlib
import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from megarlhf import algos
from megarlhf.config import RolloutConfig
from megarlhf.data.batching import prompt_response_batch
from megarlhf.data.packing import pack_prompt_response
from megarlhf.engine.forward import forward_rows, stack_results
from megarlhf.roles.offload import Offloader
from megarlhf.roles.build import Role
from megarlhf.engine.steps import make_sequence_step
from megarlhf.models import lora, moe
from megarlhf.inference.generate import Generation
from megarlhf.rollout.sampling import decode_sample, gen_sequence
from megarlhf.rewards.verifiers import RewardError
from megarlhf.rollout.hooks import RolloutHooks


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

def fed_tokens(gen: Generation) -> torch.Tensor:
    """``(B, P + T)``: the tokens the sampler fed through the model (its routing was
    recorded for them): the prompt and the response but its last sampled token."""
    fed = gen.fed_mask_BT.clone()
    last = fed.sum(dim=1) - 1
    rows = torch.arange(fed.shape[0])[last >= 0]
    fed[rows, last[last >= 0]] = 0
    return torch.cat([gen.prompt_mask_BP, fed], dim=1)


def sequence_batch_fn(gen: Generation, pad_id: int, routing: str | None = None
                      ) -> Callable[[list[int]], dict]:
    """Row indices -> one prompt+response micro-batch (attention mask for the left padding,
    position ids counting real tokens), every batch the full width P + T. ``routing`` (a
    mixture of experts' pass over the rollout's routing): ``"replay"`` routes every token
    to the experts the rollout chose, ``"compare"`` counts the tokens routed otherwise, and
    ``"record"`` counts them and keeps the pass's own choices (``models.moe``)."""

    def make_batch(rows: list[int]) -> dict:
        idx = torch.tensor(rows)
        batch = prompt_response_batch(gen.prompt_tokens_BP[idx], gen.prompt_mask_BP[idx],
                                      gen.response_tokens_BT[idx], gen.fed_mask_BT[idx],
                                      pad_id)
        return with_routing(batch, gen, idx, routing)

    return make_batch


def with_routing(batch: dict, gen: Generation, idx: torch.Tensor, routing: str | None
                 ) -> dict:
    """``batch`` (rows ``idx`` of ``gen``, padded or packed) with what its pass needs of
    the rollout's routing (``routing`` as :func:`sequence_batch_fn` takes it); a packed
    batch replays it mapped onto its tokens (``models.moe.to_packed``)."""
    if routing == "replay":
        batch["routing"] = moe.to_packed(gen.routing_BLSK[idx], batch["source"]) \
            if "source" in batch else gen.routing_BLSK[idx]
    elif routing in ("compare", "record"):
        batch["rollout_routing"] = gen.routing_BLSK[idx]
        batch["rollout_routing_mask"] = fed_tokens(gen)[idx]
    if routing == "record":
        batch["routing_rows"] = idx
    return batch


def packed_batch_fn(gen: Generation, kind: str, pad_id: int = 0,
                    routing: str | None = None) -> Callable[[list[int]], dict]:
    """Row indices -> one packed micro-batch of those samples (``data.packing``): the
    outputs a ``kind`` (lm or value) pass reads, in the (B, T) grid of the rows;
    ``routing`` as :func:`sequence_batch_fn` takes it (the rollout's routing mapped onto
    the packed tokens and back, ``models.moe.to_packed`` / ``from_packed``)."""

    def make_batch(rows: list[int]) -> dict:
        idx = torch.tensor(rows)
        batch = pack_prompt_response(gen.prompt_tokens_BP[idx], gen.prompt_mask_BP[idx],
                                     gen.response_tokens_BT[idx], gen.fed_mask_BT[idx],
                                     kind=kind, pad_id=pad_id)
        return with_routing(batch, gen, idx, routing)

    return make_batch


def sequence_lengths(gen: Generation) -> list[int]:
    """Each sample's real tokens, prompt and response (of a rollout, or of an experience
    batch: its trained response)."""
    fed = gen.fed_BT if isinstance(gen, algos.Experience) else gen.fed_mask_BT
    return (gen.prompt_mask_BP.long().sum(1) + fed.long().sum(1)).tolist()


@dataclass
class RewardSource:
    """A frozen reward-model role (with the normalisation stored in its checkpoint) or a
    programmatic reward: ``fn``, a :class:`~megarlhf.rewards.verifiers.Verifier` (a
    function by import path, or a reward server) called on rank 0 only."""

    role: Role | None = None
    fn: Callable | None = None
    decode: Callable | None = None  # token ids -> text, for ``fn`` and ``judge``
    counts: dict = field(default_factory=dict)  # fn's failures since take_counts
    judge: Callable | None = None  # a judge model (rollout.judge), called on every rank

    def take_counts(self) -> dict[str, float]:
        """``reward/failed`` and ``reward/timeouts`` since the last call (a programmatic
        reward or a judge only); counting starts again."""
        if self.fn is None and self.judge is None:
            return {}
        out = {"reward/failed": 0.0, "reward/timeouts": 0.0, **self.counts}
        self.counts = {}
        return out

    @property
    def gain(self) -> float:
        return float(self.role.saved.get("score_gain", 1.0)) if self.role else 1.0

    @property
    def bias(self) -> float:
        return float(self.role.saved.get("score_bias", 0.0)) if self.role else 0.0


@dataclass
class Scorer:
    rollout: RolloutConfig
    actor: Role
    reference: Role
    reward: RewardSource
    critic: Role | None
    pad_id: int
    micro_batch_size: int = 4
    ref_cache: SequenceCache | None = field(default_factory=SequenceCache)  # None: off
    hooks: RolloutHooks | None = None  # during_pass()
    max_tokens: int | None = None  # packed micro-batches of at most this many tokens
    padding: dict = field(default_factory=dict)  # token positions of the passes so far
    teacher: Role | None = None  # on-policy distillation's (ppo.teacher)

    def __post_init__(self):
        self.ref_offloader = Offloader(self.reference.chunks, self._offloads(self.reference))
        self.rm_offloader = Offloader(self.reward.role.chunks if self.reward.role else [],
                                      self._offloads(self.reward.role))
        self.teacher_offloader = Offloader(self.teacher.chunks if self.teacher else [],
                                           self._offloads(self.teacher))
        self.ref_offloader.offload()
        self.rm_offloader.offload()
        self.teacher_offloader.offload()

    @staticmethod
    def _offloads(role: Role | None) -> bool:
        """A frozen role is offloaded between its passes when its spec says ``all``
        (``roles.spec`` resolves ``roles.<name>.offload`` and its default,
        ``rollout.offload_frozen_models``)."""
        return role is not None and role.spec.offload == "all"

    def restore_frozen_models(self) -> None:
        """Bring the reference and reward models back (e.g. before handing them elsewhere)."""
        self.ref_offloader.reload()
        self.rm_offloader.reload()
        self.teacher_offloader.reload()

    def score(self, role: Role, gen: Generation, rows: list[int],
              routing: str | None = None) -> list[dict]:
        """``role``'s forward-only pass over ``rows`` at its own layout: per-token
        log-probs and entropy (LM) or values and the last value (value model); ``routing``
        as :func:`sequence_batch_fn` takes it."""
        step = make_sequence_step(role.spec.kind, prompt_len=gen.prompt_tokens_BP.shape[1],
                                  tp_group=role.layout.tp_group,
                                  true_vocab=role.spec.model.vocab_size,
                                  temperature=self.rollout.temperature)
        if self.hooks is not None:
            self.hooks.during_pass()
        lengths = sequence_lengths(gen)
        if self.max_tokens is not None:
            make_batch = packed_batch_fn(gen, role.spec.kind, self.pad_id, routing)
        else:
            make_batch = sequence_batch_fn(gen, self.pad_id, routing)
        return forward_rows(role, rows, make_batch, step,
                            micro_batch_size=self.micro_batch_size, max_tokens=self.max_tokens,
                            lengths=[lengths[r] for r in rows], padding=self.padding)

    def take_padding_fraction(self) -> float:
        """The share of token positions the passes since the last call computed that were
        padding; counting starts again."""
        computed = self.padding.get("computed", 0)
        fraction = self.padding.get("padding", 0) / computed if computed else 0.0
        self.padding.clear()
        return fraction

    def actor_logprobs(self, gen: Generation) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, T) the actor's log-probs at its training layout, and the routing its updates
        replay. A mixture of experts replays the rollout's routing in this pass and the
        updates (``rollout.routing_replay=r3``); otherwise it counts the tokens this pass
        routes otherwise than the rollout (``models.moe.take_mismatch``), and under ``r2``
        keeps this pass's routing for the updates. Dense or ``none``: no routing."""
        rows = list(range(gen.response_tokens_BT.shape[0]))
        replay = self.rollout.routing_replay
        routing = None
        if gen.routing_BLSK is not None:
            routing = {"r3": "replay", "r2": "record"}.get(replay, "compare")
        logprobs = stack_results(self.score(self.actor, gen, rows, routing), "logprobs")
        if routing == "replay":
            return logprobs, gen.routing_BLSK
        if routing == "record":
            return logprobs, moe.take_routing(*gen.routing_BLSK.shape, self.actor.layout)
        return logprobs, None

    def values(self, gen: Generation) -> torch.Tensor:
        """(B, T) the critic's values of the states before each response token."""
        rows = list(range(gen.response_tokens_BT.shape[0]))
        return stack_results(self.score(self.critic, gen, rows), "values")

    def reference_logprobs(self, gen: Generation) -> torch.Tensor:
        """The reference's log-probs of every sampled token: rows found in the cache, and
        rows repeating an earlier row of this batch, are not scored again."""
        B, T = gen.response_tokens_BT.shape
        if self.ref_cache is None:
            return self._score_reference(gen, list(range(B)))
        out = torch.zeros(B, T)
        first: dict[str, int] = {}  # key -> the batch row that scores it
        missing, repeats = [], []
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
            for i in missing:
                out[i] = scored[i]
                self.ref_cache.put(keys[i], out[i, :int(gen.fed_mask_BT[i].sum())])
        for i in repeats:
            out[i] = out[first[keys[i]]]
        return out

    def _score_reference(self, gen: Generation, rows: list[int]) -> torch.Tensor:
        """(B, T) with the reference's log-probs on ``rows`` (zero on padding and on the
        other rows), the reference loaded for the pass and offloaded after it."""
        out = torch.zeros(gen.response_tokens_BT.shape)
        self.ref_offloader.reload()
        with lora.disabled(self.reference.chunks) if self.reference.spec.adapters_off \
                else contextlib.nullcontext():
            scored = self.score(self.reference, gen, rows)
        self.ref_offloader.offload()
        for i, res in zip(rows, scored):
            out[i] = res["logprobs"] * gen.fed_mask_BT[i]
        return out

    def teacher_logprobs(self, gen: Generation) -> torch.Tensor:
        """(B, T) the teacher's log-probs of every token the student sampled (zero on
        padding; ``ppo.teacher``), the teacher loaded for its pass and offloaded after it."""
        out = torch.zeros(gen.response_tokens_BT.shape)
        self.teacher_offloader.reload()
        scored = self.score(self.teacher, gen, list(range(out.shape[0])))
        self.teacher_offloader.offload()
        for i, res in enumerate(scored):
            out[i] = res["logprobs"] * gen.fed_mask_BT[i]
        return out

    def reward_scores(self, gen: Generation) -> torch.Tensor:
        """(B,) the reward model's normalised score of each sample (or the programmatic
        reward's), the reward model loaded for its pass and offloaded after it."""
        B = gen.response_tokens_BT.shape[0]
        if gen.env_rewards_BT is not None:  # an environment's (rollout.environment.name)
            return gen.episode_rewards()[0]
        if self.reward.judge is not None:  # every rank: the judge generates at its layout,
            # and every rank reads the same verdicts (a stop is raised on all of them)
            scores, counts = self.reward.judge([decode_sample(gen, r, self.reward.decode)
                                                for r in range(B)])
            for key, value in counts.items():
                self.reward.counts[key] = self.reward.counts.get(key, 0.0) + value
            return torch.tensor(scores)
        if self.reward.fn is not None:  # rank 0 calls it, every rank gets the scores
            got: list = [None]
            if dist.get_rank() == 0:
                try:
                    got[0] = self.reward.fn([decode_sample(gen, r, self.reward.decode)
                                             for r in range(B)])
                except RewardError as err:
                    got[0] = str(err)
            dist.broadcast_object_list(got, src=0)
            if isinstance(got[0], str):
                raise RewardError(got[0])
            scores, counts = got[0]
            for key, value in counts.items():
                self.reward.counts[key] = self.reward.counts.get(key, 0.0) + value
            return torch.tensor(scores)
        self.rm_offloader.reload()
        raw = stack_results(self.score(self.reward.role, gen, list(range(B))), "last")
        self.rm_offloader.offload()
        return algos.normalize_scores(raw, self.reward.gain, self.reward.bias)
