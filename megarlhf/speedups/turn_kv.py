"""A multi-turn episode's keys and values kept across its turns (``rollout.environment``).

Replaces: :meth:`megarlhf.rollout.episodes.Episodes.sample`'s one
:func:`~megarlhf.inference.generate.generate` per turn, which prefills each live
episode's whole conversation again (its prompt, every turn so far and every observation)
before sampling the next turn. With this speed-up the replica's episodes decode on one
megatron ``StaticInferenceContext`` for the whole rollout: a turn feeds only what the
cache lacks - the first turn the prompt, a later one the previous turn's stop token and
the environment's observation - and samples on.

Layout (as ``inference.continuous``): the rows share columns. Each turn's new tokens of
every row end at one column, right-aligned; the columns before them that the row does not
fill are masked out of its attention, and its position ids count its own tokens, so a row
sees exactly its conversation. megatron's rotary embedding rotates by column (its cache
keeps keys unrotated and rotates ``[:end]`` at each pass), which a row's gaps would put
out of step with its positions: :func:`row_rotary` hands it a table per row instead, each
column rotated by that row's position there. Decode steps add one column for every row
still sampling. The context grows (a copy) when a turn needs more columns than it has.
Models whose attention builds its own rotary embedding (YaRN, multi-latent attention)
re-prefill instead (:func:`applies`).

Samples are :func:`generate`'s for the same per-turn, per-episode seeds (greedy, or one
draw per token from each episode's own stream). Bitwise: no - the cached columns were
computed in other passes than one prefill of the whole conversation, which this machine's
BLAS may sum in another order (tests/test_multiturn.py: the same episodes, tokens and
masks as re-prefilling; log-probs to float rounding).

The cache itself is :class:`megarlhf.inference.turns.TurnCache`; this module holds what
the switch decides with (:func:`applies`, :func:`columns`) and the per-row rotary table.

Measured (2026-12-04, ``bench/multiturn_kv.py``: the bench's medium model, 16 episodes of
3 turns, 128-token prompts, 32-token observations and turns): 1.24x as fast as
re-prefilling, the same episodes (BENCHMARKS.md).
"""

from __future__ import annotations

import contextlib

import torch


def _bare(model):
    """The model under its wrappers (DDP, Float16Module)."""
    while hasattr(model, "module"):
        model = model.module
    return model



def columns(max_seq_len: int) -> int:
    """The columns a replica's cache starts with (``data.max_seq_len``: an episode's
    tokens): room for the gaps of right-aligned turns before it grows."""
    return 2 * max_seq_len


def applies(model) -> bool:
    """Whether ``model``'s positions reach attention in a way :class:`TurnCache` steers:
    learned absolute position embeddings (the position ids), or megatron's plain RoPE."""
    gpt = _bare(model)
    return gpt.position_embedding_type in ("rope", "learned_absolute") \
        and not gpt.config.multi_latent_attention and not gpt.config.window_size


@contextlib.contextmanager
def row_rotary(model, positions_BL: torch.Tensor):
    """megatron's rotary table of the model's passes, per row: column ``c`` of row ``b``
    rotated by ``positions_BL[b, c]`` ((L, B, 1, d) instead of (L, 1, 1, d))."""
    gpt = _bare(model)
    if gpt.position_embedding_type != "rope":
        yield
        return
    rope = gpt.rotary_pos_emb
    original = rope.forward

    def per_row(max_seq_len: int, *args, **kwargs):
        table = original(int(positions_BL.max()) + 1, *args, **kwargs)  # (P, 1, 1, d)
        return table[:, 0, 0][positions_BL.t()].unsqueeze(2)

    rope.forward = per_row
    try:
        yield
    finally:
        del rope.forward  # the class's again
