"""Packed against padded micro-batches at every layout that fits the world size (run under
torchrun): ``packing_paths.py OUT``. World 1 gives the single-process padded reference.

For each layout, on one synthetic rollout of long-tailed lengths: the experience passes
(the actor's log-probs and entropy, the critic's values and last values) padded and packed;
then one update of actor and critic on an experience batch whose old log-probs are the
packed pass's, padded and packed (at another token budget, so the samples are regrouped):
the reduced loss logs, the global gradient norms and the largest difference between the
two gradients of every parameter shard. The same for the supervised stages' losses (SFT,
the reward model's pairwise loss, DPO, distillation) on micro-batches that
``stages.supervised.micro_batches`` makes, padded and packed, from the stages' own batch
functions. Results -> OUT/packing_world{N}.pt on rank 0.
"""

from __future__ import annotations

# As the CLI does, before megatron is imported: the speed-ups MEGARLHF_SPEEDUPS selects.
from megarlhf import speedups  # noqa: E402
speedups.install()

import os
import sys

import torch

from megarlhf.parallel.launch import shutdown
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import build, make_config  # noqa: E402

from megarlhf import algos  # noqa: E402
from megarlhf.engine.forward import forward_rows, stack_results  # noqa: E402
from megarlhf.engine.optimizer import forward_backward, prepare_step  # noqa: E402
from megarlhf.engine.steps import (make_policy_step, make_sequence_step,  # noqa: E402
                                   make_value_step, reduce_logs, make_lm_loss_step,
                                   make_pairwise_rm_step, make_dpo_step, make_distill_step)
from megarlhf.data.batching import sft_example  # noqa: E402
from megarlhf.data.packing import pack_weighted  # noqa: E402
from megarlhf.stages.offline import (distill_microbatches, dpo_microbatches,  # noqa: E402
                                     packed_distill_rows, packed_dpo_pairs)
from megarlhf.stages.rm import packed_pairs, pair_microbatches, pair_tokens  # noqa: E402
from megarlhf.stages.sft import make_microbatches  # noqa: E402
from megarlhf.stages.supervised import SupervisedTask, micro_batches  # noqa: E402
from megarlhf.inference.generate import Generation, left_pad  # noqa: E402
from megarlhf.models.gpt import unwrap  # noqa: E402
from megarlhf.rollout.scoring import (packed_batch_fn, sequence_batch_fn,  # noqa: E402
                                      sequence_lengths)
from megarlhf.ppo.learner import (dp_share, experience_batches,  # noqa: E402
                                  packed_experience_batches)

VOCAB = 300
PROMPT_LENS = [3, 7, 1, 5, 2, 6, 4, 8, 5, 3, 7, 2]
RESPONSE_LENS = [1, 2, 3, 41, 5, 1, 9, 2, 50, 4, 17, 3]  # long-tailed
# Packed rows longer than data.packing.MIN_ROWS, of several lengths: the pipeline stages
# exchange their shapes (and the interleaved schedule over gloo pads them to one).
FORWARD_BUDGET, TRAIN_BUDGET = 90, 70
# (arch, tp, pp, vpp); DP is what the world leaves. GPT-2's learned positions read the
# position ids (a llama's rotary positions restart from cu_seqlens). An arch's "+sp"
# turns on sequence parallelism, "+full" full recomputation (one layer a group), "+ep2"
# the experts over two ranks, whole on each (a mixture of experts at TP=2 x EP=2 on two
# processes).
LAYOUTS = {1: [("llama", 1, 1, 1), ("gpt2", 1, 1, 1), ("qwen3moe", 1, 1, 1)],
           2: [("llama", 2, 1, 1), ("llama", 1, 2, 1), ("llama", 1, 2, 2), ("llama", 1, 1, 1),
               ("llama+sp", 2, 1, 1), ("qwen3moe+sp+ep2", 2, 1, 1)],
           4: [("llama", 2, 2, 1), ("llama", 1, 2, 1), ("llama+sp", 2, 2, 1),
               ("llama+sp+full", 2, 1, 1), ("gpt2", 2, 1, 1)]}
LEVERS = {"sp": ["parallel.sequence_parallel=true"],
          "ep2": ["parallel.expert_model_parallel_size=2",
                  "parallel.expert_tensor_parallel_size=1"],
          "full": ["model.recompute.granularity=full", "model.recompute.num_layers=1"]}


def generation() -> Generation:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    tokens_BP, mask_BP = left_pad(prompts, 0)
    T = max(RESPONSE_LENS) + 3  # right padding past the longest
    resp = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, n in enumerate(RESPONSE_LENS):
        resp[b, :n] = torch.randint(3, VOCAB, (n,), generator=gen)
        mask[b, :n] = 1
    B = len(prompts)
    return Generation(tokens_BP, mask_BP, resp, mask, torch.zeros(B, T),
                      torch.ones(B, dtype=torch.bool))


def passes(role, gen, packed: bool) -> dict:
    P = gen.prompt_tokens_BP.shape[1]
    kind = role.spec.kind
    step = make_sequence_step(kind, prompt_len=P, tp_group=role.layout.tp_group,
                              true_vocab=VOCAB)
    rows = list(range(len(PROMPT_LENS)))
    padding: dict = {}
    if packed:
        out = forward_rows(role, rows, packed_batch_fn(gen, kind), step, micro_batch_size=1,
                           max_tokens=FORWARD_BUDGET, lengths=sequence_lengths(gen),
                           padding=padding)
    else:
        out = forward_rows(role, rows, sequence_batch_fn(gen, 0), step, micro_batch_size=3,
                           lengths=sequence_lengths(gen), padding=padding)
    mask = gen.fed_mask_BT.float()
    keys = ("logprobs", "entropy") if kind == "lm" else ("values", "last")
    res = {k: stack_results(out, k) * (mask if k != "last" else 1.0) for k in keys}
    res["padding_fraction"] = padding["padding"] / padding["computed"]
    return res


def experience(gen, old_logprobs, values) -> algos.Experience:
    g = torch.Generator().manual_seed(11)
    mask = gen.fed_mask_BT.float()
    B, T = mask.shape
    return algos.Experience(
        prompt_tokens_BP=gen.prompt_tokens_BP, prompt_mask_BP=gen.prompt_mask_BP,
        response_tokens_BT=gen.response_tokens_BT, response_mask_BT=mask,
        rollout_logprobs_BT=old_logprobs, old_logprobs_BT=old_logprobs,
        ref_logprobs_BT=old_logprobs - 0.1 * mask, values_BT=values,
        scores_B=torch.randn(B, generator=g), kl_BT=torch.zeros(B, T),
        rewards_BT=torch.zeros(B, T), advantages_BT=torch.randn(B, T, generator=g) * mask,
        returns_BT=torch.randn(B, T, generator=g) * mask)


def update(role, step, exp, packed: bool) -> dict:
    if packed:
        batches = packed_experience_batches(exp, role.layout, TRAIN_BUDGET, 0)
    else:
        batches = experience_batches(dp_share(exp, role.layout), 2, 0)
    logs = forward_backward(role.trained, step, batches,
                            seq_length=max(b["tokens"].shape[1] for b in batches),
                            micro_batch_size=batches[0]["tokens"].shape[0])
    grads = [p.main_grad.detach().clone() for chunk in role.trained.model
             for p in chunk.parameters()]
    _, norm = prepare_step(role.trained)
    return {"logs": reduce_logs(logs, role.layout), "grads": grads, "norm": norm}


SUPERVISED_BUDGET = 128  # the longest preference pair has 101 tokens; an SFT sample 55
TOP_K = 4


class TeacherCache:
    """The fields of ``engine.logit_cache.LogitCache`` distillation reads: a teacher's
    top-k log-probs and ids per position of each row (random numbers, fixed by a seed)."""

    def __init__(self, rows: list[list[int]]):
        g = torch.Generator().manual_seed(5)
        self.key = type("Key", (), {"top_k": TOP_K})()
        self.topk_logprobs = [torch.rand(len(r) - 1, TOP_K, generator=g).log() - 1.0
                              for r in rows]
        self.topk_ids = [torch.randint(0, VOCAB, (len(r) - 1, TOP_K), generator=g)
                         for r in rows]


def supervised_tasks() -> dict[str, SupervisedTask]:
    """SFT, RM, DPO and distillation tasks as the stages build them (padded micro-batches
    of 2 samples, or packed), on the worker's long-tailed prompts and responses."""
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    responses = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in RESPONSE_LENS]
    n = len(prompts)
    examples = [sft_example(p, r) for p, r in zip(prompts, responses)]
    pairs = [(prompts[i], responses[i], responses[(i + 5) % n]) for i in range(n)]
    ref = {i: tuple((torch.randn(2, generator=gen) * 3 - 40).tolist()) for i in range(n)}
    dpo_items = [(i, *pair) for i, pair in enumerate(pairs)]
    cache = TeacherCache([t for t, _ in examples])
    distill_items = [(i, t, w) for i, (t, w) in enumerate(examples)]
    length = 64  # data.max_seq_len
    common = dict(eval_items=[], summarize=lambda t: t, make_step=None)
    return {
        "sft": SupervisedTask(
            name="sft", train_items=examples, rows_per_micro_batch=2,
            make_batches=lambda its, training: make_microbatches(
                its, 2, packing=False, max_len=length, pad_id=0),
            tokens=lambda e: len(e[0]), make_packed=lambda its: pack_weighted(its), **common),
        "rm": SupervisedTask(
            name="rm", train_items=pairs, rows_per_micro_batch=4,
            make_batches=lambda its, training: pair_microbatches(its, 2, 2 * length, 0),
            tokens=pair_tokens, make_packed=lambda its: packed_pairs(its, 0), **common),
        "dpo": SupervisedTask(
            name="dpo", train_items=dpo_items, rows_per_micro_batch=4,
            make_batches=lambda its, training: dpo_microbatches(its, 2, 2 * length, 0, ref),
            tokens=pair_tokens, make_packed=lambda its: packed_dpo_pairs(its, 0, ref),
            **common),
        "distill": SupervisedTask(
            name="distill", train_items=distill_items, rows_per_micro_batch=2,
            make_batches=lambda its, training: distill_microbatches(its, 2, length, 0, cache),
            tokens=lambda item: len(item[1]),
            make_packed=lambda its: packed_distill_rows(its, 0, cache), **common)}


def supervised(actor, reward) -> dict:
    """Each supervised loss padded and packed at the roles' layout: reduced logs, gradient
    norm, and the largest gradient difference (``case``'s terms)."""
    tp = actor.layout.tp_group
    steps = {"sft": (actor, make_lm_loss_step(tp_group=tp, true_vocab=VOCAB)),
             "rm": (reward, make_pairwise_rm_step()),
             "dpo": (actor, make_dpo_step(tp_group=tp, true_vocab=VOCAB, beta=0.1,
                                          loss="sigmoid", label_smoothing=0.0)),
             "distill": (actor, make_distill_step(tp_group=tp, true_vocab=VOCAB,
                                                  divergence="forward", temperature=1.0,
                                                  nll_coef=0.5))}
    out = {}
    for name, task in supervised_tasks().items():
        role, step = steps[name]
        runs = {}
        for budget in (None, SUPERVISED_BUDGET):
            batches, length, rows = micro_batches(task, task.train_items, role.layout, True,
                                                  budget)
            logs = forward_backward(role.trained, step, batches, seq_length=length,
                                    micro_batch_size=rows)
            grads = [p.main_grad.detach().clone() for chunk in role.trained.model
                     for p in chunk.parameters()]
            _, norm = prepare_step(role.trained)
            runs[budget is not None] = {"logs": reduce_logs(logs, role.layout), "grads": grads,
                                        "norm": norm}
        gap = max(float((a - b).abs().max()) for a, b in zip(runs[False]["grads"],
                                                             runs[True]["grads"]))
        scale = max(float(a.abs().max()) for a in runs[False]["grads"])
        stats = torch.tensor([gap, scale])
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        out[name] = {"padded": {k: runs[False][k] for k in ("logs", "norm")},
                     "packed": {k: runs[True][k] for k in ("logs", "norm")},
                     "grad_gap": float(stats[0]), "grad_scale": float(stats[1])}
    return out


def case(arch, tp, pp, vpp) -> dict:
    # full gradients on every data-parallel rank (the distributed optimizer reduces each
    # rank's shard only), so the two updates compare parameter by parameter
    extra = ["ppo.kl.loss_coef=0.1", "ppo.entropy_coef=0.01", "model.value_head_init=normal",
             "optimizer.use_distributed_optimizer=false"]
    if vpp > 1:
        extra.append(f"parallel.virtual_pipeline_model_parallel_size={vpp}")
    arch, *levers = arch.split("+")
    for lever in levers:
        extra.extend(LEVERS[lever])
    cfg = make_config(arch, tp, pp, extra=tuple(extra))
    actor = build(cfg, "lm", trained=True)
    critic = build(cfg, "value", trained=True, seed_offset=2)
    gen = generation()
    core = unwrap(actor.chunks[0])
    # what reached megatron: its config, and the norms whose gradients it sums over TP
    out = {"forward": {}, "sequence_parallel": (
        core.config.sequence_parallel,
        sum(getattr(p, "sequence_parallel", False) for p in core.parameters()))}
    for packed in (False, True):
        out["forward"][packed] = {**passes(actor, gen, packed), **passes(critic, gen, packed)}
    fwd = out["forward"][True]
    exp = experience(gen, fwd["logprobs"], fwd["values"])
    P = gen.prompt_tokens_BP.shape[1]
    policy = make_policy_step(prompt_len=P, tp_group=actor.layout.tp_group, true_vocab=VOCAB,
                              temperature=1.0, ppo=cfg.ppo)
    value = make_value_step(prompt_len=P, cliprange_value=0.2, agg="token_mean")
    for name, role, step in (("actor", actor, policy), ("critic", critic, value)):
        padded, packed = update(role, step, exp, False), update(role, step, exp, True)
        gap = max(float((a - b).abs().max()) for a, b in zip(padded["grads"], packed["grads"]))
        scale = max(float(a.abs().max()) for a in padded["grads"])
        stats = torch.tensor([gap, scale])
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        out[name] = {"padded": {k: padded[k] for k in ("logs", "norm")},
                     "packed": {k: packed[k] for k in ("logs", "norm")},
                     "grad_gap": float(stats[0]), "grad_scale": float(stats[1])}
    out["supervised"] = supervised(actor, critic)
    return out


def main():
    out_dir = sys.argv[1]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    results = {}
    for arch, tp, pp, vpp in LAYOUTS[world]:
        results[(arch, tp, pp, vpp, world // (tp * pp))] = case(arch, tp, pp, vpp)
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, f"packing_world{world}.pt"))


if __name__ == "__main__":
    main()
    shutdown()  # the process group closed on every rank before the process exits
