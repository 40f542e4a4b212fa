"""Reliability (issue 15): files a crash leaves torn, config fields with no range or no
reader, checkpoints and converted files that are damaged, help text."""

import dataclasses
import math
import os
import typing

import pytest

from megarlhf.config import Config, ConfigError, load_config
from megarlhf.engine.metrics import MetricsLogger, read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ metrics.jsonl

def test_torn_metrics_tail_is_cut_back_and_never_blocks_a_resume(tmp_path, capsys):
    logger = MetricsLogger(str(tmp_path), tensorboard=False)
    for step in range(5):
        logger.log(step, {"x": step})
    path = tmp_path / "metrics.jsonl"
    with open(path, "a") as f:
        f.write('{"step": 5, "x": "tor')  # a full disk mid-write
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [0, 1, 2, 3, 4]
    assert "metrics.jsonl line 6 is torn" in capsys.readouterr().out
    size = os.path.getsize(path)
    MetricsLogger(str(tmp_path), tensorboard=False, resume_step=3).log(4, {"x": 40})
    rows = read_metrics(str(tmp_path))
    assert [(r["step"], r["x"]) for r in rows] == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 40)]
    assert os.path.getsize(path) < size + 20  # cut back, then appended


# ------------------------------------------------------------------ the schema

def _sections(cls=Config, prefix=""):
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            yield from _sections(hint, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, hint


def _numeric(hint) -> type | None:
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    for a in args:
        if a in (int, float):
            return a
    return None


# Numeric fields any value of which is valid (documented why).
UNBOUNDED = {
    "run.seed": "any integer seeds the generators",
    "ppo.missing_stop_penalty": "a score, any sign",
    "rollout.rewards.error_score": "a score, any sign (NaN too: it then reaches the trainer's "
                                  "non-finite guards, as tests/test_run_guards.py has it)",
    "model.rotary_base": "checked by megatron (> 0 is all it needs)",
    "model.glu_linear_offset": "an offset added to the gated MLP's linear half, any sign "
                               "(NaN and infinities refused)",
}
NUMERIC = [(n, h) for n, h in _sections() if _numeric(h) and not n.startswith("roles.")]


def _bad_values(name, kind):
    yield -1 if kind is int else -1.0
    if kind is float:
        yield math.nan


@pytest.mark.parametrize("name, hint", [(n, h) for n, h in NUMERIC if n not in UNBOUNDED])
def test_every_numeric_field_has_a_range(name, hint):
    """Each numeric field refuses a negative (or NaN) value at load time, naming itself,
    unless it is listed as unbounded with a reason."""
    kind = _numeric(hint)
    for bad in _bad_values(name, kind):
        with pytest.raises((ConfigError, ValueError)) as err:
            load_config(None, [f"{name}={bad}"])
        assert name in str(err.value), (name, bad, str(err.value))


def test_unbounded_fields_are_numeric_fields_and_take_any_value():
    numeric = dict(NUMERIC)
    for name in UNBOUNDED:
        assert name in numeric, f"{name} is not a numeric config field"
        load_config(None, [f"{name}=-1"])  # accepted


# ------------------------------------------------------------------ every field has a reader

def _readers():
    import config_readers as cr

    return cr, cr.schema_source()


def test_every_config_field_is_read_outside_the_config_package():
    """A config field nothing reads is a field that does nothing. Each of the schema's
    fields (655 dotted names, 242 fields of 29 classes) must be read somewhere in megarlhf
    outside megarlhf/config, through an object known to be its section (see
    tests/config_readers.py): ``os.path`` does not read ``tokenizer.path``, nor
    ``rollout.temperature`` ``distill.temperature``."""
    cr, schema = _readers()
    reads = cr.readers(Config, cr.package_sources(), schema)
    leaves = cr.leaf_fields(Config)
    assert len(leaves) > 300
    unread = [name for name, cls, field in leaves if (cls, field) not in reads]
    assert unread == [], f"config fields read nowhere outside megarlhf/config: {unread}"


def test_the_reader_scan_can_fail():
    """The scan on planted code, and on megarlhf's own code with one reader removed."""
    from megarlhf.config import ModelConfig, PPOConfig, RoleConfig
    from megarlhf.config.offline import DistillConfig
    from megarlhf.config import RolloutConfig, TokenizerConfig

    cr, schema = _readers()

    def scan(code):
        return cr.readers(Config, {"x.py": code}, schema)

    assert scan("import os, json\ndef f(p):\n    os.path.exists(p)\n    json.load(p)\n") \
        == set()
    reads = scan("def f(cfg):\n    return cfg.rollout.temperature\n")
    assert (RolloutConfig, "temperature") in reads and (DistillConfig, "temperature") not in reads
    assert (PPOConfig, "gamma") in scan("def f(cfg):\n    ppo = cfg.ppo\n    return ppo.gamma\n")
    assert (PPOConfig, "gamma") in scan("def f(p: PPOConfig):\n    return p.gamma\n")
    assert scan("def f(ppo):\n    return ppo.gamma\n") == set()  # nothing says what it is
    assert (ModelConfig, "ffn_hidden_size") in scan("def f(c):\n    return c.model.ffn_size\n")
    assert (RoleConfig, "checkpoint") in scan(
        "def f(cfg, n):\n    return getattr(cfg.roles, n).checkpoint\n")
    assert (TokenizerConfig, "path") not in scan("def f(tokenizer):\n    tokenizer.path\n")
    sources = cr.package_sources()
    assert not any(path.startswith(os.path.join("megarlhf", "config")) for path in sources)
    cut = {path: text.replace("ppo.dual_clip", "None") for path, text in sources.items()}
    assert (PPOConfig, "dual_clip") in cr.readers(Config, sources, schema)
    assert (PPOConfig, "dual_clip") not in cr.readers(Config, cut, schema)


# ------------------------------------------------------------------ a save that fails

def test_a_full_disk_during_save_names_the_place_and_latest(tmp_path, monkeypatch):
    import errno
    import shutil as sh

    from megarlhf.engine.checkpoint import save_error

    (tmp_path / "latest").write_text("iter_000004")
    tmp = str(tmp_path / ".tmp-iter_000005")
    # torch's writer reports a full disk as an "enforce fail"; the free space tells
    usage = sh.disk_usage(tmp_path)
    monkeypatch.setattr(sh, "disk_usage", lambda p: usage._replace(free=1 << 20))
    err = save_error(RuntimeError("Worker failure: [enforce fail at inline_container.cc:672] "
                                  ". unexpected pos 512 vs 448"), str(tmp_path), tmp)
    assert str(err).startswith(f"no space left on device at {tmp} (1 MiB free); "
                               "latest is still iter_000004")
    monkeypatch.setattr(sh, "disk_usage", lambda p: usage._replace(free=1 << 40))
    inner = OSError(errno.ENOSPC, "No space left on device")
    try:
        raise RuntimeError("wrapped") from inner
    except RuntimeError as wrapped:
        assert "no space left" in str(save_error(wrapped, str(tmp_path), tmp))
    other = save_error(ValueError("bad shard"), str(tmp_path / "none"), tmp)
    assert "failed (ValueError: bad shard); there is no earlier checkpoint" in str(other)


# ------------------------------------------------------------------ help

def test_help_teaches(capsys):
    import yaml

    from megarlhf.cli import build_parser, main
    top = build_parser().format_help()
    assert "megarlhf sft configs/sft_tiny.yaml" in top and "key.sub=value" in top
    for stage in ("sft", "rm", "ppo"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([stage, "--help"])
        text = capsys.readouterr().out
        for needle in ("example:", f"megarlhf {stage} configs/", "key.sub=value",
                       "resumes from the latest", "SIGUSR1", "Ctrl-C"):
            assert needle in text, (stage, needle)
    # (no roles to resolve: a fresh clone has no demo checkpoints)
    assert main(["config", "show", "configs/demo/ppo.yaml", "ppo.sft_checkpoint=null",
                 "--docs"]) == 0
    shown = capsys.readouterr().out
    assert "# Policy ratio clip (1 +- clip_eps)." in shown
    assert yaml.safe_load(shown)["ppo"]["num_iterations"] == 40


def test_score_never_writes_nan_into_jsonl():
    from megarlhf.stages.score import _json_row
    assert _json_row({"tokens": [1, 2], "logprobs": [-0.5]}, "in.jsonl") == \
        '{"tokens": [1, 2], "logprobs": [-0.5]}'
    with pytest.raises(ValueError, match="scoring in.jsonl gave non-finite numbers"):
        _json_row({"tokens": [1, 2], "logprobs": [float("nan")]}, "in.jsonl")



def test_empty_data_and_unwritable_run_directory_are_named(tmp_path):
    from megarlhf.data.datasets import load_rows
    from megarlhf.stages.common import check_writable

    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty.jsonl' is empty"):
        load_rows(str(tmp_path / "empty.jsonl"))
    (tmp_path / "a_file").write_text("not a folder")
    cfg = load_config(None, [f"run.output_dir={tmp_path / 'a_file'}"])
    with pytest.raises(ValueError, match="a_file/megarlhf is not writable"):
        check_writable(cfg)
    assert check_writable(load_config(None, [f"run.output_dir={tmp_path}"])) == \
        str(tmp_path / "megarlhf")


def test_a_failed_dist_checkpoint_write_is_reported_and_cleaned_up(tmp_path, monkeypatch):
    """torch's checkpoint writer raises CheckpointException, a BaseException: seen on a GPU
    machine whose disk filled during a save, it escaped as a raw traceback and left the
    partial checkpoint. Now it is the same clear error, measured before the cleanup."""
    import shutil as sh

    from torch.distributed.checkpoint.api import CheckpointException

    from megarlhf.engine import checkpoint

    (tmp_path / "latest").write_text("iter_000004")
    usage = sh.disk_usage(tmp_path)
    monkeypatch.setattr(sh, "disk_usage", lambda p: usage._replace(free=3 << 20))

    def full_disk(state, path):
        (tmp_path / ".tmp-iter_000005" / "part").write_bytes(b"x" * 100)
        raise CheckpointException("write", {0: (RuntimeError(
            "Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos 704 "
            "vs 598"), None)})

    monkeypatch.setattr(checkpoint.dist_checkpointing, "save", full_disk)
    with pytest.raises(RuntimeError, match=r"no space left on device at .*\.tmp-iter_000005 "
                                           r"\(3 MiB free\); latest is still iter_000004"):
        checkpoint.save_checkpoint(str(tmp_path), "iter_000005", {})
    assert not (tmp_path / ".tmp-iter_000005").exists()


def test_checkpoint_write_results_come_back_inside_this_process():
    """Saves are synchronous, so megatron's writer hands its results back through a queue of
    this process, not one served by a spawned Manager (which imports torch to unpickle
    them: 2.2 s per process). Every saving test then goes through it, and the writer's
    failures (``retrieve_write_results``) read the same queue."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megarlhf.speedups import checkpoint_queue

    checkpoint_queue.install()
    assert type(filesystem_async._get_write_results_queue()) is queue.Queue
