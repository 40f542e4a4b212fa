"""The current end-to-end job (until the PPO demo lands): train a tokenizer on a generated
corpus, then score the same texts with one seeded model at TP=1/PP=1, TP=2 and PP=2
through `megarlhf score`, and print how far apart the per-token log-probs are."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time

WORDS = ("the cat dog sat on a mat red blue green fast slow tree house river stone bright "
         "quiet small large one two three four five").split()


def run(cmd: list[str]) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr[-4000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if lines:
        print("   ", lines[-1])


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def main() -> None:
    out = os.path.join("runs", "layout-demo")
    os.makedirs(out, exist_ok=True)
    rng = random.Random(0)
    corpus = os.path.join(out, "corpus.txt")
    with open(corpus, "w") as f:
        for _ in range(3000):
            f.write(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) + "\n")
    texts = os.path.join(out, "texts.jsonl")
    with open(texts, "w") as f:
        for _ in range(16):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(12))}) + "\n")
    py = sys.executable
    print("1. tokenizer from a generated corpus")
    run([py, "tools/train_tokenizer.py", "--input", corpus, "--vocab-size", "200",
         "--out", os.path.join(out, "tok")])
    common = ["--config", "configs/tiny_llama.yaml", "--input", texts,
              f"tokenizer.path={out}/tok.model"]
    layouts = [("TP=1 PP=1", 1, []),
               ("TP=2", 2, ["parallel.tensor_model_parallel_size=2"]),
               ("PP=2", 2, ["parallel.pipeline_model_parallel_size=2"])]
    results = {}
    for i, (name, nprocs, extra) in enumerate(layouts, 2):
        print(f"{i}. megarlhf score at {name} ({nprocs} process{'es' if nprocs > 1 else ''})")
        path = os.path.join(out, f"scores_{name.replace(' ', '_').replace('=', '')}.jsonl")
        start = time.time()
        launcher = [py, "-m", "megarlhf.cli"] if nprocs == 1 else [
            py, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}",
            f"--master-port={free_port()}", "-m", "megarlhf.cli"]
        run(launcher + ["score", *common, "--output", path, *extra])
        results[name] = [json.loads(line) for line in open(path)]
        print(f"    {time.time() - start:.1f} s")
    ref = results["TP=1 PP=1"]
    print("\nmax |log-prob difference| against TP=1 PP=1 (fp32):")
    for name in ("TP=2", "PP=2"):
        diff = max(abs(a - b) for r, s in zip(ref, results[name])
                   for a, b in zip(r["logprobs"], s["logprobs"]))
        print(f"  {name}: {diff:.2e}  ({'OK' if diff < 1e-5 else 'MISMATCH'})")
    mean_lp = sum(sum(r["logprobs"]) for r in ref) / sum(len(r["logprobs"]) for r in ref)
    print(f"mean token log-prob of the untrained model: {mean_lp:.3f}")


if __name__ == "__main__":
    main()
