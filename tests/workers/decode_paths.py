"""Shared prompt prefill (speedups.shared_prefill) against the plain path on real process
groups: a batch whose prompts repeat (GRPO's groups, a lone prompt between them), sampled
with and without sharing, greedy and with per-row seeds, in one static batch and in four
decode slots; a mixture of experts with its routing recorded, in a static batch and in
decode slots; the paged KV cache's decode slots (inference.paged_kv). World 1: rollout TP=1; world 2: the model at TP=2. Results ->
OUT/decode_world{N}.pt on rank 0."""

from __future__ import annotations

from megarlhf import speedups  # noqa: E402
speedups.install()

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import build, make_config  # noqa: E402

from megarlhf.inference.continuous import generate_continuous  # noqa: E402
from megarlhf.inference.generate import SamplingParams, generate  # noqa: E402
from megarlhf.inference.paged_slots import generate_paged  # noqa: E402
from megarlhf.speedups import compiled_decode  # noqa: E402

# three groups of three samples and a lone prompt; prompts of three lengths
GROUPS = [[5, 17, 42, 8], [9, 3], [100, 101, 102, 103, 104, 105]]
PROMPTS = [p for p in GROUPS for _ in range(3)] + [[7, 7, 7]]


def compiled_cases(model, params, kw) -> dict:
    """The static cache's decode step compiled (speedups.compiled_decode from the first
    step) and eager, and how many steps ran compiled."""
    before = compiled_decode.compiled_steps
    os.environ[compiled_decode.ENV] = "0"
    try:
        compiled = generate(model, PROMPTS, params, **kw)
    finally:
        del os.environ[compiled_decode.ENV]
    steps = compiled_decode.compiled_steps - before
    return {"compiled": compiled, "eager": generate(model, PROMPTS, params, static_cache=True,
                                                    **kw), "steps": steps}


def paged_cases(model, params, kw) -> dict:
    """Four decode slots on the paged cache: its default pool (every slot at full length),
    a pool of six 4-token blocks (one sequence and a half: prompts wait and slots are
    preempted), without shared prefill; and, against the columns cache, new weights before
    the fourth step with the keys and values computed again or kept."""
    out = {}
    for case, extra in {"default": {}, "small": dict(cache_tokens=24, block_tokens=4),
                        "unshared": dict(shared_prefill=False, block_tokens=3)}.items():
        stats: dict = {}
        out[case] = (generate_paged(model, PROMPTS, params, slots=4, stats=stats, **extra,
                                    **kw), stats)
    weights = [p.detach().clone() for p in model.parameters()]
    for recompute in (True, False):
        for name, fn in (("paged", generate_paged), ("columns", generate_continuous)):
            calls = []

            def interrupt():  # the fourth step's new weights: every parameter x 1.5
                calls.append(1)
                if len(calls) != 4:
                    return False
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(1.5)
                return True
            out[("swap", recompute, name)] = fn(model, PROMPTS, params, slots=4,
                                                interrupt=interrupt, recompute_kv=recompute,
                                                **kw)
            with torch.no_grad():
                for p, w in zip(model.parameters(), weights):
                    p.copy_(w)
    return out


def main():
    out = sys.argv[1]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    results = {}
    for arch in ("llama", "qwen3moe"):
        cfg = make_config(arch, world, 1)
        (model,) = build(cfg, "lm").chunks
        common = dict(eos_id=2, pad_id=0, true_vocab=cfg.model.vocab_size,
                      record_routing=arch == "qwen3moe")
        cases = {"greedy": (SamplingParams(max_new_tokens=10, greedy=True), {}),
                 "seeded": (SamplingParams(max_new_tokens=10, temperature=0.9, top_k=50),
                            {"row_seeds": [31 + i for i in range(len(PROMPTS))]})}
        for name, (params, kw) in cases.items():
            stats: dict = {}
            results[(arch, name)] = {
                share: generate(model, PROMPTS, params, shared_prefill=share, **kw, **common,
                                **({"stats": stats} if share else {}))
                for share in (False, True)}
            results[(arch, name)]["stats"] = stats
            if arch == "llama" and world == 1:  # the static cache's step compiled at once
                results[(arch, name)]["compiled"] = compiled_cases(model, params, {
                    k: v for k, v in {**kw, **common}.items() if k != "record_routing"})
            if arch == "llama":  # the fixed-shape cache of the CUDA-graph step, eager here
                results[(arch, name)]["static"] = {
                    share: generate(model, PROMPTS, params, shared_prefill=share,
                                    static_cache=True, **kw,
                                    **{k: v for k, v in common.items()
                                       if k != "record_routing"})
                    for share in (False, True)}
            if arch == "qwen3moe":  # four decode slots recording the experts chosen
                results[(arch, name)]["slots_routing"] = generate_continuous(
                    model, PROMPTS, params, slots=4, **kw, **common)
            results[(arch, name)]["paged"] = paged_cases(model, params, {**kw, **common})
            if arch == "llama":  # four decode slots: the first four, then twins admitted
                kw = {k: v for k, v in {**kw, **common}.items() if k != "record_routing"}
                slot_stats: dict = {}
                results[(arch, name)]["slots"] = {
                    share: generate_continuous(model, PROMPTS, params, slots=4,
                                               shared_prefill=share, **kw,
                                               **({"stats": slot_stats} if share else {}))
                    for share in (False, True)}
                results[(arch, name)]["slots"]["stats"] = slot_stats
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out, f"decode_world{world}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
