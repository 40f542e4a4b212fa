"""Per-phase memory accounting, measured.

Static parts (parameters, gradient buffers, optimizer state, the inference model, the KV
cache) are the bytes of the live storages behind each role's tensors - exact on CPU and
GPU alike, each storage counted once. Activations are the peak bytes of tensors autograd
holds for backward during the training phase (``saved_tensors_hooks``, storages counted
once, parameters excluded). On GPU the allocator's peak per phase is recorded too
(``memory/<phase>/peak_allocated``): it also sees transient buffers the CPU counters
cannot.

Metrics are MiB, the maximum over ranks, per iteration (the rollout, experience and
training of that iteration); :func:`format_table` prints the whole run's, with the saves.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarlhf.roles.offload import part_storages, storage_bytes, unique_storages

PHASES = ("rollout", "experience", "train", "save")
PARTS = ("params", "grads", "optimizer", "kv_cache", "activations")
MIB = 2**20


def role_bytes(role) -> dict[str, int]:
    """A built role's resident bytes by part (a frozen role has parameters only)."""
    if role.trained is None:
        return {"params": storage_bytes(role.parameters)}
    return {part: sum(s.nbytes() for s in storages)
            for part, storages in part_storages(role).items()}


def chunks_bytes(chunks: list) -> int:
    return storage_bytes([p for chunk in chunks for p in chunk.parameters()])


class _Saved:
    """A tensor autograd keeps for backward; its bytes leave the count when autograd
    drops it."""

    __slots__ = ("meter", "key", "tensor")

    def __init__(self, meter: "ActivationMeter", key: int, tensor: torch.Tensor):
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self):
        self.meter._drop(self.key)


class ActivationMeter:
    """Peak bytes of the tensors autograd saves for backward inside the ``with`` block
    (activations), each storage counted once while any saved tensor uses it; storages in
    ``exclude`` (parameters) are not activations."""

    def __init__(self, exclude=()):
        self.exclude = {s.data_ptr() for s in unique_storages(exclude)}
        self.live: dict[int, list[int]] = {}  # storage ptr -> [bytes, references]
        self.current = self.peak = 0
        self._hooks: list = []

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self.exclude:
            return tensor
        entry = self.live.get(key)
        if entry is None:
            self.live[key] = [storage.nbytes(), 1]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        else:
            entry[1] += 1
        return _Saved(self, key, tensor)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _drop(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]

    def __enter__(self):
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._hooks.append(hooks)
        return self

    def __exit__(self, *exc):
        self._hooks.pop().__exit__(*exc)


class MemoryTracker:
    """Per (phase, role, part) the largest bytes seen on this rank, and per phase the
    largest total of one snapshot. ``roles`` maps a name to a built role, or to a list of
    model chunks (the inference model)."""

    def __init__(self, roles: dict):
        self.roles = {k: v for k, v in roles.items() if v is not None}
        # this iteration's peaks (the memory/* metrics), and the whole run's (the table)
        self.parts: dict[tuple[str, str, str], int] = {}
        self.totals: dict[str, int] = {}
        self.run_parts: dict[tuple[str, str, str], int] = {}
        self.run_totals: dict[str, int] = {}
        self.cuda = torch.cuda.is_available()

    def begin_iteration(self) -> None:
        self.parts, self.totals = {}, {}

    def _put(self, phase: str, role: str, part: str, value: int) -> None:
        key = (phase, role, part)
        self.parts[key] = max(self.parts.get(key, 0), int(value))
        self.run_parts[key] = max(self.run_parts.get(key, 0), int(value))

    def snapshot(self, phase: str, extra: dict[tuple[str, str], int] | None = None,
                 transient: dict[tuple[str, str], int] | None = None) -> int:
        """Record every role's resident bytes now, plus ``extra`` {(role, part): bytes}
        that coexist with them (the KV cache) and ``transient`` ones that peak one after
        the other (each trained role's activations: the total adds the largest); returns
        this snapshot's total."""
        total = 0
        for name, role in self.roles.items():
            parts = {"params": chunks_bytes(role)} if isinstance(role, list) else role_bytes(role)
            for part, value in parts.items():
                self._put(phase, name, part, value)
                total += value
        for (name, part), value in (extra or {}).items():
            self._put(phase, name, part, value)
            total += value
        for (name, part), value in (transient or {}).items():
            self._put(phase, name, part, value)
        total += max((transient or {}).values(), default=0)
        self.totals[phase] = max(self.totals.get(phase, 0), total)
        self.run_totals[phase] = max(self.run_totals.get(phase, 0), total)
        return total

    def start_phase(self, phase: str) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def end_phase(self, phase: str) -> None:
        if self.cuda:
            self._put(phase, "all", "peak_allocated", torch.cuda.max_memory_allocated())

    def metrics(self, whole_run: bool = False) -> dict[str, float]:
        """``memory/<phase>/<role>/<part>`` and ``memory/<phase>/total`` in MiB, the
        maximum over ranks, of this iteration (or of the whole run); a collective: every
        rank calls it."""
        parts, totals = (self.run_parts, self.run_totals) if whole_run else \
            (self.parts, self.totals)
        keys = sorted(parts) + [(phase, "", "total") for phase in sorted(totals)]
        values = torch.tensor([float(parts.get(k, 0)) if k[1] else float(totals[k[0]])
                               for k in keys], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        out = {}
        for (phase, role, part), value in zip(keys, values.tolist()):
            name = f"memory/{phase}/total" if not role else f"memory/{phase}/{role}/{part}"
            if value:
                out[name] = value / MIB
        return out


def format_table(metrics: dict[str, float], title: str) -> str:
    """``memory/*`` metrics (MiB) as one row per (role, part) and one column per phase."""
    rows: dict[tuple[str, str], dict[str, float]] = {}
    totals: dict[str, float] = {}
    for name, value in metrics.items():
        bits = name.split("/")
        if bits[0] != "memory":
            continue
        if len(bits) == 3 and bits[2] == "total":
            totals[bits[1]] = value
        elif len(bits) == 4:
            rows.setdefault((bits[2], bits[3]), {})[bits[1]] = value
    phases = [p for p in PHASES if p in totals or any(p in r for r in rows.values())]
    head = f"{'role':11s} {'part':15s}" + "".join(f"{p:>12s}" for p in phases)
    lines = [title, head, "-" * len(head)]
    for (role, part), by_phase in sorted(rows.items()):
        lines.append(f"{role:11s} {part:15s}" + "".join(
            f"{by_phase[p]:12.1f}" if p in by_phase else f"{'-':>12s}" for p in phases))
    lines.append(f"{'total':27s}" + "".join(f"{totals.get(p, 0.0):12.1f}" for p in phases))
    return "\n".join(lines)
