"""The log-prob gap of the bf16 configuration to fp32: the same converted policy (the
ppo_vs_trl.py "small" Llama, random weights) scores the same sequences with
``model.params_dtype=float32`` and ``bfloat16``; figures are over every scored token.

    .venv/bin/python bench/bf16_gap.py [--size small] [--rows 16] [--length 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SIZES, convert, hf_llama, machine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--length", type=int, default=64)
    args = parser.parse_args()

    from megarlhf.config import load_config
    from megarlhf.roles.build import build_from_config
    from megarlhf.parallel.launch import init_distributed
    from megarlhf.stages.score import score_sequences

    folder = tempfile.mkdtemp(prefix="bf16_gap_")
    hf_llama(args.size, os.path.join(folder, "hf"))
    convert(os.path.join(folder, "hf"), os.path.join(folder, "mrl"))
    vocab = SIZES[args.size]["vocab"]
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, vocab, (args.length,), generator=gen).tolist()
            for _ in range(args.rows)]
    out = {}
    for dtype in ("float32", "bfloat16"):
        cfg = load_config(os.path.join(folder, "mrl", "config.yaml"), [
            f"checkpoint.load={os.path.join(folder, 'mrl')}", f"model.params_dtype={dtype}",
            "run.num_threads=2"])
        init_distributed(cfg)
        role = build_from_config(cfg, kind="lm")
        rows = score_sequences(role, seqs, micro_batch_size=args.rows)
        out[dtype] = torch.tensor([r["logprobs"] for r in rows])
    gap = (out["bfloat16"] - out["float32"]).abs()
    print(f"# bf16 vs fp32 log-probs, {args.size} policy, {args.rows} x {args.length} tokens; "
          f"{machine()}")
    print(f"mean abs diff {gap.mean():.2e}, max {gap.max():.2e}; fp32 log-probs: mean "
          f"{out['float32'].mean():.3f}")


if __name__ == "__main__":
    main()
