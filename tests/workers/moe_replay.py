"""Routing replay against a plain loop: a one-layer mixture of experts routes a batch by
itself (recorded), then replays a routing in which some tokens were sent on purpose to
other experts. The layer's output under replay must be the loop's sum over the given
experts of softmax(the router's logits at them) x expert(x); the recorded routing must
be the layer's own top-k. argv: OUT."""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

from megarlhf import speedups
speedups.install()

from megarlhf.config import config_from_dict  # noqa: E402
from megarlhf.models import moe  # noqa: E402
from megarlhf.parallel.launch import init_distributed, shutdown  # noqa: E402
from megarlhf.roles.build import build_from_config  # noqa: E402

E, K = 4, 2


def expert_output(layer, j: int, x: torch.Tensor) -> torch.Tensor:
    expert = layer.experts.local_experts[j]
    gate, up = (x @ expert.linear_fc1.weight.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ expert.linear_fc2.weight.t()


def main():
    out = sys.argv[1]
    cfg = config_from_dict({"model": {
        "vocab_size": 64, "num_layers": 1, "hidden_size": 32, "num_attention_heads": 4,
        "ffn_hidden_size": 64, "moe": {"num_experts": E, "top_k": K, "ffn_hidden_size": 16}}})
    init_distributed(cfg)
    model = build_from_config(cfg, kind="lm").chunks[0]
    layer = model.decoder.layers[0].mlp
    seen = {}
    layer.router.register_forward_pre_hook(lambda m, args: seen.__setitem__("x", args[0].clone()))
    layer.register_forward_hook(lambda m, args, output: seen.__setitem__("y", output[0].clone()))
    tokens = torch.randint(1, 64, (3, 7), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(7).expand(3, -1)
    with torch.no_grad():
        with moe.recording(model) as got:
            model(tokens, positions, None)
            own = moe.routing_of(got(), 3, 7, 1, K)  # (B, L, S, k)
        x = seen["x"].reshape(-1, seen["x"].shape[-1])  # (S * B, H), sequence-major
        logits = x @ layer.router.weight.t()
        want_own = logits.topk(K, dim=-1).indices.reshape(7, 3, K).permute(1, 0, 2)
        flipped = own.clone()
        flipped[0, 0, 2] = torch.tensor([(int(own[0, 0, 2, 0]) + 1) % E,
                                         (int(own[0, 0, 2, 0]) + 2) % E])
        flipped[2, 0, 5] = flipped[2, 0, 5].flip(-1)  # the same experts, in the other order
        with moe.replaying(model, flipped):
            model(tokens, positions, None)
        y = seen["y"].reshape(-1, seen["y"].shape[-1])
        routes = flipped[:, 0].permute(1, 0, 2).reshape(-1, K).long()  # (S * B, k)
        weights = torch.softmax(logits.gather(1, routes), dim=-1)
        loop = torch.stack([sum(weights[t, i] * expert_output(layer, int(routes[t, i]), x[t])
                                for i in range(K)) for t in range(x.shape[0])])
        natural = torch.stack([sum(p * expert_output(layer, int(e), x[t]) for p, e in zip(
            torch.softmax(logits[t].topk(K).values, -1), logits[t].topk(K).indices))
            for t in range(x.shape[0])])
    torch.save({"own": own, "want_own": want_own, "y": y, "loop": loop, "natural": natural},
               os.path.join(out, "replay.pt"))


if __name__ == "__main__":
    main()
    shutdown()  # the process group closed on every rank before the process exits
