"""Tokens/s of megarlhf's KV-cached generation against transformers' `generate` on the
same (converted) weights, batch 1 and 16, and against decoding without a KV cache.

    .venv/bin/python bench/generate_vs_hf.py [--size small] [--prompt 32] [--new 32]
                                             [--repeats 7] [--group K | --slots S]

``--group K``: instead, batches of 16 and 64 rows made of prompts each repeated K times
(GRPO's groups), megarlhf with each group's prompt prefilled once
(``speedups.shared_prefill``) against megarlhf prefilling every row and transformers
(which prefills every row too). megarlhf runs with the speed-ups the CLI installs.

``--slots S``: instead, 64 prompts with long-tailed responses (sampled from per-prompt
seeds; 1% of the vocabulary ends a response, up to ``--new`` tokens) through S decode
slots on the paged KV cache (``rollout.kv_cache=paged``: its default pool, and a pool of
a quarter of it) and on megatron's columns (``columns``), against one static batch: tok/s
and the KV cache's bytes of each.

The steady state is measured: the decode step is compiled in the warm-up call
(``speedups.compiled_decode`` with ``MEGARLHF_COMPILED_DECODE_AFTER_S=0`` unless set; a
run compiles once its decoding has taken 20 s). transformers runs eagerly, as its
``generate`` does by default.

The two are timed in turn, one call of each per round after one warm-up call of each,
so both see the same machine (this VM's speed moves by up to 25% within minutes); the
figures are medians over the rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import convert, hf_llama, machine, timed  # noqa: E402


def alternating(first, second, repeats: int) -> tuple[float, float]:
    """Median wall times of ``first`` and ``second``, called in turn ``repeats`` times
    after one warm-up call of each."""
    first(), second()
    times = ([], [])
    for _ in range(repeats):
        for fn, out in zip((first, second), times):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return tuple(statistics.median(t) for t in times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["tiny", "small", "medium"], default="small")
    parser.add_argument("--group", type=int, default=1,
                        help="rows per distinct prompt (> 1: the shared-prefill table)")
    parser.add_argument("--slots", type=int, default=0,
                        help="decode slots (> 0: the paged-against-columns table)")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7,
                        help="timed calls of each, taken in turn (medians)")
    args = parser.parse_args()
    os.environ.setdefault("MEGARLHF_COMPILED_DECODE_AFTER_S", "0")  # the steady state
    from megarlhf import speedups
    speedups.install()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_PORT", "29911")
    tmp = tempfile.mkdtemp()
    hf = hf_llama(args.size, os.path.join(tmp, "hf"))
    convert(os.path.join(tmp, "hf"), os.path.join(tmp, "mrl"))

    from megarlhf.config import load_config
    from megarlhf.roles.build import build_from_config
    from megarlhf.parallel.launch import init_distributed
    from megarlhf.inference.generate import SamplingParams, generate

    cfg = load_config(os.path.join(tmp, "mrl", "config.yaml"))
    init_distributed(cfg)
    (model,) = build_from_config(cfg, kind="lm").chunks
    params = SamplingParams(max_new_tokens=args.new, greedy=True)
    if args.group > 1:
        return shared_table(args, model, hf, cfg, params)
    if args.slots:
        return slots_table(args, model, cfg)
    print(f"# generate: {args.size} model, prompt {args.prompt}, {args.new} new tokens, greedy, "
          f"fp32; {machine()}")
    print(f"{'batch':>5} {'megarlhf tok/s':>15} {'HF generate tok/s':>18} {'no-cache tok/s':>15}"
          f" {'vs HF':>6} {'vs no-cache':>11}")
    for batch in (1, 16):
        prompts = torch.randint(3, cfg.model.vocab_size, (batch, args.prompt),
                                generator=torch.Generator().manual_seed(batch)).tolist()

        def ours(use_cache=True):
            return generate(model, prompts, params, eos_id=-1, pad_id=0,
                            true_vocab=cfg.model.vocab_size, use_cache=use_cache)

        def theirs():
            return hf_greedy(hf, prompts, args.new)

        tokens = batch * args.new
        t_ours, t_hf = alternating(ours, theirs, args.repeats)
        t_nocache = timed(lambda: ours(False), repeats=1)
        same = ours().response_tokens_BT.tolist() == theirs()[:, args.prompt:].tolist()
        print(f"{batch:>5} {tokens / t_ours:>15.0f} {tokens / t_hf:>18.0f} "
              f"{tokens / t_nocache:>15.0f} {t_hf / t_ours:>6.2f} {t_nocache / t_ours:>11.2f}"
              f"   (same tokens: {same})")


def hf_greedy(hf, prompts: list[list[int]], new: int) -> torch.Tensor:
    """transformers' greedy ``generate`` of exactly ``new`` tokens per prompt, run without
    megarlhf's CPU-backend mode, as in its own process."""
    from megarlhf.parallel import cpu_backend

    with torch.no_grad(), cpu_backend.suspended():
        return hf.generate(torch.tensor(prompts), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)


def shared_table(args, model, hf, cfg, params) -> None:
    """Batches of prompts repeated ``args.group`` times: megarlhf sharing each group's
    prefill, megarlhf prefilling every row, transformers."""
    from megarlhf.inference.generate import generate

    print(f"# generate, groups of {args.group} rows per prompt: {args.size} model, prompt "
          f"{args.prompt}, {args.new} new tokens, greedy, fp32; {machine()}")
    print(f"{'batch':>5} {'shared tok/s':>13} {'every row tok/s':>16} {'HF tok/s':>9}"
          f" {'shared vs every row':>20} {'shared vs HF':>13}")
    for batch in (16, 64):
        distinct = torch.randint(3, cfg.model.vocab_size, (batch // args.group, args.prompt),
                                 generator=torch.Generator().manual_seed(batch)).tolist()
        prompts = [p for p in distinct for _ in range(args.group)]

        def ours(share: bool):
            return generate(model, prompts, params, eos_id=-1, pad_id=0,
                            true_vocab=cfg.model.vocab_size, shared_prefill=share)

        def theirs():
            return hf_greedy(hf, prompts, args.new)

        tokens = batch * args.new
        t_shared, t_every = alternating(lambda: ours(True), lambda: ours(False), args.repeats)
        t_hf = timed(theirs, repeats=max(1, args.repeats // 2))
        same = ours(True).response_tokens_BT.tolist() == ours(False).response_tokens_BT.tolist()
        print(f"{batch:>5} {tokens / t_shared:>13.0f} {tokens / t_every:>16.0f} "
              f"{tokens / t_hf:>9.0f} {t_every / t_shared:>20.2f} {t_hf / t_shared:>13.2f}"
              f"   (same tokens: {same})")


def slots_table(args, model, cfg) -> None:
    """64 long-tailed prompts: decode slots on the paged cache (default pool and a quarter
    of it), on the columns, and one static batch."""
    from megarlhf.inference.continuous import generate_continuous
    from megarlhf.inference.generate import SamplingParams, generate
    from megarlhf.inference.paged_slots import generate_paged

    V, n, S = cfg.model.vocab_size, 64, args.slots
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(args.prompt // 2, args.prompt + 1, (n,), generator=gen).tolist()
    prompts = [torch.randint(3, V, (k,), generator=gen).tolist() for k in lengths]
    stops = tuple(torch.randperm(V - 3, generator=gen)[:max(1, V // 100)].add(3).tolist())
    params = SamplingParams(max_new_tokens=args.new, temperature=1.0, stop_token_ids=stops)
    seeds = list(range(100, 100 + n))
    longest = max(lengths) + args.new - 1
    common = dict(eos_id=-1, pad_id=0, true_vocab=V, row_seeds=seeds)
    quarter = S * -(-longest // 16) * 16 // 4
    runs = {
        "paged": lambda st: generate_paged(model, prompts, params, slots=S, stats=st, **common),
        f"paged, {quarter} positions": lambda st: generate_paged(
            model, prompts, params, slots=S, cache_tokens=quarter, stats=st, **common),
        "columns": lambda st: generate_continuous(model, prompts, params, slots=S, stats=st,
                                                  **common),
        "static batch": lambda st: generate(model, prompts, params, stats=st, **common)}
    print(f"# generate, {n} prompts of {min(lengths)}-{max(lengths)} tokens, responses up to "
          f"{args.new} (1% of the vocabulary stops), {S} decode slots: {args.size} model, "
          f"fp32; {machine()}")
    outs, stats = {}, {}
    for name, fn in runs.items():
        stats[name] = {}
        outs[name] = fn(stats[name])
    tokens = int(outs["paged"].fed_mask_BT.sum())
    same = all(torch.equal(o.response_tokens_BT, outs["static batch"].response_tokens_BT)
               for o in outs.values())
    times = {name: timed(lambda fn=fn: fn({}), repeats=args.repeats) for name, fn in runs.items()}
    print(f"{'cache':>26} {'tok/s':>7} {'KV MiB':>7} {'preemptions':>12} {'vs columns':>11}")
    for name in runs:
        st = stats[name]
        print(f"{name:>26} {tokens / times[name]:>7.0f} {st['kv_cache_bytes'] / 2**20:>7.1f} "
              f"{st.get('kv_preemptions', 0):>12} {times['columns'] / times[name]:>11.2f}")
    print(f"({tokens} response tokens, mean {tokens / n:.0f}; same tokens on every path: "
          f"{same})")


if __name__ == "__main__":
    main()
