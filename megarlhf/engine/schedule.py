"""Every role's passes go through megatron-core's pipeline schedules.

The contract is megatron's own: ``forward_step(data_iterator, model) -> (output,
loss_func)``. With PP=1 the schedule is a plain loop over micro-batches, with PP>1 it is
1F1B, and interleaved 1F1B when the model is a list of virtual-pipeline chunks.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func

from megarlhf.data.packing import pad_packed
from megarlhf.models.gpt import unwrap
from megarlhf.parallel import cpu_backend
from megarlhf.parallel.launch import to_device
from megarlhf.parallel.layout import RankLayout


@cpu_backend.at_megatron()
def run_schedule(model_chunks: list, forward_step: Callable, microbatches: list[Any], *,
                 layout: RankLayout, seq_length: int, micro_batch_size: int,
                 forward_only: bool, collect_non_loss_data: bool = False) -> list:
    """Drive ``microbatches`` through the pipeline schedule of the role's ``layout`` (its
    sizes and groups; ``model_chunks`` are its VPP chunks on this rank); returns what the
    last stage's loss functions produced (empty on other stages). Under expert
    parallelism every rank calls it, with micro-batches or none (:func:`_same_count`)."""
    microbatches = _same_count(microbatches, layout)
    if not microbatches:
        return []
    if layout.layout.ep > 1:  # lengthened to the expert group's (_same_count)
        seq_length = max(seq_length, *(b["tokens"].shape[1] for b in microbatches))
    if layout.layout.sp:  # the model lengthens each micro-batch (engine.steps.model_forward)
        seq_length = -(-seq_length // layout.tp) * layout.tp
    if layout.cp > 1:  # each CP rank runs its part of the lengthened sequence (same place)
        unit = 2 * layout.cp * (layout.tp if layout.layout.sp else 1)
        seq_length = -(-seq_length // unit) * unit // layout.cp
    device = next(unwrap(model_chunks[0]).parameters()).device
    vpp, pp, pgc = layout.vpp or 1, layout.pp, layout.pg_collection
    assert len(model_chunks) == vpp, (len(model_chunks), layout.describe())
    core = unwrap(model_chunks[0])
    if vpp > 1:
        # The interleaved schedule needs a multiple of the pipeline size; top up with
        # copies that carry no loss weight (their outputs are ignored by the callers).
        microbatches = list(microbatches) + [weightless(microbatches[-1])] * (
            -len(microbatches) % pp)
    # Packed micro-batches differ in shape: the stages then send each activation's shape
    # ahead of it (megatron's variable_seq_lengths); fixed shapes skip that exchange.
    variable = pp > 1 and len({tuple(b["tokens"].shape) for b in microbatches}) > 1
    # under context parallelism a packed row is lengthened sample by sample
    variable = variable or (pp > 1 and layout.cp > 1
                            and any("cu_seqlens" in b for b in microbatches))
    if variable and vpp > 1 and not core.config.batch_p2p_comm:
        # megatron sends those shapes with batch_isend_irecv, which gloo mis-pairs in the
        # interleaved schedule (as it does activations, see models.gpt): one length instead
        microbatches = _one_length(microbatches)
        variable, seq_length = False, microbatches[0]["tokens"].shape[1]
    if vpp > 1:
        # Interleaved schedule: one iterator per chunk, each seeing every micro-batch.
        data_iterator: Any = [_feed(microbatches, device) for _ in range(vpp)]
        model: Any = model_chunks
    else:
        data_iterator = _feed(microbatches, device)
        model = model_chunks[0]
    # The role's own groups: the schedule, its p2p communicator and the gradient
    # finalisation never fall back to megatron's global parallel_state.
    forward_backward = get_forward_backward_func(pp_size=pp, vp_size=vpp if vpp > 1 else None)
    extra = {"pg_collection": pgc}
    if pp > 1:
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
        extra["p2p_communicator"] = P2PCommunicator(pp_group=pgc.pp, config=core.config)
    configs = {id(c): c for c in (unwrap(chunk).config for chunk in model_chunks)}
    saved = {key: c.variable_seq_lengths for key, c in configs.items()}
    for c in configs.values():
        c.variable_seq_lengths = variable
    try:
        return forward_backward(
            forward_step_func=_loss_without_mode(forward_step),
            data_iterator=data_iterator,
            model=model,
            num_microbatches=len(microbatches),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
            collect_non_loss_data=collect_non_loss_data,
            **extra,
        )
    finally:
        for key, c in configs.items():
            c.variable_seq_lengths = saved[key]


def _same_count(microbatches: list, layout: RankLayout) -> list:
    """Expert parallelism joins the data-parallel ranks of an expert group in every MoE
    layer of every micro-batch, so they must run as many micro-batches - which packed
    shares (balanced by tokens, not by count) and strided evaluation shares need not
    have: the ranks agree on the most and the others top up with copies that carry no loss
    weight (their outputs are ignored by the callers). On CPU the experts' dispatcher
    gathers every rank's tokens (megatron's ``allgather``; the ``alltoall`` one on GPU
    takes uneven counts), so the ranks also agree on each micro-batch's length and
    lengthen theirs to it (:func:`lengthen`)."""
    if layout.layout.ep == 1 or layout.dp == 1:
        return microbatches
    counts = torch.tensor([len(microbatches), -len(microbatches)])
    dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=layout.dp_group)
    most, fewest = int(counts[0]), -int(counts[1])
    if fewest == 0 and most > 0:
        raise ValueError(f"a data-parallel rank has no samples in a pass that others run "
                         f"{most} micro-batch(es) of, and expert parallelism (EP="
                         f"{layout.layout.ep}) needs every rank of an expert group in each: "
                         f"give the pass at least {layout.dp} samples")
    out = list(microbatches) + [weightless(microbatches[-1])] * (most - len(microbatches))
    if torch.cuda.is_available() or not out:
        return out
    lengths = torch.tensor([b["tokens"].shape[1] for b in out])
    dist.all_reduce(lengths, op=dist.ReduceOp.MAX, group=layout.dp_group)
    return [lengthen(b, int(n)) for b, n in zip(out, lengths)]


def lengthen(batch: dict, length: int) -> dict:
    """A micro-batch ``length`` tokens long: packed, one more segment of padding
    (``data.packing.pad_packed``); padded (right-padded rows), every (B, S, ...) field
    extended with zeros along S - positions no loss reads - and an attention mask with
    rows that attend to themselves only."""
    extra = length - batch["tokens"].shape[1]
    if extra <= 0:
        return batch
    if "cu_seqlens" in batch:
        return pad_packed(batch, length)
    B, S = batch["tokens"].shape
    out = {}
    for key, value in batch.items():
        if key == "attention_mask":  # (B, 1, S, S), True = blocked
            grown = torch.ones(B, 1, length, length, dtype=torch.bool)
            grown[:, :, :S, :S] = value
            grown[:, :, range(S, length), range(S, length)] = False
            out[key] = grown
        elif key == "routing":  # (B, layers, S, k): the new positions to experts 0..k-1,
            # as models.moe.unrouted routes a position whose outputs nobody reads
            k = value.shape[3]
            filler = torch.arange(k, dtype=value.dtype).expand(B, value.shape[1], extra, k)
            out[key] = torch.cat([value, filler], dim=2)
        elif isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (B, S):
            out[key] = torch.cat([value, value.new_zeros(B, extra, *value.shape[2:])], dim=1)
        else:
            out[key] = value
    return out


def _one_length(microbatches: list[dict]) -> list[dict]:
    """Packed micro-batches (``data.packing``) padded to the longest one's length."""
    if not all("cu_seqlens" in b for b in microbatches):
        raise ValueError("micro-batches of several shapes through the interleaved pipeline "
                         "schedule over gloo must all be packed (PPO-ptx's padded rows "
                         "cannot join packed ones there)")
    longest = max(b["tokens"].shape[1] for b in microbatches)
    return [pad_packed(b, longest) for b in microbatches]


def _loss_without_mode(forward_step: Callable) -> Callable:
    """``forward_step`` whose loss function runs without the CPU backend's
    ``TorchFunctionMode``: megatron calls it under the mode, which only megatron's own code
    needs (our steps suspend it around the model already); under it every torch call of
    the loss is dispatched through Python."""

    def step(data_iterator, model, *rest):
        output, loss_func = forward_step(data_iterator, model, *rest)
        return output, cpu_backend.suspended()(loss_func)

    return step


def _feed(microbatches: list, device: torch.device):
    """Micro-batches are made on the host; each moves to the model's device as the
    schedule takes it."""
    return (to_device(batch, device) for batch in list(microbatches))


WEIGHT_KEYS = ("loss_mask", "pair_mask", "weight_mask", "response_mask", "policy_mask",
               "ptx_loss_mask", "rollout_routing_mask")


def weightless(batch: dict) -> dict:
    """A copy of a micro-batch whose loss weights are all zero."""
    return {k: torch.zeros_like(v) if k in WEIGHT_KEYS else v for k, v in batch.items()}


@torch.no_grad()
def forward_only(model_chunks: list, forward_step: Callable, microbatches: list[Any], *,
                 layout: RankLayout, seq_length: int, micro_batch_size: int) -> list:
    """Forward-only pass; the last stage gets one loss-function result per micro-batch."""
    return run_schedule(model_chunks, forward_step, microbatches, layout=layout,
                        seq_length=seq_length, micro_batch_size=micro_batch_size,
                        forward_only=True, collect_non_loss_data=True)
