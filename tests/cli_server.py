"""A fork server for the tests' single-process CLI runs (tests/conftest.py's ``run_cli``).

Starting ``python -m megarlhf.cli`` costs seconds of imports (torch, megatron-core, the
stages) before the command does anything, and the suite runs the CLI well over a hundred
times. This process imports all of it once - as the CLI does, the speed-ups
``MEGARLHF_SPEEDUPS`` selects before megatron - and then forks one child per request: the
child takes the request's environment, working directory and arguments, writes its stdout
and stderr to the request's files, runs ``megarlhf.cli.main`` and exits with its code. A
child is a fresh copy of a process that has imported modules and run nothing else (no
process group, no thread pool, no random draw), so the command runs as it would in a new
interpreter, minus the imports.

Protocol (one JSON object a line): request ``{"argv", "env", "cwd", "out", "err"}`` on
stdin; the server answers ``{"pid": ...}`` when the child started and ``{"code": ...}``
when it ended. One request at a time; the client kills a child that runs past its time.
"""

from __future__ import annotations

import json
import os
import sys


def preload() -> None:
    from megarlhf import quiet_known_warnings, speedups
    quiet_known_warnings()
    speedups.install()
    import torch  # noqa: F401
    import megatron.core  # noqa: F401

    import megarlhf.cli  # noqa: F401
    from megarlhf.stages import ppo, rm, sft  # noqa: F401


def child(request: dict) -> None:
    """Runs in the forked child: never returns."""
    code = 1
    try:
        out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for entry in reversed(request["env"].get("PYTHONPATH", "").split(os.pathsep)):
            if entry and entry not in sys.path:
                sys.path.insert(0, entry)
        if request["env"].get("PYTHONWARNINGS") == "ignore":
            import warnings
            warnings.simplefilter("ignore")
        threads = request["env"].get("OMP_NUM_THREADS")
        if threads:
            import torch
            torch.set_num_threads(int(threads))
        sys.argv = ["megarlhf", *request["argv"]]
        import megarlhf.cli
        try:
            code = megarlhf.cli.main(request["argv"]) or 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # a crash of the command: its traceback, as Python prints it
        import traceback
        traceback.print_exc()
        code = 1
    finally:
        try:
            import atexit
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main() -> None:
    preload()
    answer = sys.stdout
    print(json.dumps({"ready": os.getpid()}), file=answer, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(request)
        print(json.dumps({"pid": pid}), file=answer, flush=True)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        print(json.dumps({"code": code}), file=answer, flush=True)


if __name__ == "__main__":
    main()
