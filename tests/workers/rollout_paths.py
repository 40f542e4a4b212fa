"""Rollout paths on real process groups. World 1: KV-cached generation against full
recompute, and sampled log-probs against teacher-forced scoring of each sequence alone.
World 2: resharding training TP=2 / PP=2 / TP=1xPP=2 layouts into inference layouts, before
and after an optimizer step. Results -> OUT/rollout_world{N}.pt on rank 0."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import fixed_sequences, make_config, start  # noqa: E402

from megarlhf.engine.optimizer import TrainedRole, build_optimizer, train_step, wrap_ddp  # noqa: E402
from megarlhf.engine.schedule import build_model_chunks  # noqa: E402
from megarlhf.models.gpt import init_weights  # noqa: E402
from megarlhf.models.logprobs import vocab_parallel_logprobs  # noqa: E402
from megarlhf.rollout.generate import SamplingParams, generate  # noqa: E402
from megarlhf.rollout.reshard import Resharder, build_inference_model, inference_layout  # noqa: E402
from megarlhf.stages.score import right_padded_batch, score_sequences  # noqa: E402

PROMPTS = [[5, 17, 42, 8], [9, 3], [100, 101, 102, 103, 104, 105], [7]]


def direct_logprobs(model, layout, cfg, seqs):
    """Inference-layout model, plain forward (no schedule), one sequence at a time."""
    out = []
    for seq in seqs:
        batch = right_padded_batch([seq], len(seq))
        logits = model(batch["tokens"], batch["position_ids"], None)
        lp, _ = vocab_parallel_logprobs(logits[:, :-1], batch["tokens"][:, 1:],
                                        tp_group=layout.tp_group, true_vocab=cfg.model.vocab_size)
        out.append(lp[0].tolist())
    return out


def generation_case(arch, results):
    cfg = make_config(arch, 1, 1)
    layout = start(cfg)
    (model,) = build_model_chunks(cfg, layout, "lm")
    init_weights(model, cfg)
    model.eval()
    params = SamplingParams(max_new_tokens=12, greedy=True, temperature=0.8)
    common = dict(eos_id=2, pad_id=0, true_vocab=cfg.model.vocab_size)
    cached = generate(model, PROMPTS, params, **common)
    full = generate(model, PROMPTS, params, use_cache=False, **common)
    sampled = generate(model, PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.9,
                                                      top_k=50, top_p=0.9), **common,
                       generator=torch.Generator().manual_seed(3))
    # teacher-forced log-probs of prompt + sampled response, each sequence alone
    seqs = []
    for b, prompt in enumerate(PROMPTS):
        n = int(sampled.response_mask_BT[b].sum())
        seqs.append(prompt + sampled.response_tokens_BT[b, :n].tolist())
    rows = score_sequences(cfg, layout, [model], seqs, role="lm", micro_batch_size=1,
                           temperature=0.9)
    results[f"gen_{arch}"] = {"cached": cached, "full": full, "sampled": sampled,
                              "teacher": [r["logprobs"] for r in rows]}


def reshard_case(name, tp, pp, rollout_tp, results):
    cfg = make_config("llama", tp, pp, extra=(f"rollout.tensor_parallel_size={rollout_tp}",
                                              "optimizer.lr=0.01"))
    layout = start(cfg)
    chunks = build_model_chunks(cfg, layout, "lm")
    for c in chunks:
        init_weights(c, cfg)
    inf_layout = inference_layout(rollout_tp)
    inf_model = build_inference_model(cfg, inf_layout)
    resharder = Resharder(chunks, inf_model)
    seqs = fixed_sequences(4)
    out = {}
    for phase in ("initial", "after_step"):
        if phase == "after_step":
            model = wrap_ddp(chunks, True, layout.pg_collection)
            opt, sched = build_optimizer(cfg.optimizer, model, lr=0.01, total_steps=5)
            from backend_paths import lm_step, microbatches, MICRO, SEQ_LEN
            train_step(TrainedRole(model, opt, sched), lm_step(layout, cfg.model.vocab_size),
                       microbatches(fixed_sequences(8), layout.dp_rank, layout.dp_size),
                       seq_length=SEQ_LEN, micro_batch_size=MICRO)
        stats = resharder()
        train_rows = score_sequences(cfg, layout, chunks, seqs, role="lm", micro_batch_size=2)
        inf_rows = direct_logprobs(inf_model, inf_layout, cfg, seqs)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, inf_rows)
        out[phase] = {"train": train_rows, "inference": gathered, "seconds": stats.seconds,
                      "bytes": stats.bytes_received}
    results[name] = out


def main():
    out_dir = sys.argv[1]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    results = {}
    if world == 1:
        generation_case("llama", results)
        generation_case("gpt2", results)
    else:
        reshard_case("tp2_to_tp1x2", 2, 1, 1, results)
        reshard_case("pp2_to_tp2", 1, 2, 2, results)
        reshard_case("tp1pp2_to_tp1x2", 1, 2, 1, results)
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, f"rollout_world{world}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
