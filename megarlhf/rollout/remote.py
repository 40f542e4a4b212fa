"""Sampling on the rollout ranks of a split job (``rollout.placement.mode=split``).

The training processes keep the actor's inference-layout copy (as colocated: resharded
from the training layout, also used by evaluation) and send it to the rollout ranks; the
rollout ranks hold a copy of their own at the same layout and only sample. Over the bridge
group (``parallel.placement``), point to point:

1. training rank 0 sends a request to rollout rank 0 - the prompts, the batch seed, the
   policy version to sample with and whether new weights follow - which the rollout
   world broadcasts;
2. when they do, replica 0's TP rank j of the training side sends its shard (one flat
   buffer per dtype) to TP rank j of every rollout replica, and, with
   ``rollout.placement.weight_checksum``, its SHA-256, which the receiver compares with one of the
   weights it then holds; a rollout rank samples only after every shard is in;
3. each rollout replica samples its share of the prompts with the same per-prompt seeds
   as a colocated rollout (``sampling.row_seeds``), the rollout world gathers them, and
   rollout rank 0 sends the batch, with the version it was sampled by, to training rank 0,
   which shares it with the training world.

At most one request is outstanding (``rollout.schedule`` resolves one before it sends the
next). A silent peer is the watchdog's to report: every wait runs in a named phase. A
weight sync has a deadline of its own on both sides (``rollout.placement.
sync_timeout_minutes``), and so, when set, does the training side's wait for a request
(``request_timeout_minutes``): past it, the waiting side ends as for a stall, naming the
phase and the other side's ranks.

Partial rollouts (``rollout.placement.partial``): when an update ends while a request is out, the
training side offers the new weights (:meth:`RemoteRollout.push`). Whether they are taken
is agreed on the job's store, one key per request, set once by whoever comes first:
``push:<version>`` by the training side, or ``done`` by rollout rank 0 once every replica
has finished sampling. A rollout replica that sees ``push`` between two decode steps takes
the weights there and samples the rest with them; one that finished first takes them after
sampling. The training side posts every shard's send before it waits on any, so a replica
still sampling never waits behind one that has finished.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import time
from typing import Callable

import torch
import torch.distributed as dist

from megarlhf.config import Config, PlacementConfig
from megarlhf.models import lora, moe
from megarlhf.parallel import signals, watchdog
from megarlhf.parallel.placement import Split
from megarlhf.parallel.signals import install_handlers
from megarlhf.rollout.agents import episode_sampler
from megarlhf.rollout.episodes import episode_metrics
from megarlhf.inference.generate import Generation
from megarlhf.inference.reshard import (build_inference_model, inference_layout,
                                      release_inference_weights)
from megarlhf.rollout.sampling import Sampler, gather_generations, idle_slots, sample_share
from megarlhf.rewards.verifiers import RewardError

REQUEST, WEIGHTS, RESULT = 1, 2, 3  # bridge tags


# ------------------------------------------------------------------ the wire

def send_object(pg, obj, dst: int, tag: int) -> None:
    """``obj`` (tensors, numbers, strings, lists and dicts of them) to job rank ``dst``."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    pg.send([torch.tensor([payload.numel()], dtype=torch.int64)], dst, tag).wait()
    pg.send([payload], dst, tag).wait()


def recv_object(pg, src: int, tag: int):
    size = torch.zeros(1, dtype=torch.int64)
    pg.recv([size], src, tag).wait()
    payload = torch.empty(int(size), dtype=torch.uint8)
    pg.recv([payload], src, tag).wait()
    return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)


def _synced(model, adapters_only: bool) -> list[torch.Tensor]:
    """The tensors a weight sync moves, in order: the parameters - all, or a LoRA model's
    adapters (its frozen base, once sent, does not change) - then a mixture of experts'
    expert biases (buffers the updates move, which routing reads)."""
    return [p for name, p in model.named_parameters()
            if not adapters_only or lora.is_adapter(name)] \
        + [router.expert_bias for router in moe.biased_routers(model)]


def flat_weights(model, adapters_only: bool = False) -> list[torch.Tensor]:
    """The model's parameters (:func:`_synced`) in order, one flat host buffer per dtype
    (first seen first)."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in _synced(model, adapters_only):
        groups.setdefault(p.dtype, []).append(p.detach().reshape(-1))
    return [torch.cat(parts).cpu() for parts in groups.values()]


@torch.no_grad()
def load_flat(model, flats: list[torch.Tensor], adapters_only: bool = False) -> None:
    """Write :func:`flat_weights` buffers into ``model`` (of the same architecture)."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in _synced(model, adapters_only):
        groups.setdefault(p.dtype, []).append(p)
    for params, flat in zip(groups.values(), flats, strict=True):
        offset = 0
        for p in params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def digest(flats: list[torch.Tensor]) -> torch.Tensor:
    """SHA-256 of the buffers' bytes, as 32 uint8."""
    h = hashlib.sha256()
    for flat in flats:
        h.update(flat.contiguous().view(torch.uint8).numpy().tobytes())
    return torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8)


# ------------------------------------------------------------------ the training side

class Pending:
    """A batch the rollout ranks are sampling; :meth:`receive` waits for it."""

    def __init__(self, remote: "RemoteRollout", version: int, metrics: dict, request: int):
        self.remote, self.version, self.metrics = remote, version, metrics
        self.request = request  # its number in this job (the store key of partial rollouts)
        self.pushed = False  # newer weights were offered while it was sampled

    def receive(self) -> tuple[Generation, dict]:
        return self.remote.receive(self)


class RemoteRollout:
    """The training processes' end of the bridge: :meth:`submit` a batch (sending the
    weights first when the rollout ranks hold another version), :meth:`receive` it."""

    def __init__(self, placement: PlacementConfig, split: Split, sampler: Sampler):
        self.placement, self.split, self.sampler = placement, split, sampler
        sampler.resharder.merge_adapters = False  # the rollout ranks get them as they are
        self.held: int | None = None  # the version the rollout ranks hold
        inf = sampler.inference_layout
        tp = inf.tp
        self.targets = [split.rollout_job_rank(rep * tp + inf.tp_rank)
                        for rep in range(split.rollout_world // tp)] if inf.dp_rank == 0 else []
        self.rollout_root = split.rollout_job_rank(0)
        self.rank = dist.get_rank()
        self.requests = 0  # sent so far
        self.outstanding: Pending | None = None
        self.syncs: dict[str, float] = {}  # since take_sync_metrics
        # a rollout rank received a preemption signal (SIGUSR1 / SIGTERM: Slurm sends it to
        # every task); the same on every training rank, as the results are shared
        self.signalled = False

    def take_sync_metrics(self) -> dict[str, float]:
        """The weight syncs since the last call: ``timing/weight_sync`` (seconds, the
        reshard into the inference layout included) and ``perf/weight_sync_bytes`` (sent,
        all ranks); 0 when there was none; counting starts again. Under rollout.placement.partial
        also ``rollout/inflight_updates``: the weights taken by a batch being sampled."""
        out = {"timing/weight_sync": 0.0, "perf/weight_sync_bytes": 0.0,
               **({"rollout/inflight_updates": 0.0} if self.placement.partial else {}),
               **self.syncs}
        self.syncs = {}
        return out

    def submit(self, prompts: list[list[int]], seed: int, version: int) -> Pending:
        """Ask for ``prompts`` sampled by policy ``version``: the actor as it is now when
        that differs from what the rollout ranks hold (a collective of the training world)."""
        sync = version != self.held
        request = self.requests
        self.requests += 1
        if self.rank == 0:
            with self._phase("sending a request to the rollout ranks", request=True):
                send_object(self.split.bridge,
                            {"cmd": "generate", "prompts": prompts, "seed": seed,
                             "version": version, "sync": sync, "request": request,
                             "partial": self.placement.partial},
                            self.rollout_root, REQUEST)
        metrics = self._send_weights(version) if sync else {}  # this batch's
        self.outstanding = Pending(self, version, metrics, request)
        return self.outstanding

    def push(self, version: int) -> bool:
        """rollout.placement.partial: offer policy ``version`` (the actor as it is now) to the batch
        being sampled, if any, once per batch (a collective of the training world). True
        when the rollout ranks take it: they sample the rest of that batch with it."""
        pending = self.outstanding
        if not self.placement.partial or pending is None or pending.pushed \
                or version == self.held:
            return False
        pending.pushed = True
        taken = torch.zeros(1)
        if self.rank == 0:
            offer = f"push:{version}".encode()
            taken[0] = float(self.split.store.compare_set(str(pending.request), "", offer)
                             == offer)
        dist.broadcast(taken, src=0)
        if not taken.item():  # every replica had finished: the next request syncs
            return False
        self._send_weights(version)  # (its reshard counts in timing/weight_sync)
        self.syncs["rollout/inflight_updates"] = self.syncs.get("rollout/inflight_updates",
                                                                0.0) + 1
        return True

    def _send_weights(self, version: int) -> dict:
        """Reshard the actor into the inference layout and send it to the rollout ranks
        (every send posted before any is waited on); the sync metrics accumulate in
        ``self.syncs``, the reshard's are returned."""
        hooks, bridge = self.sampler.hooks, self.split.bridge
        if hooks is not None:
            hooks.before_generate()
        start = time.perf_counter()
        # a LoRA actor's base is sent once; then only its adapters change
        adapters_only = self.held is not None and self.sampler.actor.spec.model.lora.enabled
        with self._phase("weight sync to the rollout ranks"):
            stats = self.sampler.resharder()
            sent, works = 0, []
            if self.targets:
                flats = flat_weights(self.sampler.inference_model, adapters_only)
                check = digest(flats) if self.placement.weight_checksum else None
                for dst in self.targets:
                    for flat in flats:
                        works.append(bridge.send([flat], dst, WEIGHTS))
                        sent += flat.numel() * flat.element_size()
                    if check is not None:
                        works.append(bridge.send([check], dst, WEIGHTS))
                for work in works:
                    work.wait()
            if self.sampler.release_inference:
                release_inference_weights(self.sampler.inference_model)
            total = torch.tensor([sent], dtype=torch.float64)
            dist.all_reduce(total)
        if hooks is not None:
            hooks.after_generate(0)
        for key, value in (("timing/weight_sync", time.perf_counter() - start),
                           ("perf/weight_sync_bytes", float(total))):
            self.syncs[key] = self.syncs.get(key, 0.0) + value
        self.held = version
        return {"timing/reshard": stats.seconds, "perf/reshard_bytes": stats.bytes_received}

    def _phase(self, name: str, request: bool = False):
        """A phase of this side's that waits on the rollout ranks, with its deadline: the
        request's (``rollout.placement.request_timeout_minutes``, when set) or the weight
        sync's."""
        field = "request_timeout_minutes" if request else "sync_timeout_minutes"
        minutes = getattr(self.placement, field)
        return watchdog.phase(name, deadline_s=None if minutes is None else minutes * 60,
                              setting=f"rollout.placement.{field}",
                              waits_on=("the rollout side", [
                                  self.split.rollout_job_rank(r)
                                  for r in range(self.split.rollout_world)]))

    def receive(self, pending: Pending) -> tuple[Generation, dict]:
        start = time.perf_counter()
        with self._phase("waiting for the rollout ranks' samples", request=True):
            got = [recv_object(self.split.bridge, self.rollout_root, RESULT)
                   if self.rank == 0 else None]
            dist.broadcast_object_list(got, src=0)
        result = got[0]
        if self.outstanding is pending:
            self.outstanding = None
        if "error" in result:  # an environment's failed call (rollout.rewards.on_error=stop)
            raise RewardError(result["error"])
        self.signalled = self.signalled or result["signalled"]
        if result["version"] != pending.version:
            raise RuntimeError(f"the rollout ranks sampled with policy version "
                               f"{result['version']}, not the {pending.version} asked for")
        metrics = {**pending.metrics, **result["metrics"],
                   "timing/rollout_wait": time.perf_counter() - start}
        return Generation.from_state(result["gen"]), metrics

    def rollout(self, prompts: list[list[int]], seed: int) -> tuple[Generation, dict]:
        """Sampled by the version the rollout ranks hold (DAPO's extra rounds), waited for."""
        return self.submit(prompts, seed, self.held if self.held is not None else 0).receive()

    def close(self) -> None:
        """Let the rollout ranks go (the run is over, or stops for a preemption)."""
        if self.rank == 0:
            send_object(self.split.bridge, {"cmd": "stop"}, self.rollout_root, REQUEST)


# ------------------------------------------------------------------ the rollout side

def serve(cfg: Config, tokenizer, split: Split, actor_spec) -> int:
    """A rollout rank's life: build the actor's inference-layout model, then sample each
    request until the training side says stop. Returns the batches sampled."""
    # a preemption signal is the training side's to act on (it saves, then says stop):
    # here it is only recorded and reported with the next batch
    install_handlers()
    inf = inference_layout(cfg.rollout.tensor_parallel_size, actor_spec.model)
    model = build_inference_model(actor_spec, inf)
    sender = inf.tp_rank  # replica 0's TP rank j on the training side is job rank j
    bridge, rank = split.bridge, dist.get_rank()
    synced = {"base": False}  # a LoRA actor's base is sent once, then only its adapters

    def take_weights(version: int) -> None:
        """Receive policy ``version``'s shard into the model (and check its SHA-256)."""
        adapters_only = synced["base"] and actor_spec.model.lora.enabled
        with watchdog.phase("weight sync from the training ranks",
                            deadline_s=cfg.rollout.placement.sync_timeout_minutes * 60,
                            setting="rollout.placement.sync_timeout_minutes",
                            waits_on=("the training side", list(range(split.training_world)))):
            flats = [torch.empty(f.numel(), dtype=f.dtype)
                     for f in flat_weights(model, adapters_only)]
            for flat in flats:
                bridge.recv([flat], sender, WEIGHTS).wait()
            load_flat(model, flats, adapters_only)
            synced["base"] = True
            if cfg.rollout.placement.weight_checksum:
                sent = torch.empty(32, dtype=torch.uint8)
                bridge.recv([sent], sender, WEIGHTS).wait()
                held = digest(flat_weights(model, adapters_only))
                if not torch.equal(sent, held):
                    raise RuntimeError(
                        f"weight sync of policy version {version}: the weights rollout rank "
                        f"{rank} (job rank {split.job_rank}) holds differ from what training "
                        f"rank {sender} sent (SHA-256 {bytes(held).hex()[:16]} against "
                        f"{bytes(sent).hex()[:16]})")

    episodes = episode_sampler(cfg.rollout, cfg.data, tokenizer)
    version, served = None, 0
    while True:
        with watchdog.phase("waiting for a request from the training ranks"):
            got = [recv_object(bridge, 0, REQUEST) if rank == 0 else None]
            dist.broadcast_object_list(got, src=0)
        request = got[0]
        if request["cmd"] == "stop":
            if episodes is not None:
                episodes.close()
            return served
        if request["sync"]:
            take_weights(request["version"])
            version = request["version"]
        inflight = InFlight(split.store, request["request"], model.pg_collection.tp,
                            take_weights) if request["partial"] else None
        prompts = request["prompts"]
        indices = list(inf.run_share(len(prompts)))
        start = time.perf_counter()
        gen_stats: dict = {}
        with watchdog.phase("generation"):
            gen = sample_share(cfg.rollout, model, [prompts[i] for i in indices], indices,
                               request["seed"], eos_id=tokenizer.eos_id,
                               pad_id=tokenizer.pad_id, end_ids=tokenizer.end_ids,
                               true_vocab=actor_spec.model.vocab_size, stats=gen_stats,
                               record_routing=actor_spec.model.moe.enabled,
                               interrupt=inflight, episodes=episodes)
        seconds = time.perf_counter() - start
        if inflight is not None:  # each token's version
            gen = dataclasses.replace(gen, versions_BT=torch.where(
                gen.versions_BT > 0, inflight.version or 0, version) * gen.fed_mask_BT)
        with watchdog.phase("gathering the generations"):
            gen = gather_generations(gen, prompts, inf, tokenizer.pad_id)
            metrics = {"timing/generate": seconds, **idle_slots(gen_stats)}
            failed = None
            if episodes is not None:
                try:
                    metrics.update(episode_metrics(gen_stats, cfg.rollout.rewards.on_error))
                except RewardError as err:  # the training side stops with it
                    failed = str(err)
            asked = torch.tensor([1.0 if signals.asked() else 0.0])
            dist.all_reduce(asked, op=dist.ReduceOp.MAX)
        if inflight is not None:
            version = inflight.seal(version)
            mask = gen.fed_mask_BT.bool()
            metrics["rollout/partial_tokens"] = float(
                (gen.versions_BT[mask] > request["version"]).double().mean()) \
                if mask.any() else 0.0
        if rank == 0:
            with watchdog.phase("sending samples to the training ranks"):
                send_object(bridge, {"gen": gen.state_dict(), "version": request["version"],
                                     "metrics": metrics, "signalled": bool(asked.item()),
                                     **({"error": failed} if failed else {})},
                            0, RESULT)
        served += 1


class InFlight:
    """rollout.placement.partial, on a rollout rank: weights offered while a batch is sampled.
    Called between two decode steps, it looks for the request's store key (the TP peers
    of a replica agree, so they switch at the same step) and, when the training side has
    offered new weights, takes them: True. :meth:`seal` ends the request."""

    def __init__(self, store, request: int, tp_group, take_weights: Callable[[int], None]):
        self.store, self.key, self.tp_group = store, str(request), tp_group
        self.take_weights = take_weights
        self.version: int | None = None  # taken: the version now held

    def offered(self) -> int | None:
        """The version offered for this request, if any (no wait)."""
        if not self.store.check([self.key]):
            return None
        value = self.store.get(self.key).decode()
        return int(value.split(":")[1]) if value.startswith("push:") else None

    def __call__(self) -> bool:
        if self.version is not None:
            return False  # one update per batch
        offered = torch.tensor([-1 if (v := self.offered()) is None else v])
        if self.tp_group.size() > 1:
            dist.all_reduce(offered, op=dist.ReduceOp.MAX, group=self.tp_group)
        if offered.item() < 0:
            return False
        self.take_weights(int(offered.item()))
        self.version = int(offered.item())
        return True

    def seal(self, version: int) -> int:
        """Once every replica has sampled (a collective of the rollout world): no offer is
        taken after this; one that came first and this rank did not take yet is taken now.
        Returns the version held."""
        got = [None]
        if dist.get_rank() == 0:
            got[0] = self.store.compare_set(self.key, "", b"done").decode()
        dist.broadcast_object_list(got, src=0)
        if got[0].startswith("push:") and self.version is None:
            self.version = int(got[0].split(":")[1])
            self.take_weights(self.version)
        return self.version if self.version is not None else version
