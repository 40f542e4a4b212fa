"""Exponential moving average of parameters (an evaluation-only copy of the actor).

True Polyak/EMA form, kept in fp32 and updated after every optimizer step:
    ema <- decay * ema + (1 - decay) * param,   initialised to the parameters.
InstructGPT used decay 0.992. DeepSpeed-Chat's ``moving_average`` computes
``lerp(param, ema, beta)``, algebraically the same update, but writes it into a copy held
in the training dtype (bf16/fp16 under ZeRO): with beta = 0.992 each increment is 0.8% of
the gap, below bf16's resolution for most weights, so its EMA largely stops moving. Here the
average stays in fp32 whatever the model's dtype. It never feeds back into training.
"""

from __future__ import annotations

from typing import Iterable

import torch


class ParameterEMA:
    def __init__(self, params: Iterable[torch.Tensor], decay: float = 0.992):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.shadow = [p.detach().to(torch.float32).clone() for p in params]
        self.num_updates = 0

    @torch.no_grad()
    def update(self, params: Iterable[torch.Tensor]) -> None:
        params = list(params)
        if len(params) != len(self.shadow):
            raise ValueError(f"EMA tracks {len(self.shadow)} tensors, got {len(params)}")
        for avg, p in zip(self.shadow, params):
            avg.mul_(self.decay).add_(p.detach().to(torch.float32), alpha=1.0 - self.decay)
        self.num_updates += 1

    @torch.no_grad()
    def copy_to(self, params: Iterable[torch.Tensor]) -> None:
        """Write the averages into ``params`` (e.g. an evaluation model's)."""
        for avg, p in zip(self.shadow, params):
            p.copy_(avg.to(p.dtype))

    def state_dict(self) -> dict:
        return {"decay": self.decay, "num_updates": self.num_updates, "shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        if len(state["shadow"]) != len(self.shadow):
            raise ValueError("EMA state does not match the model's parameters")
        self.decay = state["decay"]
        self.num_updates = state["num_updates"]
        for avg, saved in zip(self.shadow, state["shadow"]):
            avg.copy_(saved)
