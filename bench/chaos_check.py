"""What a chaos soak (``bench/chaos.py``, ``bench/chaos_cluster.py``) reads back from its
runs - the steps logged, the last checkpoint - and the comparison of a run hit by faults
with the same run left alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
TIMING_DEPENDENT = ("ppo-partial",)


def cli(*argv, env=None):
    return subprocess.run([PY, "-m", "megarlhf.cli", *argv], cwd=ROOT, check=True,
                          capture_output=True, text=True, env=env)


def steps(run_dir: str) -> list[int]:
    from megarlhf.engine.metrics import read_metrics
    path = os.path.join(run_dir, "metrics.jsonl")
    return [r["step"] for r in read_metrics(run_dir)] if os.path.exists(path) else []


def latest(run_dir: str) -> int:
    path = os.path.join(run_dir, "checkpoints", "latest")
    return int(open(path).read().split("_")[1]) if os.path.exists(path) else 0


def compare(stage: str, out: str, task: dict, role: str, n: int, lost: list, log: list,
            kinds: tuple, hits: dict, ref_seconds: float, chaos_seconds: float) -> dict:
    """The runs ``out/<stage>-reference`` and ``out/<stage>-chaos`` side by side: every
    step's metrics (or, timing-dependent, the invariants) and the final weights."""
    from megarlhf.engine.metrics import read_metrics

    ref_dir, run = os.path.join(out, f"{stage}-reference"), os.path.join(out, f"{stage}-chaos")
    ref = {r["step"]: r for r in read_metrics(ref_dir)}
    got = {r["step"]: r for r in read_metrics(run)}
    same_steps = sorted(ref) == sorted(got)
    if stage in TIMING_DEPENDENT:  # invariants, not equality
        diffs = [(s, key) for s, row in got.items() for key, value in row.items()
                 if isinstance(value, float) and (value != value or abs(value) == float("inf"))]
        diffs += [(s, "rollout/partial_tokens") for s, row in got.items()
                  if not 0.0 <= row.get("rollout/partial_tokens", 0.0) <= 1.0]
        diffs += [("logged more than once", s) for s in got
                  if [r["step"] for r in read_metrics(run)].count(s) > 1]
    else:
        diffs = [(s, key) for s in ref for key, value in ref[s].items()
                 if not key.startswith(("timing/", "perf/")) and got.get(s, {}).get(key) != value]
    same_weights = True
    if role and stage not in TIMING_DEPENDENT:
        seqs = os.path.join(out, "seqs.jsonl")
        with open(seqs, "w") as f:
            for tokens in ([3, 7, 9, 11, 4], [5, 6, 7, 8]):
                f.write(json.dumps({"tokens": tokens}) + "\n")
        scores = []
        for name in (f"{stage}-reference", f"{stage}-chaos"):
            for r in ([role, "ema"] if role == "actor" else [role]):
                dest = os.path.join(out, f"score_{name}_{r}.jsonl")
                cli("score", "--config", "configs/demo/tool_sft.yaml" if stage == "ppo-env"
                    else "configs/sft_tiny.yaml", "--input", seqs, "--output",
                    dest, "--ckpt-role", r, f"checkpoint.load={out}/{name}/checkpoints",
                    f"tokenizer.path={(task['tool'] if stage == 'ppo-env' else task)['tokenizer']}")
                scores.append(open(dest).read())
        half = len(scores) // 2
        same_weights = scores[:half] == scores[half:]
    ok = same_steps and not diffs and same_weights and max(lost, default=0) <= 1
    return {"stage": stage, "faults": len(lost), "lost": lost, "log": log, "ok": ok,
            "kinds": kinds, "hits": hits,
            "same_steps": same_steps, "diffs": diffs[:5], "n_diffs": len(diffs),
            "same_weights": same_weights, "ref_seconds": ref_seconds,
            "chaos_seconds": chaos_seconds, "steps": n}
