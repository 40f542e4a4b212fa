"""A reward function's worker process (``rewards.verifiers``): imports
``package.module:function`` (argv[1]), says it is ready, then reads one JSON line per batch
of [prompt, response] pairs from stdin and writes one JSON line per call as it finishes:
``{"value": x}`` (the function's number, NaN included: the caller judges it) or
``{"error": "..."}``. stdout carries only this protocol: the function's own prints go to
stderr, which the trainer's is."""

from __future__ import annotations

import importlib
import json
import numbers
import signal
import sys


def start():
    """A worker's start: the trainer's signals ignored, the callable ``package.module:name``
    of argv[1] imported, "ready" said. Returns (the callable, the protocol's stream: stdout,
    which from now on carries nothing else - prints go to stderr)."""
    # The trainer's signals are the trainer's: a preemption (SIGUSR1 / SIGTERM, which
    # Slurm sends to every process of a step), Ctrl-C. This process ends when the trainer
    # closes its stdin, or kills it.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    module, name = sys.argv[1].split(":", 1)
    out = sys.stdout
    sys.stdout = sys.stderr
    fn = getattr(importlib.import_module(module), name)
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    return fn, out


def main() -> int:
    fn, out = start()
    for line in sys.stdin:
        for prompt, response in json.loads(line):
            try:
                value = fn(prompt, response)
                if isinstance(value, bool) or not isinstance(value, numbers.Real):
                    msg = {"error": f"returned {type(value).__name__} {str(value)[:80]!r}, "
                                    "not a number"}
                else:
                    msg = {"value": float(value)}
            except Exception as err:  # the function's, reported for this call
                msg = {"error": f"raised {type(err).__name__}: {str(err)[:200]}"}
            out.write(json.dumps(msg) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
