"""Resharding the actor from its training layout into the inference layout, in memory,
with ``megatron.core.resharding.swap_model_weights``.

The inference layout has no pipeline parallelism: TP = ``rollout.tensor_parallel_size``
and the rest of the world forms data-parallel replicas. Its process groups come from
``HyperCommGrid``; the inference model is built with that ``ProcessGroupCollection``.
The training layout may be pipelined and interleaved (VPP): its chunks are presented to
megatron's planner as one module with global layer names.
Over NCCL megatron's own copy service is used; over gloo, megatron's ``GlooCopyService``
allocates a CUDA stream, so this module provides :class:`GlooP2PCopyService`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.resharding.copy_services.base import CopyService
from megatron.core.resharding.refit import swap_model_weights

from megarlhf.config import Layout
from megarlhf.models import lora, moe
from megarlhf.roles.offload import StorageStash, unique_storages
from megarlhf.roles.spec import RoleSpec
from megarlhf.roles.build import build_chunks
from megarlhf.parallel.launch import uses_nccl
from megarlhf.parallel.layout import RankLayout, build_layout
from megarlhf.parallel import cpu_backend


class GlooP2PCopyService(CopyService):
    """Point-to-point copies over the default (gloo) group: ``isend``/``irecv`` tagged with
    the plan's task id; a transfer to the same rank is a local copy."""

    def __init__(self):
        self.rank = dist.get_rank()
        self._sends: list[tuple[int | None, torch.Tensor, int]] = []
        self._recvs: list[tuple[int | None, torch.Tensor, int]] = []

    def submit_send(self, src_tensor, dest_rank):
        self._sends.append((None, src_tensor, dest_rank))

    def submit_recv(self, dest_tensor, src_rank):
        self._recvs.append((None, dest_tensor, src_rank))

    def submit_send_with_id(self, task_id, src_tensor, dest_rank):
        self._sends.append((task_id, src_tensor, dest_rank))

    def submit_recv_with_id(self, task_id, dest_tensor, src_rank):
        self._recvs.append((task_id, dest_tensor, src_rank))

    def run(self):
        local_sends = {tid: t for tid, t, peer in self._sends if peer == self.rank}
        works = []
        for tid, tensor, peer in self._recvs:
            if peer == self.rank:
                if tid not in local_sends:
                    raise RuntimeError(f"reshard: local receive {tid} has no matching send")
                tensor.copy_(local_sends.pop(tid))
            else:
                works.append(dist.irecv(tensor, src=peer, tag=_tag(tid)))
        for tid, tensor, peer in self._sends:
            if peer != self.rank:
                works.append(dist.isend(tensor.contiguous(), dst=peer, tag=_tag(tid)))
        for work in works:
            work.wait()
        if local_sends:
            raise RuntimeError(f"reshard: {len(local_sends)} local sends were never received")
        self._sends, self._recvs = [], []


def _tag(task_id: int | None) -> int:
    return 0 if task_id is None else int(task_id) % (2**31 - 1)


def inference_layout(tp: int, model) -> RankLayout:
    """The inference layout of ``model`` (the actor's): TP = ``rollout.tensor_parallel_size``,
    no PP, the rest of the world data-parallel replicas (validated by
    ``config.check_rollout_layout``; :meth:`Layout.inference`)."""
    return build_layout(Layout.inference(tp, model))


@cpu_backend.at_megatron()
def build_inference_model(actor: RoleSpec, layout: RankLayout):
    """The actor's model in the inference layout (same global shapes, so resharding maps
    tensors one to one), frozen."""
    (model,) = build_chunks(dataclasses.replace(actor, layout=layout.layout), layout)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


class VirtualStages(torch.nn.Module):
    """The chunks of one rank (VPP: several) seen as one module with global names for
    megatron's resharding planner, which reads a single module per rank and matches
    parameters by name: layers by their global numbers (``decoder.layers.<global>``), so
    chunks do not collide, and experts by their global index
    (``mlp.experts.local_experts.<global>``: megatron renames only its grouped-GEMM
    experts' ``weight<k>``), so an expert-parallel rank's experts meet their copies."""

    def __init__(self, chunks: list):
        super().__init__()
        self.chunks = torch.nn.ModuleList(chunks)
        self.pg_collection = chunks[0].pg_collection
        self.config = chunks[0].config
        ep = self.pg_collection.ep
        local = (self.config.num_moe_experts or 0) // ep.size()
        self._names = []
        for chunk in chunks:
            prefix_map = _layer_prefix_map(chunk)
            for name, p in chunk.named_parameters():
                name = _global_expert(_global_name(name, prefix_map), ep.rank() * local)
                self._names.append((name, p))

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        yield from ((prefix + name, p) for name, p in self._names)

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        yield prefix, self  # names are global already: no layer prefix map to apply


def _layer_prefix_map(chunk) -> dict[str, str]:
    out = {}
    for name, module in chunk.named_modules():
        number = getattr(module, "layer_number", None)
        parts = name.split(".")
        if isinstance(number, int) and parts[-1].isdigit():
            out[name] = ".".join(parts[:-1] + [str(number - 1)])
    return out


def _global_name(name: str, prefix_map: dict[str, str]) -> str:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        mapped = prefix_map.get(".".join(parts[:i]))
        if mapped is not None:
            return ".".join([mapped] + parts[i:])
    return name


def _global_expert(name: str, first: int) -> str:
    """``...local_experts.<j>...`` -> ``...local_experts.<first + j>...``."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "local_experts" and parts[i + 1].isdigit():
            parts[i + 1] = str(first + int(parts[i + 1]))
    return ".".join(parts)


def copy_service():
    """megatron's NCCL service on GPU; ours over gloo."""
    if uses_nccl():
        return "nccl"
    return GlooP2PCopyService()


@dataclass
class ReshardStats:
    seconds: float
    bytes_received: int  # summed over all ranks


def release_inference_weights(model) -> int:
    """Free the inference model's weights until the next reshard, which overwrites every
    one of them (``rollout.release_inference_weights``): nothing is copied out. Returns
    the bytes freed."""
    stash = getattr(model, "_megarlhf_stash", None)
    if stash is None:
        # Back filled with 0xFF bytes (NaN in every float dtype): a weight the reshard did
        # not write would show at once.
        stash = model._megarlhf_stash = StorageStash(keep=False, fill=0xFF)
    return stash.release(unique_storages(p for p in model.parameters()))


class Resharder:
    """Copies training-layout weights into the inference model; the plan is built on the
    first call and reused (megatron caches it on the target model). Weights released by
    :func:`release_inference_weights` are reallocated first."""

    def __init__(self, train_chunks: list, inference_model):
        chunks = [getattr(c, "module", c) for c in train_chunks]
        whole = len(chunks) == 1 and chunks[0].pg_collection.ep.size() == 1
        self.src = chunks[0] if whole else VirtualStages(chunks)
        self.dst = inference_model
        self.service = copy_service()
        self.chunks = chunks
        self.expert_bias = bool(chunks[0].config.moe_router_enable_expert_bias)
        # a LoRA actor's adapters folded into the inference weights after each reshard
        # (decode at the base model's cost); split placement sends the adapters instead
        self.merge_adapters = True

    @torch.no_grad()
    @cpu_backend.at_megatron()
    def __call__(self) -> ReshardStats:
        start = time.perf_counter()
        stash = getattr(self.dst, "_megarlhf_stash", None)
        if stash is not None:
            stash.restore()
        swap_model_weights([self.src], [self.dst], refit_method=self.service)
        if self.expert_bias:
            moe.copy_expert_bias(self.chunks, self.dst, self.chunks[0].pg_collection.pp)
        if self.merge_adapters:
            lora.merge_into_weights(self.dst)
        seconds = time.perf_counter() - start
        plan = getattr(getattr(self.dst, "module", self.dst), "_cached_reshard_plan", None)
        received = 0
        if plan is not None:
            params = dict(self.dst.named_parameters())
            for op in plan.recv_ops:
                p = params.get(op.param_name)
                if p is not None:
                    received += p.data[op.my_slice].numel() * p.element_size()
        total = torch.tensor([received], dtype=torch.float64)
        dist.all_reduce(total)
        return ReshardStats(seconds, int(total.item()))
