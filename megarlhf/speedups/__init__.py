"""Speed tricks, one module each, off the path one reads.

The model that runs is megatron-core's, built from layer specs; the training step is
megatron's optimizer and schedules. A speed-up here replaces one piece of that with a
faster equivalent. Each module says what it replaces, what it was measured to gain at the
benchmark's medium size (``bench/speedups.py``, the command in its docstring) and whether
its results are bitwise those of what it replaces. BENCHMARKS.md lists which stayed and
why.

Nothing is installed by importing megarlhf. The CLI (and each tool) calls :func:`install`
once at start: ``MEGARLHF_SPEEDUPS`` (default ``1``) selects them - ``0`` runs plain
megatron-core and torch, ``NAME,NAME`` only those, ``-NAME,-NAME`` all but those. Library
code asks :func:`enabled` where it chooses between a plain piece and a fast one (a layer
class in a spec, torch's fused Adam); the two process-wide replacements (torch.compile on
first use, megatron's checkpoint results queue) happen in :func:`install`. Code that
calls the library directly (tests, benchmarks) gets plain megatron-core unless it calls
:func:`install` too.

| speed-up | replaces | medium size: time without / with - 1 | bitwise |
|---|---|---|---|
| ``lazy_jit`` | ``torch.compile`` of megatron's fusion kernels at import | a process 20% | yes |
| ``checkpoint_queue`` | megatron's spawned results queue of a save | a process 35% | yes |
| ``fused_adam`` | torch's per-tensor Adam loop | PPO iteration 7.5% | no (rounding) |
| ``linears`` | megatron's TP=1 linear layers' Python | PPO iteration 5.5% | tests' shapes |
| ``positions`` | the whole sequence through the last MLP and head | PPO iteration 4.0% | tests' shapes |
| ``decode_graphs`` | an eager decode step per token (CUDA only) | GPU: BENCHMARKS.md | no (greedy tokens equal) |
| ``compiled_decode`` | megatron's eager decode step (CPU only) | generation 43-46% (batch 16 / 1) | no (tokens equal) |
| ``shared_prefill`` | every row of a GRPO group prefilling its prompt | generation 69% (256-token prompts, groups of 4, batch 16) | no (tokens equal) |
| ``turn_kv`` | a multi-turn episode's whole conversation prefilled at every turn | 3-turn decoding 24% (``bench/multiturn_kv.py``) | no (tokens equal) |

("a process": launch to the first checkpoint save of a medium PPO session.)
Dropped for paying less than 3% there (BENCHMARKS.md): one-rank collectives, cached RoPE
tables, the batch-first head, the kept additive mask and the batched-product CPU attention,
Adam outside the CPU backend's mode, foreach gradient norm and clip, KV-cached decode on the
layers' own modules.

``tests/test_speedups.py`` runs the demo-shaped PPO with all of them, with none, and
without each one, and compares the metrics: equal bit for bit where a module says
bitwise, within rounding elsewhere.
"""

from __future__ import annotations

import importlib
import os

ENV = "MEGARLHF_SPEEDUPS"
# name -> what it speeds up, in one line (the module megarlhf.speedups.<name> has the rest)
NAMES = {
    "lazy_jit": "start-up: megatron's fusion kernels compiled on first call, not at import",
    "checkpoint_queue": "start-up of a save: megatron's write results kept in this process",
    "fused_adam": "torch's fused Adam kernel",
    "linears": "TP=1 linear layers straight to the matmul",
    "positions": "outputs only where the loss reads them (the last MLP and the head)",
    "decode_graphs": "CUDA graphs of the decode step on a fixed-shape KV cache (CUDA only)",
    "compiled_decode": "torch.compile of the decode step on a fixed-shape KV cache (CPU only)",
    "shared_prefill": "a group's prompt prefilled once, its keys and values copied to its rows",
    "turn_kv": "a multi-turn episode's keys and values kept across its turns",
}
_installed: frozenset[str] | None = None


def selected(text: str | None) -> frozenset[str]:
    """The speed-ups a ``MEGARLHF_SPEEDUPS`` value turns on (None or empty: all)."""
    text = (text or "1").strip()
    if text in ("1", "all"):
        return frozenset(NAMES)
    if text in ("0", "none"):
        return frozenset()
    items = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [i.lstrip("-") for i in items if i.lstrip("-") not in NAMES]
    if unknown:
        raise ValueError(f"{ENV}={text!r}: unknown speed-up(s) {', '.join(unknown)}; "
                         f"known: {', '.join(NAMES)} (or 1 / 0)")
    minus = [i for i in items if i.startswith("-")]
    if minus and len(minus) != len(items):
        raise ValueError(f"{ENV}={text!r}: list speed-ups to keep (NAME,NAME) or to drop "
                         "(-NAME,-NAME), not both")
    if minus:
        return frozenset(NAMES) - {i[1:] for i in minus}
    return frozenset(items)


def install(text: str | None = None) -> frozenset[str]:
    """Turn on the speed-ups ``text`` (default: ``$MEGARLHF_SPEEDUPS``) selects, once per
    process; returns them. A second call must select the same ones."""
    global _installed
    names = selected(os.environ.get(ENV) if text is None else text)
    if _installed is not None:
        if names != _installed:
            raise RuntimeError(f"speed-ups already installed as {sorted(_installed)}; "
                               f"cannot switch to {sorted(names)} in one process")
        return names
    for name in (n for n in NAMES if n in names):  # lazy_jit first: before megatron
        module = importlib.import_module(f"megarlhf.speedups.{name}")
        if hasattr(module, "install"):
            module.install()
    _installed = names
    return names


def enabled(name: str) -> bool:
    """Whether speed-up ``name`` is on in this process (off until :func:`install`)."""
    assert name in NAMES, name
    return _installed is not None and name in _installed


def chosen(name: str) -> bool:
    """Whether speed-up ``name`` is on in the run this process plans or starts: installed,
    or (before :func:`install`, e.g. ``megarlhf plan``) selected by ``MEGARLHF_SPEEDUPS``."""
    assert name in NAMES, name
    return enabled(name) if _installed is not None else name in selected(os.environ.get(ENV))


def describe() -> str:
    """One line for start-up output."""
    if _installed is None or not _installed:
        return "speed-ups: none (plain megatron-core and torch)"
    off = [n for n in NAMES if n not in _installed]
    return "speed-ups: " + ("all" if not off else "all but " + ", ".join(off)) + \
        f" ({ENV}=0 turns them off)"
