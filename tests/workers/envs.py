"""Environments for tests/test_multiturn.py: the tool task's, and ones that fail on the
rows that ask for it (``row["fail"]``): raising, hanging, dying or answering nonsense."""

from __future__ import annotations

import os
import time

from megarlhf.data.tool_task import LookupEnv


class Failing(LookupEnv):
    def reset(self, row: dict) -> list[dict]:
        self.fail = row.get("fail")
        if self.fail == "reset":
            raise KeyError("no such task")
        return super().reset(row)

    def step(self, turn: dict):
        if self.fail == "raise":
            raise ConnectionError("the sandbox is gone")
        if self.fail == "hang":
            time.sleep(600)
        if self.fail == "exit":
            os._exit(3)
        if self.fail == "nonsense":
            return "nonsense"
        return super().step(turn)


class Reward2ndTurn(LookupEnv):
    """The tool task with a reward of 0.25 for every tool call (a per-turn reward)."""

    def step(self, turn: dict):
        obs, reward, done = super().step(turn)
        return obs, reward + (0.25 if turn["tool_calls"] else 0.0), done
