"""Forward-only scoring throughput (tokens/s) of one model at several layouts, measured
in one invocation so the numbers are comparable. Prints a table; asserts nothing.

    .venv/bin/python bench/score_layouts.py [--layers 4 --hidden 256 --seqs 64 --len 128]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--len", type=int, default=128)
    args = parser.parse_args()
    tmp = tempfile.mkdtemp()
    rng = random.Random(0)
    inp = os.path.join(tmp, "seqs.jsonl")
    with open(inp, "w") as f:
        for _ in range(args.seqs):
            f.write(json.dumps({"tokens": [rng.randrange(args.vocab)
                                           for _ in range(args.len)]}) + "\n")
    common = [f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
              f"model.vocab_size={args.vocab}", "model.num_attention_heads=8",
              f"model.max_position_embeddings={args.len}"]
    rows = []
    for name, nprocs, extra in [("TP=1 PP=1", 1, []),
                                ("DP=2", 2, []),
                                ("TP=2", 2, ["parallel.tensor_model_parallel_size=2"]),
                                ("PP=2", 2, ["parallel.pipeline_model_parallel_size=2"])]:
        out = os.path.join(tmp, "out.jsonl")
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}",
                    f"--master-port={free_port()}", "-m", "megarlhf.cli"]
        cmd = launcher + ["score", "--input", inp, "--output", out, "--micro-batch-size", "8",
                          *common, *extra]
        start = time.time()
        subprocess.run(cmd, check=True, capture_output=True,
                       env={**os.environ, "OMP_NUM_THREADS": str(2 // nprocs)})
        wall = time.time() - start
        rows.append((name, nprocs, wall, args.seqs * args.len / wall))
    print(f"{'layout':<10} {'procs':>5} {'wall s':>8} {'tokens/s':>10} {'vs TP=1':>8}"
          "  (wall includes process start-up and model build)")
    for name, nprocs, wall, tps in rows:
        print(f"{name:<10} {nprocs:>5} {wall:>8.2f} {tps:>10.0f} {tps / rows[0][3]:>8.2f}")


if __name__ == "__main__":
    main()
