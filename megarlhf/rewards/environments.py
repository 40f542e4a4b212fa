"""Environments (``rollout.environment.name``): the user's code, hosted.

An environment is a class (or any callable making one) named ``package.module:Name``;
the rollout makes one per episode::

    class Lookup:
        tools = [...]                     # optional: JSON schemas the chat template renders
        def reset(self, row: dict) -> list[dict]:
            ...                           # the first messages (the data row's columns in)
        def step(self, turn: dict) -> tuple[list[dict], float, bool]:
            ...                           # (observation messages, reward, done)

``turn`` is ``{"text", "tool_calls", "index"}``: the model's turn decoded without its stop
token, the calls read from it in ``rollout.environment.tool_format`` (``[{"name",
"arguments"}]``, empty without a format) and its number from 0. The observation is a list of ``tool`` (or
``user``) messages, empty when ``done``.

**Where it runs.** TP rank 0 of each inference replica runs its share's episodes - in
``rollout.rewards.workers`` worker processes (an episode stays in one; a call silent past
``rollout.rewards.timeout_s`` kills its process, and the episodes held there end as failed),
or in the trainer's process with 0 workers - and hands each step's tokens to its TP peers.
A failed call (an exception, a timeout, a dead process, a malformed result) ends its
episode: ``rollout.rewards.on_error=stop`` stops the run naming the environment, the row
and the error (after the batch, on every rank); ``penalty`` scores it
``rollout.rewards.error_score`` and counts it in ``reward/failed`` / ``reward/timeouts``; a
batch in which no episode reached its first turn stops the run either way (nothing was
sampled to learn from).


The episodes themselves - their tokens, turns and ends - are
:mod:`megarlhf.rollout.episodes`.
"""

from __future__ import annotations

import atexit
import json
import math
import numbers
import select
import time

from megarlhf.data.chat import check_messages
from megarlhf.rewards.env_worker import play
from megarlhf.rewards.verifiers import Failure, _Worker, load_reward_fn

OBSERVATION_ROLES = ("tool", "user", "system")


# ------------------------------------------------------------------ checking what it returns

def check_reset(value, tools_column) -> dict:
    """``reset``'s first messages (and the tools to render) as the rollout takes them."""
    msgs = check_messages(value, "reset() returned", needs_assistant=False)
    return {"messages": msgs, "tools": tools_column}


def check_step(value) -> dict:
    """``step``'s (observation, reward, done), checked."""
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise ValueError(f"step() must return (observation, reward, done), got "
                         f"{type(value).__name__} {str(value)[:80]!r}")
    obs, reward, done = value
    if not isinstance(done, bool):
        raise ValueError(f"step() returned done={done!r}, not a bool")
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) \
            or not math.isfinite(reward):
        raise ValueError(f"step() returned reward {str(reward)[:80]!r}, not a finite number")
    if obs is None or obs == []:
        if not done:
            raise ValueError("step() returned no observation for an episode that goes on")
        obs = []
    else:
        obs = check_messages(obs, "step() observation", needs_assistant=False)
        for msg in obs:
            if msg["role"] not in OBSERVATION_ROLES:
                raise ValueError(f"step() observation: a {msg['role']!r} message (an "
                                 f"observation is {', '.join(OBSERVATION_ROLES)} messages)")
    return {"observation": obs, "reward": float(reward), "done": done}


# ------------------------------------------------------------------ where episodes live

class InProcessEnvs:
    """``rollout.rewards.workers=0``: the episodes' environments in this process."""

    def __init__(self, path: str):
        self.path, self.factory = path, load_reward_fn(path)
        self.envs: dict[int, object] = {}

    def call(self, calls: list[tuple[int, str, object]]) -> list[object]:
        out = []
        for episode, op, arg in calls:
            try:
                out.append(play(self.envs, self.factory, episode, op, arg))
            except Exception as err:  # the environment's: this episode's failure
                out.append(Failure("error", f"{op}() raised {type(err).__name__}: "
                                            f"{str(err)[:200]}"))
        return out

    def close(self) -> None:
        self.envs = {}


class WorkerEnvs:
    """``rollout.rewards.workers`` processes holding the episodes (episode e in process
    e mod N). A call with no answer within ``timeout_s``, or a process that dies, fails
    that call; the process is replaced, and the episodes it held fail at their next call
    (their state went with it)."""

    def __init__(self, path: str, workers: int, timeout_s: float):
        self.path, self.size, self.timeout_s = path, workers, timeout_s
        self.workers: list[_Worker | None] = [None] * workers
        self.epoch = [0] * workers  # bumped when a process is replaced
        self.born: dict[int, int] = {}  # episode -> its process's epoch at reset
        atexit.register(self.close)

    def _worker(self, w: int) -> _Worker:
        if self.workers[w] is None:
            self.workers[w] = _Worker(self.path, max(60.0, self.timeout_s),
                                      module="megarlhf.rewards.env_worker",
                                      what="environment")
        return self.workers[w]

    def _replace(self, w: int) -> None:
        self.workers[w].kill()
        self.workers[w] = None
        self.epoch[w] += 1

    def call(self, calls: list[tuple[int, str, object]]) -> list[object]:
        out: list[object] = [None] * len(calls)
        mine: dict[int, list[int]] = {}
        for i, (episode, op, _) in enumerate(calls):
            w = episode % self.size
            if op == "reset":
                self.born[episode] = self.epoch[w]
            elif self.born.get(episode) != self.epoch[w]:
                out[i] = Failure("error", "its environment's worker process was replaced "
                                          "(another episode's call there failed): the "
                                          "episode's state is gone") if op == "step" else None
                continue
            mine.setdefault(w, []).append(i)
        busy: dict[int, tuple[int, _Worker]] = {}
        for w, idx in mine.items():
            worker = self._worker(w)
            payload = [{"episode": calls[i][0], "op": calls[i][1], "arg": calls[i][2]}
                       for i in idx]
            if not worker.send_payload(idx, payload):  # gone while idle: a fresh one
                self._replace(w)
                for i in idx:
                    out[i] = Failure("error", "its environment's worker process had died: "
                                              "the episode's state is gone")
                continue
            busy[worker.fd] = (w, worker)

        def fail_rest(w: int, worker: _Worker, failure: Failure) -> None:
            out[worker.calls.pop(0)] = failure
            for i in worker.calls:
                out[i] = Failure("error", "its environment's worker process was replaced "
                                          "(another episode's call there failed)")
            worker.calls = []
            self._replace(w)

        while busy:
            wait = min(wk.started + self.timeout_s for _, wk in busy.values()) - time.monotonic()
            ready, _, _ = select.select(list(busy), [], [], max(0.0, wait))
            for fd in ready:
                w, worker = busy[fd]
                lines = worker.lines()
                if lines is None:
                    code = worker.proc.wait()
                    fail_rest(w, worker, Failure("error", f"its worker process died (exit "
                                                          f"code {code}) on this call"))
                    del busy[fd]
                    continue
                for line in lines:
                    msg = json.loads(line)
                    out[worker.calls.pop(0)] = msg["value"] if "value" in msg \
                        else Failure("error", msg["error"])
                    worker.started = time.monotonic()
                if not worker.calls:
                    del busy[fd]
            now = time.monotonic()
            for fd, (w, worker) in list(busy.items()):
                if now - worker.started >= self.timeout_s:
                    fail_rest(w, worker, Failure(
                        "timeout", f"gave no result within rollout.rewards.timeout_s="
                                   f"{self.timeout_s:g}"))
                    del busy[fd]
        return out

    def close(self) -> None:
        for w, worker in enumerate(self.workers):
            if worker is not None:
                worker.kill()
                self.workers[w] = None
