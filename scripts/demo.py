"""The current end-to-end job (until the PPO demo lands): on a synthetic task with a known
gold reward, train a tokenizer, run SFT and a reward model through the `megarlhf` CLI, and
check that the SFT checkpoint scores the same at TP=1, TP=2 and PP=2."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

from megarlhf.data.synthetic import write_task

OUT = os.path.join("runs", "demo")


def megarlhf(args: list[str], nprocs: int = 1) -> None:
    launcher = [sys.executable, "-m", "megarlhf.cli"]
    if nprocs > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}",
                    f"--master-port={port}", "-m", "megarlhf.cli"]
    start = time.time()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if subprocess.run(launcher + args, env=env).returncode != 0:
        sys.exit(f"failed: megarlhf {' '.join(args)}")
    print(f"    ({time.time() - start:.0f} s)\n", flush=True)


def main() -> None:
    print("1. synthetic task: corpus, sentencepiece tokenizer, SFT and preference data")
    task = write_task(os.path.join(OUT, "task"), seed=0)
    common = [f"tokenizer.path={task['tokenizer']}", f"run.output_dir={OUT}",
              "checkpoint.resume=false"]
    print("2. SFT (configs/sft_tiny.yaml)")
    megarlhf(["sft", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}", *common,
              "train.num_epochs=4"])
    print("3. reward model on gold-labelled preferences with 10% label noise")
    megarlhf(["rm", "configs/rm_tiny.yaml", f"data.train_path={task['prefs']}", *common])
    print("4. score held-out texts with the SFT checkpoint at three layouts")
    texts = os.path.join(OUT, "texts.jsonl")
    with open(texts, "w") as f:
        for line in open(task["prompts"]).readlines()[:16]:
            prompt = json.loads(line)["prompt"]
            f.write(json.dumps({"text": prompt + " " + " ".join(reversed(prompt.split()[1:]))})
                    + "\n")
    ckpt = os.path.join(OUT, "sft-tiny", "checkpoints")
    score = ["score", "--config", "configs/sft_tiny.yaml", "--input", texts,
             f"tokenizer.path={task['tokenizer']}", f"checkpoint.load={ckpt}"]
    results = {}
    for name, nprocs, extra in [("TP=1 PP=1", 1, []),
                                ("TP=2", 2, ["parallel.tensor_model_parallel_size=2"]),
                                ("PP=2", 2, ["parallel.pipeline_model_parallel_size=2"])]:
        path = os.path.join(OUT, f"scores_{name.replace(' ', '_').replace('=', '')}.jsonl")
        megarlhf(score + ["--output", path, *extra], nprocs)
        results[name] = [json.loads(line) for line in open(path)]
    ref = results["TP=1 PP=1"]
    print("max |log-prob difference| against TP=1 PP=1 (fp32):")
    for name in ("TP=2", "PP=2"):
        diff = max(abs(a - b) for r, s in zip(ref, results[name])
                   for a, b in zip(r["logprobs"], s["logprobs"]))
        print(f"  {name}: {diff:.2e}  ({'OK' if diff < 1e-5 else 'MISMATCH'})")
    for stage in ("sft-tiny", "rm-tiny"):
        records = [json.loads(line) for line in open(os.path.join(OUT, stage, "metrics.jsonl"))]
        evals = [r for r in records if any(k.startswith("eval/") for k in r)]
        first, last = evals[0], evals[-1]
        keys = [k for k in first if k.startswith("eval/")]
        print(f"{stage}: " + ", ".join(f"{k} {first[k]:.3f} -> {last[k]:.3f}" for k in keys))
    print(f"metrics (JSONL, TensorBoard) and checkpoints under {OUT}/")


if __name__ == "__main__":
    main()
