"""An environment's worker process (``rewards.environments``): imports the environment
``package.module:Name`` (argv[1]), says it is ready, then reads one JSON line per batch of
calls ``{"episode", "op", "arg"}`` from stdin and writes one JSON line per call as it
finishes: ``{"value": ...}`` or ``{"error": "..."}``. ``reset`` makes the episode's
environment and answers ``{"messages", "tools"}``; ``step`` answers the environment's
``[observation, reward, done]`` (the caller checks it); ``close`` drops the episode. stdout
carries only this protocol: the environment's own prints go to stderr."""

from __future__ import annotations

import json
import sys

from megarlhf.rewards.verifier_worker import start


def play(envs: dict, factory, episode: int, op: str, arg):
    """One call on the episodes ``envs`` holds: ``reset`` makes the episode's environment
    with ``factory`` and returns {"messages", "tools"}, ``step`` returns what its step
    returns (the caller checks it), ``close`` drops it. Here and in the trainer's process
    (``environments.InProcessEnvs``) alike."""
    if op == "reset":
        env = envs[episode] = factory()
        return {"messages": env.reset(arg), "tools": getattr(env, "tools", None)}
    if op == "step":
        return envs[episode].step(arg)
    envs.pop(episode, None)
    return None


def main() -> int:
    factory, out = start()
    envs: dict = {}
    for line in sys.stdin:
        for call in json.loads(line):
            op = call["op"]
            try:
                text = json.dumps({"value": play(envs, factory, call["episode"], op,
                                                 call["arg"])})
            except Exception as err:  # the environment's, reported for this call
                text = json.dumps({"error": f"{op}() raised {type(err).__name__}: "
                                            f"{str(err)[:200]}"})
            out.write(text + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
