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
    two halves differ. They are kept on the tensor ``freqs`` views (a decode step's
    positions are a slice of the whole length's tensor, taken anew in every layer), keyed by
    what could change them, and sliced like ``freqs``."""
    base = freqs._base if freqs._base is not None else freqs
    d = base.shape[-1]
    key = (mscale, dtype, base._version, base.shape, base.stride())
    cached = getattr(base, "_megarlhf_cos_sin", None)
    if cached is None or cached[0] != key:
        value = None
        if d % 2 == 0 and base.is_contiguous() \
                and torch.equal(base[..., :d // 2], base[..., d // 2:]):
            first = base[..., :d // 2]
            value = ((torch.cos(first) * mscale).to(dtype).contiguous(),
                     (torch.sin(first) * mscale).to(dtype).contiguous())
        cached = (key, value)
        base._megarlhf_cos_sin = cached
    value = cached[1]
    if value is None:
        return None
    # ``freqs`` picks whole rows of the contiguous base (megatron unsqueezes and slices by
    # position): the same view of the half-width cos/sin. Anything else: no cache.
    offset = freqs.storage_offset() - base.storage_offset()
    steps = [st for st, n in zip(freqs.stride()[:-1], freqs.shape[:-1]) if n > 1]
    if freqs.shape[-1] != d or freqs.stride()[-1] != 1 or offset % d \
            or any(st % d for st in steps):
        return None
    size = (*freqs.shape[:-1], d // 2)
    stride = (*(st // 2 for st in freqs.stride()[:-1]), 1)
    return tuple(torch.as_strided(v, size, stride, v.storage_offset() + offset // 2)
                 for v in value)


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
