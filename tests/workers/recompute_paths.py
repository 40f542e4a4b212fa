"""Activation recomputation against keeping every activation (run under torchrun):
``recompute_paths.py OUT``.

At each layout of the world, for each ``model.recompute`` setting of VARIANTS (those
named in RECOMPUTE_VARIANTS, when set): one update
of a trained actor (the PPO policy loss with its KL and entropy terms) and one SFT step, on
padded and on packed micro-batches, each with the peak bytes autograd kept for backward
(``memory.accounting.ActivationMeter``), the reduced loss logs and every gradient. The
gradients' largest difference from the setting's baseline at the same layout (``none``;
with dropout, ``dropout``) is reduced over the ranks. Results -> OUT/recompute_world{N}.pt on rank 0.
"""

from __future__ import annotations

from megarlhf import speedups  # noqa: E402
speedups.install()

import os
import sys

import torch

from megarlhf.parallel.launch import shutdown
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import build, make_config  # noqa: E402
from packing_paths import VOCAB, experience, generation, passes, supervised_tasks  # noqa: E402

from megarlhf.engine.optimizer import forward_backward, prepare_step  # noqa: E402
from megarlhf.engine.steps import make_lm_loss_step, make_policy_step, reduce_logs  # noqa: E402
from megarlhf.memory.accounting import ActivationMeter  # noqa: E402
from megarlhf.ppo.learner import dp_share, experience_batches, packed_experience_batches  # noqa: E402
from megarlhf.stages.supervised import micro_batches  # noqa: E402

TRAIN_BUDGET, SFT_BUDGET = 70, 128
FULL = ["model.recompute.granularity=full", "model.recompute.num_layers=1"]
DROPOUT = ["model.hidden_dropout=0.1"]
# name -> (overrides, the setting it must equal); RECOMPUTE_VARIANTS (names) limits them
VARIANTS = {
    "none": ([], "none"),
    "full_uniform_1": (FULL, "none"),
    "full_uniform_2": (["model.recompute.granularity=full", "model.recompute.num_layers=2"],
                       "none"),
    "full_block_1": (["model.recompute.granularity=full", "model.recompute.method=block",
                      "model.recompute.num_layers=1"], "none"),
    "selective_attn": (["model.recompute.granularity=selective"], "none"),
    "selective_mlp": (["model.recompute.granularity=selective",
                       "model.recompute.modules=[core_attn,mlp]"], "none"),
    # dropout: the recomputed forward must draw the masks the first one drew
    "dropout": (DROPOUT, "dropout"),
    "dropout_full": (DROPOUT + FULL, "dropout"),
}
# (tp, pp); DP is what the world leaves
LAYOUTS = {1: [(1, 1)], 2: [(2, 1), (1, 2)]}


def measured(role, step, batches, length: int, rows: int) -> dict:
    params = [p for chunk in role.trained.model for p in chunk.parameters()]
    torch.manual_seed(1234)  # dropout draws the same masks in every setting's run
    with ActivationMeter(exclude=params) as meter:
        logs = forward_backward(role.trained, step, batches, seq_length=length,
                                micro_batch_size=rows)
    grads = [p.main_grad.detach().clone() for p in params]
    _, norm = prepare_step(role.trained)
    return {"logs": reduce_logs(logs, role.layout), "grads": grads, "norm": norm,
            "saved": meter.peak}


def runs(tp: int, pp: int, variant: list[str]) -> dict:
    cfg = make_config("llama", tp, pp, extra=("ppo.kl.loss_coef=0.1", "ppo.entropy_coef=0.01",
                                              "optimizer.use_distributed_optimizer=false",
                                              *variant))
    actor = build(cfg, "lm", trained=True)
    gen = generation()
    old = passes(actor, gen, packed=True)["logprobs"]
    exp = experience(gen, old, torch.zeros_like(old))
    P = gen.prompt_tokens_BP.shape[1]
    policy = make_policy_step(prompt_len=P, tp_group=actor.layout.tp_group, true_vocab=VOCAB,
                              temperature=1.0, ppo=cfg.ppo)
    out = {}
    for packed in (False, True):
        batches = packed_experience_batches(exp, actor.layout, TRAIN_BUDGET, 0) if packed \
            else experience_batches(dp_share(exp, actor.layout), 2, 0)
        out[("ppo", packed)] = measured(actor, policy, batches,
                                        max(b["tokens"].shape[1] for b in batches),
                                        batches[0]["tokens"].shape[0])
    sft = supervised_tasks()["sft"]
    step = make_lm_loss_step(tp_group=actor.layout.tp_group, true_vocab=VOCAB)
    for packed in (False, True):
        batches, length, rows = micro_batches(sft, sft.train_items, actor.layout, True,
                                              SFT_BUDGET if packed else None)
        out[("sft", packed)] = measured(actor, step, batches, length, rows)
    return out


def main():
    out_dir = sys.argv[1]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    results = {}
    names = os.environ.get("RECOMPUTE_VARIANTS", "").split() or list(VARIANTS)
    for tp, pp in LAYOUTS[world]:
        by_variant = {name: runs(tp, pp, VARIANTS[name][0]) for name in names}
        for name, got in by_variant.items():
            plain = by_variant[VARIANTS[name][1]]
            for key, run in got.items():
                gap = max(float((a - b).abs().max())
                          for a, b in zip(run["grads"], plain[key]["grads"]))
                stats = torch.tensor([gap, float(run["saved"])])
                dist.all_reduce(stats, op=dist.ReduceOp.MAX)
                results[(tp, pp, name, *key)] = {
                    "logs": run["logs"], "norm": run["norm"], "grad_gap": float(stats[0]),
                    "saved": int(stats[1])}
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, f"recompute_world{world}.pt"))


if __name__ == "__main__":
    main()
    shutdown()  # the process group closed on every rank before the process exits
