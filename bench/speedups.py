"""What each speed-up is worth: the PPO iteration of bench/ppo_vs_trl.py (same models, same
settings) with every speed-up on, with all off, and with each one off in turn, in one
invocation, rows alternating round by round, medians.

    .venv/bin/python bench/speedups.py --size medium [--iterations 3] [--warmup 1]
        [--only linears rope ...] [--variant fixed]

A row's ``MEGARLHF_SPEEDUPS`` is ``1`` (all), ``0`` (none) or ``-NAME`` (all but NAME).
The gain of NAME is time(all but NAME) / time(all) - 1, per phase and for the iteration,
also round by round (rows of one round run back to back). Start-up speed-ups are timed on
a process start: ``--startup`` times the worker's import and session build instead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ppo_vs_trl as bench  # noqa: E402
from common import ROOT, SIZES, machine  # noqa: E402

PHASES = ("generation", "experience", "training", "iteration")


def names() -> list[str]:
    from megarlhf import speedups
    return list(speedups.NAMES)


class Row:
    def __init__(self, label: str, setting: str, folder: str, variant: str, log):
        cmd = [sys.executable, os.path.join(ROOT, "bench", "ppo_vs_trl.py"), "--worker",
               "megarlhf", "--folder", folder, "--variant", variant, "--batch",
               str(bench.BATCH), "--response", str(bench.RESPONSE)]
        env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false",
               "MEGARLHF_SPEEDUPS": setting,
               "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.label, self.start = label, time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=log, text=True, env=env, cwd=ROOT)

    def receive(self):
        for line in self.proc.stdout:
            if line.startswith(bench.TAG):
                return json.loads(line[len(bench.TAG):])
        raise RuntimeError(f"row {self.label} exited (rc {self.proc.wait()})")

    def command(self, word: str) -> None:
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=list(SIZES), default="medium")
    parser.add_argument("--variant", choices=["fixed", "stop"], default="fixed")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--only", nargs="*", default=None, help="speed-ups to turn off")
    parser.add_argument("--group", type=int, default=3,
                        help="rows beside 'all' at a time (memory: about 2 GB a row at medium)")
    parser.add_argument("--startup", action="store_true",
                        help="time each row's start (imports + session build), 3 starts")
    parser.add_argument("--startup-worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.startup_worker:
        return startup_worker(*args.startup_worker)
    offs = args.only if args.only is not None else names()
    rows = {"all": "1", "none": "0", **{f"-{n}": f"-{n}" for n in offs}}
    folder = tempfile.mkdtemp(prefix=f"speedups_{args.size}_")
    info = bench.prepare(args.size, args.variant, folder)
    print(f"# speed-ups at {args.size} ({info['note']}); {machine()}")
    log = open(os.path.join(folder, "workers.log"), "w")
    if args.startup:
        startup(rows, folder, args)
        return
    # Every row holds four roles and their optimizers (about 2 GB at medium): rows run in
    # groups of --group, each with its own "all" row to compare with.
    labels = [label for label in rows if label != "all"]
    groups = [labels[i:i + args.group] for i in range(0, len(labels), args.group)]
    print(f"{'row':>22} " + " ".join(f"{p:>11}" for p in PHASES)
          + "   gain of the speed-up (iteration; per round median, range)")
    for group in groups:
        chosen = {"all": rows["all"], **{label: rows[label] for label in group}}
        results = run_group(chosen, folder, args, log)
        med = {label: {p: statistics.median(r[p] for r in rs) for p in PHASES}
               for label, rs in results.items()}
        for label in chosen:
            m = med[label]
            line = f"{label:>22} " + " ".join(f"{m[p]:>11.3f}" for p in PHASES)
            if label != "all":
                paired = sorted(a["iteration"] / b["iteration"] - 1
                                for a, b in zip(results[label], results["all"], strict=True))
                line += (f"   {m['iteration'] / med['all']['iteration'] - 1:+6.1%}; "
                         f"{statistics.median(paired):+6.1%} "
                         f"({paired[0]:+.1%}..{paired[-1]:+.1%})")
            print(line, flush=True)


def startup(rows: dict, folder: str, args) -> None:
    """Each row's start in a fresh process, three times, alternating: the whole process
    (interpreter, imports - bench/common installs the speed-ups first, as the CLI does -
    the PPO session's build with four roles from their checkpoints, its first checkpoint
    save), and the build and the save alone."""
    times = {label: [] for label in rows}
    for _ in range(3):
        for label, setting in rows.items():
            env = {**os.environ, "OMP_NUM_THREADS": "2", "MEGARLHF_SPEEDUPS": setting,
                   "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
            start = time.perf_counter()
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--startup-worker",
                                  folder, args.variant], env=env, cwd=ROOT, check=True,
                                 capture_output=True, text=True).stdout
            wall = time.perf_counter() - start
            times[label].append({**json.loads(out.strip().splitlines()[-1]), "process": wall})
    med = {label: {k: statistics.median(t[k] for t in ts) for k in ts[0]}
           for label, ts in times.items()}
    print(f"{'row':>22} {'build':>8} {'save':>8} {'process':>8}   vs all  (process: launch "
          "to exit, imports included)")
    for label, m in med.items():
        print(f"{label:>22} {m['build']:>8.2f} {m['save']:>8.2f} {m['process']:>8.2f}   "
              f"{m['process'] / med['all']['process'] - 1:+6.1%}", flush=True)


def startup_worker(folder: str, variant: str) -> None:
    start = time.perf_counter()
    from megarlhf.config import load_config
    from megarlhf.data.tokenizer import load_tokenizer
    from megarlhf.engine.checkpoint import save_checkpoint
    from megarlhf.ppo.session import PPOSession
    imported = time.perf_counter()
    cfg = load_config(os.path.join(folder, "policy_mrl/config.yaml"),
                      bench.megarlhf_overrides(folder, variant))
    session = PPOSession(cfg, load_tokenizer(cfg.tokenizer))
    built = time.perf_counter()
    save_checkpoint(tempfile.mkdtemp(prefix="startup_save_"), "iter_000000", session.roles)
    saved = time.perf_counter()
    print(json.dumps({"imports": imported - start, "build": built - imported,
                      "save": saved - built, "total": saved - start}))


def run_group(rows: dict, folder: str, args, log) -> dict:
    live = {label: Row(label, setting, folder, args.variant, log)
            for label, setting in rows.items()}
    for row in live.values():
        assert row.receive() == "ready"
    results = {label: [] for label in rows}
    for it in range(args.warmup + args.iterations):
        for label, row in live.items():
            time.sleep(0.5)
            row.command("go")
            out = row.receive()
            if it >= args.warmup:
                results[label].append(out)
    for row in live.values():
        row.command("stop")
        row.proc.wait(timeout=120)
    return results


if __name__ == "__main__":
    main()
