"""Built roles against the planner's exact parts, at layouts the PPO cases do not reach
(run under torchrun with 2 processes): ``memory_roles.py OUT_DIR``.

Cases: GPT-2 (tied embeddings) at PP=2 with the distributed optimizer (the shared
embedding gets its own bucket) and with the plain one, GPT-2 at DP=2 (one tied stage,
optimizer shards), Llama value model at PP=2 x VPP=2, Llama bf16 at TP=2, and a frozen
GPT-2 at PP=2. Each trained role takes one optimizer step (Adam's state exists after it).
Writes OUT_DIR/memory_roles.rank<R>.json: per case the measured and the planned bytes and
whether ``models.shapes`` lists every built chunk's parameters.
"""

from __future__ import annotations

# As the CLI does, before megatron is imported: the speed-ups MEGARLHF_SPEEDUPS selects.
from megarlhf import speedups  # noqa: E402
speedups.install()

import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import build, make_config  # noqa: E402

from megarlhf.memory.accounting import role_bytes  # noqa: E402
from megarlhf.memory.estimates import static_bytes  # noqa: E402
from megarlhf.parallel.launch import shutdown  # noqa: E402
from megarlhf.models.shapes import chunk_params  # noqa: E402
from megarlhf.parallel import cpu_backend  # noqa: E402
from megarlhf.parallel.layout import reset_layouts  # noqa: E402

# name: (arch, kind, tp, pp, vpp, trained, extra overrides)
CASES = {
    "gpt2_pp2_distopt": ("gpt2", "lm", 1, 2, None, True, ()),
    "gpt2_pp2_plain": ("gpt2", "lm", 1, 2, None, True,
                       ("optimizer.use_distributed_optimizer=false",)),
    "gpt2_dp2_distopt": ("gpt2", "lm", 1, 1, None, True, ()),
    "llama_value_pp2_vpp2": ("llama", "value", 1, 2, 2, True,
                             ("parallel.virtual_pipeline_model_parallel_size=2",)),
    "llama_tp2_bf16": ("llama", "lm", 2, 1, None, True, ("model.params_dtype=bfloat16",)),
    "gpt2_pp2_frozen": ("gpt2", "lm", 1, 2, None, False, ()),
}


def main() -> None:
    out = {}
    for name, (arch, kind, tp, pp, vpp, trained, extra) in CASES.items():
        cfg = make_config(arch, tp, pp, vocab=300, layers=4, extra=extra)
        role = build(cfg, kind, trained=trained)
        if trained:  # megatron's own step, called directly: a door of the CPU backend
            with cpu_backend.at_megatron():
                role.trained.optimizer.step()  # zero gradients; creates Adam's state
        spec, layout = role.spec, role.layout
        mismatches = []
        for v, chunk in enumerate(role.chunks):
            want = [(p.name, p.shape, p.shared_embedding) for p in chunk_params(
                spec.model, kind=kind, padded_vocab=spec.padded_vocab, tp=tp, pp=pp,
                pp_rank=layout.pp_rank, vpp=vpp, vp_stage=v)]
            have = [(n, tuple(p.shape), bool(getattr(p, "shared_embedding", False)))
                    for n, p in chunk.named_parameters()]
            if want != have:
                mismatches.append(f"chunk {v}: plan {want} built {have}")
        out[name] = {"measured": role_bytes(role),
                     "planned": static_bytes(spec, layout.dp, layout.pp_rank,
                                             layout.dp_rank),
                     "shape_mismatches": mismatches}
        reset_layouts()
    with open(os.path.join(sys.argv[1], f"memory_roles.rank{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()


if __name__ == "__main__":
    main()
    shutdown()  # the process group closed on every rank before the process exits
