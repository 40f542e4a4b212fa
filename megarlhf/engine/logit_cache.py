"""A persistent cache of a frozen model's outputs on a dataset: per-token log-probs (the DPO
reference) or the top-k log-probs and token ids per position (a distillation teacher).

A frozen model's outputs never change for one (checkpoint, data, temperature, k), so it is
run once, at its own layout, and never resident while the trained model learns.

On disk, a folder::

    manifest.json                        written last: its presence means complete
    shard-00000-of-00002.safetensors     the rows one data-parallel replica scored
    shard-00001-of-00002.safetensors

Each shard holds ``row_ids`` (R,) int64, ``offsets`` (R + 1,) int64 into the position axis,
``logprobs`` (N,) fp32 - the log-prob of token t + 1 at position t, N = sum of (row length
- 1) - and for top-k caches ``topk_logprobs`` (N, k) fp32 and ``topk_ids`` (N, k) int64.
The manifest records the key (the checkpoint's identity, a hash of the tokenized rows, the
temperature and k), each shard's byte size and (``checkpoint.checksums``) its SHA-256. A
cache is written into a ``.tmp-*`` sibling and renamed into place by rank 0 after every
shard is on disk, so a crash never leaves a folder that reads as complete; readers check
every shard against the manifest, and a shard changed in place reads as damaged (the
cache is rebuilt). Any layout reads any cache: every rank loads the rows it asks for.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megarlhf.data.batching import pad_batch
from megarlhf.data.packing import pack_rows
from megarlhf.engine.checkpoint import (META_FILE, checksums_on, file_problem, file_record,
                                       resolve_checkpoint)
from megarlhf.engine.forward import forward_rows
from megarlhf.models.logprobs import vocab_parallel_logprobs, vocab_parallel_topk

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class CacheKey:
    """What a cache's numbers depend on; two caches with equal keys hold equal numbers."""

    checkpoint: str  # resolved checkpoint folder
    checkpoint_id: str  # its tag and a hash of its metadata (step, config, layout)
    role: str  # the role read from it
    data_hash: str  # sha256 of the tokenized rows, in order
    num_rows: int
    temperature: float
    top_k: int  # 0: per-token log-probs only

    def differences(self, other: "CacheKey") -> list[str]:
        names = {"checkpoint_id": "checkpoint", "data_hash": "data", "num_rows": "rows",
                 "top_k": "top-k", "temperature": "temperature", "role": "role",
                 "checkpoint": "checkpoint path"}
        out = []
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                out.append(f"{names[f.name]}: cache has {theirs!r}, this run needs {mine!r}")
        return out


def checkpoint_identity(path: str) -> tuple[str, str]:
    """(resolved folder, "<tag> sha256:<hash of its metadata file>")."""
    resolved = resolve_checkpoint(path)
    with open(os.path.join(resolved, META_FILE), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    return resolved, f"{os.path.basename(resolved)} sha256:{digest}"


def data_hash(rows: Sequence[Sequence[int]]) -> str:
    h = hashlib.sha256()
    for row in rows:
        h.update(torch.tensor(list(row), dtype=torch.int64).numpy().tobytes())
        h.update(b"|")
    return h.hexdigest()


def make_key(checkpoint: str, role: str, rows: Sequence[Sequence[int]], *,
             temperature: float = 1.0, top_k: int = 0) -> CacheKey:
    resolved, ident = checkpoint_identity(checkpoint)
    return CacheKey(resolved, ident, role, data_hash(rows), len(rows), float(temperature),
                    int(top_k))


# ------------------------------------------------------------------ reading

class CacheError(ValueError):
    """A cache that cannot be used: incomplete, damaged or stale (the message says which)."""


@dataclass
class LogitCache:
    """A complete cache in memory: per row, (T,) log-probs and optionally (T, k) top-k."""

    key: CacheKey
    logprobs: list[torch.Tensor]
    topk_logprobs: list[torch.Tensor] | None = None
    topk_ids: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.logprobs)


def inspect(path: str, key: CacheKey, *, verify: bool = True) -> tuple[str, str]:
    """("complete" | "missing" | "incomplete" | "damaged" | "stale", why) without loading
    tensors; ``verify``: each shard's SHA-256 against the manifest's, where it records one
    and ``checkpoint.checksums`` is on (the shard is read once)."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        return "missing", f"no cache at {path}"
    if not os.path.exists(manifest_path):
        return "incomplete", f"{path} has no {MANIFEST} (a build that did not finish)"
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        saved = CacheKey(**manifest["key"])
    except (ValueError, KeyError, TypeError) as err:
        return "incomplete", f"{manifest_path} is unreadable ({err})"
    if manifest.get("format") != FORMAT_VERSION:
        return "stale", f"format {manifest.get('format')}, this version reads {FORMAT_VERSION}"
    diffs = key.differences(saved)
    if diffs:
        return "stale", "; ".join(diffs)
    for shard in manifest["shards"]:
        file = os.path.join(path, shard["file"])
        if not os.path.exists(file):
            return "incomplete", f"shard {shard['file']} is missing"
        if os.path.getsize(file) != shard["bytes"]:
            return "incomplete", (f"shard {shard['file']} has {os.path.getsize(file)} bytes, "
                                  f"the manifest says {shard['bytes']}")
        if verify and checksums_on() and "sha256" in shard:
            problem = file_problem(file, shard)
            if problem:
                return "damaged", problem
    return "complete", ""


def load_cache(path: str, key: CacheKey, *, verified: bool = False) -> LogitCache:
    """Every row of a complete, matching cache (raises :class:`CacheError` otherwise);
    ``verified``: :func:`inspect` has just checked its shards' checksums."""
    from safetensors.torch import load_file

    status, why = inspect(path, key, verify=not verified)
    if status != "complete":
        raise CacheError(f"cache {path} is {status}: {why}")
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    rows: dict[int, tuple] = {}
    for shard in manifest["shards"]:
        try:  # copies, not views of the mapped file (a rebuild replaces the file)
            t = {k: v.clone() for k, v in load_file(os.path.join(path, shard["file"])).items()}
        except Exception as err:  # SafetensorError: truncated or damaged
            raise CacheError(f"cache shard {shard['file']} in {path} is damaged ({err})") \
                from None
        offsets = t["offsets"].tolist()
        for j, row in enumerate(t["row_ids"].tolist()):
            a, b = offsets[j], offsets[j + 1]
            rows[row] = (t["logprobs"][a:b],
                         t["topk_logprobs"][a:b] if "topk_logprobs" in t else None,
                         t["topk_ids"][a:b] if "topk_ids" in t else None)
    if sorted(rows) != list(range(key.num_rows)):
        raise CacheError(f"cache {path} holds {len(rows)} of {key.num_rows} rows")
    ordered = [rows[i] for i in range(key.num_rows)]
    topk = key.top_k > 0
    return LogitCache(key, [r[0] for r in ordered],
                      [r[1] for r in ordered] if topk else None,
                      [r[2] for r in ordered] if topk else None)


# ------------------------------------------------------------------ building

def _cache_step(*, tp_group, true_vocab: int, temperature: float, top_k: int):
    """Forward-only step: per row, log-probs of tokens[1:] and (top_k > 0) the top k;
    padded, or packed (``data.packing.pack_rows`` keeping every position but each row's
    last), the results in the same (B, T, ...) layout."""
    from megarlhf.data.packing import unpack
    from megarlhf.engine.steps import model_forward

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        packed = "keep" in batch
        output = model_forward(model, batch, batch.get("keep"))

        def loss_func(logits, non_loss_data=True):
            if not packed:
                logits = logits[:, :-1]
            logprobs, _ = vocab_parallel_logprobs(
                logits, batch["targets"] if packed else batch["tokens"][:, 1:],
                tp_group=tp_group, temperature=temperature, true_vocab=true_vocab)
            out = {"logprobs": logprobs}
            if top_k:
                out["topk_logprobs"], out["topk_ids"] = vocab_parallel_topk(
                    logits, top_k, tp_group=tp_group, temperature=temperature,
                    true_vocab=true_vocab)
            return {k: unpack(v, batch) for k, v in out.items()} if packed else out

        return output, loss_func

    return forward_step


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def build_cache(role, rows: Sequence[Sequence[int]], path: str, key: CacheKey, *,
                micro_batch_size: int, max_len: int, pad_id: int = 0,
                max_tokens: int | None = None) -> None:
    """Score ``rows`` with the frozen ``role`` (any layout) and write the cache at ``path``
    atomically. Data-parallel replica d scores rows d::DP - or packed (``max_tokens`` per
    micro-batch), a share of balanced token count - and its reporting rank writes shard d;
    rank 0 writes the manifest and renames the folder into place."""
    from safetensors.torch import save_file

    layout = role.layout
    parent = os.path.dirname(os.path.abspath(path)) or "."
    token = [uuid.uuid4().hex[:8] if _rank() == 0 else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(token)
    tmp = os.path.join(parent, f".tmp-{os.path.basename(path)}-{token[0]}")
    if _rank() == 0:
        os.makedirs(parent, exist_ok=True)
        for stale in os.listdir(parent):  # builds that died: never read, give space back
            if stale.startswith(f".tmp-{os.path.basename(path)}-"):
                shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    length = min(max(len(r) for r in rows), max_len)
    step = _cache_step(tp_group=layout.tp_group, true_vocab=role.spec.model.vocab_size,
                       temperature=key.temperature, top_k=key.top_k)
    if max_tokens is not None:
        local = forward_rows(role, list(rows), lambda batch: pack_rows(
            batch, [list(range(len(r) - 1)) for r in batch], pad_id=pad_id), step,
            micro_batch_size=1, gather=False, max_tokens=max_tokens,
            lengths=[len(r) for r in rows])
    else:
        local = forward_rows(role, list(rows), lambda batch: pad_batch(
            [(list(r), []) for r in batch], length, pad_id), step,
            micro_batch_size=micro_batch_size, gather=False)
    bad = torch.tensor([float(sum(int((~torch.isfinite(v["logprobs"])).sum())
                                  for v in local.values())) if layout.writes_results else 0.0])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(bad)
    if bad.item():
        raise CacheError(f"building the cache {path}: {int(bad.item())} of the frozen "
                         f"model's log-probs are not finite (NaN/inf) - its weights or the "
                         "data are damaged; nothing was written")
    shard_name = f"shard-{layout.dp_rank:05d}-of-{layout.dp:05d}.safetensors"
    if layout.writes_results:
        ids = sorted(local)
        lengths = [len(rows[i]) - 1 for i in ids]
        tensors = {"row_ids": torch.tensor(ids, dtype=torch.int64),
                   "offsets": torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0),
                   "logprobs": torch.cat([local[i]["logprobs"][:n] for i, n in
                                          zip(ids, lengths)]).float().contiguous()}
        if key.top_k:
            for name in ("topk_logprobs", "topk_ids"):
                tensors[name] = torch.cat([local[i][name][:n] for i, n in
                                           zip(ids, lengths)]).contiguous()
        save_file(tensors, os.path.join(tmp, shard_name))
    _barrier()
    if _rank() == 0:
        shards = sorted(f for f in os.listdir(tmp) if f.endswith(".safetensors"))
        manifest = {"format": FORMAT_VERSION, "key": dataclasses.asdict(key),
                    "shards": [{"file": f, **_shard_record(os.path.join(tmp, f))}
                               for f in shards],
                    "built_at_layout": layout.describe()}
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    _barrier()


def _shard_record(file: str) -> dict:
    return file_record(file) if checksums_on() else {"bytes": os.path.getsize(file)}


def ensure_cache(path: str, key: CacheKey, build: Callable[[], None], *, on_stale: str,
                 log: Callable[[str], None] = print) -> LogitCache:
    """The cache at ``path`` for ``key``: loaded when complete and matching; built when
    missing or incomplete; a stale one is rebuilt (``on_stale="rebuild"``) or refused with
    what differs (``"error"``). ``build`` writes it (every rank calls it)."""
    status, why = inspect(path, key)
    if status == "stale" and on_stale == "error":
        raise CacheError(f"the cache at {path} was built for something else - {why}. "
                         "Set cache.on_stale=rebuild, or point cache.path elsewhere")
    if status != "complete":
        if status != "missing":
            log(f"cache {path} is {status} ({why}): rebuilding")
        else:
            log(f"building the cache {path}")
        build()
    else:
        log(f"cache {path}: complete, {key.num_rows} rows ({key.checkpoint_id})")
    return load_cache(path, key, verified=status == "complete")
