"""Rollout paths on real process groups. World 1: KV-cached generation against full
recompute, and sampled log-probs against teacher-forced scoring of each sequence alone.
World 2: resharding training TP=2 / PP=2 / TP=1xPP=2 layouts into inference layouts, before
and after an optimizer step. Results -> OUT/rollout_world{N}.pt on rank 0."""

from __future__ import annotations

# As the CLI does, before megatron is imported: the speed-ups MEGARLHF_SPEEDUPS selects.
from megarlhf import speedups  # noqa: E402
speedups.install()

import functools
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import build, fixed_sequences, make_config  # noqa: E402

from megarlhf.engine.optimizer import train_step  # noqa: E402
from megarlhf.models.logprobs import vocab_parallel_logprobs  # noqa: E402
from megarlhf.inference.continuous import generate_continuous  # noqa: E402
from megarlhf.inference.generate import SamplingParams, generate  # noqa: E402
from megarlhf.inference.reshard import Resharder, build_inference_model, inference_layout  # noqa: E402
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
    scorer = build(cfg, "lm")
    (model,) = scorer.chunks
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
        n = int(sampled.fed_mask_BT[b].sum())
        seqs.append(prompt + sampled.response_tokens_BT[b, :n].tolist())
    rows = score_sequences(scorer, seqs, micro_batch_size=1, temperature=0.9)
    # every row stops by its second token: the responses are two columns wide, not 12
    stops = tuple(sorted(set(cached.response_tokens_BT[:, 1].tolist())))
    stopped = generate(model, PROMPTS, SamplingParams(max_new_tokens=12, greedy=True,
                                                      temperature=0.8, stop_token_ids=stops),
                       **common)
    # rows stopping at different columns: the decode slots they leave idle. Sampled from
    # per-prompt seeds (greedy, a random model repeats itself): the stop tokens are tokens
    # a first run sampled, one per row at a column further right for each row
    seeds = [101 + i for i in range(len(PROMPTS))]
    free = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=50, top_p=0.9)
    probe = generate(model, PROMPTS, free, row_seeds=seeds, **common)
    stops = tuple(sorted({int(probe.response_tokens_BT[b, min(2 + 3 * b, 11)])
                          for b in range(len(PROMPTS))}))
    seeded = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=50, top_p=0.9,
                            stop_token_ids=stops)
    tail_stats: dict = {}
    tail = generate(model, PROMPTS, seeded, row_seeds=seeds, stats=tail_stats, **common)
    tail_params = SamplingParams(max_new_tokens=12, greedy=True, temperature=0.8,
                                 stop_token_ids=stops)
    continuous = {}
    for name, p, kw in (("greedy", tail_params, {}), ("seeded", seeded, {"row_seeds": seeds})):
        slot_stats: dict = {}
        continuous[name] = (generate(model, PROMPTS, p, **kw, **common),
                            generate_continuous(model, PROMPTS, p, slots=2, stats=slot_stats,
                                                **kw, **common), slot_stats)
    # the fixed-shape cache of the CUDA-graph decode step (inference/static_kv), run eagerly
    static_stats: dict = {}
    static = {"greedy": generate(model, PROMPTS, params, static_cache=True, **common),
              "seeded": generate(model, PROMPTS, seeded, row_seeds=seeds, static_cache=True,
                                 stats=static_stats, **common),
              "after": generate(model, PROMPTS, params, **common), "stats": static_stats,
              "auto": auto_choices(model)}
    results[f"gen_{arch}"] = {"cached": cached, "full": full, "sampled": sampled,
                              "teacher": [r["logprobs"] for r in rows], "stopped": stopped,
                              "tail": (tail, tail_stats), "continuous": continuous,
                              "static": static}


def auto_choices(model) -> dict:
    """Which generations decode on the static cache where a speed-up of its step applies
    (speedups.decode_graphs on a GPU, speedups.compiled_decode on the CPU; here the
    latter, on whatever this process installed): the plain cached one only (a GPU run
    found ``use_cache=False`` refused there)."""
    from megarlhf.inference.generate import _static_step
    from megarlhf.speedups import compiled_decode

    out = {}
    applies, compiled_decode.applies = compiled_decode.applies, lambda device: True
    try:
        for name, kw in (("plain", {}), ("no_cache", {"use_cache": False}),
                         ("routing", {"record_routing": True}),
                         ("interrupt", {"interrupt": lambda: False})):
            args = dict(use_cache=True, record_routing=False, interrupt=None)
            args.update(kw)
            out[name] = _static_step(model, torch.device("cpu"), None, **args) is not None
    finally:
        compiled_decode.applies = applies
    return out


def partial_case(arch, results, swap_after=3):
    """Partial rollouts: the weights change part-way (``interrupt``), in a static batch and
    in 2 decode slots, the keys and values recomputed or kept. Per token: the version
    ``generate`` recorded and the sampled log-prob, against references that do not use
    it: teacher-forced scoring by the weights of each token's version (recompute), and a
    one-row loop of megatron's own inference context - the prefix fed by the old weights,
    then one token at a time by the new (keep)."""
    from megatron.core.inference.contexts import StaticInferenceContext

    cfg = make_config(arch, 1, 1)
    scorer = build(cfg, "lm")
    (model,) = scorer.chunks
    params_ = list(model.parameters())
    old = [p.detach().clone() for p in params_]
    gen = torch.Generator().manual_seed(11)
    new = [v + 0.2 * v.std() * torch.randn(v.shape, generator=gen) if v.numel() > 1
           else v.clone() for v in old]

    class Weights:  # Weights.put(weights): the parameters only
        @staticmethod
        @torch.no_grad()
        def put(weights):
            for p, w in zip(params_, weights, strict=True):
                p.copy_(w)
    seeds = [201 + i for i in range(len(PROMPTS))]
    params = SamplingParams(max_new_tokens=10, temperature=0.9, top_k=50, top_p=0.9)
    common = dict(eos_id=2, pad_id=0, true_vocab=cfg.model.vocab_size, row_seeds=seeds)

    def swapper():
        calls = [0]

        def interrupt():
            calls[0] += 1
            if calls[0] != swap_after:
                return False
            Weights.put(new)
            return True
        return interrupt

    def teacher(weights, seqs):
        Weights.put(weights)
        rows = score_sequences(scorer, seqs, micro_batch_size=1, temperature=0.9)
        return [r["logprobs"] for r in rows]

    @torch.no_grad()
    def kept(prompt, response, first_new):
        """One row: the columns before response token ``first_new - 1`` fed by the old
        weights in one prefill (they predict tokens 0 .. first_new - 1), then one column at
        a time by the new; each response token's log-prob from the logits before it."""
        seq = prompt + response
        ctx = StaticInferenceContext(1, len(seq))
        ctx.materialize_only_last_token_logits = False  # the prefill's every column

        def feed(start, end):
            q = end - start
            blocked = torch.ones(q, end, dtype=torch.bool).triu(start + 1).view(1, 1, q, end)
            logits = model(torch.tensor([seq[start:end]]), torch.arange(start, end)[None],
                           blocked, inference_context=ctx, runtime_gather_output=True)
            ctx.sequence_len_offset += q
            ctx.enable_decode_mode()
            return torch.log_softmax(logits[0, :, :cfg.model.vocab_size].float() / 0.9, -1)

        Weights.put(old)
        lp = feed(0, len(prompt) + first_new - 1)
        out = [float(lp[len(prompt) - 1 + j, response[j]]) for j in range(first_new)]
        Weights.put(new)
        for j in range(first_new, len(response)):
            col = len(prompt) + j - 1  # it predicts response token j
            out.append(float(feed(col, col + 1)[-1, response[j]]))
        return out

    cases = {}
    for how in ("static", "slots"):
        for kv in ("recompute", "keep"):
            Weights.put(old)
            kw = dict(interrupt=swapper(), recompute_kv=kv == "recompute")
            g = (generate(model, PROMPTS, params, **common, **kw) if how == "static" else
                 generate_continuous(model, PROMPTS, params, slots=2, **common, **kw))
            seqs, responses = [], []
            for b, prompt in enumerate(PROMPTS):
                n = int(g.fed_mask_BT[b].sum())
                responses.append(g.response_tokens_BT[b, :n].tolist())
                seqs.append(prompt + responses[-1])
            case = {"gen": g, "old": teacher(old, seqs), "new": teacher(new, seqs)}
            if (how, kv) == ("static", "keep"):
                case["kept"] = [kept(prompt, responses[b], swap_after) if
                                len(responses[b]) > swap_after else None
                                for b, prompt in enumerate(PROMPTS)]
            cases[(how, kv)] = case
    Weights.put(old)
    cases["unswapped"] = generate(model, PROMPTS, params, **common)
    results[f"partial_{arch}"] = cases


def short_linears_case(arch, results):
    """megarlhf's short TP=1 forward of megatron's linears (speedups/linears.py) against
    megatron's own: logits bitwise equal without autograd, and with it the same loss and
    the same gradients in megatron DDP's main_grad buffers; and which path ran - megatron's
    linear functions never on the short path."""
    from megatron.core.tensor_parallel import layers

    from megarlhf.speedups import linears

    cfg = make_config(arch, 1, 1)
    (model,) = build(cfg, "lm", trained=True).trained.model  # megatron DDP around the GPT
    model.eval()  # no dropout: the two passes must see the same function
    seqs = torch.randint(0, cfg.model.vocab_size, (3, 12),
                         generator=torch.Generator().manual_seed(5))
    positions = torch.arange(seqs.shape[1]).expand_as(seqs)
    weights = torch.randn(3, 12, cfg.model.vocab_size, generator=torch.Generator().manual_seed(6))
    calls = {"n": 0}
    originals = {name: getattr(layers, name) for name in
                 ("linear_with_frozen_weight", "linear_with_grad_accumulation_and_async_allreduce")}

    def counted(fn):
        @functools.wraps(fn)  # megatron keeps a ``warned`` flag on one of them
        def wrapper(*args, **kwargs):
            calls["n"] += 1
            return fn(*args, **kwargs)
        return wrapper

    def run():
        """(no-grad logits, loss, main grads, megatron linear calls)"""
        calls["n"] = 0
        with torch.no_grad():
            logits = model(seqs, positions, None)
        model.zero_grad_buffer()
        out = model(seqs, positions, None)
        loss = (out[..., :cfg.model.vocab_size] * weights).sum()
        loss.backward()
        grads = {n: p.main_grad.clone() for n, p in model.named_parameters()}
        return logits, loss.detach(), grads, calls["n"]

    for name, fn in originals.items():
        setattr(layers, name, counted(fn))
    try:
        short = run()
        short_forwards = {}  # module -> its fast class; megatron's class for the second run
        for module in model.modules():
            if type(module) in (linears.ColumnLinear, linears.RowLinear):
                short_forwards[module] = type(module)
                module.__class__ = type(module).__bases__[0]
        theirs = run()
        for module, cls in short_forwards.items():
            module.__class__ = cls
    finally:
        for name, fn in originals.items():
            setattr(layers, name, fn)
    results[f"linears_{arch}"] = {
        "short": short[0], "megatron": theirs[0], "loss": (short[1], theirs[1]),
        "grad_diff": max((short[2][n] - theirs[2][n]).abs().max().item() for n in short[2]),
        "grad_scale": max(g.abs().max().item() for g in theirs[2].values()),
        "short_calls": short[3], "megatron_calls": theirs[3], "linears": len(short_forwards)}


def reshard_case(name, tp, pp, rollout_tp, results, vpp=None, arch="llama"):
    extra = [f"rollout.tensor_parallel_size={rollout_tp}", "optimizer.lr=0.01"]
    if vpp:
        extra.append(f"parallel.virtual_pipeline_model_parallel_size={vpp}")
    cfg = make_config(arch, tp, pp, extra=tuple(extra))
    actor = build(cfg, "lm", trained=True, total_steps=5)
    inf_layout = inference_layout(rollout_tp, actor.spec.model)
    inf_model = build_inference_model(actor.spec, inf_layout)
    resharder = Resharder(actor.chunks, inf_model)
    seqs = fixed_sequences(4)
    out = {}
    for phase in ("initial", "after_step"):
        if phase == "after_step":
            from backend_paths import lm_step, microbatches, MICRO, SEQ_LEN
            train_step(actor.trained, lm_step(actor.layout, cfg.model.vocab_size),
                       microbatches(fixed_sequences(8), actor.layout.dp_rank,
                                    actor.layout.dp),
                       seq_length=SEQ_LEN, micro_batch_size=MICRO)
        stats = resharder()
        train_rows = score_sequences(actor, seqs, micro_batch_size=2)
        inf_rows = direct_logprobs(inf_model, inf_layout, cfg, seqs)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, inf_rows)
        out[phase] = {"train": train_rows, "inference": gathered, "seconds": stats.seconds,
                      "bytes": stats.bytes_received}
    results[name] = out


def sampling_case(name, tp, pp, vpp, rollout_tp, results, arch="llama"):
    """Sampled tokens and their log-probs after resharding from a training layout (the
    same seeded weights at every layout): equal to the TP=1 run's."""
    extra = [f"rollout.tensor_parallel_size={rollout_tp}"]
    if vpp:
        extra.append(f"parallel.virtual_pipeline_model_parallel_size={vpp}")
    cfg = make_config(arch, tp, pp, extra=tuple(extra))
    actor = build(cfg, "lm", trained=True)
    inf_layout = inference_layout(rollout_tp, actor.spec.model)
    inf_model = build_inference_model(actor.spec, inf_layout)
    Resharder(actor.chunks, inf_model)()
    params = SamplingParams(max_new_tokens=8, temperature=0.9, top_k=40)
    kw = dict(eos_id=2, pad_id=0, true_vocab=cfg.model.vocab_size,
              row_seeds=[11 * 1000003 + i for i in range(len(PROMPTS))])
    stats = {}
    gen = generate(inf_model, PROMPTS, params, stats=stats, **kw)
    gen.kv_cache_bytes = stats["kv_cache_bytes"]
    gen.static = generate(inf_model, PROMPTS, params, static_cache=True, **kw)
    results[name] = gen


def main():
    out_dir = sys.argv[1]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    results = {}
    if world == 1:
        generation_case("llama", results)
        generation_case("gpt2", results)
        generation_case("qwen3", results)
        partial_case("llama", results)
        if speedups.enabled("linears"):
            short_linears_case("llama", results)
            short_linears_case("gpt2", results)
        sampling_case("sample_tp1", 1, 1, None, 1, results)
        sampling_case("sample_qwen3_tp1", 1, 1, None, 1, results, arch="qwen3")
    else:
        sampling_case("sample_pp2vpp2_to_tp2", 1, 2, 2, 2, results)
        sampling_case("sample_qwen3_pp2vpp2_to_tp2", 1, 2, 2, 2, results, arch="qwen3")
        reshard_case("qwen3_pp2vpp2_to_tp2", 1, 2, 2, results, vpp=2, arch="qwen3")
        reshard_case("pp2vpp2_to_tp2", 1, 2, 2, results, vpp=2)
        reshard_case("tp2_to_tp1x2", 2, 1, 1, results)
        reshard_case("pp2_to_tp2", 1, 2, 2, results)
        reshard_case("tp1pp2_to_tp1x2", 1, 2, 1, results)
        reshard_case("olmo3_tp2_to_tp1x2", 2, 1, 1, results, arch="olmo3")
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, f"rollout_world{world}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
