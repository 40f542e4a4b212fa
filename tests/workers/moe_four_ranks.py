"""A converted mixture of experts on four ranks: experts split over two ranks and each over
two tensor-parallel ranks (EP=2 x ETP=2, dense TP=2, DP=2), and over four (EP=4). Per-token
log-probs of converted_models.SEQS. argv: OUT CONV_DIR ARCH -> OUT/moe_four_ranks.pt"""

from __future__ import annotations

from megarlhf import speedups  # noqa: E402  (as the CLI, before megatron is imported)
speedups.install()

import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from common import build  # noqa: E402
from converted_models import SEQS  # noqa: E402

from megarlhf.config import load_config  # noqa: E402
from megarlhf.stages.score import score_sequences  # noqa: E402


def main():
    out, conv, arch = sys.argv[1:4]
    results = {}
    for tp, ep in ((2, 2), (1, 4)):
        cfg = load_config(os.path.join(conv, arch, "config.yaml"), [
            f"parallel.tensor_model_parallel_size={tp}",
            f"parallel.expert_model_parallel_size={ep}"])
        scorer = build(cfg, "lm")
        rows = score_sequences(scorer, SEQS, micro_batch_size=1)
        results[(tp, ep)] = {"layout": scorer.layout.describe(),
                             "logprobs": [r["logprobs"] for r in rows]}
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out, "moe_four_ranks.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
