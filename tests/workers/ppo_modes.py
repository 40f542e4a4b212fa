"""PPO iterations in several modes, one process group for all of them (run under torchrun
with 1 or 2 processes): ``ppo_modes.py CASES.json OUT_DIR``.

CASES.json maps a case name to {"overrides": [...], "iterations": N}. For every case the
worker builds a ``PPOSession`` from configs/demo/ppo.yaml plus the overrides, runs N
iterations and writes ``OUT_DIR/<name>.world<W>.pt`` (rank 0): the metrics of every
iteration, the first iteration's experience, the actor's weights before and after, and
for PPO-ptx the reference NLL of the first ptx mini-batch under the initial actor.
"""

from __future__ import annotations

# As the CLI does, before megatron is imported: the speed-ups MEGARLHF_SPEEDUPS selects.
from megarlhf import speedups  # noqa: E402
speedups.install()

import dataclasses
import json
import os
import sys

import torch

from megarlhf.parallel.launch import shutdown
import torch.distributed as dist

from megarlhf.config import load_config
from megarlhf.data.tokenizer import load_tokenizer
from megarlhf.engine.forward import forward_rows, stack_results
from megarlhf.data.batching import pad_batch
from megarlhf.engine.steps import make_score_step
from megarlhf.ppo.session import PPOSession


def gathered_params(role) -> torch.Tensor:
    """The actor's full weights, the same on every rank (TP/PP shards are not used here:
    these cases run the actor at TP=1 PP=1)."""
    return torch.cat([p.detach().reshape(-1).clone() for p in role.parameters])


def ptx_reference_nll(session) -> float:
    """NLL per token of mini-batch 0's ptx samples under the current actor weights, from
    the plain scoring step's per-token log-probs (not the PPO step's ptx branch)."""
    ptx = session.ptx
    rows = [ptx.examples[ptx.order[k % len(ptx.order)]] for k in range(ptx.batch_size)]
    length = max(len(toks) for toks, _ in rows)
    step = make_score_step("lm", tp_group=session.actor.layout.tp_group,
                           true_vocab=session.actor.spec.model.vocab_size)
    batches = [pad_batch([row], length, session.tokenizer.pad_id) for row in rows]
    out = forward_rows(session.actor, list(range(len(rows))), lambda idx: batches[idx[0]],
                       step, micro_batch_size=1)
    nll = sum(-float((o["logprobs"] * b["loss_mask"][0, :-1]).sum())
              for o, b in zip(out, batches, strict=True))
    return nll / sum(float(b["loss_mask"].sum()) for b in batches)


def main() -> None:
    cases = json.load(open(sys.argv[1]))
    out_dir = sys.argv[2]
    for name, case in cases.items():
        cfg = load_config("configs/demo/ppo.yaml", case["overrides"])
        tokenizer = load_tokenizer(cfg.tokenizer)
        session = PPOSession(cfg, tokenizer)
        before = gathered_params(session.actor)
        result = {"metrics": [], "eos_id": tokenizer.eos_id,
                  "ref_cache_capacity": getattr(session.scorer.ref_cache, "capacity", 0)}
        if session.ptx is not None:
            result["ptx_reference_nll"] = ptx_reference_nll(session)
        if session.critic is not None and name == "gae_stop":
            # the critic's head output after the last token vs the reward model's
            # normalised score, on the first iteration's samples, before any update
            sampler, scorer = session.sampler, session.scorer
            gen, _ = sampler.finalize(sampler.rollout(session.prompt_batch(0), cfg.run.seed)[0])
            rows = list(range(gen.response_tokens_BT.shape[0]))
            result["critic_last"] = stack_results(scorer.score(session.critic, gen, rows),
                                                  "last")
            result["rm_score"] = scorer.reward_scores(gen)
        for it in range(case.get("iterations", 1)):
            metrics, exp, gen = session.iteration(it)
            result["metrics"].append(metrics)
            if it == 0:
                result["experience"] = {f.name: getattr(exp, f.name)
                                        for f in dataclasses.fields(exp)}
                result["finished"] = gen.finished_B.clone()
        result["before"], result["after"] = before, gathered_params(session.actor)
        session.close()
        if dist.get_rank() == 0:
            world = dist.get_world_size()
            torch.save(result, os.path.join(out_dir, f"{name}.world{world}.pt"))
    dist.barrier()


if __name__ == "__main__":
    main()
    shutdown()  # the process group closed on every rank before the process exits
