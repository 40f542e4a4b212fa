"""How a PPO iteration grows with the work: one axis at a time from a base shape (small
model, responses of 32, rollout batch 16, one process), with TRL's ``PPOTrainer`` (without
its gc) run side by side where it can run the same shape.

    .venv/bin/python bench/scaling.py [--iterations 2] [--warmup 1] [--axes size response
                                       batch processes]

- size: tiny, small, medium (bench/common.py SIZES); the growth exponent is taken against
  the parameter count of the policy;
- response: 32, 128, 256 tokens (``fixed`` variant: every response runs to the limit);
- batch: 16 and 64 rollouts (mini-batches are half the batch, as in ppo_vs_trl.py);
- processes: the ``megarlhf ppo`` CLI at 1 process (2 threads) and under torchrun at 2
  processes (1 thread each) as DP=2 and as TP=2 (rollout TP=2), medians of
  ``timing/*`` from its metrics.jsonl after the first iteration. TRL is not run here (its
  multi-process PPO is a different program, accelerate's), so this axis has no ratio.

Rows of the first three axes come from ``ppo_vs_trl.run_pair`` (alternating workers, the
same checkpoints and settings). The exponent of an axis is the slope of log(iteration
time) against log(axis value) between its first and last point: 1 is linear growth.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ppo_vs_trl as pv  # noqa: E402
from common import ROOT, SIZES, child_env, machine  # noqa: E402

PHASES = ("generation", "experience", "training")


def params_of(size: str) -> int:
    """Parameter count of the policy (HF Llama, untied head)."""
    s = SIZES[size]
    h, f, v, n = s["hidden"], s["ffn"], s["vocab"], s["layers"]
    kv = h // s["heads"] * s["kv_heads"]
    layer = h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h
    return n * layer + 2 * v * h + h


def compared(size: str, batch: int, response: int, iterations: int, warmup: int) -> dict:
    pv.configure(batch, response)
    folder = tempfile.mkdtemp(prefix=f"scaling_{size}_{batch}_{response}_")
    out = pv.run_pair(size, "fixed", iterations, warmup, folder, ("megarlhf", "trl-nogc"))
    return out["medians"]


def cli_run(procs: int, layout: list[str], iterations: int) -> dict:
    """The CLI's PPO on the base shape; medians of its per-iteration timings."""
    pv.configure(16, 32)
    folder = tempfile.mkdtemp(prefix=f"scaling_cli_{procs}_")
    pv.prepare("small", "fixed", folder)
    overrides = [o for o in pv.megarlhf_overrides(folder, "fixed")
                 if not o.startswith(("run.num_threads", "ppo.num_iterations"))]
    overrides += [f"run.num_threads={2 // procs}", f"ppo.num_iterations={iterations + 1}",
                  "checkpoint.save_interval=0", "ppo.eval_interval=1000",
                  "logging.sample_table_interval=0", *layout]
    if procs > 1 and not any(o.startswith("parallel.tensor") for o in layout):
        overrides.append(f"ppo.micro_batch_size={16 // 2 // procs}")  # DP ranks split each
    launcher = ["-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={procs}"] if procs > 1 else []
    cmd = [sys.executable, *launcher, "-m", "megarlhf.cli", "ppo",
           os.path.join(folder, "policy_mrl", "config.yaml"), *overrides]
    env = {**child_env(), "OMP_NUM_THREADS": str(2 // procs)}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"megarlhf ppo ({procs} processes) failed:\n{proc.stderr[-4000:]}")
    (metrics,) = glob.glob(os.path.join(folder, "run_megarlhf", "**", "metrics.jsonl"),
                           recursive=True)
    rows = [json.loads(line) for line in open(metrics)]
    rows = [r for r in rows if "timing/iteration" in r and r.get("step", 0) > 1]
    med = lambda key: statistics.median(r.get(key, 0.0) for r in rows)  # noqa: E731
    return {"generation": med("timing/rollout"),
            "experience": med("timing/experience") + med("timing/reward"),
            "training": med("timing/train"), "iteration": med("timing/iteration")}


def exponent(x0: float, t0: float, x1: float, t1: float) -> float:
    return math.log(t1 / t0) / math.log(x1 / x0)


def table(axis: str, points: list[tuple[str, float, dict]], with_trl: bool) -> None:
    print(f"\n### {axis}")
    head = "| value | generation s | experience s | training s | iteration s |"
    if with_trl:
        head += " TRL-nogc iteration s | megarlhf vs TRL-nogc |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for label, _, med in points:
        ours = med["megarlhf"] if with_trl else med
        line = (f"| {label} | " + " | ".join(f"{ours[p]:.3f}" for p in PHASES)
                + f" | {ours['iteration']:.3f} |")
        if with_trl:
            trl = med["trl-nogc"]
            line += f" {trl['iteration']:.3f} | {trl['iteration'] / ours['iteration']:.2f}x |"
        print(line)
    if len(points) > 1 and points[0][1] != points[-1][1]:
        (_, x0, m0), (_, x1, m1) = points[0], points[-1]
        pick = (lambda m: m["megarlhf"]) if with_trl else (lambda m: m)
        parts = [f"iteration {exponent(x0, pick(m0)['iteration'], x1, pick(m1)['iteration']):.2f}"]
        parts += [f"{p} {exponent(x0, pick(m0)[p], x1, pick(m1)[p]):.2f}" for p in PHASES]
        if with_trl:
            parts.append("TRL-nogc iteration "
                         f"{exponent(x0, m0['trl-nogc']['iteration'], x1, m1['trl-nogc']['iteration']):.2f}")
        print("\ngrowth exponent (megarlhf): " + ", ".join(parts))
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--axes", nargs="+", default=["size", "response", "batch", "processes"],
                        choices=["size", "response", "batch", "processes"])
    args = parser.parse_args()
    it, wu = args.iterations, args.warmup
    print(f"# PPO iteration scaling, base: small, response 32, batch 16, 1 process, fp32, "
          f"4 epochs x 2 mini-batches; median of {it} iterations after {wu} warm-up; "
          f"{machine()}")
    if "size" in args.axes:
        table("model size (policy parameters)",
              [(f"{size} ({params_of(size) / 1e6:.1f} M)", params_of(size),
                compared(size, 16, 32, it, wu)) for size in ("tiny", "small", "medium")], True)
    if "response" in args.axes:
        table("response length (tokens)",
              [(str(n), n, compared("small", 16, n, it, wu)) for n in (32, 128, 256)], True)
    if "batch" in args.axes:
        table("rollout batch", [(str(b), b, compared("small", b, 32, it, wu)) for b in (16, 64)],
              True)
    if "processes" in args.axes:
        runs = [("1 process", 1, cli_run(1, [], it + wu)),
                ("2 processes, DP=2", 2, cli_run(2, [], it + wu)),
                ("2 processes, TP=2", 2, cli_run(2, ["parallel.tensor_model_parallel_size=2",
                                                     "rollout.tensor_parallel_size=2"], it + wu))]
        table("processes (megarlhf ppo CLI; 2 cores in all)", runs[:2], False)
        table("processes, tensor parallel", [runs[0], runs[2]], False)


if __name__ == "__main__":
    main()
