"""PPO memory measured against ``megarlhf plan`` (run under torchrun with 1 or 2
processes): ``memory_paths.py CASES.json OUT_DIR``.

CASES.json maps a case name to {"overrides": [...], "iterations": N}. For every case the
worker builds a ``PPOSession`` from configs/demo/ppo.yaml plus the overrides, runs N
iterations, snapshots the save phase, and writes ``OUT_DIR/<name>.rank<R>.json``: this
rank's measured bytes per (phase, role, part) and per phase total, the plan's prediction
for this rank (with the experience batch's own prompt and response widths), whether
``models.shapes`` lists exactly the parameters of every built chunk, and the metrics of
every iteration. Between cases the finished session is collected (it sits in reference
cycles, so dropping the name alone leaves its models resident until Python's next full
collection) and, on CUDA, the bytes still allocated after that are recorded
(``leftover_allocated``): each case's peaks count that case's session only.
"""

from __future__ import annotations

# As the CLI does, before megatron is imported: the speed-ups MEGARLHF_SPEEDUPS selects.
from megarlhf import speedups  # noqa: E402
speedups.install()

import gc
import json
import os
import sys

import torch
import torch.distributed as dist

from megarlhf.config import load_config
from megarlhf.data.tokenizer import load_tokenizer
from megarlhf.memory.plan import plan_ppo
from megarlhf.models.shapes import chunk_params
from megarlhf.parallel.launch import shutdown
from megarlhf.ppo.session import PPOSession


def shape_mismatches(session) -> list[str]:
    """Where ``models.shapes`` disagrees with a built chunk (names, shapes, shared flag)."""
    out = []
    roles = {"actor": session.actor, "critic": session.critic,
             "reference": session.reference, "reward": session.scorer.reward.role}
    for name, role in roles.items():
        if role is None:
            continue
        spec, layout = role.spec, role.layout
        for v, chunk in enumerate(role.chunks):
            want = [(p.name, p.shape, p.shared_embedding) for p in chunk_params(
                spec.model, kind=spec.kind, padded_vocab=spec.padded_vocab, tp=spec.layout.tp,
                pp=spec.layout.pp, pp_rank=layout.pp_rank, vpp=spec.layout.vpp, vp_stage=v)]
            have = [(n, tuple(p.shape), bool(getattr(p, "shared_embedding", False)))
                    for n, p in chunk.named_parameters()]
            if want != have:
                out.append(f"{name} chunk {v}: plan {want} built {have}")
    model = session.sampler.inference_model
    spec = session.specs["actor"]
    want = [(p.name, p.shape) for p in chunk_params(
        spec.model, kind="lm", padded_vocab=spec.padded_vocab,
        tp=session.sampler.inference_layout.tp, pp=1, pp_rank=0)]
    have = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    if want != have:
        out.append(f"inference: plan {want} built {have}")
    return out


def main() -> None:
    cases = json.load(open(sys.argv[1]))
    out_dir = sys.argv[2]
    for name, case in cases.items():
        leftover = torch.cuda.memory_allocated() if torch.cuda.is_available() else None
        cfg = load_config("configs/demo/ppo.yaml", case["overrides"])
        session = PPOSession(cfg, load_tokenizer(cfg.tokenizer))
        metrics = []
        for it in range(case.get("iterations", 1)):
            m, exp, _ = session.iteration(it)
            metrics.append({k: v for k, v in m.items()
                            if not k.startswith(("timing/", "perf/", "memory/"))})
        session.hooks.before_save()
        tracker = session.tracker
        world, rank = dist.get_world_size(), dist.get_rank()
        plan = plan_ppo(cfg, world, specs=session.specs,
                        prompt_len=exp.prompt_tokens_BP.shape[1],
                        response_len=exp.response_tokens_BT.shape[1])
        result = {
            "measured": {"/".join(k): v for k, v in tracker.run_parts.items()},
            "measured_totals": tracker.run_totals,
            "planned": {f"{phase}/{role}/{part}": value
                        for phase, parts in plan.ranks[rank].items()
                        for (role, part), value in parts.items()},
            "planned_totals": plan.measurable[rank],
            # with the forward-only estimates only a GPU allocator sees (bench/gpu_memory.py)
            "planned_full_totals": plan.totals[rank],
            "shape_mismatches": shape_mismatches(session),
            "metrics": metrics,
            "leftover_allocated": leftover,
        }
        session.close()
        del session, tracker, exp
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        with open(os.path.join(out_dir, f"{name}.rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()


if __name__ == "__main__":
    main()
    shutdown()  # the process group closed on every rank before the process exits
