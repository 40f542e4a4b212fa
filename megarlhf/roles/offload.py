"""Moving model state off the accelerator between phases and back.

One mechanism for every role: the *storage* behind a set of tensors is copied to host
memory (pinned on GPU) and resized to zero, then resized back and refilled. Every tensor
and view over that storage - a parameter, megatron's ``main_grad`` views into the
contiguous gradient buffer, the distributed optimizer's shard views - stays the same
Python object and is valid again after the return, so nothing has to be re-wired.
On CPU the same code runs (host to host), so its correctness is tested everywhere.

- :class:`Offloader`: a frozen role's parameters (reference, reward model), around its
  scoring passes.
- :class:`TrainedOffloader`: a trained role's optimizer state, gradient buffers and
  (level ``all``) parameters during rollout - see ``RoleConfig.offload``.
"""

from __future__ import annotations

import torch

OFFLOAD_LEVELS = ("none", "optimizer", "optimizer+grads", "all")
# What each level moves off the device while the rollout runs.
LEVEL_PARTS = {"none": (), "optimizer": ("optimizer",),
               "optimizer+grads": ("optimizer", "grads"),
               "all": ("optimizer", "grads", "params")}


def unique_storages(tensors, skip: set[int] | None = None) -> list[torch.UntypedStorage]:
    """The distinct, non-empty storages behind ``tensors`` (in first-seen order), leaving
    out those whose ``data_ptr`` is in ``skip``; their pointers are added to ``skip``."""
    seen = skip if skip is not None else set()
    out = []
    for t in tensors:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if storage.nbytes() == 0 or ptr in seen:
            continue
        seen.add(ptr)
        out.append(storage)
    return out


def storage_bytes(tensors) -> int:
    """Bytes of the distinct live storages behind ``tensors``."""
    return sum(s.nbytes() for s in unique_storages(tensors))


class StorageStash:
    """The storages of a set of tensors, released and restored as one. ``keep=False``
    drops the contents instead of copying them (gradient buffers: every training step
    zeroes them first); they come back zeroed. Host buffers are kept for the next cycle
    (pinned allocations are slow)."""

    def __init__(self, keep: bool = True, fill: int = 0):
        self.keep = keep
        self.fill = fill  # the byte a storage that was not kept comes back filled with
        self.held: list[tuple[torch.UntypedStorage, int]] = []  # released, with their size
        self.host: list[torch.Tensor] = []

    @property
    def released(self) -> bool:
        return bool(self.held)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.held)

    def release(self, storages: list[torch.UntypedStorage]) -> int:
        """Copy (when ``keep``) and free ``storages``; returns the bytes freed."""
        if self.held:
            return 0
        cuda = any(s.device.type == "cuda" for s in storages)
        for i, storage in enumerate(storages):
            n = storage.nbytes()
            if self.keep:
                if i >= len(self.host) or self.host[i].numel() != n:
                    buf = torch.empty(n, dtype=torch.uint8, device="cpu", pin_memory=cuda)
                    self.host[i:i + 1] = [buf]
                self.host[i].untyped_storage().copy_(storage, non_blocking=cuda)
            self.held.append((storage, n))
        if cuda:
            torch.cuda.synchronize()  # the copies finish before the device memory is freed
        for storage, _ in self.held:
            storage.resize_(0)
        if cuda:
            torch.cuda.empty_cache()
        return self.nbytes

    def restore(self) -> int:
        """Reallocate and refill (or zero) what :meth:`release` freed; returns the bytes."""
        total = self.nbytes
        for i, (storage, n) in enumerate(self.held):
            storage.resize_(n)
            if self.keep:
                storage.copy_(self.host[i].untyped_storage(), non_blocking=True)
            else:
                torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage) \
                    .fill_(self.fill)
        self.held = []
        return total


class Offloader:
    """A frozen role's parameters off the device between its passes, and back."""

    def __init__(self, chunks: list, enabled: bool):
        self.params = [p for chunk in chunks for p in chunk.parameters()]
        self.enabled = enabled
        self._stash = StorageStash(keep=True)

    def offload(self) -> None:
        if self.enabled:
            self._stash.release(unique_storages(self.params))

    def reload(self) -> None:
        self._stash.restore()

    @property
    def offloaded(self) -> bool:
        return self._stash.released

    @property
    def stash(self) -> list[torch.Tensor]:
        """The host copies (pinned on GPU)."""
        return self._stash.host


def trained_role_tensors(role) -> dict[str, list[torch.Tensor]]:
    """A trained role's tensors by part: ``params`` (the model chunks' parameters; with the
    distributed optimizer views into megatron's contiguous param buffer), ``grads``
    (megatron DDP's contiguous gradient buffers) and ``optimizer`` (Adam's state and the
    fp32 master copies of low-precision parameters; fp32 masters are the parameters
    themselves and count there)."""
    trained = role.trained
    params = [p for chunk in role.chunks for p in chunk.parameters()]
    grads = [buf.grad_data for ddp in trained.model
             for buf in list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", []))]
    optimizer = []
    for opt in getattr(trained.optimizer, "chained_optimizers", [trained.optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            optimizer.extend(group["params"])
        for state in inner.state.values():
            optimizer.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return {"params": params, "grads": grads, "optimizer": optimizer}


def part_storages(role) -> dict[str, list[torch.UntypedStorage]]:
    """:func:`trained_role_tensors` as distinct storages, each counted once, in the part
    that owns it (params, then grads, then optimizer)."""
    tensors = trained_role_tensors(role)
    seen: set[int] = set()
    return {part: unique_storages(tensors[part], seen) for part in ("params", "grads",
                                                                     "optimizer")}


class TrainedOffloader:
    """A trained role's state off the device while the rollout runs (``level``, one of
    :data:`OFFLOAD_LEVELS`). Optimizer state and gradients leave before generation and
    return before training; parameters (level ``all``) leave after the actor has been
    resharded into the inference model and return for the experience passes (old
    log-probs, values), which need them. Gradients are dropped, not copied."""

    def __init__(self, role, level: str):
        if level not in OFFLOAD_LEVELS:
            raise ValueError(f"offload level must be one of {OFFLOAD_LEVELS}, got {level!r}")
        self.role, self.level = role, level
        self.stashes = {"params": StorageStash(keep=True), "grads": StorageStash(keep=False),
                        "optimizer": StorageStash(keep=True)}

    def release(self, parts: tuple[str, ...]) -> int:
        """Free ``parts`` that this level offloads; returns the bytes freed."""
        parts = tuple(p for p in parts if p in LEVEL_PARTS[self.level]
                      and not self.stashes[p].released)
        if not parts:
            return 0
        if "grads" in parts:
            # megatron's main-param .grad views into the buffer (and bf16 copies) go first.
            self.role.trained.optimizer.zero_grad()
        storages = part_storages(self.role)
        return sum(self.stashes[p].release(storages[p]) for p in parts)

    def restore(self, parts: tuple[str, ...]) -> int:
        return sum(self.stashes[p].restore() for p in parts if self.stashes[p].released)

    @property
    def released(self) -> dict[str, int]:
        """Bytes currently off the device, by part."""
        return {p: s.nbytes for p, s in self.stashes.items() if s.released}
