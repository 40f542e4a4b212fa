"""The expert bias's move after a step, on two data-parallel ranks whose routers counted
different tokens: every rank moves each expert's bias by rate x sign(mean - count) of the
counts summed over both ranks (here the ranks' own counts would move expert 0 the other
way), and the counts are reset. argv: OUT."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from megarlhf import speedups
speedups.install()

from megarlhf.config import config_from_dict  # noqa: E402
from megarlhf.models import moe  # noqa: E402
from megarlhf.parallel.launch import init_distributed, shutdown  # noqa: E402
from megarlhf.roles.build import build_from_config  # noqa: E402

COUNTS = {0: [0.0, 9.0, 0.0, 0.0], 1: [5.0, 0.0, 3.0, 3.0]}
RATE = 0.1


def main():
    out = sys.argv[1]
    cfg = config_from_dict({"model": {
        "vocab_size": 64, "num_layers": 1, "hidden_size": 32, "num_attention_heads": 4,
        "ffn_hidden_size": 64, "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 16,
                                       "score_function": "sigmoid", "expert_bias": True}}})
    init_distributed(cfg)
    role = build_from_config(cfg, kind="lm")
    router = role.chunks[0].decoder.layers[0].mlp.router
    rank = dist.get_rank()
    router.local_tokens_per_expert.copy_(torch.tensor(COUNTS[rank]))
    before = router.expert_bias.clone()
    moe.update_expert_bias(role.chunks, RATE, role.layout.dp_group)
    total = torch.tensor(COUNTS[0]) + torch.tensor(COUNTS[1])
    want = before + RATE * torch.sign(total.mean() - total)
    if rank == 0:
        torch.save({"dp": role.layout.dp, "got": router.expert_bias.clone(), "want": want,
                    "counts": router.local_tokens_per_expert.clone(),
                    "local": before + RATE * torch.sign(torch.tensor(COUNTS[0]).mean()
                                                        - torch.tensor(COUNTS[0]))},
                   os.path.join(out, "bias.pt"))


if __name__ == "__main__":
    main()
    shutdown()  # the process group closed on every rank before the process exits
