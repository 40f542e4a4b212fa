"""Resharding the actor from its training layout into the inference layout, in memory,
with ``megatron.core.resharding.swap_model_weights``.

The inference layout has no pipeline parallelism: TP = ``rollout.tensor_parallel_size``
and the rest of the world forms data-parallel replicas. Its process groups come from
``HyperCommGrid``; the inference model is built with that ``ProcessGroupCollection``.
Over NCCL megatron's own copy service is used; over gloo, megatron's ``GlooCopyService``
allocates a CUDA stream, so this module provides :class:`GlooP2PCopyService`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.resharding.copy_services.base import CopyService
from megatron.core.resharding.refit import swap_model_weights

from megarlhf.config import Config
from megarlhf.models.gpt import build_model
from megarlhf.parallel.launch import ParallelLayout


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


def inference_layout(tp_size: int) -> ParallelLayout:
    """Process groups of the inference layout: TP x DP replicas, no PP. Every rank must
    call this, in the same order (it creates groups)."""
    world = dist.get_world_size()
    if world % tp_size:
        raise ValueError(f"rollout.tensor_parallel_size={tp_size} must divide the world size "
                         f"{world}")
    grid = HyperCommGrid([tp_size, 1, 1, 1, world // tp_size], ["tp", "cp", "ep", "pp", "dp"])
    tp, pp, dp = grid.create_pg("tp"), grid.create_pg("pp"), grid.create_pg("dp")
    cp, ep = grid.create_pg("cp"), grid.create_pg("ep")
    pgc = ProcessGroupCollection(
        tp=tp, cp=cp, pp=pp, ep=ep, embd=pp, pos_embd=pp, dp=dp,
        tp_cp=grid.create_pg(["tp", "cp"]), mp=grid.create_pg(["tp", "cp", "ep", "pp"]),
        expt_tp=tp, expt_dp=dp, tp_ep=grid.create_pg(["tp", "ep"]),
        tp_ep_pp=grid.create_pg(["tp", "ep", "pp"]), dp_cp=grid.create_pg(["cp", "dp"]),
        tp_dp_cp=grid.create_pg(["tp", "cp", "dp"]))
    return ParallelLayout(tp_size=tp_size, pp_size=1, dp_size=world // tp_size,
                          tp_rank=tp.rank(), pp_rank=0, dp_rank=dp.rank(), vpp_size=None,
                          pg_collection=pgc)


def build_inference_model(cfg: Config, layout: ParallelLayout, role: str = "lm"):
    model = build_model(cfg, role=role, pg_collection=layout.pg_collection,
                        pre_process=True, post_process=True)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def copy_service():
    """megatron's NCCL service on GPU; ours over gloo."""
    if dist.get_backend() == "nccl":
        return "nccl"
    return GlooP2PCopyService()


@dataclass
class ReshardStats:
    seconds: float
    bytes_received: int  # summed over all ranks


class Resharder:
    """Copies training-layout weights into the inference model; the plan is built on the
    first call and reused (megatron caches it on the target model)."""

    def __init__(self, train_chunks: list, inference_model):
        if len(train_chunks) != 1:
            raise ValueError("resharding from a virtual-pipeline (interleaved) training layout "
                             "is not supported; set parallel.virtual_pipeline_model_parallel_size"
                             "=null for PPO")
        self.src = train_chunks[0]
        self.dst = inference_model
        self.service = copy_service()

    @torch.no_grad()
    def __call__(self) -> ReshardStats:
        start = time.perf_counter()
        swap_model_weights([self.src], [self.dst], refit_method=self.service)
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
