"""``megarlhf dpo`` and ``megarlhf distill``: a trained model learning against a frozen one
whose outputs come from the cache (``engine.logit_cache``), and ``megarlhf cache build``.

The frozen model (DPO's reference, the distillation teacher) is built at its own layout
only while its cache is built - once per (checkpoint, data, temperature, k) - and released
before the trained model is; reruns and resumes read the cache. Training runs in the one
supervised loop (``stages.common.run_supervised``): any TP/PP/DP layout, the distributed
optimizer, evaluation, metrics, checkpoints, resume.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os

import torch

from megarlhf.config import Config, ConfigError, LoRAConfig, Written, check_roles
from megarlhf.data.batching import batch_length, pad_batch, sft_example
from megarlhf.data.budgets import cache_budget, train_budget
from megarlhf.data.packing import pack_weighted
from megarlhf.data.tokenizer import fingerprint
from megarlhf.engine.logit_cache import (LogitCache, build_cache, ensure_cache, make_key)
from megarlhf.models import lora
from megarlhf.roles.spec import base_reference, frozen_role_spec
from megarlhf.roles.build import Role, build_role
from megarlhf.engine.steps import make_distill_step, make_dpo_step, ratio
from megarlhf.parallel.launch import init_distributed, read_dist_env
from megarlhf.parallel.rank import print0
from megarlhf.stages.common import check_writable, run_dir
from megarlhf.stages.supervised import (SupervisedTask, check_budget, run_supervised,
                                        step_plan, supervised_spec)


def cache_path(cfg: Config, role: str) -> str:
    return cfg.cache.path or os.path.join(run_dir(cfg), "cache", role)


def frozen_cache(cfg: Config, spec, rows: list[list[int]], *, top_k: int,
                 temperature: float, max_len: int, pad_id: int) -> LogitCache:
    """The cache of ``spec`` (a frozen role) on ``rows``: read when complete and current,
    otherwise the role is built at its layout, scores the rows once and is released."""
    key = make_key(spec.checkpoint, spec.checkpoint_role, rows, temperature=temperature,
                   top_k=top_k)
    path = cache_path(cfg, spec.name)

    budget = cache_budget(cfg)
    longest = max((len(r) for r in rows), default=0)
    if budget is not None and longest > budget:
        field = "cache.max_tokens_per_micro_batch" if cfg.cache.max_tokens_per_micro_batch \
            else "train.max_tokens_per_micro_batch"
        raise ValueError(f"{field}={budget} cannot hold a row of {longest} tokens that the "
                         f"{spec.name}'s cache scores: a packed micro-batch takes whole rows")

    def build():
        role = build_role(spec, seed=cfg.run.seed)
        print0(f"[cache] {spec.name} at {role.layout.describe()} scores {len(rows)} rows"
               + (f" in packed micro-batches of {budget} tokens" if budget else ""))
        build_cache(role, rows, path, key, micro_batch_size=cfg.cache.micro_batch_size,
                    max_len=max_len, pad_id=pad_id, max_tokens=budget)
        del role
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    return ensure_cache(path, key, build, on_stale=cfg.cache.on_stale, log=print0)


# ------------------------------------------------------------------ DPO

def dpo_specs(cfg: Config, tokenizer, written: Written | None = None):
    """The trained policy (``checkpoint.load``, ``model``, ``parallel``) and the frozen
    reference (``roles.reference.checkpoint``, alias ``dpo.reference_checkpoint``, or the
    policy's checkpoint)."""
    written = written or Written.differing(cfg)
    check_roles(cfg, written, ("reference",), "dpo")
    policy = supervised_spec(cfg, "policy", "lm", tokenizer, written)
    ref_ckpt = cfg.roles.reference.checkpoint or cfg.checkpoint.load
    where = written.spelling("roles.reference.checkpoint") \
        if cfg.roles.reference.checkpoint else "checkpoint.load"
    if ref_ckpt is None:
        raise ConfigError("DPO needs a reference: set checkpoint.load (the SFT policy, also "
                          "the reference) or dpo.reference_checkpoint")
    reference = frozen_role_spec(cfg, name="reference", checkpoint=ref_ckpt, where=where,
                                 base=policy, world_size=read_dist_env().world_size,
                                 tokenizer=fingerprint(tokenizer), written=written)
    return policy, base_reference(policy, reference)


def pair_rows(pairs: list) -> list[list[int]]:
    """Chosen then rejected sequence of every pair."""
    rows = []
    for prompt, chosen, rejected in pairs:
        rows += [prompt + chosen, prompt + rejected]
    return rows


def response_logprob(logprobs_T: torch.Tensor, prompt_len: int, response_len: int,
                     mean: bool) -> float:
    """Sum (or mean) of the log-probs of a row's response tokens: positions prompt_len - 1
    ... prompt_len + response_len - 2 predict them."""
    part = logprobs_T[prompt_len - 1:prompt_len - 1 + response_len].double()
    return float(part.mean() if mean else part.sum())


def dpo_microbatches(items: list, pairs_per_micro: int, max_len: int, pad_id: int,
                     ref: dict) -> tuple[list[dict], int]:
    """Rows chosen, rejected of each pair with their response ``loss_mask`` and the
    reference's log-probs ``ref``; a short last micro-batch is topped up with copies of
    its first pair, masked out by ``pair_mask``."""
    if not items:
        return [], 0
    length = min(batch_length([len(p) + max(len(c), len(r)) for _, p, c, r in items]),
                 max_len)
    out = []
    for start in range(0, len(items), pairs_per_micro):
        chunk = items[start:start + pairs_per_micro]
        real = len(chunk)
        chunk = chunk + [chunk[0]] * (pairs_per_micro - real)
        examples, refs = [], []
        for idx, prompt, chosen, rejected in chunk:
            examples += [sft_example(prompt, chosen), sft_example(prompt, rejected)]
            refs += list(ref[idx])
        batch = pad_batch(examples, length, pad_id)
        batch["ref"] = torch.tensor(refs, dtype=torch.float64)
        batch["pair_mask"] = torch.arange(pairs_per_micro) < real
        out.append(batch)
    return out, length


def packed_dpo_pairs(items: list, pad_id: int, ref: dict) -> dict:
    """DPO items (index, prompt, chosen, rejected) as one packed micro-batch
    (``data.packing.pack_weighted``): chosen, rejected of each pair, the response tokens
    kept, with the reference's log-probs ``ref``; every pair real."""
    batch = pack_weighted([sft_example(p, seq) for _, p, c, r in items for seq in (c, r)],
                          pad_id=pad_id)
    batch["ref"] = torch.tensor([x for idx, *_ in items for x in ref[idx]],
                                dtype=torch.float64)
    batch["pair_mask"] = torch.ones(len(items), dtype=torch.bool)
    return batch


def gold_evaluator(cfg: Config, tokenizer):
    """``dpo.gold_reward_fn`` on greedy samples of the policy for ``dpo.gold_eval_path``'s
    prompts: the policy is resharded into the inference layout (rollout.tensor_parallel_size)
    and each replica samples its share. None when not configured."""
    if cfg.dpo.gold_reward_fn is None:
        return None
    import torch.distributed as dist

    from megarlhf.data.datasets import tokenize_dataset
    from megarlhf.rollout.sampling import decode_sample
    from megarlhf.inference.generate import SamplingParams, generate
    from megarlhf.inference.reshard import Resharder, build_inference_model, inference_layout
    from megarlhf.rewards.verifiers import gold_on_some_ranks, make_verifier

    gold_fn = make_verifier(cfg.rollout.rewards, fn_path=cfg.dpo.gold_reward_fn,
                            name="dpo.gold_reward_fn")
    prompts = tokenize_dataset(cfg.dpo.gold_eval_path, "prompt", cfg.data,
                               tokenizer).prompts[:cfg.dpo.num_gold_prompts]
    r = cfg.rollout
    params = SamplingParams(max_new_tokens=r.max_new_tokens, greedy=True,
                            temperature=r.temperature,
                            stop_token_ids=(*r.stop_token_ids, *tokenizer.end_ids),
                            stop_at_eos=r.stop_at_eos)
    built: dict = {}

    def evaluate(role) -> dict:
        if not built:
            layout = inference_layout(r.tensor_parallel_size, role.spec.model)
            model = build_inference_model(role.spec, layout)
            built.update(layout=layout, model=model,
                         resharder=Resharder(role.chunks, model))
        built["resharder"]()
        layout = built["layout"]
        mine = layout.strided_share(len(prompts))
        local = torch.zeros(3, dtype=torch.float64)
        pairs = None
        if mine:
            gen = generate(built["model"], [prompts[i] for i in mine], params,
                           eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                           true_vocab=role.spec.model.vocab_size)
            if layout.tp_rank == 0:
                pairs = [decode_sample(gen, b, tokenizer.decode) for b in range(len(mine))]
                local[1] = float(gen.fed_mask_BT.sum())
                local[2] = len(mine)
        local[0] = gold_on_some_ranks(gold_fn, pairs)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(local)
        return {"eval/gold_score": float(local[0] / local[2]),
                "eval/response_len": float(local[1] / local[2])}

    return evaluate


def run_dpo(cfg: Config, tokenizer, written: Written | None = None) -> dict:
    from megarlhf.stages.rm import load_pairs, pair_tokens

    policy, reference = dpo_specs(cfg, tokenizer, written)
    train_pairs, eval_pairs = load_pairs(cfg, tokenizer)
    max_len = min(cfg.data.max_seq_len, policy.model.max_position_embeddings)
    pairs = train_pairs + eval_pairs
    items = [(i, *pair) for i, pair in enumerate(pairs)]
    mean = cfg.dpo.loss == "ipo"
    pad = tokenizer.pad_id
    ref: dict[int, tuple[float, float]] = {}

    def fill(results_for: dict[int, torch.Tensor]) -> None:
        """Reference log-probs per pair from per-row log-probs (rows 2i, 2i + 1)."""
        for i, (prompt, chosen, rejected) in enumerate(pairs):
            if 2 * i in results_for:
                ref[i] = (response_logprob(results_for[2 * i], len(prompt), len(chosen), mean),
                          response_logprob(results_for[2 * i + 1], len(prompt), len(rejected),
                                           mean))

    step_plan(cfg, policy, len(train_pairs), 2)  # bad batch arithmetic: before any work
    check_budget(cfg, train_pairs, pair_tokens, "training pair", 2)
    check_budget(cfg, eval_pairs, pair_tokens, "evaluation pair", 2)
    budget = train_budget(cfg, sequences=2)
    check_writable(cfg)
    init_distributed(cfg)
    before_batch = None
    on_built = None
    if cfg.dpo.use_cache:
        if reference.adapters_off:  # scored by the base model, built for the cache
            reference = dataclasses.replace(reference, adapters_off=False, model=dataclasses
                                            .replace(reference.model, lora=LoRAConfig()))
        cache = frozen_cache(cfg, reference, pair_rows(pairs), top_k=0, temperature=1.0,
                             max_len=max_len, pad_id=pad)
        fill(dict(enumerate(cache.logprobs)))
        print0(f"[dpo] reference log-probs of {len(pairs)} pairs from the cache; the "
               "reference model is not resident")
    else:
        held: dict = {}
        if reference.adapters_off:  # the LoRA policy with its adapters off
            print0("[dpo] reference: the policy's model with its LoRA adapters off (no model "
                   "of its own); it scores every batch (dpo.use_cache=false)")

            def share(role) -> None:
                held["role"] = Role(reference, role.layout, role.chunks)
            on_built = share
        else:
            held["role"] = build_role(reference, seed=cfg.run.seed)
            print0(f"[dpo] reference resident at {held['role'].layout.describe()}; it scores "
                   "every batch (dpo.use_cache=false)")

        def before_batch(batch_items: list) -> None:
            ref_role = held["role"]
            kw = dict(tp_group=ref_role.layout.tp_group, true_vocab=reference.model.vocab_size)
            rows = pair_rows([(p, c, r) for _, p, c, r in batch_items])
            with lora.disabled(ref_role.chunks) if reference.adapters_off \
                    else contextlib.nullcontext():
                out = _score_pairs(ref_role, rows, kw, budget, max_len, pad,
                                   cfg.cache.micro_batch_size)
            results = {}
            for j, (idx, *_rest) in enumerate(batch_items):
                results[2 * idx], results[2 * idx + 1] = (out[2 * j]["logprobs"],
                                                          out[2 * j + 1]["logprobs"])
            fill(results)

    d, mbs = cfg.dpo, cfg.train.micro_batch_size

    def summarize(t: dict) -> dict:
        chosen, rejected = ratio(t, "chosen_sum", "pairs"), ratio(t, "rejected_sum", "pairs")
        return {"loss": ratio(t, "loss_sum", "pairs"), "rewards/chosen": chosen,
                "rewards/rejected": rejected, "rewards/margin": chosen - rejected,
                "rewards/accuracy": ratio(t, "correct", "pairs")}

    n_train = len(train_pairs)
    return run_supervised(cfg, policy, SupervisedTask(
        name="dpo", train_items=items[:n_train], eval_items=items[n_train:],
        make_batches=lambda its, training: dpo_microbatches(its, mbs, max_len, pad, ref),
        rows_per_micro_batch=2 * mbs,
        make_step=lambda role: make_dpo_step(tp_group=role.layout.tp_group,
                                             true_vocab=policy.model.vocab_size, beta=d.beta,
                                             loss=d.loss, label_smoothing=d.label_smoothing),
        summarize=summarize, before_batch=before_batch,
        extra_eval=gold_evaluator(cfg, tokenizer), tokens=pair_tokens,
        make_packed=lambda its: packed_dpo_pairs(its, pad, ref), sequences=2,
        on_built=on_built,
        describe=f"{d.loss} loss, beta {d.beta}"
                 + (f", label smoothing {d.label_smoothing}" if d.label_smoothing else "")),
        tokenizer)


def _score_pairs(ref_role, rows: list, kw: dict, budget, max_len: int, pad: int,
                 micro_batch_size: int) -> list[dict]:
    """The reference's per-row log-probs of a batch's pair rows: packed as the policy's
    passes are (``budget``), or in padded micro-batches."""
    from megarlhf.engine.forward import forward_rows
    from megarlhf.engine.steps import make_score_step, make_sequence_step
    from megarlhf.stages.score import packed_batch, right_padded_batch

    if budget is not None:
        return forward_rows(ref_role, rows, lambda b: packed_batch(b, "lm"),
                            make_sequence_step("lm", prompt_len=1, **kw), micro_batch_size=1,
                            max_tokens=budget, lengths=[len(r) for r in rows])
    length = min(batch_length([len(r) for r in rows]), max_len)
    return forward_rows(ref_role, rows, lambda b: right_padded_batch(b, length, pad),
                        make_score_step("lm", **kw), micro_batch_size=micro_batch_size)


# ------------------------------------------------------------------ distillation

def distill_specs(cfg: Config, tokenizer, written: Written | None = None):
    """The trained student (as DPO's policy) and the frozen teacher
    (``roles.teacher.checkpoint``, alias ``distill.teacher_checkpoint``)."""
    written = written or Written.differing(cfg)
    check_roles(cfg, written, ("teacher",), "distill")
    student = supervised_spec(cfg, "policy", "lm", tokenizer, written)
    ckpt = cfg.roles.teacher.checkpoint
    if ckpt is None:
        raise ConfigError("distill needs a teacher: set distill.teacher_checkpoint")
    teacher = frozen_role_spec(cfg, name="teacher", checkpoint=ckpt,
                               where=written.spelling("roles.teacher.checkpoint"),
                               base=student, world_size=read_dist_env().world_size,
                               tokenizer=fingerprint(tokenizer), written=written)
    return student, teacher


def distill_microbatches(items: list, micro: int, max_len: int, pad_id: int,
                         cache: LogitCache) -> tuple[list[dict], int]:
    """SFT rows with the teacher's top-k log-probs and ids per position (B, S, k)."""
    if not items:
        return [], 0
    length = min(batch_length([len(t) for _, t, _ in items]), max_len)
    k = cache.key.top_k
    out = []
    for start in range(0, len(items), micro):
        chunk = items[start:start + micro]
        # A short last micro-batch is topped up with copies of its first row that weigh 0.
        filler = (chunk[0][0], chunk[0][1], [0] * len(chunk[0][2]))
        chunk = chunk + [filler] * (micro - len(chunk))
        batch = pad_batch([(t, w) for _, t, w in chunk], length, pad_id)
        logprobs = torch.zeros(len(chunk), length, k)
        ids = torch.zeros(len(chunk), length, k, dtype=torch.long)
        for b, (idx, tokens, _) in enumerate(chunk):
            n = len(tokens) - 1
            logprobs[b, :n] = cache.topk_logprobs[idx]
            ids[b, :n] = cache.topk_ids[idx]
        batch["teacher_logprobs"], batch["teacher_ids"] = logprobs, ids
        out.append(batch)
    return out, length


def packed_distill_rows(items: list, pad_id: int, cache: LogitCache) -> dict:
    """Distillation items (index, tokens, weights) as one packed micro-batch
    (``data.packing.pack_weighted``) with the teacher's top-k log-probs and ids at its
    kept outputs, (1, K, k)."""
    batch = pack_weighted([(t, w) for _, t, w in items], pad_id=pad_id)
    k, length = cache.key.top_k, batch["tokens"].shape[1]
    logprobs, ids = torch.zeros(length, k), torch.zeros(length, k, dtype=torch.long)
    for (idx, tokens, _), start in zip(items, batch["cu_seqlens"].tolist()):
        n = len(tokens) - 1  # the cache's positions: each predicts the next token
        logprobs[start:start + n] = cache.topk_logprobs[idx]
        ids[start:start + n] = cache.topk_ids[idx]
    keep = batch["keep"]
    batch["teacher_logprobs"], batch["teacher_ids"] = logprobs[keep][None], ids[keep][None]
    return batch


def run_distill(cfg: Config, tokenizer, written: Written | None = None) -> dict:
    from megarlhf.stages.sft import load_sft_data

    student, teacher = distill_specs(cfg, tokenizer, written)
    train, held = load_sft_data(cfg, tokenizer)
    max_len = min(cfg.data.max_seq_len, student.model.max_position_embeddings)
    examples = train + held
    step_plan(cfg, student, len(train))
    check_budget(cfg, train, lambda example: len(example[0]), "training sample")
    check_budget(cfg, held, lambda example: len(example[0]), "evaluation sample")
    check_writable(cfg)
    init_distributed(cfg)
    d = cfg.distill
    cache = frozen_cache(cfg, teacher, [t for t, _ in examples], top_k=d.top_k,
                         temperature=d.temperature, max_len=max_len, pad_id=tokenizer.pad_id)
    print0(f"[distill] teacher top-{d.top_k} log-probs of {len(examples)} rows from the "
           "cache; the teacher is not resident")
    items = [(i, t, w) for i, (t, w) in enumerate(examples)]
    mbs, pad = cfg.train.micro_batch_size, tokenizer.pad_id

    def summarize(t: dict) -> dict:
        out = {"loss": ratio(t, "loss_sum", "tokens"), "kl": ratio(t, "kl_sum", "tokens")}
        if "nll_sum" in t:
            out["nll"] = ratio(t, "nll_sum", "tokens")
        return out

    return run_supervised(cfg, student, SupervisedTask(
        name="distill", train_items=items[:len(train)], eval_items=items[len(train):],
        make_batches=lambda its, training: distill_microbatches(its, mbs, max_len, pad, cache),
        rows_per_micro_batch=mbs,
        make_step=lambda role: make_distill_step(
            tp_group=role.layout.tp_group, true_vocab=student.model.vocab_size,
            divergence=d.divergence, temperature=d.temperature, nll_coef=d.nll_coef),
        summarize=summarize, tokens=lambda item: len(item[1]),
        make_packed=lambda its: packed_distill_rows(its, pad, cache),
        describe=f"{d.divergence} KL over the teacher's top {d.top_k} + the rest"),
        tokenizer)


# ------------------------------------------------------------------ megarlhf cache build

def run_cache_build(cfg: Config, tokenizer, stage: str, written: Written | None = None) -> str:
    """Build (or check) the cache a ``dpo`` or ``distill`` run with this config reads."""
    if stage == "dpo":
        from megarlhf.stages.rm import load_pairs
        policy, spec = dpo_specs(cfg, tokenizer, written)
        train_pairs, eval_pairs = load_pairs(cfg, tokenizer)
        rows, top_k, temperature = pair_rows(train_pairs + eval_pairs), 0, 1.0
    else:
        from megarlhf.stages.sft import load_sft_data
        policy, spec = distill_specs(cfg, tokenizer, written)
        train, held = load_sft_data(cfg, tokenizer)
        rows = [t for t, _ in train + held]
        top_k, temperature = cfg.distill.top_k, cfg.distill.temperature
    max_len = min(cfg.data.max_seq_len, policy.model.max_position_embeddings)
    init_distributed(cfg)
    frozen_cache(cfg, spec, rows, top_k=top_k, temperature=temperature, max_len=max_len,
                 pad_id=tokenizer.pad_id)
    return cache_path(cfg, spec.name)
