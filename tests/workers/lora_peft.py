"""A LoRA model built from a converted checkpoint, its adapters from a PEFT folder
(``model.lora.init_from``): per-token log-probs of fixed sequences at every layout of this
world, the planner's parameter shapes against the built ones, (one pipeline stage) the
adapters' gradients of the summed log-probs, whole, by PEFT key, and at TP=2 checkpoints
(OUT/ckpt whole, OUT/ckpt_adapters the adapters only) for the exports.
argv: OUT CONV_DIR PEFT_DIR RANK ALPHA. Results ->
OUT/lora_world{N}.pt"""

from __future__ import annotations

from megarlhf import speedups  # noqa: E402
speedups.install()

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import build  # noqa: E402

from megarlhf.config import load_config  # noqa: E402
from megarlhf.engine.checkpoint import save_checkpoint  # noqa: E402
from megarlhf.engine.steps import model_forward, token_logprobs  # noqa: E402
from megarlhf.models import lora  # noqa: E402
from megarlhf.models.shapes import chunk_params  # noqa: E402
from megarlhf.stages.score import score_sequences  # noqa: E402

SEQS = [[5, 17, 42, 8, 99, 250, 3, 77], [9, 3, 120, 121],
        [(37 * i + 11) % 299 + 1 for i in range(24)]]


def main():
    out_dir, conv, peft_dir, rank, alpha = sys.argv[1:6]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # (TP, PP, SP, VPP): the interleaved schedule's two chunks of two layers per stage
    layouts = [(1, 1, False, None)] if world == 1 else [
        (2, 1, False, None), (2, 1, True, None), (1, 2, False, None), (1, 2, False, 2)]
    results = {}
    for tp, pp, sp, vpp in layouts:
        cfg = load_config(os.path.join(conv, "config.yaml"), [
            f"parallel.tensor_model_parallel_size={tp}",
            f"parallel.pipeline_model_parallel_size={pp}",
            f"parallel.sequence_parallel={str(sp).lower()}",
            f"parallel.virtual_pipeline_model_parallel_size={vpp or 'null'}",
            f"model.lora.rank={rank}", f"model.lora.alpha={alpha}",
            f"model.lora.init_from={peft_dir}"])
        role = build(cfg, "lm")  # the converted base, then PEFT's adapter (init_from)
        assert role.source.endswith(f"; LoRA adapters from {peft_dir}"), role.source
        rows = score_sequences(role, SEQS, micro_batch_size=1)
        if (tp, pp, sp, vpp) == (2, 1, False, None):  # for the exports (tests/test_lora.py): whole,
            for name, only in (("ckpt", False), ("ckpt_adapters", True)):  # and adapters
                save_checkpoint(os.path.join(out_dir, name), "step_1",
                                {"policy": role.state(adapters_only=only)},
                                trainer_state={"step": 1}, layout=role.layout.describe())
        got = {"logprobs": [r["logprobs"] for r in rows]}
        if vpp is None:
            spec = role.spec  # the planner's parameter shapes (adapters included)
            want = [(p.name, p.shape, p.frozen) for p in chunk_params(
                spec.model, kind="lm", padded_vocab=spec.padded_vocab, tp=tp, pp=pp,
                pp_rank=role.layout.pp_rank)]
            have = [(n, tuple(p.shape), "_lora." not in n)
                    for n, p in role.chunks[0].named_parameters()]
            got["shapes_agree"] = want == have
        if pp == 1:
            chunk = role.chunks[0]
            for p in lora.adapter_parameters(chunk):
                p.requires_grad_(True)
            for seq in SEQS:
                tokens = torch.tensor([seq])
                batch = {"tokens": tokens, "position_ids": torch.arange(len(seq))[None]}
                hidden = model_forward(chunk, batch, hidden=True)
                logprobs, _ = token_logprobs(chunk, hidden[:, :-1], tokens[:, 1:],
                                             tp_group=role.layout.tp_group,
                                             true_vocab=cfg.model.vocab_size)
                logprobs.sum().backward()
            got["grads"] = lora.peft_tensors(role.chunks, role.layout.pp_group, grads=True)
        results[(tp, pp, sp, vpp)] = got
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, f"lora_world{world}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
