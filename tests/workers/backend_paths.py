"""Exercises every CPU-backend-redirected megatron-core path: a pipeline-schedule training
step (PP=2, 1F1B), Megatron DDP + the distributed optimizer (DP=2), and a
dist_checkpointing save. Run at world size 1 (reference) and 2; results -> OUT/rank*.pt.
"""

from __future__ import annotations

# As the CLI does, before megatron is imported: the speed-ups MEGARLHF_SPEEDUPS selects.
from megarlhf import speedups  # noqa: E402
speedups.install()

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import build, fixed_sequences, make_config  # noqa: E402

from megarlhf.engine import checkpoint  # noqa: E402
from megarlhf.engine.checkpoint import RoleState, load_checkpoint, save_checkpoint  # noqa: E402
from megarlhf.parallel import cpu_backend  # noqa: E402
from megarlhf.engine.optimizer_state import legacy_plain_state, sub_optimizers  # noqa: E402
from megarlhf.engine.optimizer import step_together, train_step  # noqa: E402
from megarlhf.models.logprobs import vocab_parallel_logprobs  # noqa: E402
from megarlhf.stages.score import right_padded_batch, score_sequences  # noqa: E402

SEQ_LEN = 17
MICRO = 2


def lm_step(layout, vocab, poison=False):
    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], None)

        def loss_func(logits):
            logprobs, _ = vocab_parallel_logprobs(
                logits[:, :-1], batch["tokens"][:, 1:], tp_group=layout.tp_group,
                true_vocab=vocab)
            mask = batch["loss_mask"][:, 1:]
            loss_sum = -(logprobs * mask).sum()
            if poison:
                loss_sum = loss_sum * float("nan")
            num_tokens = mask.sum().to(torch.int)
            return loss_sum, num_tokens, {"loss": torch.stack([loss_sum.detach(),
                                                               num_tokens.float()])}

        return output, loss_func

    return forward_step


def microbatches(seqs, dp_rank, dp_size):
    mine = seqs[dp_rank::dp_size]
    out = []
    for i in range(0, len(mine), MICRO):
        batch = right_padded_batch(mine[i:i + MICRO], SEQ_LEN)
        mask = torch.zeros_like(batch["tokens"], dtype=torch.float)
        for b, s in enumerate(mine[i:i + MICRO]):
            mask[b, :len(s)] = 1
        batch["loss_mask"] = mask
        out.append(batch)
    return out


def run_case(name, tp, pp, out_dir, results):
    cfg = make_config("llama", tp, pp, extra=("optimizer.lr=0.01", "optimizer.clip_grad=1.0"))
    built = build(cfg, "lm", trained=True)
    layout, chunks, role = built.layout, built.chunks, built.trained
    model, optimizer, scheduler = role.model, role.optimizer, role.scheduler
    seqs = fixed_sequences(8)
    losses = []
    for _ in range(3):
        logs, applied, grad_norm = train_step(
            role, lm_step(layout, cfg.model.vocab_size),
            microbatches(seqs, layout.dp_rank, layout.dp),
            seq_length=SEQ_LEN, micro_batch_size=MICRO)
        assert applied
        total = torch.stack([log["loss"] for log in logs]).sum(0) if logs else torch.zeros(2)
        dist.all_reduce(total)  # sum over DP ranks (and zeros from non-last stages)
        total = total / (layout.tp)  # every TP rank of the last stage contributed
        losses.append((total[0] / total[1]).item())
    rows = score_sequences(built, fixed_sequences(6), micro_batch_size=2)
    ckpt = save_checkpoint(os.path.join(out_dir, f"ckpt_{name}"), "step_3",
                           {"policy": RoleState(model, optimizer, scheduler)},
                           trainer_state={"step": 3}, layout=layout.describe())
    results[name] = {"losses": losses, "rows": rows, "ckpt": ckpt,
                     "params": [p.detach().clone() for p in chunks[0].parameters()]}


def nonfinite_case(results):
    """DP=2: a NaN loss on rank 1 only; both ranks must skip the step, weights unchanged."""
    cfg = make_config("llama", 1, 1, extra=("optimizer.lr=0.01",))
    built = build(cfg, "lm", trained=True)
    layout, chunks, role = built.layout, built.chunks, built.trained
    seqs = fixed_sequences(8)
    before = [p.detach().clone() for p in chunks[0].parameters()]
    _, applied, norm = train_step(role, lm_step(layout, cfg.model.vocab_size,
                                                poison=dist.get_rank() == 1),
                                  microbatches(seqs, layout.dp_rank, layout.dp),
                                  seq_length=SEQ_LEN, micro_batch_size=MICRO)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, chunks[0].parameters(), strict=True))
    _, applied2, _ = train_step(role, lm_step(layout, cfg.model.vocab_size),
                                microbatches(seqs, layout.dp_rank, layout.dp),
                                seq_length=SEQ_LEN, micro_batch_size=MICRO)
    changed = not all(torch.equal(a, b) for a, b in zip(before, chunks[0].parameters(), strict=True))
    flags = torch.tensor([float(applied), float(unchanged), float(applied2), float(changed),
                          float(role.num_skipped_steps)])
    gathered = [torch.zeros(5) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flags)
    results["nonfinite"] = [g.tolist() for g in gathered]


def _adam_state(optimizer) -> list[torch.Tensor]:
    """Every main weight, Adam moment and step of a plain optimizer, in its order."""
    inner = sub_optimizers(optimizer)[0].optimizer
    out = []
    for group in inner.param_groups:
        for p in group["params"]:
            state = inner.state[p]
            out += [p.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone(),
                    torch.as_tensor(state["step"], dtype=torch.float32).clone()]
    return out


def legacy_case(out_dir, results):
    """A checkpoint in megatron's own plain-optimizer format (as written before the one
    format) loads into a plain optimizer with every Adam tensor equal; the distributed
    optimizer refuses it with a message naming the fix."""
    plain = ("optimizer.lr=0.01", "optimizer.use_distributed_optimizer=false")
    cfg = make_config("llama", 1, 1, extra=plain)
    built = build(cfg, "lm", trained=True)
    role = built.trained
    for _ in range(2):
        train_step(role, lm_step(built.layout, cfg.model.vocab_size),
                   microbatches(fixed_sequences(8), 0, 1), seq_length=SEQ_LEN,
                   micro_batch_size=MICRO)
    saved = _adam_state(role.optimizer)
    formats = checkpoint.sharded_optimizer_state
    checkpoint.sharded_optimizer_state = legacy_plain_state  # write the old format
    try:
        path = save_checkpoint(os.path.join(out_dir, "ckpt_legacy"), "step_2",
                               {"policy": RoleState(role.model, role.optimizer, role.scheduler)},
                               config={"optimizer": {"use_distributed_optimizer": False}})
    finally:
        checkpoint.sharded_optimizer_state = formats
    meta_path = os.path.join(path, checkpoint.META_FILE)
    meta = json.load(open(meta_path))
    del meta["roles"]["policy"]["optimizer_format"]  # old checkpoints have none
    json.dump(meta, open(meta_path, "w"))

    fresh = build(cfg, "lm", trained=True, seed_offset=1).trained
    load_checkpoint(path, {"policy": RoleState(fresh.model, fresh.optimizer, fresh.scheduler)})
    loaded = _adam_state(fresh.optimizer)
    results["legacy"] = {
        "tensors": len(saved),
        "max_diff": max((a - b).abs().max().item() for a, b in zip(saved, loaded, strict=True)),
        "moments_nonzero": all(t.abs().sum() > 0 for t in saved[1::4])}
    distributed = build(make_config("llama", 1, 1, extra=(
        "optimizer.lr=0.01", "optimizer.use_distributed_optimizer=true")), "lm",
        trained=True).trained
    try:
        load_checkpoint(path, {"policy": RoleState(distributed.model, distributed.optimizer,
                                                   distributed.scheduler)})
        results["legacy"]["refusal"] = None
    except ValueError as err:
        results["legacy"]["refusal"] = str(err)


def extra_state_case(out_dir, results):
    """A checkpoint of the local layers into a model whose final norm keeps extra state
    (as TransformerEngine's modules keep fp8 metadata; a GPU run found such a load
    refused): the weights load, the module keeps its own extra state. A checkpoint that
    lacks weights the model has (no q/k norms) is an error naming them."""
    ref = results["ref"]

    class WithExtraState(torch.nn.Module):
        def get_extra_state(self):
            return torch.tensor([7.0])

        def set_extra_state(self, state):
            self.set_to = state

    cfg = make_config("llama", 1, 1)
    fresh = build(cfg, "lm", trained=True, seed_offset=1).trained
    norm = fresh.model[0].module.decoder.final_layernorm if hasattr(fresh.model[0], "module") \
        else fresh.model[0].decoder.final_layernorm
    norm.__class__ = type("NormWithExtraState", (type(norm), WithExtraState), {})
    load_checkpoint(ref["ckpt"], {"policy": RoleState(fresh.model, None)}, load_optimizer=False,
                    load_rng=False)
    params = [p.detach().clone() for p in fresh.model[0].parameters()]
    out = {"param_diff": max((a - b).abs().max().item()
                             for a, b in zip(ref["params"], params, strict=True)),
           "set_to": getattr(norm, "set_to", None)}
    deeper = build(make_config("llama", 1, 1, extra=("model.qk_layernorm=true",)), "lm",
                   trained=True).trained
    try:
        load_checkpoint(ref["ckpt"], {"policy": RoleState(deeper.model, None)},
                        load_optimizer=False, load_rng=False)
        out["refusal"] = None
    except ValueError as err:
        out["refusal"] = str(err)
    results["extra_state"] = out


def megatron_step_case(results):
    """megarlhf's split step (prepare_step, then apply_step: megatron's clip called only
    where it scales) against megatron's own ``optimizer.step()``, from the same weights
    and gradients: two steps at clip thresholds that do and do not clip, and clipping
    off, with the plain and the distributed optimizer. Every weight must be equal."""
    from megarlhf.engine.optimizer import forward_backward

    out = {}
    for distributed in ("false", "true"):
        for clip in (1e-3, 1e3, 0.0):
            cfg = make_config("llama", 1, 1, extra=(
                "optimizer.lr=0.01", f"optimizer.clip_grad={clip}",
                f"optimizer.use_distributed_optimizer={distributed}"))
            ours, theirs = (build(cfg, "lm", trained=True) for _ in range(2))
            norms = []
            for _ in range(2):
                for built in (ours, theirs):
                    forward_backward(built.trained, lm_step(built.layout, cfg.model.vocab_size),
                                     microbatches(fixed_sequences(8), 0, 1),
                                     seq_length=SEQ_LEN, micro_batch_size=MICRO)
                applied, (norm,) = step_together([ours.trained])
                with cpu_backend.at_megatron():  # megatron's own step, called directly
                    ok, their_norm, _ = theirs.trained.optimizer.step()
                theirs.trained.scheduler.step(increment=1)
                assert applied and ok
                norms.append((norm, float(their_norm)))
            pairs = zip(ours.chunks[0].parameters(), theirs.chunks[0].parameters(), strict=True)
            out[(distributed, clip)] = {
                "equal": all(torch.equal(a, b) for a, b in pairs), "norms": norms}
    results["megatron_step"] = out


def reload_and_score(name, ckpt, results):
    """The saved checkpoint through the role builder (checkpoint.load) at TP=1 PP=1."""
    scorer = build(make_config("llama", 1, 1, extra=(f"checkpoint.load={ckpt}",)), "lm")
    ref_params = results["ref"]["params"]
    results[f"reload_{name}"] = {
        "param_diff": max((a - b).abs().max().item() for a, b in
                          zip(ref_params, [p.detach().clone() for p in scorer.chunks[0].parameters()], strict=True)),
        "rows": score_sequences(scorer, fixed_sequences(6), micro_batch_size=2)}


def main():
    out_dir = sys.argv[1]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    results = {}
    if world == 1:
        run_case("ref", 1, 1, out_dir, results)
        extra_state_case(out_dir, results)
        legacy_case(out_dir, results)
        megatron_step_case(results)
        for name in sys.argv[2:]:
            reload_and_score(name, os.path.join(out_dir, f"ckpt_{name}", "step_3"), results)
    else:
        run_case("dp2", 1, 1, out_dir, results)
        run_case("pp2", 1, 2, out_dir, results)
        run_case("tp2", 2, 1, out_dir, results)
        nonfinite_case(results)
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, f"results_world{world}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
