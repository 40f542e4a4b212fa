"""Metrics to JSONL and TensorBoard (and W&B when installed and configured), from
global rank 0 only; every other rank gets a logger that does nothing."""

from __future__ import annotations

import json
import math
import os
import time

import torch
import torch.distributed as dist


METRICS_FILE = "metrics.jsonl"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class MetricsLogger:
    def __init__(self, run_dir: str, *, tensorboard: bool = True,
                 wandb_project: str | None = None, config: dict | None = None,
                 resume_step: int | None = None):
        self.active = _rank() == 0
        self.path = os.path.join(run_dir, METRICS_FILE)
        self._tb = None
        self._wandb = None
        if not self.active:
            return
        os.makedirs(run_dir, exist_ok=True)
        if resume_step is not None and os.path.exists(self.path):
            # Rows past the checkpoint we resume from are logged again by the resumed run:
            # cut the file back (one truncate, no rewrite), together with any torn tail.
            _truncate(self.path, resume_step)
        elif resume_step is None and os.path.exists(self.path):
            os.replace(self.path, self.path + f".{int(time.time())}.old")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        if wandb_project:
            try:
                import wandb
            except ImportError:
                print("logging.wandb_project is set but wandb is not installed; skipping W&B")
            else:
                self._wandb = wandb.init(project=wandb_project, config=config,
                                         name=os.path.basename(run_dir))

    def log(self, step: int, metrics: dict) -> None:
        if not self.active:
            return
        clean = {k: _scalar(v) for k, v in metrics.items()}
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, **clean}) + "\n")
        except OSError as err:  # a full disk: the next resume cuts the torn row back
            raise RuntimeError(f"cannot append to {self.path}: {err.strerror}") from err
        if self._tb is not None:
            for key, value in clean.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def log_text(self, step: int, tag: str, text: str) -> None:
        if self.active and self._tb is not None:
            self._tb.add_text(tag, text, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _scalar(value):
    if isinstance(value, torch.Tensor):
        return value.item()
    return value


def _rows(path: str):
    """(row, end offset) for each complete row of a JSONL file, stopping at the first torn
    or invalid line (with a warning naming the file and line)."""
    offset = 0
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            end = offset + len(line)
            if not line.strip():
                offset = end
                continue
            try:
                if not line.endswith(b"\n"):
                    raise ValueError("no line end")
                row = json.loads(line)
            except ValueError as err:
                print(f"warning: {path} line {line_no} is torn or not JSON ({err}); "
                      "ignoring it and everything after it", flush=True)
                return
            yield row, end
            offset = end


def _truncate(path: str, last_step: int) -> None:
    keep = 0
    for row, end in _rows(path):
        if row.get("step", 0) > last_step:
            break
        keep = end
    if keep != os.path.getsize(path):
        os.truncate(path, keep)


def read_metrics(run_dir: str) -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl`` up to the first torn line (a crash or a full
    disk mid-write leaves one at the end)."""
    return [row for row, _ in _rows(os.path.join(run_dir, METRICS_FILE))]
