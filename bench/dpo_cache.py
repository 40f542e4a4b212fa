"""DPO with the reference's log-probs from the cache against recomputing them every step,
side by side in one run (alternating, medians): wall time of one epoch and the peak
resident memory of the process.

    .venv/bin/python bench/dpo_cache.py [--size medium] [--repeats 2]

Both configurations train the same policy on the same pairs (the synthetic task's 461
training pairs, one epoch of 28 steps). The reference has the policy's size. "cached" runs
``megarlhf dpo`` on a cache built beforehand by ``megarlhf cache build`` (timed separately:
it is paid once per checkpoint and data); "recompute" runs it with ``dpo.use_cache=false``,
the reference resident and scoring every global batch. The epoch's time is the sum of
the run's ``perf/step_seconds`` (reference scoring included, start-up and evaluation not);
the process's wall time and peak RSS are reported beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, SIZES, child_env, machine  # noqa: E402

# "medium": the reference's weights (fp32) are large enough to show in the process's RSS.
BENCH_SIZES = {**SIZES, "medium": dict(layers=8, hidden=512, heads=8, kv_heads=4, ffn=1376,
                                       vocab=0)}


def run(argv: list[str], threads: int) -> tuple[float, float]:
    """(seconds, peak RSS in MiB) of one CLI run in its own process."""
    env = {**child_env(), "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "megarlhf.cli", *argv], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"megarlhf {' '.join(argv)} failed:\n{proc.stderr.read()[-3000:]}")
    return seconds, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=list(BENCH_SIZES), default="medium")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from megarlhf.data.synthetic import write_task

    out = tempfile.mkdtemp()
    task = write_task(os.path.join(out, "task"), seed=0)
    s = BENCH_SIZES[args.size]  # the vocabulary is the task tokenizer's
    sizes = [f"model.num_layers={s['layers']}", f"model.hidden_size={s['hidden']}",
             f"model.num_attention_heads={s['heads']}", f"model.num_query_groups={s['kv_heads']}",
             f"model.ffn_hidden_size={s['ffn']}"]
    common = [f"tokenizer.path={task['tokenizer']}", f"run.output_dir={out}",
              "logging.progress_bar=false", "logging.tensorboard=false"]
    run(["sft", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}", "train.max_steps=1",
         *sizes, *common], args.threads)
    dpo = ["configs/dpo_tiny.yaml", f"data.train_path={task['prefs']}",
           f"checkpoint.load={out}/sft-tiny/checkpoints", "train.eval_interval=0",
           "data.eval_fraction=0.1", "checkpoint.resume=false", f"cache.path={out}/cache",
           "dpo.gold_reward_fn=null", "dpo.gold_eval_path=null", *common]
    build_s, build_rss = run(["cache", "build", "dpo", *dpo], args.threads)
    times: dict[str, list] = {"cached": [], "recompute": []}
    for r in range(args.repeats):
        for name in (("cached", "recompute") if r % 2 == 0 else ("recompute", "cached")):
            extra = ["dpo.use_cache=false"] if name == "recompute" else []
            wall, rss = run(["dpo", *dpo, f"run.name={name}{r}", *extra], args.threads)
            rows = [json.loads(line) for line in open(os.path.join(out, f"{name}{r}",
                                                                   "metrics.jsonl"))]
            epoch = sum(row["perf/step_seconds"] for row in rows if "perf/step_seconds" in row)
            times[name].append((epoch, rss, wall))
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(f"# DPO epoch (28 steps of 16 pairs, {args.size} policy and reference), "
          f"{args.repeats} alternating runs each, medians; {machine()}, "
          f"OMP_NUM_THREADS={args.threads}")
    print(f"cache build (once): {build_s:.1f} s, peak RSS {build_rss:.0f} MiB")
    for name in ("recompute", "cached"):
        t, rss, wall = med[name]
        print(f"{name:>9}: {t:.1f} s per epoch (28 steps), process wall {wall:.1f} s, "
              f"peak RSS {rss:.0f} MiB   epochs: "
              + ", ".join(f"{x:.1f}" for x, _, _ in times[name]))
    print(f"speed-up {med['recompute'][0] / med['cached'][0]:.2f}x per epoch; peak RSS "
          f"{med['recompute'][1] - med['cached'][1]:+.0f} MiB with the reference resident")


if __name__ == "__main__":
    main()
