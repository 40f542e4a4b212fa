"""Four roles of two sizes, each at its own layout, built side by side in one job (as PPO
builds them) and scored through the one forward-only path. World 1 builds all four at
TP=1 PP=1 as the reference. Results -> OUT/roles_world{N}.pt on rank 0."""

from __future__ import annotations

# As the CLI does, before megatron is imported: the speed-ups MEGARLHF_SPEEDUPS selects.
from megarlhf import speedups  # noqa: E402
speedups.install()

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import build, fixed_sequences, make_config  # noqa: E402

from megarlhf.stages.score import score_sequences  # noqa: E402

# role: (kind, layers, hidden, seed offset, (tp, pp, vpp) at world 2)
ROLES = {
    "actor": ("lm", 4, 64, 0, (2, 1, None)),
    "critic": ("value", 2, 32, 1, (1, 2, None)),
    "reference": ("lm", 4, 64, 2, (1, 2, 2)),
    "reward": ("value", 2, 32, 3, (1, 1, None)),  # DP=2
}


def main():
    out_dir = sys.argv[1]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    seqs = fixed_sequences(8)
    built = {}
    for name, (kind, layers, hidden, offset, (tp, pp, vpp)) in ROLES.items():
        if world == 1:
            tp, pp, vpp = 1, 1, None
        extra = ["model.value_head_init=normal"]
        if vpp:
            extra.append(f"parallel.virtual_pipeline_model_parallel_size={vpp}")
        cfg = make_config("llama", tp, pp, layers=layers, hidden=hidden, extra=tuple(extra))
        built[name] = build(cfg, kind, trained=name in ("actor", "critic"), seed_offset=offset)
    results = {}
    for name, role in built.items():  # all four alive at once, each on its own groups
        results[name] = {"layout": role.layout.describe(),
                         "rows": score_sequences(role, seqs, micro_batch_size=2)}
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, f"roles_world{world}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
