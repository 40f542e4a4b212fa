"""Checkpoints through ``megatron.core.dist_checkpointing``: layout-independent, so a
model saved at TP=2 loads at TP=1 or PP=2.

Atomicity: every rank writes into ``<dir>/.tmp-<tag>``; after a barrier rank 0 renames
it to ``<dir>/<tag>`` and only then rewrites ``<dir>/latest`` (write + ``os.replace``).
A crash at any point leaves the previous ``latest`` pointing at a complete checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil

import torch.distributed as dist
from megatron.core import dist_checkpointing

META_FILE = "megarlhf_meta.json"
LATEST_FILE = "latest"


def _model_state(model_chunks: list) -> dict:
    if len(model_chunks) == 1:
        return {"model": model_chunks[0].sharded_state_dict()}
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(model_chunks)}


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def resolve_checkpoint(path: str) -> str:
    """A run's checkpoint folder (holding ``latest``) or one checkpoint -> the checkpoint."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    latest = os.path.join(path, LATEST_FILE)
    if os.path.exists(latest):
        with open(latest) as f:
            tag = f.read().strip()
        path = os.path.join(path, tag)
    if not os.path.exists(os.path.join(path, META_FILE)):
        raise FileNotFoundError(f"{path!r} is not a megarlhf checkpoint (no {META_FILE})")
    return path


def read_meta(path: str) -> dict:
    with open(os.path.join(resolve_checkpoint(path), META_FILE)) as f:
        return json.load(f)


def save_checkpoint(save_dir: str, tag: str, model_chunks: list, meta: dict,
                    keep_last: int | None = None) -> str:
    """Write ``model_chunks`` (and ``meta``, a JSON-able dict) as ``save_dir/tag``."""
    final = os.path.join(save_dir, tag)
    tmp = os.path.join(save_dir, f".tmp-{tag}")
    if _rank() == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    dist_checkpointing.save(_model_state(model_chunks), tmp)
    _barrier()
    if _rank() == 0:
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump({**meta, "num_chunks": len(model_chunks)}, f, indent=1)
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


def _prune(save_dir: str, keep_last: int, protect: str) -> None:
    tags = sorted(d for d in os.listdir(save_dir)
                  if not d.startswith(".") and os.path.isdir(os.path.join(save_dir, d))
                  and os.path.exists(os.path.join(save_dir, d, META_FILE)))
    for old in tags[:-keep_last]:
        if old != protect:
            shutil.rmtree(os.path.join(save_dir, old), ignore_errors=True)


def load_checkpoint(path: str, model_chunks: list) -> dict:
    """Load model weights from ``path`` into ``model_chunks`` (any layout); returns meta."""
    path = resolve_checkpoint(path)
    meta = read_meta(path)
    # Tensors are matched by their global names (layer offsets included), so chunks
    # of any pipeline split find their weights.
    state = _model_state(model_chunks)
    loaded = dist_checkpointing.load(state, path)
    for i, chunk in enumerate(model_chunks):
        key = "model" if len(model_chunks) == 1 else f"model{i}"
        chunk.load_state_dict(loaded[key], strict=True)
    return meta
