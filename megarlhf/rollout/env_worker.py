"""An environment's worker process (``rollout.environments``): imports the environment
``package.module:Name`` (argv[1]), says it is ready, then reads one JSON line per batch of
calls ``{"episode", "op", "arg"}`` from stdin and writes one JSON line per call as it
finishes: ``{"value": ...}`` or ``{"error": "..."}``. ``reset`` makes the episode's
environment and answers ``{"messages", "tools"}``; ``step`` answers the environment's
``[observation, reward, done]`` (the caller checks it); ``close`` drops the episode. stdout
carries only this protocol: the environment's own prints go to stderr."""

from __future__ import annotations

import importlib
import json
import signal
import sys


def main() -> int:
    # the trainer's signals are the trainer's (see verifier_worker)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    module, name = sys.argv[1].split(":", 1)
    out = sys.stdout
    sys.stdout = sys.stderr
    factory = getattr(importlib.import_module(module), name)
    envs: dict = {}
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        for call in json.loads(line):
            episode, op = call["episode"], call["op"]
            try:
                if op == "reset":
                    env = envs[episode] = factory()
                    value = {"messages": env.reset(call["arg"]),
                             "tools": getattr(env, "tools", None)}
                elif op == "step":
                    value = envs[episode].step(call["arg"])
                else:
                    envs.pop(episode, None)
                    value = None
                text = json.dumps({"value": value})
            except Exception as err:  # the environment's, reported for this call
                text = json.dumps({"error": f"{op}() raised {type(err).__name__}: "
                                            f"{str(err)[:200]}"})
            out.write(text + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
