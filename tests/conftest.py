"""Shared test helpers: launching real multi-process gloo jobs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script_or_args, nprocs: int, *args: str, timeout: int = 600,
             env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``script`` (a path) or a megarlhf CLI argv (a list) under torchrun, with a
    standalone rendezvous: the port is the OS's pick when torchrun binds it, and the
    rendezvous id is the job's own. (A port chosen here before torchrun bound it could be
    taken by a concurrent job in between, seen with two pytest workers - and a worker
    could then join the other job's rendezvous.) A start that still fails with EADDRINUSE
    is retried, at most three times."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
                **(env or {})}
    for _ in range(3):
        base = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}",
                "--standalone"]
        if isinstance(script_or_args, list):
            cmd = base + ["-m", "megarlhf.cli", *script_or_args, *args]
        else:
            cmd = base + [script_or_args, *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=full_env, cwd=ROOT)
        if proc.returncode == 0 or "EADDRINUSE" not in proc.stderr:
            break
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def run_cli(*argv: str, check: bool = True, timeout: int = 600,
            env: dict | None = None) -> subprocess.CompletedProcess:
    """The real CLI in a subprocess (single process)."""
    proc = subprocess.run([sys.executable, "-m", "megarlhf.cli", *argv], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"megarlhf {' '.join(argv)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """The synthetic task, a tiny SFT policy with checkpoints at steps 3 and 6 and a tiny
    reward model: (folder, task files, the CLI arguments every run shares).

    ``MEGARLHF_TINY_DIR`` names a folder to keep them in and reuse when complete:
    tests/mutants.py builds them once with the unmutated code and every mutant's run
    reads them (nothing writes into them after they are complete)."""
    from pathlib import Path

    from megarlhf.data.synthetic import write_task

    keep = os.environ.get("MEGARLHF_TINY_DIR")
    out = Path(keep) if keep else tmp_path_factory.mktemp("tiny")
    done = out / "COMPLETE"
    if keep and done.exists():
        return out, json.loads(done.read_text()), tiny_common(out, json.loads(done.read_text()))
    task = write_task(str(out / "task"), seed=0)
    common = tiny_common(out, task)
    run_cli("sft", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}",
            "train.max_steps=6", "checkpoint.save_interval=3", "checkpoint.keep_last=2", *common)
    run_cli("rm", "configs/rm_tiny.yaml", f"data.train_path={task['prefs']}",
            "train.max_steps=6", "checkpoint.save_interval=0", *common)
    if keep:
        done.write_text(json.dumps(task))
    return out, task, common


def tiny_common(out, task) -> list[str]:
    return [f"tokenizer.path={task['tokenizer']}", f"run.output_dir={out}",
            "logging.progress_bar=false", "logging.tensorboard=false"]
