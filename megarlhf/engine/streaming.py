"""Save a checkpoint whose tensors are made one at a time, when they are written.

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
"""

from __future__ import annotations

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
            self._last = (name, full.contiguous())
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
        dcp_save(state, storage_writer=FileSystemWriter(str(checkpoint_dir), thread_count=1,
                                                        single_file_per_rank=True),
                 planner=planner)
