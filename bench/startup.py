"""Start-up cost of a CLI command: the same short SFT run (2 steps, a checkpoint at the end)
and the bare imports, for this checkout and optionally another one (``--baseline DIR``, a
``git worktree`` of an older commit), alternating, medians of wall seconds.

    .venv/bin/python bench/startup.py --baseline /tmp/old --repeats 5

Every test and every user command pays this once per process (twice per torchrun rank
pair), so it is most of a short run's time."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, machine  # noqa: E402

IMPORTS = ("import megarlhf, torch, megatron.core.models.gpt, megatron.core.optimizer, "
           "megatron.core.dist_checkpointing")


def wall(argv: list[str], tree: str) -> float:
    env = {**os.environ, "PYTHONPATH": tree, "PYTHONWARNINGS": "ignore",
           "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    subprocess.run(argv, cwd=tree, env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="another checkout to compare with")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    trees = {"this": ROOT, **({"baseline": os.path.abspath(args.baseline)}
                              if args.baseline else {})}
    work = tempfile.mkdtemp(prefix="startup-")
    sys.path.insert(0, ROOT)
    from megarlhf.data.synthetic import write_task

    task = write_task(os.path.join(work, "task"), seed=0)
    times: dict[tuple[str, str], list[float]] = {}
    for i in range(args.repeats):
        for name, tree in trees.items():
            sft = [sys.executable, "-m", "megarlhf.cli", "sft", "configs/sft_tiny.yaml",
                   f"tokenizer.path={task['tokenizer']}", f"data.train_path={task['sft']}",
                   f"run.output_dir={work}", f"run.name={name}-{i}", "train.max_steps=2",
                   "logging.progress_bar=false", "logging.tensorboard=false"]
            times.setdefault((name, "imports"), []).append(
                wall([sys.executable, "-c", IMPORTS], tree))
            times.setdefault((name, "sft, 2 steps + save"), []).append(wall(sft, tree))
    print(f"# {machine()}; medians of {args.repeats}, alternating")
    for what in ("imports", "sft, 2 steps + save"):
        row = {name: statistics.median(times[name, what]) for name in trees}
        ratio = f"  ({row['baseline'] / row['this']:.2f}x)" if "baseline" in row else ""
        print(f"{what:22s} " + "  ".join(f"{n}: {t:5.2f} s" for n, t in row.items()) + ratio)


if __name__ == "__main__":
    main()
