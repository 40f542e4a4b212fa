"""A mixture-of-experts layer's auxiliary losses against their formulas, written here: the
Switch load-balancing loss coeff * E / (k T^2) * sum_e (sum_t p_te) * n_e (p: softmax over
all experts, n_e: tokens routed to e) and the z-loss coeff * mean_t logsumexp(logits_t)^2.
Their values (what moe/aux_loss and moe/z_loss log, without the coefficients) and the router
weight's gradient from them alone (the main loss multiplied by 0). argv: OUT."""

from __future__ import annotations

import os
import sys

import torch

from megarlhf import speedups
speedups.install()

from megarlhf.config import config_from_dict  # noqa: E402
from megarlhf.models import moe  # noqa: E402
from megarlhf.parallel.launch import init_distributed, shutdown  # noqa: E402
from megarlhf.roles.build import build_from_config  # noqa: E402

AUX, Z, E, K = 0.01, 0.001, 4, 2


def main():
    out = sys.argv[1]
    cfg = config_from_dict({"model": {
        "vocab_size": 64, "num_layers": 1, "hidden_size": 32, "num_attention_heads": 4,
        "ffn_hidden_size": 64, "moe": {"num_experts": E, "top_k": K, "ffn_hidden_size": 16,
                                       "aux_loss_coeff": AUX, "z_loss_coeff": Z}}})
    init_distributed(cfg)
    role = build_from_config(cfg, kind="lm")
    model = role.chunks[0]  # built frozen: made trainable here, without DDP's buffers
    model.train()
    for p in model.parameters():
        p.requires_grad_(True)
    router = model.decoder.layers[0].mlp.router
    seen = []
    router.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 64, (3, 10), generator=gen)
    positions = torch.arange(10).expand(3, -1)
    logits = model(tokens, positions, None)
    (logits * 0.0).sum().backward()  # only the routers' losses send a gradient
    logged = moe.take_losses(cfg.model, role.layout, 1)

    weight = router.weight.detach().clone().requires_grad_(True)
    hidden = seen[0].reshape(-1, seen[0].shape[-1])
    scores_logits = hidden @ weight.t()
    probs = torch.softmax(scores_logits, dim=-1)
    chosen = torch.zeros_like(probs).scatter(1, probs.topk(K, dim=-1).indices, 1.0)
    tokens_n = probs.shape[0]
    aux = E / (K * tokens_n * tokens_n) * (probs.sum(0) * chosen.sum(0)).sum()
    z = torch.logsumexp(scores_logits, dim=-1).square().mean()
    (AUX * aux + Z * z).backward()
    torch.save({"logged": logged, "aux": float(aux), "z": float(z),
                "grad": router.weight.grad.clone(), "want_grad": weight.grad.clone()},
               os.path.join(out, "aux.pt"))


if __name__ == "__main__":
    main()
    shutdown()  # the process group closed on every rank before the process exits
