"""megatron's tensor-parallel linears, straight to the matmul at one tensor-parallel rank.

Replaces: ``ColumnParallelLinear`` / ``RowParallelLinear`` in the layer spec's attention
and MLP slots, and the LM head's class (:func:`head_class`).

At TP=1 megatron's linears compute ``torch.matmul(input, weight.t())`` plus the bias, yet
each call goes through megatron's Python: two identity ``autograd.Function``s for the TP
regions and ``LinearWithGradAccumulationAndAsyncCommunication`` (or
``LinearWithFrozenWeight``), each with its autocast decorator, and in training three
Python backward functions. :class:`ColumnLinear` and :class:`RowLinear` are those classes
with a forward that, at TP=1, is the matmul and the bias as torch ops, which autograd
differentiates natively: the same weight gradient megatron's backward computes
(``grad_output^T @ input``), accumulated into ``main_grad`` by megatron DDP's hook as
before. megatron's own forward runs whenever its extra machinery is on: TP > 1, sequence
parallelism, fused gradient accumulation (the CUDA extension), deferred embedding
gradients, activation offloading, expert layers.

Bitwise: no. Without autograd the results are megatron's op for op (torch's own 2-D folding
of the matmul made explicit), except that a product of at most ``FEW_ROWS`` rows is taken
the other way round (:func:`_matmul`): this machine's MKL then sums as in the usual order
at 16 rows and more and differs by rounding at fewer. With autograd the gradients agree to
rounding (tests/test_rollout.py).

Measured (2026-11-25, ``bench/speedups.py --size medium``): the PPO iteration 5.5% longer
without it (per-round median 5.9%), its generation phase 16%.
"""

from __future__ import annotations

import functools

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
    left one (1.0-1.2x above 64)."""
    rows = input_.reshape(-1, input_.shape[-1])
    if rows.shape[0] <= FEW_ROWS:
        out = torch.mm(weight, rows.t()).t().contiguous()
    else:
        out = torch.matmul(rows, weight.t())
    return out.view(*input_.shape[:-1], weight.shape[0])


def _short_way(layer) -> bool:
    """The matmul alone computes what megatron's forward computes for ``layer``."""
    tp = layer.tp_group.size() if layer.tp_group is not None else 1
    return (tp == 1 and not layer.sequence_parallel
            and not layer.gradient_accumulation_fusion
            and not layer.config.defer_embedding_wgrad_compute
            and getattr(layer.config, "_cpu_offloading_context", None) is None
            and not getattr(layer, "explicit_expert_comm", False))


class ColumnLinear(ColumnParallelLinear):
    """``ColumnParallelLinear`` with the matmul-only forward where it is the same."""

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if not _short_way(self) or (weight is None and self.weight is None) or (
                weight is not None
                and weight.shape != (self.output_size_per_partition, self.input_size)):
            return super().forward(input_, weight=weight,
                                   runtime_gather_output=runtime_gather_output)
        output = _matmul(input_, self.weight if weight is None else weight)
        if self.bias is not None and not self.skip_bias_add:
            output = output + self.bias
        return output, self.bias if self.skip_bias_add else None


class RowLinear(RowParallelLinear):
    """``RowParallelLinear`` with the matmul-only forward where it is the same."""

    def forward(self, input_):
        if not _short_way(self):
            return super().forward(input_)
        output = _matmul(input_, self.weight)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None


def use_in_spec(spec) -> None:
    """Put the fast classes in a local GPT layer spec's linear slots (attention's QKV and
    output projection, a dense MLP's two layers) where megatron's own classes sit."""
    slots = [(spec.submodules.self_attention.submodules, "linear_qkv"),
             (spec.submodules.self_attention.submodules, "linear_proj"),
             (spec.submodules.mlp.submodules, "linear_fc1"),
             (spec.submodules.mlp.submodules, "linear_fc2")]
    for holder, name in slots:
        current = getattr(holder, name, None)  # a mixture-of-experts MLP has other slots
        if current is ColumnParallelLinear:
            setattr(holder, name, ColumnLinear)
        elif current is RowParallelLinear:
            setattr(holder, name, RowLinear)


@functools.cache
def head_class(base: type) -> type:
    """The LM head's class with the fast forward: megatron's ``GPTModel`` builds its
    output layer as a ``ColumnParallelLinear`` itself, outside the layer spec."""
    if base is ColumnParallelLinear:
        return ColumnLinear
    return base
