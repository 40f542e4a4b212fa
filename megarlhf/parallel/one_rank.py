"""Collectives over a group of one rank return at once.

A group of one has nothing to exchange: an all-reduce (sum, average, max, min, product,
bitwise), a broadcast or a barrier leaves every tensor as it is. megatron-core still issues
them where a role has one data-parallel, pipeline or model-parallel rank: the gradient
sync, the loss-token count, the gradient norm. At the tiny benchmark size a PPO iteration
makes about 50 all-reduces and 16 broadcasts on one-rank groups, and gloo spends about
0.1 ms in each (about 3% of that iteration, measured in BENCHMARKS.md).

Only synchronous calls return early: an asynchronous one (``async_op=True``) goes to torch,
whose ``Work`` handle the caller waits on. A group this rank is not in (size -1) and any
other reduction (``PREMUL_SUM`` scales) go to torch too.
"""

from __future__ import annotations

import functools

import torch.distributed as dist

_ORIGINALS: dict = {}


def _identity_op(op) -> bool:
    R = dist.ReduceOp
    return any(op == kind for kind in (R.SUM, R.AVG, R.MAX, R.MIN, R.PRODUCT, R.BAND,
                                       R.BOR, R.BXOR))


def _alone(group) -> bool:
    return dist.get_world_size(group) == 1


def _all_reduce(original):
    @functools.wraps(original)
    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not async_op and _alone(group) and _identity_op(op):
            return None
        return original(tensor, op=op, group=group, async_op=async_op)
    return all_reduce


def _broadcast(original):
    @functools.wraps(original)
    def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
        if not async_op and _alone(group):
            return None
        return original(tensor, src=src, group=group, async_op=async_op, group_src=group_src)
    return broadcast


def _barrier(original):
    @functools.wraps(original)
    def barrier(group=None, async_op=False, device_ids=None, timeout=None):
        if not async_op and _alone(group):
            return None
        return original(group=group, async_op=async_op, device_ids=device_ids,
                        timeout=timeout)
    return barrier


_WRAPPERS = {"all_reduce": _all_reduce, "broadcast": _broadcast, "barrier": _barrier}


def gather_objects(obj) -> list:
    """``dist.all_gather_object`` of ``obj`` over the world, as a list by rank; ``[obj]``
    without pickling where the world is one process (or none was started)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


def install() -> None:
    """Make ``torch.distributed``'s all-reduce, broadcast and barrier return at once on a
    one-rank group. Idempotent."""
    for name, wrap in _WRAPPERS.items():
        if name not in _ORIGINALS:
            _ORIGINALS[name] = getattr(dist, name)
            setattr(dist, name, wrap(_ORIGINALS[name]))


def uninstall() -> None:
    """Undo :func:`install` (used by tests)."""
    for name, original in _ORIGINALS.items():
        setattr(dist, name, original)
    _ORIGINALS.clear()
