"""The dropped-token fraction of a mixture of experts with a capacity against its count
written here: each expert takes C = ceil(T k / E x capacity_factor) of the T tokens' k
choices, so an expert chosen n_e times drops max(0, n_e - C) of them; moe/dropped_frac is
their sum over the T k choices (per layer and over both layers). A forward-only pass (eval
mode) counts nothing. argv: OUT."""

from __future__ import annotations

import math
import os
import sys

import torch

from megarlhf import speedups
speedups.install()

from megarlhf.config import config_from_dict  # noqa: E402
from megarlhf.models import moe  # noqa: E402
from megarlhf.parallel.launch import init_distributed, shutdown  # noqa: E402
from megarlhf.roles.build import build_from_config  # noqa: E402

E, K, CF = 4, 2, 0.75


def main():
    out = sys.argv[1]
    cfg = config_from_dict({"model": {
        "vocab_size": 64, "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
        "ffn_hidden_size": 64, "moe": {"num_experts": E, "top_k": K, "ffn_hidden_size": 16,
                                       "capacity_factor": CF}}})
    init_distributed(cfg)
    role = build_from_config(cfg, kind="lm")
    model = role.chunks[0]
    seen = {}
    for i, layer in enumerate(model.decoder.layers):
        layer.mlp.router.register_forward_pre_hook(
            lambda module, args, i=i: seen.setdefault(i, args[0].detach()))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 64, (3, 10), generator=gen)
    positions = torch.arange(10).expand(3, -1)
    model.eval()
    with torch.no_grad():
        model(tokens, positions, None)
    quiet = moe.take_losses(cfg.model, role.layout, 1)
    seen.clear()
    model.train()
    with torch.no_grad():
        model(tokens, positions, None)
    logged = moe.take_losses(cfg.model, role.layout, 1)

    want, drops = {}, []
    for i, layer in enumerate(model.decoder.layers):
        hidden = seen[i].reshape(-1, seen[i].shape[-1])
        chosen = (hidden @ layer.mlp.router.weight.detach().t()).topk(K, dim=-1).indices
        n = torch.bincount(chosen.reshape(-1), minlength=E)
        capacity = math.ceil(hidden.shape[0] * K / E * CF)
        dropped = int((n - capacity).clamp(min=0).sum())
        want[f"moe/dropped_frac/layer{i}"] = dropped / (hidden.shape[0] * K)
        drops.append((dropped, hidden.shape[0] * K))
    want["moe/dropped_frac"] = sum(d for d, _ in drops) / sum(t for _, t in drops)
    torch.save({"quiet": quiet, "logged": logged, "want": want},
               os.path.join(out, "drops.pt"))


if __name__ == "__main__":
    main()
    shutdown()  # the process group closed on every rank before the process exits
