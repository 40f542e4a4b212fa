"""Python objects gathered from every rank."""

from __future__ import annotations

import torch.distributed as dist


def gather_objects(obj) -> list:
    """``dist.all_gather_object`` of ``obj`` over the world, as a list by rank; ``[obj]``
    without pickling where the world is one process (or none was started)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts
