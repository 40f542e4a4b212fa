"""Scores fixed sequences with both architectures (GQA) and a Qwen3-shaped llama (a head
size of its own, q/k norms, llama3 RoPE scaling), LM and value heads, at every layout that
fits the world size. World 1 gives the single-process reference.
Results -> OUT/layouts_world{N}.pt on rank 0."""

from __future__ import annotations

# As the CLI does, before megatron is imported: the speed-ups MEGARLHF_SPEEDUPS selects.
from megarlhf import speedups  # noqa: E402
speedups.install()

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import build, fixed_sequences, make_config  # noqa: E402

from megarlhf.engine.forward import forward_rows, stack_results  # noqa: E402
from megarlhf.engine.steps import make_score_step, make_sequence_step  # noqa: E402
from megarlhf.models.gpt import unwrap  # noqa: E402
from megarlhf.speedups.positions import CutLayer  # noqa: E402
from megatron.core.transformer.transformer_layer import TransformerLayer  # noqa: E402
from megarlhf.stages.score import right_padded_batch, score_sequences  # noqa: E402

PROMPT = 4  # the response-only case: outputs from position PROMPT - 1 on


def response_only_gap(scorer, seqs) -> tuple[float, list[int]]:
    """Largest difference between the sequence step's outputs at the response positions
    (log-probs and entropy, or values and each row's last value) and the full-sequence
    score step's, on the same batches; and the row counts (positions x batch) the last
    layer's MLP saw on this rank in the sequence step (empty off the last stage)."""
    length = max(len(s) for s in seqs)
    kind = scorer.spec.kind

    def last_index(rows):  # as prompt_response_batch's: never before the prompt's end
        return torch.tensor([max(len(r), PROMPT) - 1 for r in rows])

    def make(rows):
        return {**right_padded_batch(rows, length), "last_index": last_index(rows)}

    kw = dict(tp_group=scorer.layout.tp_group, true_vocab=scorer.spec.model.vocab_size)
    full = forward_rows(scorer, seqs, make, make_score_step(kind, **kw), micro_batch_size=2)
    mlp_rows: list[int] = []
    gpt = unwrap(scorer.chunks[-1])
    hook = gpt.decoder.layers[-1].mlp.register_forward_pre_hook(
        lambda module, args: mlp_rows.append(args[0].shape[0] * args[0].shape[1])) \
        if gpt.post_process else None
    part = forward_rows(scorer, seqs, make, make_sequence_step(kind, prompt_len=PROMPT, **kw),
                        micro_batch_size=2)
    if hook is not None:
        hook.remove()
    if kind == "lm":
        gaps = [(stack_results(part, k) - stack_results(full, k)[:, PROMPT - 1:]).abs().max()
                for k in ("logprobs", "entropy")]
        assert stack_results(part, "logprobs").shape[1] == length - PROMPT
    else:
        values = stack_results(full, "values")  # (B, S)
        last = values[torch.arange(len(seqs)), last_index(seqs)]
        gaps = [(stack_results(part, "values") - values[:, PROMPT - 1:-1]).abs().max(),
                (stack_results(part, "last") - last).abs().max()]
        assert stack_results(part, "values").shape[1] == length - PROMPT
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mlp_rows)
    return float(max(gaps)), [n for rank in seen for n in rank]


# (tp, pp, vpp); vpp > 1 runs the interleaved 1F1B schedule.
LAYOUTS = {1: [(1, 1, 1)], 2: [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 2, 2)]}


def main():
    out_dir = sys.argv[1]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    seqs = fixed_sequences(8)
    results = {}
    for arch in ("llama", "gpt2", "qwen3", "olmo3", "gemma3", "gptoss"):  # common.FAMILIES
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
                if arch in ("olmo3", "gemma3", "gptoss"):  # no MLP cut to compare (OLMo's
                    # and Gemma's MLP is megarlhf's; gpt-oss's experts are not cut)
                    continue
                results[("response_only", arch, role, tp, pp, vpp)] = \
                    response_only_gap(scorer, seqs)
                if world == 1:  # where the MLP cut is not allowed (fp8, ...): the head cuts
                    last = unwrap(scorer.chunks[-1]).decoder.layers[-1]
                    if isinstance(last, CutLayer):  # built as a plain layer would be
                        last.__class__ = TransformerLayer
                    results[("head_only", arch, role, tp, pp, vpp)] = \
                        response_only_gap(scorer, seqs)
    results["positions_cut"] = speedups.enabled("positions")
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, f"layouts_world{world}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
