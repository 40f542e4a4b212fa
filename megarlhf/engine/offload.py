"""Moving a role's parameters off the accelerator between phases and back."""

from __future__ import annotations

import torch


class Offloader:
    """Moves a frozen model's parameters off the accelerator between phases and back.

    On GPU the copies live in pinned CPU memory and the device storage is released; on
    CPU the same mechanism swaps the parameter storage for an empty tensor and back, so
    the code path (and its correctness) is exercised everywhere."""

    def __init__(self, chunks: list, enabled: bool):
        self.params = [p for chunk in chunks for p in chunk.parameters()]
        self.enabled = enabled
        self.stash: list[torch.Tensor] | None = None

    def offload(self) -> None:
        if not self.enabled or self.stash is not None:
            return
        pin = torch.cuda.is_available()
        self.stash = []
        for p in self.params:
            host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
            host.copy_(p.data)
            self.stash.append(host)
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def reload(self) -> None:
        if self.stash is None:
            return
        device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
        for p, host in zip(self.params, self.stash):
            p.data = host.to(device, non_blocking=True)
        self.stash = None

    @property
    def offloaded(self) -> bool:
        return self.stash is not None
