"""megatron's tensor-parallel linears, straight to the matmul at one tensor-parallel rank.

At TP=1 ``ColumnParallelLinear`` and ``RowParallelLinear`` compute
``torch.matmul(input, weight.t())`` plus the bias, yet each call goes through megatron's
Python: two identity ``autograd.Function``s for the TP regions and
``LinearWithGradAccumulationAndAsyncCommunication`` (or ``LinearWithFrozenWeight``), each
with its autocast decorator, and in training three Python backward functions. At a decode
step of the small benchmark model that was about 30 ms of a 0.4 s ``generate``; at the tiny
model's training steps about a tenth of the step. :func:`install` gives each such layer a
forward that, at TP=1, is the matmul and the bias as torch ops, which autograd
differentiates natively: the same weight gradient megatron's backward computes
(``grad_output^T @ input``), accumulated into ``main_grad`` by megatron DDP's hook as
before. Without autograd the results are bitwise megatron's (the same ops in the same
order, torch's own 2-D folding of the matmul made explicit), except that a product of at
most ``FEW_ROWS`` rows is taken the other way round (see :func:`_matmul`): this machine's
MKL then sums as in the usual order at 16 rows and more and differs by rounding at
fewer. With autograd the gradients agree to rounding (tests/test_rollout.py). megatron's
own forward runs whenever its extra machinery is on: TP > 1, sequence parallelism, fused
gradient accumulation (the CUDA extension), deferred embedding gradients, activation
offloading, expert layers.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


FEW_ROWS = 64


def _matmul(input_: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``torch.matmul(input_, weight.t())`` as one 2-D matmul, which is what torch does
    with an (S, B, H) input in the usual strides. A decode step's (1, B, H) or (B, 1, H)
    input after a transpose has a size-1 dimension with an unusual stride; torch then
    broadcasts the weight over the batch into a ``bmm`` (the output layer of the small
    benchmark model at batch 16: 1.6 ms a step instead of 1.0).

    With at most ``FEW_ROWS`` rows (a decode step) the product is taken the other way
    round, ``(weight @ input^T)^T``, and copied back to the usual layout (pipeline sends
    and collectives need it contiguous): MKL's sgemm with a short right operand ran the
    small model's 17 decode GEMMs 1.6x faster at 16 rows and 2-4x at 2-8 than with a short
    left one (1.0-1.2x above 64; BENCHMARKS.md, round 6)."""
    rows = input_.reshape(-1, input_.shape[-1])
    if rows.shape[0] <= FEW_ROWS:
        out = torch.mm(weight, rows.t()).t().contiguous()
    else:
        out = torch.matmul(rows, weight.t())
    return out.view(*input_.shape[:-1], weight.shape[0])


def _short_way_possible(layer) -> bool:
    return (layer.megarlhf_tp_size == 1 and not layer.sequence_parallel
            and not layer.gradient_accumulation_fusion
            and not layer.config.defer_embedding_wgrad_compute
            and getattr(layer.config, "_cpu_offloading_context", None) is None
            and not getattr(layer, "explicit_expert_comm", False))


def _column(layer):
    forward = layer.forward

    def column_forward(input_, weight=None, runtime_gather_output=None):
        if not _short_way_possible(layer) or (weight is None and layer.weight is None):
            return forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        if weight is None:
            weight = layer.weight
        elif weight.shape != (layer.output_size_per_partition, layer.input_size):
            return forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        output = _matmul(input_, weight)
        if layer.bias is not None and not layer.skip_bias_add:
            output = output + layer.bias
        return output, layer.bias if layer.skip_bias_add else None

    return column_forward


def _row(layer):
    forward = layer.forward

    def row_forward(input_):
        if not _short_way_possible(layer):
            return forward(input_)
        output = _matmul(input_, layer.weight)
        if layer.skip_bias_add:
            return output, layer.bias
        return (output + layer.bias if layer.bias is not None else output), None

    return row_forward


def install(model: torch.nn.Module) -> None:
    """Give every megatron ``ColumnParallelLinear`` / ``RowParallelLinear`` in ``model``
    the short TP=1 forward (TransformerEngine's layers are other classes: untouched).
    Call before anything else wraps a layer's ``forward``."""
    for module in model.modules():
        kind = type(module)
        if kind not in (ColumnParallelLinear, RowParallelLinear):
            continue
        module.megarlhf_tp_size = module.tp_group.size() if module.tp_group is not None else 1
        module.forward = _column(module) if kind is ColumnParallelLinear else _row(module)
