"""Scores fixed sequences with both architectures (GQA), LM and value heads, at every
layout that fits the world size. World 1 gives the single-process reference.
Results -> OUT/layouts_world{N}.pt on rank 0."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import build, fixed_sequences, make_config  # noqa: E402

from megarlhf.engine.forward import forward_rows, stack_results  # noqa: E402
from megarlhf.engine.steps import make_score_step, make_sequence_step  # noqa: E402
from megarlhf.stages.score import right_padded_batch, score_sequences  # noqa: E402

PROMPT = 4  # the response-only logits case: positions from PROMPT - 1 on


def response_only_gap(scorer, seqs) -> float:
    """Largest difference between the response log-probs of the sequence step (the LM
    head computes logits at the response positions only) and the full-sequence score
    step's, on the same batches."""
    length = max(len(s) for s in seqs)
    make = lambda rows: right_padded_batch(rows, length)  # noqa: E731
    kw = dict(tp_group=scorer.layout.tp_group, true_vocab=scorer.spec.model.vocab_size)
    full = forward_rows(scorer, seqs, make, make_score_step("lm", **kw), micro_batch_size=2)
    part = forward_rows(scorer, seqs, make, make_sequence_step("lm", prompt_len=PROMPT, **kw),
                        micro_batch_size=2)
    gaps = [(stack_results(part, k) - stack_results(full, k)[:, PROMPT - 1:]).abs().max()
            for k in ("logprobs", "entropy")]
    assert stack_results(part, "logprobs").shape[1] == length - PROMPT
    return float(max(gaps))

# (tp, pp, vpp); vpp > 1 runs the interleaved 1F1B schedule.
LAYOUTS = {1: [(1, 1, 1)], 2: [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 2, 2)]}


def main():
    out_dir = sys.argv[1]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    seqs = fixed_sequences(8)
    results = {}
    for arch in ("llama", "gpt2"):
        for role in ("lm", "value"):
            for tp, pp, vpp in LAYOUTS[world]:
                extra = ["model.value_head_init=normal"]
                if vpp > 1:
                    extra.append(f"parallel.virtual_pipeline_model_parallel_size={vpp}")
                cfg = make_config(arch, tp, pp, extra=tuple(extra))
                scorer = build(cfg, role)
                for temperature in ((1.0, 0.7) if role == "lm" else (1.0,)):
                    rows = score_sequences(scorer, seqs, micro_batch_size=2,
                                           temperature=temperature)
                    results[(arch, role, tp, pp, vpp, temperature)] = rows
                if role == "lm":
                    results[("response_only", arch, tp, pp, vpp)] = response_only_gap(scorer,
                                                                                     seqs)
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, f"layouts_world{world}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
