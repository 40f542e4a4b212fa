"""CUDA graphs of the decode step (CUDA only; the CPU has no graphs).

Replaces: one eager decode step per sampled token - a forward of megatron's layers that
launches a few hundred small kernels for one token per row, which at batch 1 leaves the
GPU waiting on the host (on the H100, generation was 0.79x / 0.67x transformers'
``generate`` at batch 1 / 64 with the eager loop). With this speed-up a generation on
CUDA decodes on :class:`megarlhf.inference.static_kv.StaticDecoder` (fixed shapes, the KV
cache written at a device-side column) and captures its step once per generation - one
capture per (batch, prompt + response length), warmed up twice on a side stream first -
then replays it for every token. The sampling step stays eager (it reads the logits the
graph wrote, before the next replay overwrites them).

Measured: ``python bench/gpu.py --parts generate`` (tokens/s with and without, and the
tokens of both), figures in BENCHMARKS.md's GPU table. Bitwise: no - the decode step's
attention runs over the whole preallocated cache (the unwritten columns masked), so the
sums differ in rounding from megatron's growing cache; greedy tokens are checked equal.
Off: ``MEGARLHF_SPEEDUPS=-decode_graphs`` (megatron's ``StaticInferenceContext`` then
decodes, as on the CPU). A capture that fails falls back to the eager static step, said
once on stderr.
"""

from __future__ import annotations

import sys

import torch

_warned = False


def applies(device: torch.device) -> bool:
    """Whether a generation on ``device`` decodes through a captured graph."""
    from megarlhf import speedups

    return device.type == "cuda" and speedups.enabled("decode_graphs")


def capture(decoder) -> None:
    """Make ``decoder.run`` (a StaticDecoder's step on its buffers) replay a CUDA graph,
    captured at its first call."""
    eager = decoder.run
    state: dict = {}

    def run() -> torch.Tensor:
        global _warned
        graph = state.get("graph")
        if graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # allocations of the warm-up off the graph's pool
                for _ in range(2):
                    eager()  # the same column and inputs as the replay: the same writes
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    state["out"] = eager()
            except Exception as err:  # a kernel that cannot be captured
                if not _warned:
                    print(f"megarlhf: note: the decode step could not be captured as a CUDA "
                          f"graph ({type(err).__name__}: {err}); decoding eagerly",
                          file=sys.stderr)
                    _warned = True
                decoder.run = eager
                return eager()
            state["graph"] = graph
        graph.replay()
        return state["out"]

    decoder.run = run
