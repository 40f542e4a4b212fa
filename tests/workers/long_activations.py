"""Activations of long sequences, measured against the plan (run under torchrun, one
process): ``long_activations.py OUT``. A tiny-width llama (2 layers of 64, vocabulary 512)
trains one PPO policy update on one sample of 512 prompt + LENGTH - 512 response tokens,
with each recomputation setting (on two processes: at TP=2 without and with sequence
parallelism); the bytes autograd keeps for backward
(``memory.accounting.ActivationMeter``) against ``memory.estimates.train_activation_bytes``
for the same shapes. Results -> OUT/long_activations_world{N}.pt."""

from __future__ import annotations

from megarlhf import speedups  # noqa: E402
speedups.install()

import os
import sys

import torch

from megarlhf.parallel.launch import shutdown

sys.path.insert(0, os.path.dirname(__file__))
from common import build, make_config  # noqa: E402

from megarlhf import algos  # noqa: E402
from megarlhf.engine.optimizer import forward_backward, prepare_step  # noqa: E402
from megarlhf.engine.steps import make_policy_step  # noqa: E402
from megarlhf.memory.accounting import ActivationMeter  # noqa: E402
from megarlhf.memory.estimates import train_activation_bytes  # noqa: E402
from megarlhf.ppo.learner import dp_share, experience_batches  # noqa: E402

LENGTH = int(os.environ.get("LONG_LENGTH", "4096"))
PROMPT, VOCAB = 512, 512
SETTINGS = {"none": [],
            "full": ["model.recompute.granularity=full", "model.recompute.num_layers=1"],
            "selective_mlp": ["model.recompute.granularity=selective",
                              "model.recompute.modules=[mlp]"]}
# on two processes: TP=2 without and with sequence parallelism
TP2_SETTINGS = {"tp2": ["parallel.tensor_model_parallel_size=2"],
                "tp2_sp": ["parallel.tensor_model_parallel_size=2",
                           "parallel.sequence_parallel=true"]}


def main():
    out = {}
    g = torch.Generator().manual_seed(0)
    T = LENGTH - PROMPT
    prompt = torch.randint(3, VOCAB, (1, PROMPT), generator=g)
    response = torch.randint(3, VOCAB, (1, T), generator=g)
    mask = torch.ones(1, T)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for name, extra in (TP2_SETTINGS if world == 2 else SETTINGS).items():
        cfg = make_config("llama", 1, 1, vocab=VOCAB, layers=2, hidden=64, extra=(
            f"model.max_position_embeddings={LENGTH}",
            "optimizer.use_distributed_optimizer=false", *extra))
        actor = build(cfg, "lm", trained=True)
        exp = algos.Experience(
            prompt_tokens_BP=prompt, prompt_mask_BP=torch.ones(1, PROMPT, dtype=torch.long),
            response_tokens_BT=response, response_mask_BT=mask,
            rollout_logprobs_BT=-torch.ones(1, T), old_logprobs_BT=-torch.ones(1, T),
            ref_logprobs_BT=-torch.ones(1, T), values_BT=torch.zeros(1, T),
            scores_B=torch.zeros(1), kl_BT=torch.zeros(1, T), rewards_BT=torch.zeros(1, T),
            advantages_BT=torch.randn(1, T, generator=g), returns_BT=torch.zeros(1, T))
        step = make_policy_step(prompt_len=PROMPT, tp_group=actor.layout.tp_group,
                                true_vocab=VOCAB, temperature=1.0, ppo=cfg.ppo)
        batches = experience_batches(dp_share(exp, actor.layout), 1, 0)
        params = [p for chunk in actor.trained.model for p in chunk.parameters()]
        with ActivationMeter(exclude=params) as meter:
            forward_backward(actor.trained, step, batches, seq_length=LENGTH,
                             micro_batch_size=1)
        prepare_step(actor.trained)
        planned = train_activation_bytes(actor.spec, pp_rank=0, micro=1, micro_batches=1,
                                         seq=LENGTH, response=T)
        peak = torch.tensor([float(meter.peak)])
        if world > 1:  # the TP ranks keep the same shapes: the largest
            torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        out[name] = {"measured": float(peak), "planned": planned}
        print(name, float(peak), planned, flush=True)
    if world == 1 or torch.distributed.get_rank() == 0:
        torch.save(out, os.path.join(sys.argv[1], f"long_activations_world{world}.pt"))


if __name__ == "__main__":
    main()
    shutdown()  # the process group closed on every rank before the process exits
