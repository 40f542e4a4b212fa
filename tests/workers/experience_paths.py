"""One experience call from prompts at several layouts, offloading on and off, and the
reference log-prob cache. Results -> OUT/experience_world{N}.pt on rank 0."""

from __future__ import annotations

# As the CLI does, before megatron is imported: the speed-ups MEGARLHF_SPEEDUPS selects.
from megarlhf import speedups  # noqa: E402
speedups.install()

import dataclasses
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import build as build_role_from, make_config  # noqa: E402

from megarlhf.rollout.experience import ExperienceMaker  # noqa: E402
from megarlhf.rollout.sampling import Sampler  # noqa: E402
from megarlhf.rollout.scoring import RewardSource, Scorer, SequenceCache  # noqa: E402
from megarlhf.inference.generate import Generation  # noqa: E402
from megarlhf.inference.reshard import build_inference_model, inference_layout  # noqa: E402

PROMPTS = [[5, 17, 42, 8], [9, 3], [100, 101, 102, 103, 104, 105], [7], [11, 12, 13],
           [200, 3], [4, 4, 4, 4, 4], [60]]


def case(name, tp, pp, rollout_tp, results, offload_variants=(True,)):
    """``offload_variants``: True/False (frozen models offloaded or not, forward
    micro-batches of 2) or "mb8" (offloaded, one forward micro-batch of all 8 rows)."""
    cfg = make_config("llama", tp, pp, extra=(
        f"rollout.tensor_parallel_size={rollout_tp}", "rollout.max_new_tokens=6",
        "rollout.temperature=0.9", "rollout.top_k=40", "model.value_head_init=normal",
        "ppo.kl.init_coef=0.1", "rollout.recompute_logprobs=true",
        "ppo.missing_stop_penalty=null"))
    actor = build_role_from(cfg, "lm", trained=True)
    reference = build_role_from(cfg, "lm", seed_offset=1)
    critic = build_role_from(cfg, "value", trained=True, seed_offset=2)
    reward = build_role_from(cfg, "value", seed_offset=3)
    reward.saved = {"score_gain": 0.5, "score_bias": 0.1}
    layout = actor.layout
    inf_layout = inference_layout(rollout_tp, actor.spec.model)
    inf_model = build_inference_model(actor.spec, inf_layout)
    out = {}
    for variant in offload_variants:
        offload = bool(variant)
        for frozen in (reference, reward):  # as roles.spec resolves roles.<name>.offload
            frozen.spec = dataclasses.replace(frozen.spec, offload="all" if offload else "none")
        scorer = Scorer(cfg.rollout, actor, reference, RewardSource(role=reward), critic, pad_id=0,
                        micro_batch_size=8 if variant == "mb8" else 2,
                        ref_cache=SequenceCache())
        sampler = Sampler(cfg.rollout, actor, inf_layout, inf_model, eos_id=2, pad_id=0)
        maker = ExperienceMaker(cfg.ppo, cfg.rollout, sampler, scorer)
        exp, gen, metrics = maker.make(PROMPTS, seed=5, kl_coef=0.1)
        assert scorer.ref_offloader.offloaded == offload
        exp2, _, metrics2 = maker.make(PROMPTS, seed=5, kl_coef=0.1)  # same samples: all hits
        full = {f.name: getattr(exp, f.name) for f in dataclasses.fields(exp)}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (layout.dp_rank, layout.tp_rank, layout.pp_rank, full))
        # the actor's own pass over the batch, again: what the old log-probs must be
        recomputed = scorer.actor_logprobs(gen)[0] * exp.response_mask_BT
        out[variant] = {"experience": gathered, "metrics": metrics, "metrics2": metrics2,
                        "ref_equal_on_hit": torch.equal(exp.ref_logprobs_BT, exp2.ref_logprobs_BT),
                        "old_is_recomputed": torch.equal(exp.old_logprobs_BT, recomputed),
                        "rollout_is_recomputed": torch.equal(exp.rollout_logprobs_BT,
                                                             recomputed),
                        "generation": gen, "repeats": repeats_case(scorer, gen)}
        scorer.restore_frozen_models()
    results[name] = out


def repeats_case(scorer, gen):
    """The sampled batch twice over, with a fresh cache and without one: which rows the
    reference scored, the cache's hits, and both results."""
    doubled = Generation(*(None if getattr(gen, f.name) is None  # a dense actor's routing
                           else torch.cat((getattr(gen, f.name),) * 2)
                           for f in dataclasses.fields(gen)))
    scored, real, saved = [], scorer.score, scorer.ref_cache

    def counting(role, g, rows, *rest):
        if role is scorer.reference:
            scored.append(list(rows))
        return real(role, g, rows, *rest)

    scorer.score = counting
    try:
        scorer.ref_cache = SequenceCache()
        cached = scorer.reference_logprobs(doubled)
        hits = scorer.ref_cache.hits
        scorer.ref_cache = None
        plain = scorer.reference_logprobs(doubled)
    finally:
        del scorer.score
        scorer.ref_cache = saved
    return {"cached": cached, "plain": plain, "scored": scored, "hits": hits,
            "rows": gen.response_tokens_BT.shape[0]}


def main():
    out_dir = sys.argv[1]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    results = {}
    if world == 1:
        case("single", 1, 1, 1, results, offload_variants=(True, False, "mb8"))
    else:
        case("tp2_rollout_tp1x2", 2, 1, 1, results)
        case("pp2_rollout_tp2", 1, 2, 2, results)
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, f"experience_world{world}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
