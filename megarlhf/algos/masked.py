"""Masked reductions and whitening.

Statistics are over the tensors given: PPO's experience batch is whole on every rank, so
whitening it is global without any collective. Variance convention: ``unbiased=True`` applies Bessel's correction
n/(n-1) (torch's default, and TRL's); ``unbiased=False`` is the population variance
(TensorFlow's ``tf.nn.moments``, used by OpenAI's lm-human-preferences).
"""

from __future__ import annotations

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` where ``mask`` is 1 (over all elements, or along ``dim``). An empty
    mask gives 0, not NaN."""
    mask = mask.to(x.dtype)
    if dim is not None:
        return masked_sum(x, mask, dim) / mask.sum(dim).clamp(min=1)
    parts = torch.stack([masked_sum(x, mask), mask.sum()])
    return parts[0] / parts[1].clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked elements (two passes, for precision). Fewer than two
    elements give 0."""
    mask = mask.to(x.dtype)
    mean = masked_mean(x, mask)
    parts = torch.stack([masked_sum((x - mean) ** 2, mask), mask.sum()])
    sq_sum, count = parts[0], parts[1]
    if count < 2:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return sq_sum / (count - 1) if unbiased else sq_sum / count


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  unbiased: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked elements; with ``shift_mean=False``
    the mean is added back (scale only, as trlx/TRL do for rewards). Masked-out positions
    are transformed too; callers zero them if they need to."""
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=unbiased)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    return whitened if shift_mean else whitened + mean


def last_valid_index(mask_BT: torch.Tensor) -> torch.Tensor:
    """(B,) index of the last 1 in each row of ``mask_BT``; -1 for an all-zero row."""
    T = mask_BT.shape[-1]
    has_any = mask_BT.any(dim=-1)
    last = T - 1 - mask_BT.flip(-1).to(torch.int8).argmax(dim=-1)
    return torch.where(has_any, last, torch.full_like(last, -1))
