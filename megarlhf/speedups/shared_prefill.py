"""A group's prompt prefilled once: the rows of a static batch that hold the same prompt
(GRPO's and RLOO's k samples of a prompt, a batch's repeated prompts) share one prefill.

Replaces: :func:`megarlhf.inference.generate.generate`'s first pass over every row's
prompt. With this speed-up the pass feeds one row per distinct (left-padded) prompt; the
keys and values it leaves in megatron's ``StaticInferenceContext`` (its memory is
``(columns, rows, ...)`` per layer), or in the fixed-shape cache of the CUDA-graph decode
step (``inference.static_kv``), are then copied to the other rows of its group and
its logits handed to each of them, which sample with their own seeds as before. A group of
k rows pays one prompt's prefill and k copies of its keys and values instead of k
prefills. With decode slots (``rollout.decode_slots``, ``inference.continuous``) the first
slots' repeated prompts share their pass and a prompt admitted at the same step as its
twin copies the twin's columns (:func:`copy`). Decode steps and a recompute after new
weights (``rollout.placement.partial``) feed every row as before.

Bitwise: no. The prefill's matmuls see fewer rows, which this machine's BLAS may sum in
another order, so a row's keys, values and logits can differ in the last bits (as with
decode slots, whose rows are computed in other batches). tests/test_decode_paths.py:
the same tokens, stops and routing as the plain path, greedy and seeded, at rollout TP=1
and TP=2; log-probs equal or 4.8e-7 apart.

Measured (2026-12-04, ``bench/generate_vs_hf.py --size medium --prompt 256 --new 32
--group 4``): generation 1.69x / 1.55x as fast at batch 16 / 64 (BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Groups:
    """The rows a shared prefill feeds (one per distinct prompt, first occurrences in
    order) and, for every row of the batch, its group's index among them."""

    rows: torch.Tensor  # (U,) long
    owner: torch.Tensor  # (B,) long, values in [0, U)


def groups(prompt_tokens_BP: torch.Tensor, prompt_mask_BP: torch.Tensor) -> Groups | None:
    """The batch's groups of identical prompts; None when every prompt is distinct."""
    rows = torch.cat([prompt_tokens_BP * prompt_mask_BP, prompt_mask_BP], dim=1)
    _, inverse = torch.unique(rows, dim=0, return_inverse=True)
    if int(inverse.max()) + 1 == rows.shape[0]:
        return None
    index: dict[int, int] = {}  # unique's group -> its number by first occurrence
    heads, owner = [], []
    for b, group in enumerate(inverse.tolist()):
        if group not in index:
            index[group] = len(heads)
            heads.append(b)
        owner.append(index[group])
    device = rows.device
    return Groups(torch.tensor(heads, device=device), torch.tensor(owner, device=device))


@torch.no_grad()
def spread(context, owner: torch.Tensor, columns: int) -> None:
    """Copy the keys and values of columns ``[0, columns)`` that the prefill wrote for the
    ``U`` fed rows (rows ``0..U-1`` of ``context``'s memory) to every row of the batch:
    row ``b`` gets its group's, ``owner[b]``."""
    for memories in context.key_value_memory_dict.values():
        for memory in memories:
            memory[:columns, :owner.numel()] = memory[:columns, owner]


@torch.no_grad()
def copy(context, source: int, target: int, start: int, end: int) -> None:
    """Copy row ``source``'s keys and values of columns ``[start, end)`` to row ``target``
    (a prompt admitted into a decode slot at the same columns as its twin)."""
    for memories in context.key_value_memory_dict.values():
        for memory in memories:
            memory[start:end, target] = memory[start:end, source]
