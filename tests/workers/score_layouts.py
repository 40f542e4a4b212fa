"""Scores fixed sequences with both architectures (GQA), LM and value heads, at every
layout that fits the world size. World 1 gives the single-process reference.
Results -> OUT/layouts_world{N}.pt on rank 0."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import build, fixed_sequences, make_config  # noqa: E402

from megarlhf.stages.score import score_sequences  # noqa: E402

# (tp, pp, vpp); vpp > 1 runs the interleaved 1F1B schedule.
LAYOUTS = {1: [(1, 1, 1)], 2: [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 2, 2)]}


def main():
    out_dir = sys.argv[1]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    seqs = fixed_sequences(8)
    results = {}
    for arch in ("llama", "gpt2"):
        for role in ("lm", "value"):
            for tp, pp, vpp in LAYOUTS[world]:
                extra = ["model.value_head_init=normal"]
                if vpp > 1:
                    extra.append(f"parallel.virtual_pipeline_model_parallel_size={vpp}")
                cfg = make_config(arch, tp, pp, extra=tuple(extra))
                scorer = build(cfg, role)
                for temperature in ((1.0, 0.7) if role == "lm" else (1.0,)):
                    rows = score_sequences(scorer, seqs, micro_batch_size=2,
                                           temperature=temperature)
                    results[(arch, role, tp, pp, vpp, temperature)] = rows
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, f"layouts_world{world}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
