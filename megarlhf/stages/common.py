"""What the stages share: the run directory, rank-0 printing, the progress bar."""

from __future__ import annotations

import math
import os
import sys
import time

from megarlhf.config import Config
from megarlhf.parallel import watchdog
from megarlhf.parallel.rank import is_first, launcher_rank, print0
from megarlhf.stages import runlock


def run_dir(cfg: Config) -> str:
    return os.path.join(cfg.run.output_dir, cfg.run.name)


def check_writable(cfg: Config) -> str:
    """The run directory exists, takes a file and is this run's alone (``runlock``) -
    before any model is built."""
    path = run_dir(cfg)
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write-test-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as err:
        raise ValueError(f"the run directory {path} is not writable ({err.strerror}): set "
                         "run.output_dir to a writable place") from None
    watchdog.set_run_dir(path)
    from megarlhf.engine.checkpoint import use_checksums
    use_checksums(cfg.checkpoint.checksums)
    if launcher_rank() == 0:  # one lock per run, taken by its first rank
        runlock.acquire(path)
    return path


def progress(total: int, initial: int, desc: str, enabled: bool, stream=None):
    """The run's progress on the job's first rank: a bar redrawn in place on a terminal;
    when the output is not one (a Slurm log, ``demo.sh 2> log``), a plain line every
    :data:`LINE_INTERVAL_S` seconds and at the end (:class:`LineProgress`), so the log is
    lines, not one line of carriage returns. ``stream``: where it writes (stderr)."""
    from tqdm import tqdm
    stream = stream or sys.stderr
    shown = enabled and is_first()
    if shown and not stream.isatty():
        return LineProgress(total, initial, desc, stream)
    return tqdm(total=total, initial=initial, desc=desc, disable=not shown,
                dynamic_ncols=True, file=stream)


LINE_INTERVAL_S = 10.0


class LineProgress:
    """:func:`progress` for output that is not a terminal: tqdm's text on a line of its
    own (``desc: 30% 12/40 [00:48<01:52, 4.00s/it, kl=0.12]``), at most every
    :data:`LINE_INTERVAL_S` seconds, and the last count when closed."""

    def __init__(self, total: int, initial: int, desc: str, stream):
        self.total, self.initial, self.n, self.desc, self.stream = total, initial, initial, \
            desc, stream
        self.start = self.shown_at = time.monotonic()
        self.postfix, self.shown_n = "", initial

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.shown_at >= LINE_INTERVAL_S:
            self._show(now)

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def write(self, text: str) -> None:
        print(text, flush=True)

    def close(self) -> None:
        if self.n != self.shown_n:
            self._show(time.monotonic())

    def _show(self, now: float) -> None:
        from tqdm import tqdm
        line = tqdm.format_meter(
            self.n, self.total, now - self.start, prefix=self.desc, initial=self.initial,
            postfix=self.postfix or None,
            bar_format="{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} "
                       "[{elapsed}<{remaining}, {rate_fmt}{postfix}]")
        print(line, file=self.stream, flush=True)
        self.shown_at, self.shown_n = now, self.n


_ABSENT = "(absent)"


def _flat(tree, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return out


def _fixed(key: str) -> bool:
    """A field the resumed weights depend on: the model's shape."""
    from megarlhf.roles.spec import MLA_SHAPE_FIELDS, MOE_SHAPE_FIELDS, SHAPE_FIELDS
    parts = key.split(".")
    if parts[0] == "roles" and len(parts) > 2:
        parts = parts[2:]
    if parts[:1] != ["model"]:
        return False
    if len(parts) == 2:
        return parts[1] in SHAPE_FIELDS
    return len(parts) == 3 and parts[2] in {"moe": MOE_SHAPE_FIELDS,
                                            "mla": MLA_SHAPE_FIELDS}.get(parts[1], ())


# fields whose null means a value derived from the others: compared as derived
_DERIVED = {"ffn_hidden_size": "ffn_size", "num_query_groups": "query_groups",
            "head_dim": "head_size", "tie_word_embeddings": "tied",
            "add_qkv_bias": "qkv_bias"}


def _same_in_effect(key: str, saved: dict, cfg: Config) -> bool:
    """``model.<field>`` written out as the value its null stood for."""
    from megarlhf.config import ModelConfig, section_from_dict

    parts = key.split(".")
    if len(parts) != 2 or parts[0] != "model" or parts[1] not in _DERIVED:
        return False
    try:
        before = section_from_dict(ModelConfig, dict(saved.get("model") or {}), "saved model")
    except ValueError:
        return False
    prop = _DERIVED[parts[1]]
    return getattr(before, prop) == getattr(cfg.model, prop)


def explain_resume(cfg: Config, ckpt_dir: str, stage: str = "resume") -> dict:
    """Before a resume from ``ckpt_dir``'s latest checkpoint: the settings that differ from
    those it was written with, printed field by field and appended to
    ``RUN_DIR/resumes.jsonl``; a changed model shape is refused (the saved weights are of
    the old one); the run's records are checked (:func:`check_records`). Returns
    {key: [old, new]}."""
    import dataclasses
    import json

    from megarlhf.engine.checkpoint import read_meta, resolve_checkpoint

    path = resolve_checkpoint(ckpt_dir)
    meta = {**read_meta(path), "tag": os.path.basename(path)}
    check_records(meta, run_dir(cfg), stage)
    saved = meta.get("config")
    if not isinstance(saved, dict):
        return {}
    from megarlhf.config import config_from_dict

    before, now = _flat(saved), _flat(dataclasses.asdict(cfg))
    defaults = _flat(dataclasses.asdict(config_from_dict({})))
    changes = {k: [before.get(k, _ABSENT), now.get(k, _ABSENT)]
               for k in sorted(set(before) | set(now))
               if before.get(k, _ABSENT) != now.get(k, _ABSENT)
               # a field added since the checkpoint was written, at its default
               and not (k not in before and k in defaults and now.get(k) == defaults[k])}
    fixed = [k for k in changes if _fixed(k) and not _same_in_effect(k, saved, cfg)]
    if fixed:
        raise ValueError(
            f"resuming {meta.get('tag')} of {run_dir(cfg)} with another model shape: "
            + "; ".join(f"{k} was {changes[k][0]!r}, now {changes[k][1]!r}" for k in fixed)
            + ". The checkpoint's weights have the old shape: drop the override, or start "
            "a new run (run.name) from this checkpoint (checkpoint.load)")
    if changes:
        print0(f"[{stage}] resuming {meta.get('tag')} with {len(changes)} setting(s) changed "
               "since it was written:")
        for key, (old, new) in changes.items():
            print0(f"[{stage}]   {key}: {old!r} -> {new!r}")
        if launcher_rank() == 0:
            with open(os.path.join(run_dir(cfg), "resumes.jsonl"), "a") as f:
                f.write(json.dumps({"checkpoint": meta.get("tag"), "changes": changes},
                                   default=str) + "\n")
    return changes


def check_records(meta: dict, folder: str, stage: str) -> None:
    """The run's own records in ``folder`` (``metrics.jsonl``) against the size and
    SHA-256 the checkpoint ``meta`` took of them when it was saved: a record cut short or
    changed in place since is an error naming it (the resume would append to rows that are
    not the ones logged); a record that is gone is said, and the resumed run starts it
    afresh. Rows logged after the save are not checked (the resume cuts them back)."""
    from megarlhf.engine.checkpoint import checksums_on, prefix_problem

    if not checksums_on():
        return
    for name, want in sorted((meta.get("records") or {}).items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            print0(f"[{stage}] {path}, recorded by {meta.get('tag')}, is gone: the resumed "
                   "run starts it afresh")
            continue
        problem = prefix_problem(path, want, meta.get("tag"))
        if problem:
            raise ValueError(f"{problem}: move it aside to resume (the resumed run then "
                             "starts it afresh), or restore it, or set "
                             "checkpoint.checksums=false to take it as it is")


class MetricBands:
    """``run.metric_bands`` and ``run.allow_nonfinite``: a run whose logged metric leaves
    its band, or is NaN or infinite without being allowed to, stops (exit 2) before the
    step is saved, so ``latest`` stays on the last good checkpoint.

    :meth:`check` is collective: every rank calls it at the same point, and all of them
    stop when any finds a value outside its band (a metric only one rank computes, such
    as an evaluation, stops them all)."""

    def __init__(self, cfg: Config):
        self.bands = dict(cfg.run.metric_bands)
        self.allowed = tuple(cfg.run.allow_nonfinite)
        self.seen: set[str] = set()

    def check(self, metrics: dict, where: str, skipped: tuple[str, ...] = ()) -> None:
        """``skipped``: name prefixes of an update whose optimizer steps were skipped
        (their non-finite losses are the skipped-step guards' to judge)."""
        import fnmatch

        import torch
        import torch.distributed as dist

        from megarlhf.engine.optimizer import RunawayError
        outside = [f"{name}={float(value)} is not finite (run.allow_nonfinite lists the "
                   "metrics that may be)" for name, value in metrics.items()
                   if isinstance(value, (int, float)) and not math.isfinite(value)
                   and not name.startswith(skipped)
                   and not any(fnmatch.fnmatchcase(name, p) for p in self.allowed)]
        for name, (low, high) in self.bands.items():
            if name not in metrics:
                continue
            self.seen.add(name)
            value = float(metrics[name])
            if any(line.startswith(f"{name}=") for line in outside):
                continue  # (said: not finite)
            if not math.isfinite(value) or (low is not None and value < low) \
                    or (high is not None and value > high):
                outside.append(f"{name}={value:.4g} is outside its band [{_bound(low)}, "
                               f"{_bound(high)}] (run.metric_bands)")
        flag = torch.tensor([1.0 if outside else 0.0])
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            what = "; ".join(outside) or "another rank found a metric outside its band " \
                "or not finite"
            raise RunawayError(
                f"{where}: {what}: the run went wrong - check optimizer.lr, the KL "
                "coefficient and the rewards/data. This step is not saved; the last "
                "checkpoint is unchanged")

    def report_unseen(self) -> None:
        """At the end of a run: bands whose metric never appeared (a misspelt name)."""
        for name in sorted(set(self.bands) - self.seen):
            print0(f"[megarlhf] warning: run.metric_bands names '{name}', which this run "
                   "never logged: that band checked nothing (see metrics.jsonl for names)")


def _bound(value) -> str:
    return "null" if value is None else f"{value:g}"
