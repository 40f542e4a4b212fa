"""Chunked vocab-parallel log-probs at TP = the world size (run under torchrun):
``logprob_chunks.py OUT``. Every rank makes the same full (B, T, V) logits, keeps its
vocabulary shard, and computes log-probs and entropy with their gradients in chunks of
3 positions and in one chunk; rank 0 also computes them from the full logits with plain
torch. The same for the LM head a chunk at a time (``head_logprobs``) from hidden states
and a weight every rank makes whole and keeps its vocabulary shard of, and for the
log-probs of several ids per position that way (``head_gather_logprobs``, distillation's).
Results -> OUT/logprob_chunks.pt on rank 0."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from megarlhf.models.logprobs import head_gather_logprobs, head_logprobs, vocab_parallel_logprobs


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    g = torch.Generator().manual_seed(0)
    B, T, V, true_vocab = 3, 11, 64, 58
    full = torch.randn(B, T, V, generator=g)
    target = torch.randint(0, true_vocab, (B, T), generator=g)
    w1, w2 = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    shard = V // world
    out = {}
    for chunk in (3, 10**9):
        mine = full[..., rank * shard:(rank + 1) * shard].clone().requires_grad_(True)
        lp, ent = vocab_parallel_logprobs(mine, target, tp_group=group, temperature=0.7,
                                          true_vocab=true_vocab, chunk=chunk)
        ((lp * w1).sum() + (ent * w2).sum()).backward()
        grads = [torch.empty_like(mine.grad) for _ in range(world)]
        dist.all_gather(grads, mine.grad, group=group)
        out[chunk] = {"logprobs": lp.detach(), "entropy": ent.detach(),
                      "grad": torch.cat(grads, -1)}
    # the head a chunk at a time: hidden states whole on every rank, the weight's shard
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
    H = 8
    hidden_full = torch.randn(B, T, H, generator=g)
    weight_full = torch.randn(V, H, generator=g) * 0.5
    for chunk in (3, 10**9):
        hidden = hidden_full.clone().requires_grad_(True)
        weight = weight_full[rank * shard:(rank + 1) * shard].clone().requires_grad_(True)
        lp, ent = head_logprobs(copy_to_tensor_model_parallel_region(hidden, group=group),
                                weight, target, tp_group=group, temperature=0.7,
                                true_vocab=true_vocab, chunk=chunk)
        ((lp * w1).sum() + (ent * w2).sum()).backward()
        grads = [torch.empty_like(weight.grad) for _ in range(world)]
        dist.all_gather(grads, weight.grad, group=group)
        out[("head", chunk)] = {"logprobs": lp.detach(), "entropy": ent.detach(),
                                "hidden_grad": hidden.grad, "weight_grad": torch.cat(grads)}
    ids = torch.randint(0, true_vocab, (B, T, 4), generator=g)
    w3 = torch.randn(B, T, 4, generator=g)
    for chunk in (3, 10**9):
        hidden = hidden_full.clone().requires_grad_(True)
        weight = weight_full[rank * shard:(rank + 1) * shard].clone().requires_grad_(True)
        lp = head_gather_logprobs(copy_to_tensor_model_parallel_region(hidden, group=group),
                                  weight, ids, tp_group=group, temperature=0.7,
                                  true_vocab=true_vocab, chunk=chunk)
        (lp * w3).sum().backward()
        grads = [torch.empty_like(weight.grad) for _ in range(world)]
        dist.all_gather(grads, weight.grad, group=group)
        out[("gather", chunk)] = {"logprobs": lp.detach(), "hidden_grad": hidden.grad,
                                  "weight_grad": torch.cat(grads)}
    if rank == 0:
        hidden = hidden_full.double().requires_grad_(True)
        weight = weight_full.double().requires_grad_(True)
        lsm = torch.log_softmax((hidden @ weight.t())[..., :true_vocab] / 0.7, -1)
        ref_lp = lsm.gather(-1, ids)
        (ref_lp * w3.double()).sum().backward()
        out["gather_reference"] = {"logprobs": ref_lp, "hidden_grad": hidden.grad,
                                   "weight_grad": weight.grad}
    if rank == 0:
        hidden = hidden_full.double().requires_grad_(True)
        weight = weight_full.double().requires_grad_(True)
        lsm = torch.log_softmax((hidden @ weight.t())[..., :true_vocab] / 0.7, -1)
        ref_lp = lsm.gather(-1, target[..., None]).squeeze(-1)
        ref_ent = -(lsm.exp() * lsm).sum(-1)
        ((ref_lp * w1.double()).sum() + (ref_ent * w2.double()).sum()).backward()
        out["head_reference"] = {"logprobs": ref_lp, "entropy": ref_ent,
                                 "hidden_grad": hidden.grad, "weight_grad": weight.grad}
    if rank == 0:
        ref_in = full.clone().requires_grad_(True)
        lsm = torch.log_softmax(ref_in[..., :true_vocab].double() / 0.7, -1)
        ref_lp = lsm.gather(-1, target[..., None]).squeeze(-1)
        ref_ent = -(lsm.exp() * lsm).sum(-1)
        ((ref_lp * w1.double()).sum() + (ref_ent * w2.double()).sum()).backward()
        out["reference"] = {"logprobs": ref_lp, "entropy": ref_ent, "grad": ref_in.grad}
        torch.save(out, os.path.join(sys.argv[1], "logprob_chunks.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
