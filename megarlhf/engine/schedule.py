"""Every role's passes go through megatron-core's pipeline schedules.

The contract is megatron's own: ``forward_step(data_iterator, model) -> (output,
loss_func)``. With PP=1 the schedule is a plain loop over micro-batches, with PP>1 it is
1F1B, and interleaved 1F1B when the model is a list of virtual-pipeline chunks.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from megarlhf.config import Config
from megarlhf.models.gpt import build_model
from megarlhf.parallel.launch import ParallelLayout


def build_model_chunks(cfg: Config, layout: ParallelLayout, role: str) -> list:
    """This rank's model chunks (one, or ``vpp`` with the interleaved schedule)."""
    vpp = layout.vpp_size or 1
    chunks = []
    for vp_stage in range(vpp):
        chunks.append(build_model(
            cfg, role=role, pg_collection=layout.pg_collection,
            pre_process=layout.is_first_stage and vp_stage == 0,
            post_process=layout.is_last_stage and vp_stage == vpp - 1,
            vp_stage=vp_stage if layout.vpp_size else None,
            vpp_size=layout.vpp_size))
    return chunks


def run_schedule(model_chunks: list, forward_step: Callable, microbatches: list[Any], *,
                 seq_length: int, micro_batch_size: int, forward_only: bool,
                 collect_non_loss_data: bool = False) -> list:
    """Drive ``microbatches`` through the pipeline schedule; returns what the last stage's
    loss functions produced (empty on other stages)."""
    if not microbatches:
        return []
    vpp = len(model_chunks)
    if vpp > 1:
        # The interleaved schedule needs a multiple of the pipeline size; top up with
        # copies that carry no loss weight (their outputs are ignored by the callers).
        pp = model_chunks[0].config.pipeline_model_parallel_size
        microbatches = list(microbatches) + [weightless(microbatches[-1])] * (
            -len(microbatches) % pp)
        # Interleaved schedule: one iterator per chunk, each seeing every micro-batch.
        data_iterator: Any = [iter(list(microbatches)) for _ in range(vpp)]
        model: Any = model_chunks
    else:
        data_iterator = iter(list(microbatches))
        model = model_chunks[0]
    forward_backward = get_forward_backward_func()
    return forward_backward(
        forward_step_func=forward_step,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
    )


WEIGHT_KEYS = ("loss_mask", "pair_mask", "weight_mask")


def weightless(batch: dict) -> dict:
    """A copy of a micro-batch whose loss weights are all zero."""
    return {k: torch.zeros_like(v) if k in WEIGHT_KEYS else v for k, v in batch.items()}


def chunked(items: list, size: int) -> Iterable[list]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def set_eval(model_chunks: list) -> None:
    for chunk in model_chunks:
        chunk.eval()


@torch.no_grad()
def forward_only(model_chunks: list, forward_step: Callable, microbatches: list[Any], *,
                 seq_length: int, micro_batch_size: int) -> list:
    """Forward-only pass; the last stage gets one loss-function result per micro-batch."""
    return run_schedule(model_chunks, forward_step, microbatches, seq_length=seq_length,
                        micro_batch_size=micro_batch_size, forward_only=True,
                        collect_non_loss_data=True)
