"""Agent programs (``rollout.agent``): one process per episode, started with the episode's
endpoint in its environment and its data row on stdin, its result read from the last line
it prints (a reward, or null).

``rollout.agent.entry`` runs ``python -m megarlhf.rewards.agent_worker package.module:fn``;
``rollout.agent.command`` runs the user's program. Each process gets a session of its own
(a Ctrl-C or a Slurm signal for the trainer is not its), the trainer's environment without
its process-group settings, stdout and stderr in files (a chatty agent cannot fill a pipe
and stall), and is killed with its children when the rollout ends or it is silent too long
(:mod:`megarlhf.rollout.agents` keeps the time).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile

from megarlhf.config import AgentConfig
from megarlhf.rewards.verifiers import Failure, load_reward_fn


def agent_argv(agent: AgentConfig) -> list[str]:
    """The program each episode runs, checked before any work: the entry point imported
    (a bad path fails here, naming it), the command's program found."""
    if agent.entry is not None:
        load_reward_fn(agent.entry, what="rollout.agent.entry")
        return [sys.executable, "-m", "megarlhf.rewards.agent_worker", agent.entry]
    argv = shlex.split(agent.command)
    if shutil.which(argv[0]) is None:
        raise ValueError(f"rollout.agent.command={agent.command!r}: no program {argv[0]!r} "
                         "(not on PATH, or not executable)")
    return argv


# The trainer's process-group settings: an agent that starts torch.distributed, torchrun
# or an inference server of its own must not join the trainer's job.
TRAINER_ONLY = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "ROLE_NAME")


def agent_environment() -> dict[str, str]:
    """The trainer's environment without its process-group settings (``TRAINER_ONLY``,
    ``TORCHELASTIC_*``)."""
    return {k: v for k, v in os.environ.items()
            if k not in TRAINER_ONLY and not k.startswith("TORCHELASTIC_")}


def reward_of(line: str) -> float | None | Failure:
    """An agent's last line: a finite number, null (another source scores the episode),
    or a failure saying what it was instead."""
    try:
        value = json.loads(line)
    except ValueError:
        value = ...
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not math.isfinite(value):
        return Failure("error", f"its last line {line.strip()[:80]!r} is not a reward (a "
                                "finite JSON number, or null)")
    return float(value)


class AgentProcess:
    """One episode's agent, running."""

    def __init__(self, argv: list[str], env: dict[str, str], row: dict):
        self.files = [tempfile.TemporaryFile(mode="w+b") for _ in range(3)]
        row_file, self.out, self.err = self.files
        row_file.write(json.dumps(row).encode())
        row_file.seek(0)
        self.proc = subprocess.Popen(argv, stdin=row_file, stdout=self.out, stderr=self.err,
                                     env={**agent_environment(), **env},
                                     start_new_session=True)
        self.result: float | None | Failure = ...  # ... until it ends

    @property
    def running(self) -> bool:
        return self.result is ...

    def poll(self) -> bool:
        """Whether it has just ended (its result is then read)."""
        if not self.running or self.proc.poll() is None:
            return False
        code = self.proc.returncode
        if code != 0:
            self.result = Failure("error", f"the agent exited with code {code}"
                                           f"{self._said(self.err, ': ')}")
        else:
            lines = [line for line in self._text(self.out).splitlines() if line.strip()]
            self.result = reward_of(lines[-1]) if lines else Failure(
                "error", "the agent printed no result (its last line must be a reward, a "
                         "JSON number, or null)")
        self._close()
        return True

    def kill(self, failure: Failure) -> None:
        """End it now (its process group), its result ``failure``."""
        if self.running:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()
            self.result = Failure(failure.kind, failure.message + self._said(self.err,
                                                                            "; it said: "))
            self._close()

    @staticmethod
    def _text(f) -> str:
        f.seek(0)
        return f.read().decode("utf-8", errors="replace")

    def _said(self, f, lead: str) -> str:
        """The last line of what it wrote to ``f``, for a message."""
        lines = [line for line in self._text(f).splitlines() if line.strip()]
        return f"{lead}{lines[-1].strip()[:300]}" if lines else ""

    def _close(self) -> None:
        for f in self.files:
            f.close()
