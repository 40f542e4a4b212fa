"""Shared test helpers: launching real multi-process gloo jobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")


class CommandFailed(Exception):
    """A command a test ran exited non-zero when it had to succeed. Not an
    AssertionError: tests/mutants.py counts a mutant as killed only when a test's own
    check fails, and a command that crashed is reported as a crash."""


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
        raise CommandFailed(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                            f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def run_cli(*argv: str, check: bool = True, timeout: int = 600,
            env: dict | None = None) -> subprocess.CompletedProcess:
    """The real CLI, single process: forked from this worker's CLI server
    (tests/cli_server.py: the imports done once) when the run's environment selects the
    server's speed-ups; a new interpreter otherwise, or everywhere with
    ``MEGARLHF_TEST_FORK=0``."""
    full_env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    server = _cli_server() if _forkable(full_env) else None
    for _ in range(3):  # a single process picks its rendezvous port before it binds it: a
        # concurrent job can take it in between (EADDRINUSE, seen once); start again
        if server is None:
            proc = subprocess.run([sys.executable, "-m", "megarlhf.cli", *argv],
                                  capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                                  env=full_env)
        else:
            proc = server.run(list(argv), full_env, timeout)
        if proc.returncode == 0 or "EADDRINUSE" not in proc.stderr:
            break
    if check and proc.returncode != 0:
        raise CommandFailed(f"megarlhf {' '.join(argv)} failed ({proc.returncode}):\n"
                            f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def _forkable(env: dict) -> bool:
    """Whether a CLI run may fork from the server. Not on a CUDA machine: the server's
    imports (TransformerEngine's, there) initialise CUDA, which a forked child cannot use
    ("Cannot re-initialize CUDA in forked subprocess", seen on the H200 with TE)."""
    return os.environ.get("MEGARLHF_TEST_FORK", "1") != "0" and \
        env.get("MEGARLHF_SPEEDUPS", "1") == os.environ.get("MEGARLHF_SPEEDUPS", "1") and \
        not torch.cuda.is_available()


class _CLIServer:
    """This process's tests/cli_server.py, started on first use."""

    def __init__(self):
        import tempfile
        self.folder = tempfile.mkdtemp(prefix="megarlhf-cli-")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tests", "cli_server.py")], cwd=ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"})  # threads as a new interpreter's
        assert "ready" in json.loads(self.proc.stdout.readline() or "{}"), \
            "tests/cli_server.py did not start"

    def run(self, argv: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
        import select
        out, err = os.path.join(self.folder, "out"), os.path.join(self.folder, "err")
        self.proc.stdin.write(json.dumps({"argv": argv, "env": env, "cwd": ROOT, "out": out,
                                          "err": err}) + "\n")
        self.proc.stdin.flush()
        pid = json.loads(self.proc.stdout.readline())["pid"]
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            os.kill(pid, 9)
            self.proc.stdout.readline()
            raise subprocess.TimeoutExpired(["megarlhf", *argv], timeout)
        code = json.loads(self.proc.stdout.readline())["code"]
        read = lambda path: open(path, errors="replace").read()  # noqa: E731
        return subprocess.CompletedProcess(["megarlhf", *argv], code, read(out), read(err))


_server: list = []


def _cli_server() -> _CLIServer | None:
    if not _server:
        try:
            _server.append(_CLIServer())
        except (AssertionError, OSError, ValueError):
            _server.append(None)
    return _server[0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each failure labelled with what failed: ``check`` when the test's own check did (an
    assertion, ``pytest.fail``), ``crash`` when anything else raised (the code under test,
    a command that exited non-zero, a fixture, a time-out). tests/mutants.py counts only
    checks as kills."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.excinfo is not None:
        excinfo = call.excinfo
        timed_out = "Timeout" in str(excinfo.value)[:40]
        check = (report.when == "call" and not timed_out
                 and excinfo.errisinstance((AssertionError, pytest.fail.Exception))
                 and not excinfo.errisinstance(CommandFailed))
        report.user_properties.append(("failure", "check" if check else "crash"))


def outcomes(terminalreporter) -> dict[str, str]:
    """Each test's outcome: passed, skipped, check (failed its own check) or crash."""
    out: dict[str, str] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            when = getattr(report, "when", None)
            if when not in ("setup", "call", "teardown"):
                continue
            if report.failed:
                out[report.nodeid] = dict(report.user_properties).get("failure", "crash")
            elif report.skipped:
                out.setdefault(report.nodeid, "skipped")
            elif when == "call":
                out.setdefault(report.nodeid, "passed")
    return out


def pytest_terminal_summary(terminalreporter):
    """Each test's outcome to the file ``MEGARLHF_OUTCOMES`` names (tests/mutants.py reads
    the suite's, and its own runs'), then the seconds per test file."""
    path = os.environ.get("MEGARLHF_OUTCOMES")
    if path:
        with open(path + ".tmp", "w") as f:
            json.dump(outcomes(terminalreporter), f, indent=0, sort_keys=True)
        os.replace(path + ".tmp", path)
    seconds_per_file(terminalreporter)


def seconds_per_file(terminalreporter):
    """Seconds per test file (set-up, call and tear-down of its tests, module fixtures
    included), slowest first, so a file that grows shows in every run's output."""
    per_file: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) in ("setup", "call", "teardown"):
                path = report.nodeid.split("::")[0]
                per_file[path] = per_file.get(path, 0.0) + report.duration
    if not per_file:
        return
    terminalreporter.section("seconds per test file")
    for path, seconds in sorted(per_file.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:7.1f} s  {path}")
    terminalreporter.write_line(f"{sum(per_file.values()):7.1f} s  in all (summed over "
                                "the workers; the wall time is less)")


# The slowest test files (seconds on 2 cores, the fresh-clone fast tier of 2026-11-28):
# run first, so that the two workers (``--dist loadfile``) do not end on one long file.
SLOW_FILES = {"test_run_guards.py": 130, "test_convert.py": 118, "test_moe.py": 109,
              "test_walkthrough.py": 101, "test_engine.py": 96, "test_ppo_modes.py": 96,
              "test_ppo_reference.py": 84, "test_packing.py": 82, "test_layouts.py": 73,
              "test_async.py": 71, "test_memory.py": 69, "test_multiturn.py": 59,
              "test_speedups.py": 50, "test_recompute.py": 20}


def pytest_collection_modifyitems(config, items):
    # longest files first, each file's tests in their own order (a stable sort)
    items.sort(key=lambda item: -SLOW_FILES.get(os.path.basename(item.nodeid.split("::")[0]),
                                                0))
    collected = os.environ.get("MEGARLHF_COLLECTED")  # tests/test_suite_lists.py
    if collected:
        with open(collected, "w") as f:
            json.dump({item.nodeid: item.get_closest_marker("extended") is not None
                       for item in items}, f)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tool_sft(tmp_path_factory):
    """The tool task (``megarlhf.data.tool_task``: tokenizer with a ChatML template, SFT
    conversations, rows) and a tiny SFT policy trained on it for 120 steps, which calls the
    lookup tool some of the time: {"tmp": the folder, "files": the task's files,
    "checkpoints": the SFT run's checkpoints}. One per test worker, shared by
    test_multiturn, test_agents and test_judge (their runs' folder names differ)."""
    from megarlhf.data.tool_task import write_tool_task

    tmp = tmp_path_factory.mktemp("tool_task")
    files = write_tool_task(str(tmp / "task"), seed=0, num_sft=512)
    run_cli("sft", "configs/demo/tool_sft.yaml", f"tokenizer.path={files['tokenizer']}",
            f"data.train_path={files['sft']}", f"run.output_dir={tmp}",
            "checkpoint.resume=false", "logging.progress_bar=false", "train.max_steps=120")
    return {"tmp": tmp, "files": files, "checkpoints": str(tmp / "tool-sft" / "checkpoints")}


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """The synthetic task, a tiny SFT policy with checkpoints at steps 3 and 6 and a tiny
    reward model: (folder, task files, the CLI arguments every run shares).

    ``MEGARLHF_TINY_DIR`` names a folder to keep them in and reuse when complete:
    tests/mutants.py builds them once with the unmutated code (:func:`build_tiny`) and
    every mutant's run reads them (nothing writes into them after they are complete)."""
    from pathlib import Path

    keep = os.environ.get("MEGARLHF_TINY_DIR")
    out = Path(keep) if keep else tmp_path_factory.mktemp("tiny")
    task = build_tiny(out, keep=bool(keep))
    return out, task, tiny_common(out, task)


def build_tiny(out, keep: bool = True) -> dict:
    """Write the synthetic task and train the tiny SFT policy and reward model into
    ``out``; with ``keep``, a folder already complete is reused. Returns the task's files."""
    from pathlib import Path

    from megarlhf.data.synthetic import write_task

    out = Path(out)
    done = out / "COMPLETE"
    if keep and done.exists():
        return json.loads(done.read_text())
    task = write_task(str(out / "task"), seed=0)
    common = tiny_common(out, task)
    run_cli("sft", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}",
            "train.max_steps=6", "checkpoint.save_interval=3", "checkpoint.keep_last=2", *common)
    run_cli("rm", "configs/rm_tiny.yaml", f"data.train_path={task['prefs']}",
            "train.max_steps=6", "checkpoint.save_interval=0", *common)
    if keep:
        done.write_text(json.dumps(task))
    return task


def tiny_hf(out, step: int):
    """The tiny SFT policy's checkpoint at ``step`` converted to Hugging Face, once per
    folder (``out/hf-step<step>``): the folder of the converted model."""
    dest = os.path.join(str(out), f"hf-step{step}")
    if not os.path.exists(dest):
        tmp = os.path.join(str(out), f".hf-step{step}-{os.getpid()}")
        subprocess.run([sys.executable, "tools/convert_megatron_to_hf.py", "--config",
                        "configs/sft_tiny.yaml", "--out", tmp, "--ckpt",
                        f"{out}/sft-tiny/checkpoints/step_{step:07d}"],
                       check=True, capture_output=True, cwd=ROOT)
        os.replace(tmp, dest)
    return dest


def tiny_common(out, task) -> list[str]:
    return [f"tokenizer.path={task['tokenizer']}", f"run.output_dir={out}",
            "logging.progress_bar=false", "logging.tensorboard=false"]


def tiny_ppo_args(tiny, runs, name, *extra) -> list[str]:
    """A two-iteration PPO command on the tiny task (the SFT policy at step 6 and the reward
    model), its run in ``runs`` (never the shared tiny folder, which a resumed run would read
    back); later overrides in ``extra`` win."""
    out, task, common = tiny
    return ["ppo", "configs/demo/ppo.yaml", f"data.train_path={task['prompts']}",
            f"data.eval_path={task['eval_prompts']}",
            f"ppo.sft_checkpoint={out}/sft-tiny/checkpoints/step_0000006",
            f"ppo.reward_checkpoint={out}/rm-tiny/checkpoints", "ppo.num_iterations=2",
            "ppo.eval_interval=2", "ppo.num_eval_prompts=8", "checkpoint.save_interval=0",
            "run.deterministic=true", f"run.name={name}", *common, f"run.output_dir={runs}",
            *extra]


def checkpoint_tensors(path) -> dict:
    """Every tensor of one megarlhf checkpoint folder, whole, by its sharded key."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
             for k, v in meta.items() if hasattr(v, "chunks")}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state
