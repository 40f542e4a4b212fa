"""The decode step compiled by ``torch.compile`` on the CPU (the CPU's counterpart of
``decode_graphs``).

Replaces: megatron's eager decode step on ``StaticInferenceContext`` - a few hundred small
operations per sampled token, whose Python and dispatch dominate a decode step's time on
the CPU (one token per row: the matmuls are small). With this speed-up a plain cached
generation on the CPU (no routing record, no partial rollouts' interrupts; a model
``inference.static_kv`` supports) decodes on the fixed-shape cache of
:class:`~megarlhf.inference.static_kv.StaticDecoder`. Its step runs eagerly until the steps
of that model at that batch size have taken :func:`after_s` seconds in this process
(``MEGARLHF_COMPILED_DECODE_AFTER_S``, default 20), then through ``torch.compile``
(inductor, dynamic shapes: one compile serves every prompt and response length; one
graph: megatron's ``make_viewless_tensor``, which only cuts a view from its base for
pipeline sends, is skipped while compiling). Compiling costs 12-20 s here, so a run pays
it only after decoding eagerly for about as long, and short runs (the tests' tiny models)
never do.

Measured (2026-12-04, ``bench/generate_vs_hf.py --size medium``, compiled in the warm-up
call, against the same bench with ``MEGARLHF_SPEEDUPS=-compiled_decode``): generation at
batch 1 / 16, 32-token prompts, 32 new tokens, 1.27x / 1.36x transformers' ``generate``
against 0.87x / 0.95x without it (1.46x / 1.43x); in one process, against the same static
cache's step eager: 1.27x / 1.16x. Bitwise: no (the step's fused kernels
round differently; greedy tokens are checked equal, ``tests/test_decode_paths.py``).
Off: ``MEGARLHF_SPEEDUPS=-compiled_decode`` (megatron's ``StaticInferenceContext`` then
decodes on the CPU). A compile that fails falls back to the eager step, said once on
stderr.
"""

from __future__ import annotations

import os
import sys
import time

import torch

ENV = "MEGARLHF_COMPILED_DECODE_AFTER_S"
_spent: dict[tuple, float] = {}  # eager seconds of the decode steps of each (model, batch)
_compiled = None
_warned = False
compiled_steps = 0  # decode steps run compiled in this process


def applies(device: torch.device) -> bool:
    """Whether a generation on ``device`` decodes on the static cache with this step."""
    from megarlhf import speedups

    return device.type == "cpu" and speedups.enabled("compiled_decode")


def after_s() -> float:
    """Eager seconds of a shape's decode steps before they are compiled."""
    text = os.environ.get(ENV, "20")
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{ENV}={text!r}: seconds of eager decoding before compiling, a "
                         "number >= 0")
    return value


def install() -> None:
    """Skip megatron's ``make_viewless_tensor`` while ``torch.compile`` traces (it sets a
    tensor's ``.data``, which breaks the graph); eager calls are unchanged."""
    import megatron.core.transformer.transformer_block as block
    import megatron.core.transformer.transformer_layer as layer
    import megatron.core.utils as utils

    plain = utils.make_viewless_tensor
    if getattr(plain, "_megarlhf", False):
        return

    def make_viewless_tensor(inp, requires_grad, keep_graph):
        if torch.compiler.is_compiling():
            return inp
        return plain(inp, requires_grad, keep_graph)

    make_viewless_tensor._megarlhf = True
    for module in (utils, layer, block):
        module.make_viewless_tensor = make_viewless_tensor


def attach(decoder) -> None:
    """Make ``decoder.run`` (a StaticDecoder's step on its buffers) eager until its model
    at its batch size has decoded for :func:`after_s` seconds, compiled after."""
    global _compiled
    eager = decoder.run
    key = (id(decoder.gpt), decoder.key_mask.shape[0])
    limit = after_s()
    if _compiled is None:
        _compiled = torch.compile(type(decoder).run, dynamic=True)

    def run() -> torch.Tensor:
        global _warned, compiled_steps
        if _spent.get(key, 0.0) >= limit:
            try:
                out = _compiled(decoder)
                compiled_steps += 1
                return out
            except Exception as err:  # noqa: BLE001 - e.g. no C++ compiler
                if not _warned:
                    print(f"megarlhf: note: the decode step could not be compiled "
                          f"({type(err).__name__}: {err}); decoding eagerly", file=sys.stderr)
                    _warned = True
                _spent[key] = float("-inf")  # never again for this shape
                decoder.run = eager
                return eager()
        start = time.perf_counter()
        out = eager()
        _spent[key] = _spent.get(key, 0.0) + time.perf_counter() - start
        return out

    decoder.run = run
