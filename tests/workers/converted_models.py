"""Converted HF checkpoints at several layouts: per-token log-probs of fixed sequences and
32-token greedy generations through the KV-cached rollout (value models, named ``*_rm``:
per-token values). argv: OUT CONV_DIR ARCH... Results -> OUT/converted_world{N}.pt"""

from __future__ import annotations

# As the CLI does, before megatron is imported: the speed-ups MEGARLHF_SPEEDUPS selects.
from megarlhf import speedups  # noqa: E402
speedups.install()

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import build  # noqa: E402

from megarlhf.config import load_config  # noqa: E402
from megarlhf.memory.estimates import kv_cache_bytes  # noqa: E402
from megarlhf.models.shapes import chunk_params  # noqa: E402
from megarlhf.inference.generate import SamplingParams, generate  # noqa: E402
from megarlhf.stages.score import score_sequences  # noqa: E402

# The last is longer than the scaled-RoPE families' original context (16 in the tests).
SEQS = [[5, 17, 42, 8, 99, 250, 3, 77], [9, 3, 120, 121], [100, 101, 102, 103, 104, 105, 7, 8,
                                                             9, 10, 11, 12, 13, 14, 15, 16],
        [(37 * i + 11) % 299 + 1 for i in range(48)]]
PROMPTS = [[5, 17, 42, 8], [9, 3, 120]]


def main():
    out_dir, conv_dir, archs = sys.argv[1], sys.argv[2], sys.argv[3:]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    results = {}
    shapes_wrong: list[str] = []
    for arch in archs:
        moe = "moe" in arch or "mixtral" in arch or "deepseek" in arch or "gpt_oss" in arch
        layouts = [(1, 1)] if world == 1 else [(2, 1), (1, 2)] + ([(1, 1, 2)] if moe else [])
        for tp, pp, *ep in layouts:
            ep = ep[0] if ep else 1
            cfg = load_config(os.path.join(conv_dir, arch, "config.yaml"), [
                f"parallel.tensor_model_parallel_size={tp}",
                f"parallel.pipeline_model_parallel_size={pp}",
                f"parallel.expert_model_parallel_size={ep}"])
            key = (arch, tp, pp) if ep == 1 else (arch, tp, pp, ep)
            value = arch.endswith("_rm")
            scorer = build(cfg, "value" if value else "lm")
            chunks = scorer.chunks
            spec = scorer.spec  # the planner's parameter shapes against the built chunks
            for v, chunk in enumerate(chunks):
                want = [(p.name, p.shape) for p in chunk_params(
                    spec.model, kind=spec.kind, padded_vocab=spec.padded_vocab, tp=tp, pp=pp,
                    pp_rank=scorer.layout.pp_rank, vpp=spec.layout.vpp, vp_stage=v,
                    ep=spec.layout.ep, etp=spec.layout.expert_tp)]
                have = [(n, tuple(p.shape)) for n, p in chunk.named_parameters()]
                if want != have:
                    shapes_wrong.append(f"{arch} TP={tp} PP={pp} EP={ep}: plan {want} built "
                                        f"{have}")
            rows = score_sequences(scorer, SEQS, micro_batch_size=1)
            if value:
                results[key] = {"values": [r["values"] for r in rows]}
                continue
            results[key] = {"logprobs": [r["logprobs"] for r in rows]}
            if cfg.model.sliding_window is not None:  # the sequences packed in one row
                results[key]["packed"] = [r["logprobs"] for r in score_sequences(
                    scorer, SEQS, micro_batch_size=1, max_tokens=sum(map(len, SEQS)))]
            if world == 1:
                stats: dict = {}
                gen = generate(chunks[0], PROMPTS, SamplingParams(max_new_tokens=32, greedy=True),
                               eos_id=-1, pad_id=0, true_vocab=cfg.model.vocab_size,
                               stats=stats)
                results[key]["greedy"] = gen.response_tokens_BT.tolist()
                if cfg.model.sliding_window is not None:  # every other KV cache
                    results[key]["greedy_caches"] = window_caches(chunks[0], cfg)
                results[key]["kv_cache"] = (stats["kv_cache_bytes"], kv_cache_bytes(
                    spec.model, tp=1, batch=len(PROMPTS),
                    seq=max(map(len, PROMPTS)) + 32))
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, shapes_wrong)
    results[("shapes_wrong", world)] = [line for rank in seen for line in rank]
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, f"converted_world{world}.pt"))
    dist.destroy_process_group()


def window_caches(model, cfg) -> dict[str, list]:
    """The greedy tokens of PROMPTS through the caches a sliding window must reach besides
    the static batch's: megatron's inference context, decode slots on the columns cache
    (a prompt written ending at its admission column) and on the paged cache (blocks of
    4 positions: windows across blocks). One slot: the second prompt starts later."""
    from megarlhf.inference.continuous import generate_continuous
    from megarlhf.inference.paged_slots import generate_paged

    params = SamplingParams(max_new_tokens=32, greedy=True)
    common = dict(eos_id=-1, pad_id=0, true_vocab=cfg.model.vocab_size)
    runs = {"context": generate(model, PROMPTS, params, static_cache=False, **common),
            "columns": generate_continuous(model, PROMPTS, params, slots=1, **common),
            "paged": generate_paged(model, PROMPTS, params, slots=1, block_tokens=4,
                                    **common)}
    return {name: gen.response_tokens_BT.tolist() for name, gen in runs.items()}


if __name__ == "__main__":
    main()
