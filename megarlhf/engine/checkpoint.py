"""Checkpoints through ``megatron.core.dist_checkpointing``.

A checkpoint holds one or more *roles* (``policy``, ``reward``, ``actor``, ``critic``...),
each with its model and, for trained roles, the distributed-optimizer state (megatron's
``fully_reshardable`` format: reshardable across TP, PP and DP) and LR schedule;
plus per-rank RNG states and a JSON-able trainer state (step, data position, KL
controller, reward normalisation). Tensors are stored under global names prefixed by the
role, so a model saved at TP=2 loads at TP=1 or PP=2.

Atomicity: every rank writes into ``<dir>/.tmp-<tag>``; after a barrier rank 0 writes the
metadata, renames the folder to ``<dir>/<tag>`` and only then replaces ``<dir>/latest``
(write + fsync + ``os.replace``). A crash at any point leaves the previous ``latest``
pointing at a complete checkpoint; stale ``.tmp-*`` folders are removed by the next save.

Integrity (``checkpoint.checksums``, :func:`use_checksums`): the metadata records the size
and SHA-256 of every file the save wrote (``files``: the shards and the format's own
index files, hashed by the ranks in turn; ``objects``: the objects saved beside them). A
checkpoint is used only when every file it lists is there as written
(:func:`verify_checkpoint`): resolving a run's ``latest`` falls back to the newest
checkpoint that is, said so; a checkpoint named directly is an error naming the file. An
object is checked when it is read (:func:`load_object`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.validation import StrictHandling
from torch.distributed.checkpoint import DefaultLoadPlanner, LoadPlan
from torch.distributed.checkpoint.api import CheckpointException

from megarlhf.engine.optimizer_state import (
    FORMAT as OPTIMIZER_FORMAT,
    is_distributed,
    legacy_plain_state,
    load_optimizer_state,
    sharded_optimizer_state,
)
from megarlhf.models import lora
from megarlhf.models.gpt import sharded_state_dict, unwrap
from megarlhf.parallel import watchdog
from megarlhf.parallel.gather import gather_objects
from megarlhf.parallel.rank import is_first
from megarlhf.parallel import cpu_backend

META_FILE = "megarlhf_meta.json"
LATEST_FILE = "latest"
# Fault injection for tests: "save_before_commit:N" kills the process (exit 137) during the
# N-th save of this process, after every rank wrote its shards and before the commit.
FAULT_ENV = "MEGARLHF_FAULT_INJECT"
_saves_in_process = [0]
_checksums = [True]  # checkpoint.checksums (use_checksums)
_verified: dict[tuple, str | None] = {}  # (folder, the stats of its files) -> problem
_warned: set[str] = set()
_READ_BLOCK = 8 << 20


def use_checksums(enabled: bool) -> None:
    """``checkpoint.checksums``: whether saves record, and reads check, every file's size and
    SHA-256 (checkpoints and frozen-model caches). Off, a checkpoint is taken as it is."""
    _checksums[0] = bool(enabled)


def checksums_on() -> bool:
    return _checksums[0]


def file_digest(path: str) -> str:
    """The SHA-256 of a file, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_READ_BLOCK):
            h.update(block)
    return h.hexdigest()


def file_record(path: str) -> dict:
    return {"bytes": os.path.getsize(path), "sha256": file_digest(path)}


def file_problem(path: str, want: dict) -> str | None:
    """How ``path`` differs from what was written (``file_record``), or None."""
    if not os.path.isfile(path):
        return f"{path} is missing"
    size = os.path.getsize(path)
    if size != want["bytes"]:
        return f"{path} has {size} bytes, the save wrote {want['bytes']}"
    if file_digest(path) != want["sha256"]:
        return f"{path} was changed since the save (its SHA-256 is not the one recorded)"
    return None


def prefix_problem(path: str, want: dict, by: str) -> str | None:
    """How the first ``want["bytes"]`` bytes of the append-only ``path`` differ from the
    ``file_record`` that ``by`` (a checkpoint) took of it - cut short or changed in place -
    or None. Rows appended since are not checked (a resume cuts them back)."""
    size = os.path.getsize(path)
    if size < want["bytes"]:
        return f"{path} has {size} bytes, fewer than the {want['bytes']} {by} recorded"
    h, left = hashlib.sha256(), want["bytes"]
    with open(path, "rb") as f:
        while left and (block := f.read(min(left, _READ_BLOCK))):
            h.update(block)
            left -= len(block)
    if h.hexdigest() != want["sha256"]:
        return (f"{path} was changed after {by} recorded it (the SHA-256 of its first "
                f"{want['bytes']} bytes is not the one recorded)")
    return None


def _listing(folder: str) -> list[str]:
    """Every file under ``folder`` but the metadata, relative, sorted."""
    out = []
    for root, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), folder)
            if rel != META_FILE:
                out.append(rel)
    return sorted(out)


def verify_checkpoint(folder: str) -> str | None:
    """Why the checkpoint ``folder`` does not hold what its save wrote - a file missing, of
    another size, or changed in place - or None. Every file its metadata's ``files`` lists
    is read once per process, and again when a file's size or modification time changes.
    A checkpoint saved without checksums passes, as does every checkpoint with checksums
    off."""
    if not _checksums[0]:
        return None
    meta_file = os.path.join(folder, META_FILE)
    try:
        stat = os.stat(meta_file)
        with open(meta_file) as f:
            files = json.load(f).get("files")
    except (OSError, ValueError, AttributeError) as err:
        return f"{meta_file} cannot be read ({err})"
    key = (os.path.abspath(folder), stat.st_mtime_ns, stat.st_size,
           *(_stat_of(os.path.join(folder, name)) for name in sorted(files or {})))
    if key not in _verified:
        problem = None
        for name, want in sorted((files or {}).items()):
            problem = file_problem(os.path.join(folder, name), want)
            if problem:
                break
        _verified[key] = problem
    return _verified[key]


def _stat_of(path: str) -> tuple | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_size, stat.st_mtime_ns


def _warn_once(text: str) -> None:
    if text not in _warned and is_first():
        _warned.add(text)
        print(text, flush=True)


@dataclass
class RoleState:
    """What one role contributes to a checkpoint."""

    model: list  # model chunks (bare or DDP-wrapped)
    optimizer: Any = None
    scheduler: Any = None
    extra: dict = field(default_factory=dict)  # JSON-able, e.g. reward normalisation
    # LoRA: the whole checkpoint ({"path", "role", "meta_sha256"}: :func:`base_of`) whose
    # weights the model's frozen base holds. Saving writes only what trains and names it;
    # loading a checkpoint that names this base skips reading it again.
    base: dict | None = None


def _model_sharded(role: str, chunks: list, skip_head: bool = False,
                   skip_adapters: bool = False, trained_only: bool = False) -> dict:
    prefix = f"{role}."

    def one(chunk):
        sd = sharded_state_dict(unwrap(chunk), prefix=prefix)
        if skip_head:
            sd = {k: v for k, v in sd.items() if not k.startswith(f"{prefix}output_layer")}
        if skip_adapters:
            sd = {k: v for k, v in sd.items() if not lora.is_adapter(k)}
        if trained_only:  # an adapter-only checkpoint
            sd = {k: v for k, v in sd.items() if lora.trains(k, unwrap(chunk).kind)}
        return sd

    if len(chunks) == 1:
        return {"model": one(chunks[0])}
    return {f"model{i}": one(c) for i, c in enumerate(chunks)}


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _sharded_state(roles: dict[str, RoleState], loading: bool, with_rng: bool,
                   skip_head: bool = False, legacy: frozenset = frozenset(),
                   skip_adapters: bool = False) -> dict:
    """A role whose ``base`` is set enters with what trains only: an adapter-only
    checkpoint (saving, it names that base; loading, the base is in the model already)."""
    state: dict = {}
    for name, role in roles.items():
        entry = _model_sharded(name, role.model, skip_head, skip_adapters,
                               trained_only=role.base is not None)
        if role.optimizer is not None:
            # one format for both optimizers (optimizer_state), but for old plain ones
            state_of = legacy_plain_state if name in legacy else sharded_optimizer_state
            entry["optimizer"] = state_of(role.optimizer, dict(entry), loading=loading)
        state[name] = entry
    if with_rng:
        state["rng"] = ShardedObject("rng_state", rng_state(), (_world(),), (_rank(),),
                                     replica_id=0)
    return state


def resolve_checkpoint(path: str) -> str:
    """A run's checkpoint folder (holding ``latest``), one checkpoint, or a folder with a
    ``checkpoints/`` folder in it (a run directory, a converter's output) -> the checkpoint."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    nested = os.path.join(path, "checkpoints")
    if not os.path.exists(os.path.join(path, LATEST_FILE)) \
            and os.path.exists(os.path.join(nested, LATEST_FILE)):
        path = nested
    latest = os.path.join(path, LATEST_FILE)
    if os.path.exists(latest):
        return _latest_complete(path, latest)
    if not os.path.exists(os.path.join(path, META_FILE)):
        raise FileNotFoundError(f"{path!r} is not a complete megarlhf checkpoint "
                                f"(no {META_FILE})")
    problem = verify_checkpoint(path)
    if problem:
        raise ValueError(f"checkpoint {path} does not hold what its save wrote: {problem}. "
                         "Point at another checkpoint (a run's checkpoints folder falls back "
                         "to its newest intact one), or set checkpoint.checksums=false to use "
                         "it as it is")
    return path


def _complete(folder: str) -> bool:
    """A checkpoint whose metadata (written after everything else) is there and readable."""
    try:
        with open(os.path.join(folder, META_FILE)) as f:
            return isinstance(json.load(f), dict)
    except (OSError, ValueError):
        return False


def _latest_complete(folder: str, latest: str) -> str:
    """The checkpoint ``latest`` names; when that is not a complete checkpoint (the pointer
    damaged or emptied, the folder deleted or torn) or does not hold what its save wrote
    (:func:`verify_checkpoint`), the newest one in ``folder`` that is both, said so; an
    error naming the pointer when there is none."""
    try:
        with open(latest) as f:
            name = f.read().strip()
    except (OSError, UnicodeDecodeError):
        name = ""
    target = os.path.join(folder, name)
    if name and os.sep not in name and _complete(target):
        problem = verify_checkpoint(target)
        if problem is None:
            return target
        why = f"names {name!r}, which does not hold what its save wrote: {problem}"
    else:
        why = (f"names {name!r}, which is not a complete checkpoint" if name
               else "is empty or unreadable")
    tags = sorted((d for d in os.listdir(folder) if d != name and os.path.isdir(
        os.path.join(folder, d)) and _complete(os.path.join(folder, d))), key=lambda d: (len(d), d))
    skipped = []
    for tag in reversed(tags):
        problem = verify_checkpoint(os.path.join(folder, tag))
        if problem is None:
            _warn_once(f"[checkpoint] warning: {latest} {why}; taking {tag}, the newest "
                       "complete checkpoint there" + (f" (passed over: {'; '.join(skipped)})"
                                                     if skipped else ""))
            return os.path.join(folder, tag)
        skipped.append(problem)
    raise FileNotFoundError(f"{latest} {why}, and {folder} holds no complete checkpoint"
                            + (f" (damaged: {'; '.join(skipped)})" if skipped else "")
                            + ": start the run afresh (delete the folder) or point "
                            "checkpoint.load at another checkpoint")


def read_meta(path: str) -> dict:
    """A checkpoint's metadata; a damaged file is an error naming it."""
    file = os.path.join(resolve_checkpoint(path), META_FILE)
    try:
        with open(file) as f:
            meta = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{file} is damaged (not valid JSON: {err}); the checkpoint cannot "
                         "be read: point at another one, or delete this checkpoint folder "
                         "so the run resumes from the one before") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{file} is damaged (a {type(meta).__name__}, not the checkpoint's "
                         "metadata)")
    return meta


@watchdog.labelled("checkpoint save")
@cpu_backend.at_megatron()
def save_checkpoint(save_dir: str, tag: str, roles: dict[str, RoleState], *,
                    trainer_state: dict | None = None, config: dict | None = None,
                    layout: str = "", keep_last: int | None = None,
                    objects: dict[str, Any] | None = None, sharded_strategy=None,
                    records: tuple[str, ...] = ()) -> str:
    """Write ``roles`` and ``trainer_state`` as ``save_dir/tag``; returns its path.
    ``objects`` (name -> picklable tensors/dicts, the same on every rank) are written by
    rank 0 as ``<name>.pt`` inside the checkpoint, committed with it. ``sharded_strategy``:
    megatron's default (``torch_dist``) unless given (``engine.streaming.StreamingSave``).
    ``records``: the run's own append-only files (its ``metrics.jsonl``, written by rank
    0); with checksums on, their size and SHA-256 as of this save go into the metadata
    (``"records"``), for a resume to check (``stages.common.check_records``)."""
    final = os.path.join(save_dir, tag)
    tmp = os.path.join(save_dir, f".tmp-{tag}")
    if _rank() == 0:
        os.makedirs(save_dir, exist_ok=True)
        for stale in os.listdir(save_dir):
            if stale.startswith(".tmp-"):
                shutil.rmtree(os.path.join(save_dir, stale), ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    state = _sharded_state(roles, loading=False, with_rng=True)
    for name, role in roles.items():
        if role.scheduler is not None:
            state[name]["scheduler"] = role.scheduler.state_dict()
    try:
        dist_checkpointing.save(state, tmp, sharded_strategy=sharded_strategy)
    except (Exception, CheckpointException) as err:  # the latter is a BaseException
        error = save_error(err, save_dir, tmp)  # measures the free space before cleanup
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # give the space back
        raise error from err
    _barrier()
    _saves_in_process[0] += 1
    fault = os.environ.get(FAULT_ENV, "")
    if fault.startswith("save_before_commit:") and \
            int(fault.split(":")[1]) == _saves_in_process[0]:
        os._exit(137)
    files = None
    if _checksums[0]:  # every rank hashes its turn of the files; rank 0 records them all
        names = _listing(tmp)
        mine = {n: file_record(os.path.join(tmp, n)) for n in names[_rank()::_world()]}
        files = {k: v for part in gather_objects(mine) for k, v in part.items()}
    if _rank() == 0:
        saved_objects = {}
        for name, obj in (objects or {}).items():
            torch.save(obj, os.path.join(tmp, f"{name}.pt"))
            if files is not None:
                saved_objects[name] = file_record(os.path.join(tmp, f"{name}.pt"))
        meta = {
            "tag": tag,
            "roles": {name: {"trained": role.optimizer is not None, **role.extra,
                             **({"optimizer_format": OPTIMIZER_FORMAT}
                                if role.optimizer is not None else {}),
                             **({"base": role.base} if role.base is not None else {})}
                      for name, role in roles.items()},
            "trainer": trainer_state or {},
            "config": config or {},
            "layout": layout,
            "world_size": _world(),
            **({"files": files, "objects": saved_objects,
                "records": {os.path.basename(p): file_record(p) for p in records
                            if os.path.isfile(p)}} if files is not None else {}),
        }
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump(meta, f, indent=1, default=str)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = os.path.join(save_dir, f".{LATEST_FILE}.tmp")
        with open(pointer, "w") as f:
            f.write(tag)
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer, os.path.join(save_dir, LATEST_FILE))
        if keep_last:
            _prune(save_dir, keep_last, protect=tag)
    _barrier()
    return final


def save_error(err: Exception, save_dir: str, tmp: str) -> RuntimeError:
    """What a failed save says: the place, the cause in words (a full disk reads as one
    whatever layer noticed it), and which checkpoint ``latest`` still names."""
    latest_file = os.path.join(save_dir, LATEST_FILE)
    latest = open(latest_file).read().strip() if os.path.exists(latest_file) else None
    still = f"latest is still {latest}" if latest else "there is no earlier checkpoint"
    text = f"{type(err).__name__}: {err}"
    # torch's checkpoint writer reports a worker's failure by text, one cause per rank
    for cause in getattr(err, "failures", {}).values():
        text += f" {cause[0] if isinstance(cause, tuple) else cause}"
    errno_28 = any(getattr(e, "errno", None) == 28 for e in _chain(err))
    try:
        free = shutil.disk_usage(save_dir).free
    except OSError:
        free = None
    if errno_28 or "No space left" in text or (free is not None and free < 64 << 20):
        return RuntimeError(f"no space left on device at {tmp} "
                            f"({free // (1 << 20) if free is not None else '?'} MiB free); "
                            f"{still}")
    return RuntimeError(f"saving the checkpoint into {tmp} failed ({text.splitlines()[0]}); "
                        f"{still}")


def _chain(err: BaseException):
    while err is not None:
        yield err
        err = err.__cause__ or err.__context__


def load_object(path: str, name: str) -> Any:
    """An object saved with the checkpoint at ``path`` (see ``save_checkpoint(objects=)``),
    or None when it has none."""
    folder = resolve_checkpoint(path)
    file = os.path.join(folder, f"{name}.pt")
    want = (read_meta(folder).get("objects") or {}).get(name) if _checksums[0] else None
    if want is not None:
        problem = file_problem(file, want)
        if problem:
            raise ValueError(f"{file} is damaged and cannot be read ({problem})")
    if not os.path.exists(file):
        return None
    try:
        return torch.load(file, weights_only=True)
    except Exception as err:  # torch raises its own types for torn or foreign files
        raise ValueError(f"{file} is damaged and cannot be read ({type(err).__name__}: "
                         f"{str(err)[:200]})") from None


def _prune(save_dir: str, keep_last: int, protect: str) -> None:
    tags = sorted(d for d in os.listdir(save_dir)
                  if not d.startswith(".") and os.path.isdir(os.path.join(save_dir, d))
                  and os.path.exists(os.path.join(save_dir, d, META_FILE)))
    for old in tags[:-keep_last]:
        if old != protect:
            shutil.rmtree(os.path.join(save_dir, old), ignore_errors=True)


def checkpoint_role(meta: dict, wanted: str | None, path: str) -> str:
    """The role to read: ``wanted``, or the only role the checkpoint holds."""
    roles = list(meta.get("roles", {}))
    if wanted is None:
        if len(roles) != 1:
            raise ValueError(f"checkpoint {path} holds roles {roles}; say which one to load")
        return roles[0]
    if wanted not in roles:
        raise ValueError(f"checkpoint {path} has no role '{wanted}' (it holds {roles})")
    return wanted


POLICY_ROLES = ("actor", "policy")  # ppo's trained policy, sft's and dpo's


def policy_role(meta: dict, wanted: str | None, path: str) -> str:
    """``wanted``, else the checkpoint's policy (actor or policy), else its only role."""
    if wanted is None:
        wanted = next((r for r in POLICY_ROLES if r in meta.get("roles", {})), None)
    return checkpoint_role(meta, wanted, path)


@watchdog.labelled("checkpoint load")
@cpu_backend.at_megatron()
def load_checkpoint(path: str, roles: dict[str, RoleState], *, load_optimizer: bool = True,
                    load_rng: bool = True, layout: str = "",
                    source_roles: dict[str, str] | None = None,
                    skip_head: bool = False) -> dict:
    """Load ``roles`` from ``path`` (any layout). ``source_roles`` maps a role here to the
    role name in the checkpoint (e.g. critic <- reward). Optimizer state and RNG are read
    only where asked and present; RNG only when the layout is unchanged. ``skip_head``
    loads the trunk only (a value model from an LM checkpoint keeps its own fresh head).
    Returns meta."""
    path = resolve_checkpoint(path)
    meta = read_meta(path)
    source_roles = source_roles or {}
    targets = {name: checkpoint_role(meta, source_roles.get(name, name), path)
               for name in roles}
    state, use_opt, legacy, fresh, bases = {}, {}, set(), {}, {}
    for name, role in roles.items():
        src = targets[name]
        fresh[name] = _fresh_adapters(meta, src, role.model, path)
        bases[name] = meta["roles"][src].get("base")
        if bases[name] is not None and bases[name] != role.base:
            _load_base(bases[name], path, src, name, role.model)
        trained = meta["roles"][src].get("trained", False) and not fresh[name]
        use_opt[name] = load_optimizer and role.optimizer is not None and trained
        if use_opt[name] and _legacy_plain(meta, src):
            if is_distributed(role.optimizer):
                raise ValueError(
                    f"checkpoint {path}: role '{src}' holds optimizer state in the plain "
                    "optimizer's old format, which the distributed optimizer cannot read; "
                    "resume it with optimizer.use_distributed_optimizer=false")
            legacy.add(src)
        sub = RoleState(role.model, role.optimizer if use_opt[name] else None,
                        base=bases[name])
        state[src] = _sharded_state({src: sub}, loading=True, with_rng=False,
                                    skip_head=skip_head, legacy=frozenset(legacy),
                                    skip_adapters=fresh[name])[src]
    same_layout = meta.get("layout") == layout and meta.get("world_size") == _world()
    if load_rng and same_layout:
        state["rng"] = ShardedObject("rng_state", None, (_world(),), (_rank(),), replica_id=0)
    try:
        loaded, _, absent = dist_checkpointing.load(state, path,
                                                    strict=StrictHandling.RETURN_UNEXPECTED)
    except (Exception, CheckpointException) as err:  # the latter is a BaseException
        text = f"{type(err).__name__}: {err}".splitlines()[0][:300]
        raise ValueError(f"checkpoint {path} cannot be read ({text}); its files may be "
                         "damaged (checkpoint.checksums=true names a changed one) or of "
                         "another model") from err
    _check_absent(absent, path)
    for name, role in roles.items():
        src = targets[name]
        for i, chunk in enumerate(role.model):
            key = "model" if len(role.model) == 1 else f"model{i}"
            weights = _strip_prefix(loaded[src][key], f"{src}.")
            own = unwrap(chunk).state_dict()
            if skip_head:
                weights.update({k: v for k, v in own.items() if k.startswith("output_layer")})
            if fresh[name]:  # a base checkpoint: the adapters keep their new values
                weights.update({k: v for k, v in own.items() if lora.is_adapter(k)})
            if bases[name] is not None:  # adapters only: the base is in the model already
                kind = unwrap(chunk).kind
                weights.update({k: v for k, v in own.items() if not lora.trains(k, kind)})
            # TransformerEngine's modules keep fp8 metadata as extra state; a checkpoint of
            # the local layers has none: those modules keep their own (fresh) metadata
            weights.update({k: v for k, v in own.items()
                            if k.endswith("_extra_state") and k not in weights})
            unwrap(chunk).load_state_dict(weights, strict=True)
        if use_opt[name]:
            load_optimizer_state(role.optimizer, loaded[src]["optimizer"],
                                 legacy=src in legacy)
            # The LR schedule is a common (non-sharded) item: it comes back from the file.
            if role.scheduler is not None and loaded[src].get("scheduler") is not None:
                role.scheduler.load_state_dict(loaded[src]["scheduler"])
    if "rng" in loaded:
        set_rng_state(loaded["rng"])
    meta["rng_restored"] = "rng" in loaded
    return meta


def base_of(path: str, role: str) -> dict:
    """Checkpoint ``path``'s role ``role`` as the base of LoRA adapters: its folder, the role
    and a digest of its metadata (a folder since replaced by another checkpoint is told
    apart); for an adapter-only checkpoint, the base it names."""
    folder = os.path.abspath(resolve_checkpoint(path))
    entry = read_meta(folder)["roles"][role]
    if entry.get("base"):
        return entry["base"]
    return {"path": folder, "role": role, "meta_sha256": _meta_digest(folder)}


def _meta_digest(folder: str) -> str:
    with open(os.path.join(folder, META_FILE), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _load_base(base: dict, path: str, src: str, name: str, chunks: list) -> None:
    """The whole checkpoint an adapter-only role ``src`` of ``path`` names, into ``chunks``
    (their adapters untouched; a value model's head comes with the adapters)."""
    check_base(base, path, src)
    load_checkpoint(base["path"], {name: RoleState(chunks)}, load_optimizer=False,
                    load_rng=False, source_roles={name: base["role"]},
                    skip_head=unwrap(chunks[0]).kind == "value")


def check_base(base: dict, path: str, src: str) -> None:
    """The base an adapter-only role names is there and is the checkpoint it was."""
    where = (f"checkpoint {path}: role '{src}' holds LoRA adapters only, for the base "
             f"{base['path']} (role '{base['role']}'), which")
    try:
        digest = _meta_digest(base["path"])
    except OSError as err:
        raise FileNotFoundError(f"{where} cannot be read ({err.strerror}): put it back "
                                "there, or resume from a checkpoint saved with "
                                "checkpoint.adapters_only=false") from None
    if digest != base["meta_sha256"]:
        raise ValueError(f"{where} has changed since (its {META_FILE} differs): the "
                         "adapters were trained on other weights; put the original back")


def _fresh_adapters(meta: dict, src: str, chunks: list, path: str) -> bool:
    """Whether the model's LoRA adapters start fresh on the checkpoint's role ``src`` (a
    base model's checkpoint, saved without adapters); a checkpoint with adapters for a
    model without them is an error, not a silent loss of what they learnt."""
    has = any(lora.is_adapter(k) for chunk in chunks for k in unwrap(chunk).state_dict())
    saved = (meta["roles"][src].get("model") or {}).get("lora", {}).get("rank", 0)
    if saved and not has:
        raise ValueError(f"checkpoint {path}: role '{src}' holds LoRA adapters (rank "
                         f"{saved}) that this model would not load: give it the same "
                         "model.lora (or export the merged model and start from that)")
    return has and not saved


def _check_absent(keys: set[str], path: str) -> None:
    """What the model asked for and the checkpoint lacks: TransformerEngine's extra state
    (fp8 metadata; a checkpoint of the local layers has none) is left to the modules;
    anything else is an error naming it."""
    absent = sorted(k for k in keys if not k.endswith("_extra_state"))
    if absent:
        more = f" and {len(absent) - 5} more" if len(absent) > 5 else ""
        raise ValueError(f"checkpoint {path} lacks {len(absent)} entries this model needs: "
                         f"{', '.join(absent[:5])}{more} - a checkpoint of another model "
                         "shape or family?")


@cpu_backend.at_megatron()
def load_parameters(path: str, role: str, chunk, names: list[str]) -> dict[str, torch.Tensor]:
    """Read only the parameters ``names`` of ``role`` from the checkpoint ``path`` into new
    host tensors, whatever layout saved it. ``chunk`` (a TP=1, PP=1, EP=1 model built on
    the meta device: no weights) gives each parameter's stored tensor and its region there
    (a layer's slice of a tensor stacked over the layers, an expert's of one stacked over
    the experts); torch's reader fetches those regions' bytes only, so a model can be read
    a layer at a time (the streamed export). (megatron's loader reads whole stored tensors
    in one process.) An adapter-only checkpoint's other parameters come from its base."""
    base = read_meta(path)["roles"][role].get("base")
    if base is None:
        return _own_parameters(path, role, chunk, names)
    check_base(base, path, role)  # adapters only: the rest from their base
    kind = unwrap(chunk).kind
    rest = [n for n in names if not lora.trains(n, kind)]
    names = [n for n in names if lora.trains(n, kind)]
    return {**(load_parameters(base["path"], base["role"], chunk, rest) if rest else {}),
            **(_own_parameters(path, role, chunk, names) if names else {})}


def _own_parameters(path: str, role: str, chunk, names: list[str]) -> dict:
    """:func:`load_parameters` from this checkpoint's own files."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    stored = _stored_regions(unwrap(chunk), f"{role}.", names)
    state, origin = {}, {}
    for key, regions in stored.items():  # one region per stored tensor: the regions' box
        lo = tuple(map(min, zip(*(r.offsets for r in regions))))
        hi = tuple(map(max, zip(*(tuple(o + e for o, e in zip(r.offsets, r.extent))
                                  for r in regions))))
        box = tuple(b - a for a, b in zip(lo, hi))
        if math.prod(box) != sum(math.prod(r.extent) for r in regions):
            raise ValueError(f"{key}: the parameters asked for are not one block of it")
        state[key], origin[key] = torch.empty(box, dtype=regions[0].dtype), lo
    dcp_load(state, storage_reader=FileSystemReader(path), no_dist=True,
             planner=_RegionLoadPlanner(origin))
    out = {}
    for key, regions in stored.items():
        for r in regions:
            part = state[key][tuple(slice(o - a, o - a + e) for o, a, e in
                                    zip(r.offsets, origin[key], r.extent))]
            out[r.name] = part.reshape(r.shape)
    return out


@dataclass(frozen=True)
class _Region:
    """Where a parameter lives in a stored (global) tensor."""

    name: str  # the parameter's state-dict name
    offsets: tuple[int, ...]  # its first element in the stored tensor
    extent: tuple[int, ...]  # its size there (a stacked layer's leading 1 included)
    shape: tuple[int, ...]  # its own shape
    dtype: torch.dtype


def _stored_regions(model, prefix: str, names: list[str]) -> dict[str, list[_Region]]:
    """stored tensor name -> the regions of it that parameters in ``names`` are, from
    megatron's sharded state dict of the TP=1 ``model`` (the gated MLP's factory gives its
    two halves, which together are the parameter)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    wanted = {prefix + n: n for n in names}
    regions: dict[str, list[_Region]] = {}
    for key, item in sharded_state_dict(model, prefix=prefix).items():
        if key not in wanted:
            continue
        parts = item.build() if isinstance(item, ShardedTensorFactory) else [item]
        parts = list(parts.values() if isinstance(parts, dict) else parts)
        starts = [p.global_offset for p in parts]
        ends = [tuple(o + n for o, n in zip(p.global_offset, (1,) * p.prepend_axis_num
                                             + tuple(p.local_shape))) for p in parts]
        lo, hi = tuple(map(min, zip(*starts))), tuple(map(max, zip(*ends)))
        extent = tuple(b - a for a, b in zip(lo, hi))
        if math.prod(extent) != item.data.numel() or len({p.key for p in parts}) != 1:
            raise ValueError(f"{key}: its stored parts do not tile one region")
        regions.setdefault(parts[0].key, []).append(
            _Region(wanted.pop(key), lo, extent, tuple(item.data.shape), item.data.dtype))
    if wanted:
        raise KeyError(f"the model has no parameters {sorted(wanted.values())[:4]}")
    return regions


class _RegionLoadPlanner(DefaultLoadPlanner):
    """torch's load planner for plain tensors that are regions of the stored ones
    (``offsets``: where each starts); a region the checkpoint does not wholly hold is an
    error, not uninitialised memory."""

    def __init__(self, offsets: dict[str, tuple[int, ...]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.offsets = offsets

    def create_local_plan(self) -> LoadPlan:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        items = []
        for key, tensor in self.state_dict.items():
            stored = self.metadata.state_dict_metadata.get(key)
            if stored is None or not hasattr(stored, "chunks"):
                raise KeyError(f"the checkpoint holds no tensor '{key}'")
            region = ChunkStorageMetadata(offsets=torch.Size(self.offsets[key]),
                                          sizes=tensor.shape)
            reads = create_read_items_for_chunk_list(key, stored, [region])
            held = sum(math.prod(r.lengths) for r in reads)
            if held != tensor.numel():
                raise ValueError(f"the checkpoint holds {held} of the {tensor.numel()} values "
                                 f"of '{key}' at {tuple(self.offsets[key])} "
                                 f"(stored {tuple(stored.size)})")
            items.extend(reads)
        return LoadPlan(items)

    def lookup_tensor(self, index):
        return self.state_dict[index.fqn]  # the region itself: reads are placed within it


def _legacy_plain(meta: dict, role: str) -> bool:
    """A trained role saved before the one optimizer format, by the plain optimizer."""
    if meta["roles"][role].get("optimizer_format"):
        return False
    return meta.get("config", {}).get("optimizer", {}).get("use_distributed_optimizer") \
        is False


def _strip_prefix(state: dict, prefix: str) -> dict:
    return {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in state.items()}
