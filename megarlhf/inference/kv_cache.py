"""The KV cache's measured bytes."""

from __future__ import annotations

import torch

from megarlhf.roles.offload import storage_bytes


def kv_cache_bytes(context) -> int:
    """Bytes of the key/value buffers megatron's inference context allocated."""
    tensors = [t for kv in getattr(context, "key_value_memory_dict", {}).values()
               for t in kv if isinstance(t, torch.Tensor)]
    return storage_bytes(tensors)
