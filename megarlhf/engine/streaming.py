"""Checkpoints and Hugging Face files whose tensors are made one at a time, when they are
written: what lets a converter hold about one layer of a model however deep it is.

megatron-core's ``torch_dist`` save is one call that, through its asynchronous writer,
first copies every tensor of the state dict: a model converted from Hugging Face would be
held whole. Here the model is built on the meta device (megatron's own modules, so its own
sharded layout: layers stacked on a leading axis, the gated MLP's halves, extra state) and
saved through megatron's ``dist_checkpointing.save`` with :class:`StreamingSave` as the
sharded strategy. It translates the state dict as megatron's strategy does and writes it
with torch's synchronous file writer and megatron's planner, whose ``resolve_data`` asks
``produce(name)`` for each tensor as it is written. Only one parameter (and the piece being
written) is in memory at a time. The files, ``metadata.json`` and ``common.pt`` are
megatron's own format; any layout loads them.

:class:`SafetensorsFiles` is the other direction's writer: safetensors files whose header
is written from the tensors' shapes before any data, each tensor put in its place when it
is made. :func:`return_freed_memory` keeps the memory freed between tensors from staying
in the process.
"""

from __future__ import annotations

import ctypes
import json
import os
from typing import Callable

import torch
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner, TorchDistSaveShardedStrategy, _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict)
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.planner import WriteItemType


class _ProducingPlanner(MCoreSavePlanner):
    """megatron's save planner, with each tensor made when the writer asks for it: the
    state dict holds meta tensors (parameters of a meta-device model, views of them, or
    ``.data`` aliases), mapped back to their parameter by the storage they share."""

    def __init__(self, params: dict[str, torch.Tensor],
                 produce: Callable[[str], torch.Tensor], **kwargs):
        super().__init__(**kwargs)
        self.params, self.produce = params, produce
        self.names = {storage_id(p): name for name, p in params.items()}
        self._last: tuple[str, torch.Tensor] | None = None  # the gated MLP asks twice

    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        meta = self.lookup_object(write_item.index)
        name = self.names.get(storage_id(meta))
        if name is None:
            raise RuntimeError(f"checkpoint item {write_item.index.fqn} is not a view of a "
                               "parameter of the model")
        if self._last is None or self._last[0] != name:
            self._last = None  # let the previous tensor go first
            full, base = self.produce(name), self.params[name]
            if tuple(full.shape) != tuple(base.shape) or full.dtype != base.dtype:
                raise RuntimeError(f"{name}: made {tuple(full.shape)} {full.dtype}, the model "
                                   f"holds {tuple(base.shape)} {base.dtype}")
            full = full.contiguous()
            if full.storage_offset():  # a view into a larger tensor: as_strided below
                full = full.clone()  # reads from the storage's start, as the meta's does
            self._last = (name, full)
        return self._last[1].as_strided(meta.shape, meta.stride(), meta.storage_offset())


def storage_id(tensor: torch.Tensor) -> int:
    """The identity of the storage behind ``tensor`` (meta tensors have storages too)."""
    return tensor.untyped_storage()._cdata


class StreamingSave(TorchDistSaveShardedStrategy):
    """megatron's ``torch_dist`` format (same backend and version, so loads are unchanged),
    written synchronously with each tensor made by ``produce(name)`` for the meta model's
    ``params`` (state-dict name -> parameter)."""

    def __init__(self, params: dict[str, torch.Tensor],
                 produce: Callable[[str], torch.Tensor]):
        super().__init__("torch_dist", 1)
        self.params, self.produce = params, produce

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, self.keep_only_main_replica)
        state = mcore_to_pyt_state_dict(sharded_state_dict, False)
        planner = _ProducingPlanner(self.params, self.produce,
                                    dedup_replicated_tensors=not self.keep_only_main_replica,
                                    flatten_state_dict=False)
        # One file per tensor: torch's writer keeps every tensor of a file referenced until
        # the file is done (for its safetensors format), so one file per rank would hold
        # one tensor of each name - the embedding, the head, one of each layer's - to the end.
        dcp_save(state, storage_writer=FileSystemWriter(str(checkpoint_dir), thread_count=1,
                                                        single_file_per_rank=False),
                 planner=planner)


def return_freed_memory(threshold: int = 4 << 20) -> bool:
    """Have glibc's allocator give every block of ``threshold`` bytes or more back to the
    system when it is freed. By default the threshold rises to the largest block freed so
    far, and a stream of tensors of a layer's size then stays in the heap: a conversion at
    hidden 2048 peaked at 586 MiB with it and 504 MiB without, at 8 and at 16 layers
    (bench/convert.py). False where the C library is not glibc (nothing changes)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_mmap_threshold = -3
    return bool(libc.mallopt(m_mmap_threshold, threshold))


# safetensors' dtype names, in the order of its own Dtype enum (it sorts by it)
_SAFETENSORS_DTYPES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8",
                       torch.int16: "I16", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int32: "I32", torch.float32: "F32", torch.float64: "F64",
                       torch.int64: "I64"}
_DTYPE_ORDER = {"BOOL": 0, "U8": 1, "I8": 2, "I16": 3, "F16": 4, "BF16": 5, "I32": 6,
                "F32": 7, "F64": 8, "I64": 9}


class SafetensorsFiles:
    """Safetensors files written a tensor at a time. ``plan`` maps each file name in
    ``folder`` to its tensors (name -> a tensor of the shape and dtype to come, on the meta
    device), so every header is written first; :meth:`write` puts a tensor at its offset
    and :meth:`finish` checks that every one came. The layout is the safetensors library's
    (tensors by dtype, then name; a JSON header padded with spaces to 8 bytes), so a file
    is byte for byte what ``save_file`` writes for the same tensors."""

    def __init__(self, folder: str, plan: dict[str, dict[str, torch.Tensor]],
                 metadata: dict[str, str] | None = None):
        self.where: dict[str, tuple] = {}  # tensor -> (file, offset, shape, dtype)
        self.files = {}
        for fname, tensors in plan.items():
            order = sorted(tensors, key=lambda n: (-_DTYPE_ORDER[_dtype_name(tensors[n])], n))
            header: dict = {"__metadata__": metadata} if metadata else {}
            start, places = 0, {}
            for name in order:
                t = tensors[name]
                end = start + t.numel() * t.element_size()
                header[name] = {"dtype": _dtype_name(t), "shape": list(t.shape),
                                "data_offsets": [start, end]}
                places[name], start = header[name]["data_offsets"][0], end
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)
            f = open(os.path.join(folder, fname), "wb")
            f.write(len(text).to_bytes(8, "little") + text)
            f.truncate(8 + len(text) + start)
            self.files[fname] = f
            for name in order:
                self.where[name] = (f, 8 + len(text) + places[name], tuple(tensors[name].shape),
                                    tensors[name].dtype)
        self.written: set[str] = set()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.where:
            raise KeyError(f"{name} is not in the planned files")
        f, offset, shape, dtype = self.where[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"{name}: {tuple(tensor.shape)} {tensor.dtype}, planned "
                             f"{shape} {dtype}")
        f.seek(offset)
        f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self.written.add(name)

    def close(self) -> None:
        """Close the files (also after a failure)."""
        for f in self.files.values():
            f.close()

    def finish(self) -> None:
        """Close the files, checking that every planned tensor was written."""
        self.close()
        missing = sorted(set(self.where) - self.written)
        if missing:
            raise RuntimeError(f"{len(missing)} of {len(self.where)} tensors never written: "
                               f"{missing[:4]}")


def _dtype_name(tensor: torch.Tensor) -> str:
    if tensor.dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"safetensors cannot hold {tensor.dtype}")
    return _SAFETENSORS_DTYPES[tensor.dtype]
