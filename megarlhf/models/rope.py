"""Rotary embeddings with cos/sin computed once per frequency tensor, not per call.

megatron-core's unfused RoPE (``rope_utils._apply_rotary_pos_emb_bshd``, what runs without
TransformerEngine's fused kernel) takes ``cos`` and ``sin`` of the whole frequency tensor,
then a ``cat`` for ``rotate_half`` and another for the untouched channels, for the query
and the key of every layer of every forward. The frequency tensor of one sequence length
is one object for all of them (``RotaryEmbedding.forward`` is cached; a decode step slices
it once for every layer), so its cos/sin are kept on it.

The arithmetic is megatron's, operation for operation, so the results are bitwise equal:
with halves ``(x1, x2)`` and the duplicated frequency halves ``(c, s)``,
``x * cos + rotate_half(x) * sin`` is ``(x1 * c - x2 * s, x2 * c + x1 * s)``.
Interleaved and multi-latent variants, partial rotary dimensions and frequency tensors
whose halves differ go to megatron's function unchanged.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings import rope_utils

_megatron_bshd = rope_utils._apply_rotary_pos_emb_bshd


def _cos_sin(freqs: torch.Tensor, mscale: float, dtype: torch.dtype):
    """(cos, sin) of the first half of ``freqs`` (scaled, in ``dtype``), or None when the
    two halves differ; kept on the tensor, keyed by what could change them."""
    key = (mscale, dtype, freqs._version)
    cached = getattr(freqs, "_megarlhf_cos_sin", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    half = freqs.shape[-1] // 2
    value = None
    if freqs.shape[-1] % 2 == 0 and torch.equal(freqs[..., :half], freqs[..., half:]):
        first = freqs[..., :half]
        value = ((torch.cos(first) * mscale).to(dtype), (torch.sin(first) * mscale).to(dtype))
    freqs._megarlhf_cos_sin = (key, value)
    return value


def apply_rotary_pos_emb_bshd(t: torch.Tensor, freqs: torch.Tensor,
                              rotary_interleaved: bool = False,
                              multi_latent_attention: bool = False,
                              mscale: float = 1.0) -> torch.Tensor:
    """megatron's ``_apply_rotary_pos_emb_bshd`` with cached cos/sin (same signature)."""
    if rotary_interleaved or multi_latent_attention or t.shape[-1] != freqs.shape[-1]:
        return _megatron_bshd(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
    cos_sin = _cos_sin(freqs, mscale, t.dtype)
    if cos_sin is None:
        return _megatron_bshd(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
    c, s = cos_sin
    x1, x2 = torch.chunk(t, 2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def install() -> None:
    """Route megatron's unfused RoPE through :func:`apply_rotary_pos_emb_bshd`."""
    rope_utils._apply_rotary_pos_emb_bshd = apply_rotary_pos_emb_bshd
