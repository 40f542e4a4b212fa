"""The model paths on one device, for the CUDA-vs-CPU tests (``tests/test_gpu.py``).

Run once without CUDA (``CUDA_VISIBLE_DEVICES=``: the CPU backend, fp32) and once on the
GPU (fp32, then bf16). The seeded initialisation gives both runs the same weights, so the
test compares their numbers. Results -> OUT/gpu_paths_{cpu,cuda}.pt.

Cases: teacher-forced log-probs of fixed sequences; greedy generation with and without the
KV cache; sampled generation against teacher-forced scoring (the rollout/train mismatch);
on CUDA also bf16 versions of these, an offload/reload round trip with the bytes the GPU
freed, and resharding a trained actor into the inference model through megatron's NCCL
copy service. In fp32 on both: a Qwen3-MoE-shaped mixture of experts (log-probs, greedy
tokens, the experts each token chose) and a llama with LoRA adapters set to seeded non-zero
values (log-probs, greedy tokens, the adapters' gradients of the summed log-probs).
"""

from __future__ import annotations

# As the CLI does, before megatron is imported: the speed-ups MEGARLHF_SPEEDUPS selects.
from megarlhf import speedups  # noqa: E402
speedups.install()

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import build, fixed_sequences, make_config  # noqa: E402

from megarlhf.engine.steps import model_forward, token_logprobs  # noqa: E402
from megarlhf.models import lora  # noqa: E402
from megarlhf.roles.offload import Offloader  # noqa: E402
from megarlhf.inference.generate import SamplingParams, generate  # noqa: E402
from megarlhf.stages.score import score_sequences  # noqa: E402

PROMPTS = [[5, 17, 42, 8], [9, 3], [100, 101, 102, 103, 104, 105], [7]]
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def model_cases(dtype: str, results: dict) -> None:
    cfg = make_config("llama", 1, 1, extra=(f"model.params_dtype={DTYPES[dtype]}",))
    role = build(cfg, "lm")
    (model,) = role.chunks
    out: dict = {"device": str(next(model.parameters()).device)}
    seqs = fixed_sequences(6)
    out["logprobs"] = [r["logprobs"] for r in score_sequences(role, seqs, micro_batch_size=2)]
    common = dict(eos_id=2, pad_id=0, true_vocab=cfg.model.vocab_size)
    greedy = SamplingParams(max_new_tokens=12, greedy=True)
    out["greedy_cached"] = generate(model, PROMPTS, greedy, **common)
    out["greedy_full"] = generate(model, PROMPTS, greedy, use_cache=False, **common)
    sampled = generate(model, PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.9),
                       **common, row_seeds=[1000 + i for i in range(len(PROMPTS))])
    samples = []
    for b, prompt in enumerate(PROMPTS):
        n = int(sampled.fed_mask_BT[b].sum())
        samples.append(prompt + sampled.response_tokens_BT[b, :n].tolist())
    rows = score_sequences(role, samples, micro_batch_size=2, temperature=0.9)
    out["sampled"] = sampled
    out["teacher"] = [r["logprobs"] for r in rows]
    if torch.cuda.is_available():
        out["offload"] = offload_case(role, seqs)
    results[dtype] = out


def family_cases(results: dict) -> None:
    """fp32: a mixture of experts, a LoRA model and an OLMo-3-shaped one (post norms, q/k
    over all heads, sliding windows, partial rotary), each on the device this process
    has."""
    greedy = SamplingParams(max_new_tokens=12, greedy=True)
    seqs = fixed_sequences(6)
    cases = {"moe": ("qwen3moe", ()),
             "lora": ("llama", ("model.lora.rank=4", "model.lora.alpha=8")),
             "olmo3": ("olmo3", ())}
    for name, (arch, extra) in cases.items():
        cfg = make_config(arch, 1, 1, extra=extra)
        role = build(cfg, "lm")
        (model,) = role.chunks
        adapters = lora.adapter_parameters(model)
        gen = torch.Generator().manual_seed(11)
        with torch.no_grad():  # B starts at zero: seeded values make the adapters count
            for p in adapters:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
        out = {"logprobs": [r["logprobs"] for r in score_sequences(role, seqs,
                                                                   micro_batch_size=2)],
               "greedy": generate(model, PROMPTS, greedy, eos_id=2, pad_id=0,
                                  true_vocab=cfg.model.vocab_size,
                                  record_routing=name == "moe")}
        if adapters:
            device = next(model.parameters()).device
            for p in adapters:
                p.requires_grad_(True)
                p.grad = None
            for seq in seqs:
                tokens = torch.tensor([seq], device=device)
                batch = {"tokens": tokens,
                         "position_ids": torch.arange(len(seq), device=device)[None]}
                hidden = model_forward(model, batch, hidden=True)
                logprobs, _ = token_logprobs(model, hidden[:, :-1], tokens[:, 1:],
                                             tp_group=role.layout.tp_group,
                                             true_vocab=cfg.model.vocab_size)
                logprobs.sum().backward()
            out["adapter_grads"] = [p.grad.detach().cpu().clone() for p in adapters]
        results[name] = out


def offload_case(role, seqs) -> dict:
    """Bytes the GPU frees when the role is offloaded, and its log-probs after reload."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    offloader = Offloader(role.chunks, enabled=True)
    offloader.offload()
    torch.cuda.synchronize()
    during = torch.cuda.memory_allocated()
    pinned = all(host.is_pinned() for host in offloader.stash)
    offloader.reload()
    torch.cuda.synchronize()
    param_bytes = sum(p.numel() * p.element_size() for p in role.parameters)
    after = [r["logprobs"] for r in score_sequences(role, seqs, micro_batch_size=2)]
    return {"freed": before - during, "param_bytes": param_bytes, "logprobs": after,
            "pinned": pinned}


def reshard_case(results: dict) -> None:
    """A trained actor (distributed optimizer) resharded into the inference model over the
    NCCL copy service; both then score the same sequences."""
    from megarlhf.inference.reshard import (Resharder, build_inference_model, copy_service,
                                          inference_layout)

    cfg = make_config("llama", 1, 1, extra=("optimizer.lr=0.01",))
    actor = build(cfg, "lm", trained=True, seed_offset=5)
    layout = inference_layout(1, actor.spec.model)
    inference = build_inference_model(actor.spec, layout)
    stats = Resharder(actor.chunks, inference)()
    seqs = fixed_sequences(4)
    train_rows = [r["logprobs"] for r in score_sequences(actor, seqs, micro_batch_size=2)]
    from megarlhf.stages.score import right_padded_batch

    direct = []
    with torch.no_grad():
        for seq in seqs:
            batch = right_padded_batch([seq], len(seq))
            device = next(inference.parameters()).device
            logits = inference(batch["tokens"].to(device), batch["position_ids"].to(device),
                               None)
            lp = torch.log_softmax(logits[0, :-1, :cfg.model.vocab_size].float(), -1)
            direct.append(lp.gather(-1, batch["tokens"][0, 1:, None].to(device))[:, 0].cpu())
    results["reshard"] = {"service": str(copy_service()), "train": train_rows,
                          "inference": direct, "bytes": stats.bytes_received}


def main() -> None:
    out_dir = sys.argv[1]
    results: dict = {}
    model_cases("fp32", results)
    family_cases(results)
    if torch.cuda.is_available():
        model_cases("bf16", results)
        reshard_case(results)
    name = "cuda" if torch.cuda.is_available() else "cpu"
    torch.save(results, os.path.join(out_dir, f"gpu_paths_{name}.pt"))


if __name__ == "__main__":
    main()
