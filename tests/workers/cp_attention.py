"""Context-parallel attention at CP = the world size (run under torchrun):
``cp_attention.py OUT``. Every rank makes the same queries, keys and values of a whole
sequence and a padding mask, keeps its load-balanced part (``parallel.context``), runs
the causal attention over the CP group and puts the output back together along the
sequence; a weighted sum of it is the loss. Rank 0 also runs plain SDPA over the whole
sequence. Results (outputs, and the gradients of every rank's part, put in position
order) -> OUT/cp_attention.pt on rank 0."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megarlhf.parallel import context


def attend(q, k, v, allowed):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    g = torch.Generator().manual_seed(0)
    B, heads, groups, S, hd = 2, 4, 2, 4 * world * 2, 8
    q_full = torch.randn(B, heads, S, hd, generator=g, dtype=torch.float64)
    k_full = torch.randn(B, groups, S, hd, generator=g, dtype=torch.float64)
    v_full = torch.randn(B, groups, S, hd, generator=g, dtype=torch.float64)
    weight = torch.randn(B, heads, S, hd, generator=g, dtype=torch.float64)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, :3] = True  # row 1's first three positions are left padding
    blocked = pad[:, None, None, :].expand(B, 1, S, S)  # megatron's: True = may not look
    out = {}
    rows = context.chunk_positions(S, world, rank)
    for case, mask in (("padded", blocked), ("causal", None)):
        q, k, v = (context.local_part(x, 2, group).clone().requires_grad_(True)
                   for x in (q_full, k_full, v_full))
        local = context.attention(attend, q, k, v, group,
                                  None if mask is None else mask[:, :, rows])
        whole = context.gather_sequence(local, 2, group)
        (whole * weight).sum().backward()
        # / CP: what the reduction over DP x CP does by its token count (gather_sequence)
        grads = {name: context.gather_sequence(x.grad, 2, group) / world
                 for name, x in (("q", q), ("k", k), ("v", v))}
        if rank == 0:
            out[case] = {"out": whole.detach(), **grads}
            q, k, v = (x.clone().requires_grad_(True) for x in (q_full, k_full, v_full))
            allowed = torch.ones(S, S, dtype=torch.bool).tril()
            if mask is not None:
                allowed = (allowed & ~mask) | torch.eye(S, dtype=torch.bool)
            ref = attend(q, k, v, allowed)
            (ref * weight).sum().backward()
            out[case + "_reference"] = {"out": ref.detach(), "q": q.grad, "k": k.grad,
                                        "v": v.grad}
    if rank == 0:
        torch.save(out, os.path.join(sys.argv[1], "cp_attention.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
