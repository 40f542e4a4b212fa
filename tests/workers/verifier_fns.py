"""Reward functions for tests/test_verifiers.py, run in verifier worker processes (no
megarlhf import: they start fast). ``judge`` misbehaves as its response asks."""

from __future__ import annotations

import os
import time


def judge(prompt: str, response: str):
    if response.startswith("hang"):  # 5 times the test's timeout, and a mutant's run short
        time.sleep(5)
    if response.startswith("boom"):
        raise ZeroDivisionError("planted")
    if response.startswith("nan"):
        return float("nan")
    if response.startswith("text"):
        return "great answer"
    if response.startswith("die"):
        os._exit(3)
    return float(len(response)) + 0.5 * len(prompt)


def never(prompt: str, response: str):
    raise ValueError("always")


def gold_until(prompt: str, response: str) -> float:
    """The synthetic task's gold reward, but a failure once VERIFIER_FAIL_AFTER calls have
    been made while the file VERIFIER_MARKER exists (the calls counted in that file's
    folder; one worker process, so they come one at a time)."""
    from megarlhf.data.synthetic import gold_reward_pair
    marker = os.environ["VERIFIER_MARKER"]
    counter = os.path.join(os.path.dirname(marker), "calls")
    calls = int(open(counter).read()) if os.path.exists(counter) else 0
    with open(counter, "w") as f:
        f.write(str(calls + 1))
    if os.path.exists(marker) and calls >= int(os.environ["VERIFIER_FAIL_AFTER"]):
        raise ConnectionError("the sandbox is gone")
    return gold_reward_pair(prompt, response)
