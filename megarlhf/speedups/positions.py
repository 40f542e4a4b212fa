"""Outputs only where the loss reads them: the last layer's MLP and the LM head at chosen
sequence positions."""

from __future__ import annotations

import contextlib

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.mlp import MLP


def _let_head_skip_positions(layer) -> None:
    """The LM head computes logits for ``layer.megarlhf_positions`` (a slice of the
    sequence) only, when set: a loss that reads the response positions alone then pays
    neither the prompt's (S, B, H) x (H, V/tp) matmul nor its logits. See
    :func:`head_positions`."""
    forward = layer.forward
    layer.megarlhf_positions = None

    def sliced_forward(hidden_states, *args, **kwargs):
        if layer.megarlhf_positions is not None:
            hidden_states = hidden_states[layer.megarlhf_positions]  # (S, B, H): a view
        return forward(hidden_states, *args, **kwargs)

    layer.forward = sliced_forward


def _let_last_mlp_skip_positions(model: GPTModel):
    """The last layer's MLP (with its norm and residual) runs at ``megarlhf_positions``
    only, when set; returns that layer, or None where the model does not allow it. Nothing
    after it mixes positions - the final norm and the head work per position - so every
    other position's MLP is work whose result no caller reads: with the benchmark's 32
    prompt and 32 response tokens, 9% of the trunk's linear-layer FLOPs at the small model
    (4 layers), 18% at tiny (2).
    Attention still runs at every position (the kept ones attend to all). Not with sequence
    or context parallelism (the hidden states are sharded along the sequence), activation
    recomputation (the recomputed forward would see no positions), multi-token prediction
    (it reads every position), fp8 (its GEMMs want row counts in multiples of 8 or 16) or a
    mixture-of-experts MLP (routing statistics count tokens)."""
    config = model.config
    layers = model.decoder.layers
    if not layers or config.sequence_parallel or config.context_parallel_size > 1 \
            or config.recompute_granularity is not None or config.mtp_num_layers \
            or config.fp8 or type(layers[-1].mlp) is not MLP:
        return None
    layer = layers[-1]
    forward_mlp = layer._forward_mlp
    layer.megarlhf_positions = None

    def sliced_forward_mlp(hidden_states, *args, **kwargs):
        if layer.megarlhf_positions is not None:
            hidden_states = hidden_states[layer.megarlhf_positions]  # (S, B, H): a view
        return forward_mlp(hidden_states, *args, **kwargs)

    layer._forward_mlp = sliced_forward_mlp
    return layer


@contextlib.contextmanager
def head_positions(model, positions: slice | None):
    """Within the block, ``model`` (any wrapping; a no-op but on the last pipeline stage)
    returns its outputs at sequence ``positions`` only: (B, len(positions), V/tp) logits or
    (B, len(positions), 1) values. The sequence is cut before the last layer's MLP where
    the model allows it (:func:`_let_last_mlp_skip_positions`), else at the head."""
    from megarlhf.models.gpt import unwrap

    module = unwrap(model)
    cut = getattr(module, "megarlhf_cut", None) if getattr(module, "post_process", False) \
        else None
    if positions is None or cut is None:
        yield
        return
    cut.megarlhf_positions = positions
    try:
        yield
    finally:
        cut.megarlhf_positions = None
