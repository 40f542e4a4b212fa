"""Sampling on the rollout ranks of a split job (``rollout.placement=split``).

The training processes keep the actor's inference-layout copy (as colocated: resharded
from the training layout, also used by evaluation) and send it to the rollout ranks; the
rollout ranks hold a copy of their own at the same layout and only sample. Over the bridge
group (``parallel.placement``), point to point:

1. training rank 0 sends a request to rollout rank 0 - the prompts, the batch seed, the
   policy version to sample with and whether new weights follow - which the rollout
   world broadcasts;
2. when they do, replica 0's TP rank j of the training side sends its shard (one flat
   buffer per dtype) to TP rank j of every rollout replica, and, with
   ``rollout.weight_checksum``, its SHA-256, which the receiver compares with one of the
   weights it then holds; a rollout rank samples only after every shard is in;
3. each rollout replica samples its share of the prompts with the same per-prompt seeds
   as a colocated rollout (``sampling.row_seeds``), the rollout world gathers them, and
   rollout rank 0 sends the batch, with the version it was sampled by, to training rank 0,
   which shares it with the training world.

At most one request is outstanding (``rollout.schedule`` resolves one before it sends the
next). A silent peer is the watchdog's to report: every wait runs in a named phase.
"""

from __future__ import annotations

import hashlib
import io
import time

import torch
import torch.distributed as dist

from megarlhf.config import Config, ConfigError
from megarlhf.parallel import signals, watchdog
from megarlhf.parallel.placement import Split
from megarlhf.parallel.signals import install_handlers
from megarlhf.rollout.generate import Generation
from megarlhf.rollout.reshard import (build_inference_model, inference_layout,
                                      release_inference_weights)
from megarlhf.rollout.sampling import Sampler, gather_generations, idle_slots, sample_share

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


def flat_weights(model) -> list[torch.Tensor]:
    """The model's parameters in order, one flat host buffer per dtype (first seen first)."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in model.parameters():
        groups.setdefault(p.dtype, []).append(p.detach().reshape(-1))
    return [torch.cat(parts).cpu() for parts in groups.values()]


@torch.no_grad()
def load_flat(model, flats: list[torch.Tensor]) -> None:
    """Write :func:`flat_weights` buffers into ``model`` (of the same architecture)."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in model.parameters():
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

    def __init__(self, remote: "RemoteRollout", version: int, metrics: dict):
        self.remote, self.version, self.metrics = remote, version, metrics

    def receive(self) -> tuple[Generation, dict]:
        return self.remote.receive(self)


class RemoteRollout:
    """The training processes' end of the bridge: :meth:`submit` a batch (sending the
    weights first when the rollout ranks hold another version), :meth:`receive` it."""

    def __init__(self, cfg: Config, split: Split, sampler: Sampler):
        self.cfg, self.split, self.sampler = cfg, split, sampler
        self.held: int | None = None  # the version the rollout ranks hold
        inf = sampler.inference_layout
        tp = inf.tp
        self.targets = [split.rollout_job_rank(rep * tp + inf.tp_rank)
                        for rep in range(split.rollout_world // tp)] if inf.dp_rank == 0 else []
        self.rollout_root = split.rollout_job_rank(0)
        self.rank = dist.get_rank()
        self.syncs: dict[str, float] = {}  # since take_sync_metrics
        # a rollout rank received a preemption signal (SIGUSR1 / SIGTERM: Slurm sends it to
        # every task); the same on every training rank, as the results are shared
        self.signalled = False

    def take_sync_metrics(self) -> dict[str, float]:
        """The weight syncs since the last call: ``timing/weight_sync`` (seconds, the
        reshard into the inference layout included) and ``perf/weight_sync_bytes`` (sent,
        all ranks); 0 when there was none; counting starts again."""
        out = {"timing/weight_sync": 0.0, "perf/weight_sync_bytes": 0.0, **self.syncs}
        self.syncs = {}
        return out

    def submit(self, prompts: list[list[int]], seed: int, version: int) -> Pending:
        """Ask for ``prompts`` sampled by policy ``version``: the actor as it is now when
        that differs from what the rollout ranks hold (a collective of the training world)."""
        sync = version != self.held
        bridge = self.split.bridge
        if self.rank == 0:
            with watchdog.phase("sending a request to the rollout ranks"):
                send_object(bridge, {"cmd": "generate", "prompts": prompts, "seed": seed,
                                     "version": version, "sync": sync}, self.rollout_root,
                            REQUEST)
        metrics: dict = {}  # this batch's
        if sync:
            hooks = self.sampler.hooks
            if hooks is not None:
                hooks.before_generate()
            start = time.perf_counter()
            with watchdog.phase("weight sync to the rollout ranks"):
                stats = self.sampler.resharder()
                sent = 0
                if self.targets:
                    flats = flat_weights(self.sampler.inference_model)
                    check = digest(flats) if self.cfg.rollout.weight_checksum else None
                    for dst in self.targets:
                        for flat in flats:
                            bridge.send([flat], dst, WEIGHTS).wait()
                            sent += flat.numel() * flat.element_size()
                        if check is not None:
                            bridge.send([check], dst, WEIGHTS).wait()
                if self.sampler.release_inference:
                    release_inference_weights(self.sampler.inference_model)
                total = torch.tensor([sent], dtype=torch.float64)
                dist.all_reduce(total)
            if hooks is not None:
                hooks.after_generate(0)
            metrics = {"timing/reshard": stats.seconds,
                       "perf/reshard_bytes": stats.bytes_received}
            for key, value in (("timing/weight_sync", time.perf_counter() - start),
                               ("perf/weight_sync_bytes", float(total))):
                self.syncs[key] = self.syncs.get(key, 0.0) + value
            self.held = version
        return Pending(self, version, metrics)

    def receive(self, pending: Pending) -> tuple[Generation, dict]:
        start = time.perf_counter()
        with watchdog.phase("waiting for the rollout ranks' samples"):
            got = [recv_object(self.split.bridge, self.rollout_root, RESULT)
                   if self.rank == 0 else None]
            dist.broadcast_object_list(got, src=0)
        result = got[0]
        self.signalled = self.signalled or result["signalled"]
        if result["version"] != pending.version:
            raise RuntimeError(f"the rollout ranks sampled with policy version "
                               f"{result['version']}, not the {pending.version} asked for")
        metrics = {**pending.metrics, **result["metrics"],
                   "timing/rollout_wait": time.perf_counter() - start}
        return Generation(**result["gen"]), metrics

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
    if actor_spec.model.moe.enabled:
        raise ConfigError("rollout.placement=split does not take a mixture-of-experts actor "
                          "yet (its expert layout and router bias are not sent to the rollout "
                          "ranks): use rollout.placement=colocated")
    # a preemption signal is the training side's to act on (it saves, then says stop):
    # here it is only recorded and reported with the next batch
    install_handlers()
    inf = inference_layout(cfg.rollout.tensor_parallel_size)
    model = build_inference_model(actor_spec, inf)
    shapes = [(f.dtype, f.numel()) for f in flat_weights(model)]
    sender = inf.tp_rank  # replica 0's TP rank j on the training side is job rank j
    bridge, rank = split.bridge, dist.get_rank()
    version, served = None, 0
    while True:
        with watchdog.phase("waiting for a request from the training ranks"):
            got = [recv_object(bridge, 0, REQUEST) if rank == 0 else None]
            dist.broadcast_object_list(got, src=0)
        request = got[0]
        if request["cmd"] == "stop":
            return served
        if request["sync"]:
            with watchdog.phase("weight sync from the training ranks"):
                flats = [torch.empty(n, dtype=dtype) for dtype, n in shapes]
                for flat in flats:
                    bridge.recv([flat], sender, WEIGHTS).wait()
                load_flat(model, flats)
                if cfg.rollout.weight_checksum:
                    sent = torch.empty(32, dtype=torch.uint8)
                    bridge.recv([sent], sender, WEIGHTS).wait()
                    held = digest(flat_weights(model))
                    if not torch.equal(sent, held):
                        raise RuntimeError(
                            f"weight sync of policy version {request['version']}: the weights "
                            f"rollout rank {rank} (job rank {split.job_rank}) holds differ from "
                            f"what training rank {sender} sent (SHA-256 {bytes(held).hex()[:16]} "
                            f"against {bytes(sent).hex()[:16]})")
            version = request["version"]
        prompts = request["prompts"]
        indices = list(range(inf.dp_rank, len(prompts), inf.dp))
        start = time.perf_counter()
        gen_stats: dict = {}
        with watchdog.phase("generation"):
            gen = sample_share(cfg, model, [prompts[i] for i in indices], indices,
                               request["seed"], eos_id=tokenizer.eos_id,
                               pad_id=tokenizer.pad_id, end_ids=tokenizer.end_ids,
                               true_vocab=actor_spec.model.vocab_size, stats=gen_stats)
        seconds = time.perf_counter() - start
        with watchdog.phase("gathering the generations"):
            gen = gather_generations(gen, prompts, inf, tokenizer.pad_id)
            metrics = {"timing/generate": seconds, **idle_slots(gen_stats)}
            asked = torch.tensor([1.0 if signals.asked() else 0.0])
            dist.all_reduce(asked, op=dist.ReduceOp.MAX)
        if rank == 0:
            with watchdog.phase("sending samples to the training ranks"):
                send_object(bridge, {"gen": gen.state_dict(), "version": version,
                                     "metrics": metrics, "signalled": bool(asked.item())},
                            0, RESULT)
        served += 1
