"""Rotary embeddings with cos/sin computed once per frequency tensor, not per call.

megatron-core's unfused RoPE (``rope_utils._apply_rotary_pos_emb_bshd``, what runs without
TransformerEngine's fused kernel) takes ``cos`` and ``sin`` of the whole frequency tensor,
then a ``cat`` for ``rotate_half`` and another for the untouched channels, for the query
and the key of every layer of every forward. The frequency tensor of one sequence length
is one object for all of them (``RotaryEmbedding.forward`` is cached; a decode step slices
it once for every layer), so its cos/sin are kept on it.

The arithmetic is megatron's, product for product and sum for sum, so the results are
bitwise equal. With halves ``(x1, x2)`` and the duplicated frequency halves ``(c, s)``,
megatron's ``x * cos + rotate_half(x) * sin`` is ``(x1 * c + (-x2) * s, x2 * c + x1 * s)``;
here it is ``x * (c, c) + roll(x) * (-s, s)`` with ``roll(x) = (x2, x1)``: two products,
a roll and a sum (half the operations of megatron's, forward and backward; a 64 x 8 x 4 x 16
forward and backward took 0.33 ms against 0.60 ms).
Interleaved and multi-latent variants, partial rotary dimensions and frequency tensors
whose halves differ go to megatron's function unchanged.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings import rope_utils

_megatron_bshd = rope_utils._apply_rotary_pos_emb_bshd


def _cos_sin(freqs: torch.Tensor, mscale: float, dtype: torch.dtype):
    """(cos, signed sin) of ``freqs``, scaled and in ``dtype``: ``(c, c)`` and ``(-s, s)``
    over the last dimension, shaped like ``freqs``; None when its two halves differ. They
    are kept on the tensor ``freqs`` views (a decode step's positions are a slice of the
    whole length's tensor, taken anew in every layer), keyed by what could change them,
    and viewed as ``freqs`` views it."""
    base = freqs._base if freqs._base is not None else freqs
    d = base.shape[-1]
    key = (mscale, dtype, base._version, base.shape, base.stride())
    cached = getattr(base, "_megarlhf_cos_sin", None)
    if cached is None or cached[0] != key:
        value = None
        if d % 2 == 0 and base.is_contiguous() \
                and torch.equal(base[..., :d // 2], base[..., d // 2:]):
            half = base[..., :d // 2]
            c = (torch.cos(half) * mscale).to(dtype)
            s = (torch.sin(half) * mscale).to(dtype)
            value = (torch.cat((c, c), dim=-1), torch.cat((-s, s), dim=-1))
        cached = (key, value)
        base._megarlhf_cos_sin = cached
    value = cached[1]
    if value is None:
        return None
    if freqs is base:
        return value
    if freqs.shape[-1] != d or freqs.stride()[-1] != 1:
        return None  # not whole rows of the base: no cache
    # ``freqs`` is a view of the contiguous base (megatron unsqueezes and slices by
    # position): the same view of cos/sin, which are laid out as the base is.
    offset = freqs.storage_offset() - base.storage_offset()
    return tuple(torch.as_strided(v, freqs.shape, freqs.stride(), v.storage_offset() + offset)
                 for v in value)


def apply_rotary_pos_emb_bshd(t: torch.Tensor, freqs: torch.Tensor,
                              rotary_interleaved: bool = False,
                              multi_latent_attention: bool = False,
                              mscale: float = 1.0) -> torch.Tensor:
    """megatron's ``_apply_rotary_pos_emb_bshd`` with cached cos/sin (same signature)."""
    tables = _tables(freqs, t.shape[-1], t.dtype, rotary_interleaved, multi_latent_attention,
                     mscale)
    if tables is None:
        return _megatron_bshd(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
    return rotate(t, *tables)


def _tables(freqs, head_dim: int, dtype, interleaved: bool, latent: bool, mscale: float):
    """(cos, signed sin) for whole-head, non-interleaved, non-latent RoPE; else None."""
    if interleaved or latent or head_dim != freqs.shape[-1]:
        return None
    return _cos_sin(freqs, mscale, dtype)


def rotate(t: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``t`` rotated by the tables of :func:`cos_sin` (megatron's arithmetic, see above)."""
    return t * cos + t.roll(t.shape[-1] // 2, dims=-1) * signed_sin


def cos_sin(freqs: torch.Tensor, config, head_dim: int, dtype: torch.dtype):
    """The (cos, signed sin) tables :func:`apply_rotary_pos_emb_bshd` uses for ``freqs``
    where megatron's ``apply_rotary_pos_emb(t, freqs, config)`` would reach it (no fused
    RoPE, whole-head rotation, neither interleaved nor multi-latent); else None. A caller
    that rotates many tensors with one ``freqs`` (a decode step: every layer's query and
    key) takes them once and calls :func:`rotate`."""
    if config.apply_rope_fusion:
        return None
    return _tables(freqs, head_dim, dtype, config.rotary_interleaved,
                   config.multi_latent_attention, 1.0)


def install() -> None:
    """Route megatron's unfused RoPE through :func:`apply_rotary_pos_emb_bshd`."""
    rope_utils._apply_rotary_pos_emb_bshd = apply_rotary_pos_emb_bshd
