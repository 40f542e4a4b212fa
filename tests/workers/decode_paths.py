"""Shared prompt prefill (speedups.shared_prefill) against the plain path on real process
groups: a batch whose prompts repeat (GRPO's groups, a lone prompt between them), sampled
with and without sharing, greedy and with per-row seeds, in one static batch and in four
decode slots; a mixture of experts with its routing recorded, in a static batch and in
decode slots. World 1: rollout TP=1; world 2: the model at TP=2. Results ->
OUT/decode_world{N}.pt on rank 0."""

from __future__ import annotations

from megarlhf import speedups  # noqa: E402
speedups.install()

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import build, make_config  # noqa: E402

from megarlhf.inference.continuous import generate_continuous  # noqa: E402
from megarlhf.inference.generate import SamplingParams, generate  # noqa: E402

# three groups of three samples and a lone prompt; prompts of three lengths
GROUPS = [[5, 17, 42, 8], [9, 3], [100, 101, 102, 103, 104, 105]]
PROMPTS = [p for p in GROUPS for _ in range(3)] + [[7, 7, 7]]


def main():
    out = sys.argv[1]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    results = {}
    for arch in ("llama", "qwen3moe"):
        cfg = make_config(arch, world, 1)
        (model,) = build(cfg, "lm").chunks
        common = dict(eos_id=2, pad_id=0, true_vocab=cfg.model.vocab_size,
                      record_routing=arch == "qwen3moe")
        cases = {"greedy": (SamplingParams(max_new_tokens=10, greedy=True), {}),
                 "seeded": (SamplingParams(max_new_tokens=10, temperature=0.9, top_k=50),
                            {"row_seeds": [31 + i for i in range(len(PROMPTS))]})}
        for name, (params, kw) in cases.items():
            stats: dict = {}
            results[(arch, name)] = {
                share: generate(model, PROMPTS, params, shared_prefill=share, **kw, **common,
                                **({"stats": stats} if share else {}))
                for share in (False, True)}
            results[(arch, name)]["stats"] = stats
            if arch == "llama":  # the fixed-shape cache of the CUDA-graph step, eager here
                results[(arch, name)]["static"] = {
                    share: generate(model, PROMPTS, params, shared_prefill=share,
                                    static_cache=True, **kw,
                                    **{k: v for k, v in common.items()
                                       if k != "record_routing"})
                    for share in (False, True)}
            if arch == "qwen3moe":  # four decode slots recording the experts chosen
                results[(arch, name)]["slots_routing"] = generate_continuous(
                    model, PROMPTS, params, slots=4, **kw, **common)
            if arch == "llama":  # four decode slots: the first four, then twins admitted
                kw = {k: v for k, v in {**kw, **common}.items() if k != "record_routing"}
                slot_stats: dict = {}
                results[(arch, name)]["slots"] = {
                    share: generate_continuous(model, PROMPTS, params, slots=4,
                                               shared_prefill=share, **kw,
                                               **({"stats": slot_stats} if share else {}))
                    for share in (False, True)}
                results[(arch, name)]["slots"]["stats"] = slot_stats
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out, f"decode_world{world}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
