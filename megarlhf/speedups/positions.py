"""Outputs only where the loss reads them: the last layer's MLP and the LM head at the
positions a caller asks ``RoleModel.forward(..., positions=)`` for.

Replaces: with ``positions`` given, ``models.gpt.RoleModel`` computes the whole sequence
and slices its output; with this speed-up the sequence is cut before the last layer's MLP
(:class:`CutLayer`, the model's last layer in the block spec, :func:`block_spec`) where the
model allows it, else before the head. A PPO loss reads the response positions only, so
neither the prompt's head matmul and logits nor its last MLP is computed. Nothing after the
last MLP mixes positions - the final norm and the head work per position - so every other
position's MLP is work whose result no caller reads: with the benchmark's 32 prompt and 32
response tokens, 9% of the trunk's linear-layer FLOPs at the small model (4 layers), 18% at
tiny (2). Attention still runs at every position (the kept ones attend to all).

The MLP cut is not made with sequence or context parallelism (the hidden states are
sharded along the sequence), activation recomputation (the recomputed forward would see no
positions), multi-token prediction (it reads every position), fp8 (its GEMMs want row
counts in multiples of 8 or 16) or a mixture-of-experts MLP (routing statistics count
tokens); the head cut is, but for sequence parallelism (then nothing is cut early).

Bitwise: no. The head's and the MLP's matmuls see fewer rows, which this machine's MKL
may sum in another order (the logits of a kept position agree to float rounding).

Measured (2026-11-25, ``bench/speedups.py --size medium``): the PPO iteration 4.0% longer
without it (per-round median 4.4%).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    LayerNormImpl,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import TransformerLayer


class CutLayer(TransformerLayer):
    """The model's last transformer layer: while ``positions`` is set, its MLP (with its
    norm and residual) runs at those sequence positions only, and so does everything
    after it."""

    positions: slice | torch.Tensor | None = None

    def _forward_mlp(self, hidden_states, *args, **kwargs):
        if self.positions is not None:
            hidden_states = hidden_states[self.positions]  # (S, B, H): a view
        return super()._forward_mlp(hidden_states, *args, **kwargs)


def mlp_cut_allowed(config, layer_spec: ModuleSpec) -> bool:
    """Whether the last MLP may run at some positions only (see the module docstring)."""
    return (isinstance(layer_spec, ModuleSpec) and issubclass(layer_spec.module, TransformerLayer)
            and layer_spec.submodules.mlp.module is MLP
            and not config.sequence_parallel and config.context_parallel_size == 1
            and config.recompute_granularity is None and not config.mtp_num_layers
            and not config.fp8)


def block_spec(layer_spec: ModuleSpec, config, *, vp_stage: int | None, pp_rank: int
               ) -> TransformerBlockSubmodules:
    """The block of the model's last chunk with :class:`CutLayer` as its last layer (the
    layers megatron would build on this stage from ``layer_spec``, as megatron lists
    them)."""
    num_layers = get_num_layers_to_build(config, vp_stage, pp_rank)
    last = ModuleSpec(module=CutLayer, params=layer_spec.params,
                      submodules=layer_spec.submodules)
    layers = [layer_spec] * (num_layers - 1) + [last] if num_layers else []
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=LayerNormImpl)


def head_cut_allowed(config) -> bool:
    """Whether the head may run at some positions only: not with its input sharded along
    the sequence."""
    return not config.sequence_parallel and config.context_parallel_size == 1
