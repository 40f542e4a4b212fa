"""Programmatic rewards that cannot take the trainer down: a reward function
(``rollout.rewards.fn``, the gold functions of evaluation) in worker processes, or a reward
server (``rollout.rewards.url``).

- **Worker processes** (``rollout.rewards.workers`` N >= 1): N processes, each importing the
  function once (``verifier_worker``), are sent batches of ``rollout.rewards.batch``
  (prompt, response) pairs and answer call by call. A call with no answer within
  ``rollout.rewards.timeout_s`` is a timeout: its process is killed and replaced, and the
  rest of its batch goes on in another. A process that dies (a segfault, ``os._exit``)
  fails the call it was on, likewise. N = 0 calls the function in the trainer's process:
  no timeout, and a crash there is the trainer's.
- **A reward server**: batches are POSTed as JSON ``{"prompts": [...], "responses": [...]}``
  and answered with ``{"rewards": [...]}`` (a number per sample; docs/ppo.md). A request
  that fails (refused, an HTTP error, no answer within ``rollout.rewards.timeout_s``,
  malformed JSON, the wrong number of rewards) is retried ``rollout.rewards.retries`` times,
  waiting 0.5 s, 1 s, 2 s... in between.
- **What a failed call gives** (a timeout, an exception, a dead process, a server that
  stays down, or a result that is not a finite number): ``rollout.rewards.on_error=stop``
  (the default) stops the run with a message naming the function or URL, the sample and
  what happened - the last checkpoint is intact, and the same command resumes once the
  cause is fixed; ``penalty`` scores the sample ``rollout.rewards.error_score`` and counts it
  (``reward/failed``, ``reward/timeouts``). A reward server that fails every request of a
  batch stops the run either way: it is down, and a batch of penalties teaches nothing.
"""

from __future__ import annotations

import atexit
import collections
import importlib
import json
import math
import numbers
import os
import select
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from http.client import HTTPException
from typing import Callable

from megarlhf.config import RewardsConfig

Pair = tuple[str, str]


class RewardError(RuntimeError):
    """A reward call failed and the run stops (``rollout.rewards.on_error=stop``, or a batch
    with no reward at all)."""


@dataclass(frozen=True)
class Failure:
    """A call that gave no reward: ``kind`` timeout or error."""

    kind: str
    message: str


def _judge(value, where: str) -> float | Failure:
    """A finite number, or the failure it is."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return Failure("error", f"{where} {type(value).__name__} {str(value)[:80]!r}, not a "
                                "number")
    if not math.isfinite(value):
        return Failure("error", f"{where} {value}, not a finite number")
    return float(value)


def _chunks(n: int, size: int) -> list[list[int]]:
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def load_reward_fn(path: str, what: str = "reward function") -> Callable:
    """``package.module:function`` -> the function (``what`` names it in errors)."""
    if ":" not in path:
        raise ValueError(f"{what} {path!r} must look like 'package.module:function'")
    module, name = path.split(":", 1)
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot import {what} {path!r}: {err}") from None
    if not callable(fn):
        raise ValueError(f"{what} {path!r} is not callable")
    return fn


# ------------------------------------------------------------------ in the trainer's process

class InProcess:
    """``rollout.rewards.workers=0``: the function called here, one pair at a time."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def map(self, pairs: list[Pair]) -> list[float | Failure]:
        out = []
        for prompt, response in pairs:
            try:
                out.append(_judge(self.fn(prompt, response), "returned"))
            except Exception as err:  # the function's: reported like a worker's
                out.append(Failure("error", f"raised {type(err).__name__}: {str(err)[:200]}"))
        return out

    def close(self) -> None:
        pass


# ------------------------------------------------------------------ worker processes

class _Worker:
    """One worker process and the calls it has in flight (in order)."""

    def __init__(self, path: str, start_timeout_s: float,
                 module: str = "megarlhf.rewards.verifier_worker", what: str = "reward function"):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        # a session of its own: signals sent to the trainer's process group (a terminal's
        # Ctrl-C, a launcher's) are not its; it ends when its stdin closes
        self.proc = subprocess.Popen([sys.executable, "-m", module, path],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, start_new_session=True)
        self.fd = self.proc.stdout.fileno()
        self.buf = b""
        self.calls: list[int] = []
        self.started = 0.0
        ready, _, _ = select.select([self.fd], [], [], start_timeout_s)
        line = self.lines() if ready else None
        if not line or json.loads(line[0]) != {"ready": True}:
            self.kill()
            raise RewardError(f"{what} {path!r}: its worker process did not start "
                              f"(exit code {self.proc.poll()}; its error is above)")

    def send(self, calls: list[int], pairs: list[Pair]) -> bool:
        """False when the process is gone (it died between batches: nothing was sent)."""
        return self.send_payload(calls, [pairs[i] for i in calls])

    def send_payload(self, calls: list[int], payload: list) -> bool:
        """``payload`` (one JSON line, an entry per call) for the calls ``calls``; False
        when the process is gone."""
        if self.proc.poll() is not None:
            return False
        try:
            self.proc.stdin.write(json.dumps(payload).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:  # a broken pipe: it died just now
            return False
        self.calls = list(calls)
        self.started = time.monotonic()
        return True

    def lines(self) -> list[str] | None:
        """The complete lines read now; None at end of file (the process is gone)."""
        data = os.read(self.fd, 1 << 16)
        if not data:
            return None
        self.buf += data
        *done, self.buf = self.buf.split(b"\n")
        return [line.decode() for line in done]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:  # unflushed input to a dead process
                pass


class WorkerPool:
    """``rollout.rewards.workers`` processes running the function ``path``."""

    def __init__(self, path: str, workers: int, timeout_s: float, batch: int):
        self.path, self.size, self.timeout_s, self.batch = path, workers, timeout_s, batch
        self.workers: list[_Worker] = []  # started on first use
        atexit.register(self.close)

    def _spawn(self) -> _Worker:
        return _Worker(self.path, max(60.0, self.timeout_s))

    def map(self, pairs: list[Pair]) -> list[float | Failure]:
        out: list[float | Failure | None] = [None] * len(pairs)
        todo = collections.deque(_chunks(len(pairs), self.batch))
        while len(self.workers) < min(self.size, len(todo)):
            self.workers.append(self._spawn())
        idle, busy = list(self.workers), {}

        def replace(worker: _Worker, failure: Failure) -> None:
            out[worker.calls.pop(0)] = failure
            if worker.calls:
                todo.appendleft(worker.calls)
            worker.kill()
            fresh = self._spawn()
            self.workers[self.workers.index(worker)] = fresh
            del busy[worker.fd]
            idle.append(fresh)

        while todo or busy:
            while todo and idle:
                worker = idle.pop()
                if not worker.send(todo[0], pairs):  # gone while idle: a fresh one takes it
                    worker.kill()
                    fresh = self._spawn()
                    self.workers[self.workers.index(worker)] = fresh
                    idle.append(fresh)
                    continue
                todo.popleft()
                busy[worker.fd] = worker
            wait = min(w.started + self.timeout_s for w in busy.values()) - time.monotonic()
            ready, _, _ = select.select(list(busy), [], [], max(0.0, wait))
            for fd in ready:
                worker = busy[fd]
                lines = worker.lines()
                if lines is None:
                    code = worker.proc.wait()
                    replace(worker, Failure("error", f"its worker process died (exit code "
                                                     f"{code}) on this call"))
                    continue
                for line in lines:
                    msg = json.loads(line)
                    out[worker.calls.pop(0)] = _judge(msg["value"], "returned") \
                        if "value" in msg else Failure("error", msg["error"])
                    worker.started = time.monotonic()
                if not worker.calls:
                    del busy[fd]
                    idle.append(worker)
            now = time.monotonic()
            for worker in [w for w in busy.values() if now - w.started >= self.timeout_s]:
                replace(worker, Failure("timeout", f"gave no result within "
                                                   f"rollout.rewards.timeout_s={self.timeout_s:g}"))
        return out

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()
        self.workers = []


# ------------------------------------------------------------------ a reward server

class RewardServer:
    """Batched JSON requests to ``url``, retried with back-off."""

    def __init__(self, url: str, timeout_s: float, retries: int, batch: int,
                 backoff_s: float = 0.5):
        self.url, self.timeout_s, self.retries, self.batch = url, timeout_s, retries, batch
        self.backoff_s = backoff_s

    def _request(self, chunk: list[Pair]) -> list:
        body = json.dumps({"prompts": [p for p, _ in chunk],
                           "responses": [r for _, r in chunk]}).encode()
        request = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
            payload = json.loads(answer.read())
        rewards = payload.get("rewards") if isinstance(payload, dict) else None
        if not isinstance(rewards, list) or len(rewards) != len(chunk):
            raise ValueError(f'the answer is not {{"rewards": [{len(chunk)} numbers]}}: '
                             f"{json.dumps(payload)[:120]}")
        return rewards

    def map(self, pairs: list[Pair]) -> list[float | Failure]:
        out: list[float | Failure] = []
        for calls in _chunks(len(pairs), self.batch):
            chunk = [pairs[i] for i in calls]
            rewards, last = None, None
            for attempt in range(self.retries + 1):
                if attempt:
                    time.sleep(self.backoff_s * 2 ** (attempt - 1))
                try:
                    rewards = self._request(chunk)
                    break
                except (OSError, ValueError, HTTPException) as err:  # refused, HTTP error,
                    last = err  # timed out, malformed
            if rewards is None:
                timeout = isinstance(last, TimeoutError) or "timed out" in str(last)
                out += [Failure("timeout" if timeout else "error",
                                f"failed {self.retries + 1} times, last: "
                                f"{type(last).__name__}: {last}")] * len(chunk)
            else:
                out += [_judge(v, "returned") for v in rewards]
        return out

    def close(self) -> None:
        pass


# ------------------------------------------------------------------ what the run calls

class Verifier:
    """A reward source (``map``) under the run's failure rule: ``__call__(pairs)`` gives
    each pair's score and the counts ``reward/failed`` and ``reward/timeouts``."""

    def __init__(self, name: str, source, on_error: str, error_score: float,
                 down_when_all_fail: bool = False):
        self.name, self.source = name, source
        self.on_error, self.error_score = on_error, error_score
        self.down_when_all_fail = down_when_all_fail  # a server: every call failed = down

    def __call__(self, pairs: list[Pair]) -> tuple[list[float], dict[str, float]]:
        values = self.source.map(pairs)
        failed = [(i, v) for i, v in enumerate(values) if isinstance(v, Failure)]
        counts = {"reward/failed": float(len(failed)),
                  "reward/timeouts": float(sum(v.kind == "timeout" for _, v in failed))}
        down = self.down_when_all_fail and len(failed) == len(values) > 0
        if failed and (self.on_error == "stop" or down):
            i, first = failed[0]
            more = f" ({len(failed) - 1} more of the batch's {len(values)} failed too)" \
                if len(failed) > 1 else ""
            why = ("every request of the batch failed: the server is down" if down and
                   self.on_error == "penalty" else
                   "rollout.rewards.on_error=penalty would score such samples "
                   f"rollout.rewards.error_score={self.error_score:g} instead")
            raise RewardError(f"{self.name}: sample {i} (response {pairs[i][1][:60]!r}): "
                              f"{first.message}{more}; the run stops ({why})")
        return [self.error_score if isinstance(v, Failure) else v for v in values], counts

    def close(self) -> None:
        self.source.close()


def gold_on_some_ranks(gold_fn: Callable, pairs: list[Pair] | None) -> float:
    """The sum of ``gold_fn``'s scores of ``pairs`` on the ranks that hold some (TP rank 0
    of each inference replica; None elsewhere), and a stop on every rank when any rank's
    call failed: a collective of the world, so no rank waits in the next collective for
    one that stopped (the watchdog would name it, not the function)."""
    total, error = 0.0, None
    if pairs:
        try:
            total = float(sum(gold_fn(pairs)[0]))
        except RewardError as err:
            error = str(err)
    from megarlhf.parallel.gather import gather_objects
    failed = [e for e in gather_objects(error) if e]
    if failed:
        raise RewardError(failed[0])
    return total


def make_verifier(rewards: RewardsConfig, *, fn_path: str | None = None,
                  url: str | None = None, name: str = "rollout.rewards.fn") -> Verifier:
    """The reward function ``fn_path`` (imported here first, so a bad path fails before any
    work) or the server ``url``, under ``rewards``' settings (``rollout.rewards``)."""
    if url is not None:
        return Verifier(f"rollout.rewards.url={url}",
                        RewardServer(url, rewards.timeout_s, rewards.retries, rewards.batch),
                        rewards.on_error, rewards.error_score, down_when_all_fail=True)
    fn = load_reward_fn(fn_path)
    source = WorkerPool(fn_path, rewards.workers, rewards.timeout_s, rewards.batch) \
        if rewards.workers else InProcess(fn)
    return Verifier(f"{name}={fn_path}", source, rewards.on_error, rewards.error_score)
