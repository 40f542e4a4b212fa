"""This machine's measured fp32 matmul peak, and the training phase's model FLOP/s as a
fraction of it (CPU MFU), for the small size: forward+backward+optimizer steps of the
policy through megarlhf's engine (1 process).

    .venv/bin/python bench/roofline.py [--size small] [--batch 16] [--seq 64]
    .venv/bin/python bench/roofline.py --ppo [--size small] [--iterations 5]

``--ppo``: the PPO iteration's training phase instead (actor and critic, ``ppo_vs_trl.py``'s
shape, fixed variant, megarlhf defaults), each iteration against a peak measured just
before it (this VM's speed moves by up to 25% within minutes), with three FLOP counts:
every parameter at every token (6 x params x tokens + attention, as for the step above);
without the input embeddings (a lookup, not a matmul: the usual model-FLOPs count); and
what megarlhf runs, which computes the LM head and the last layer's MLP at the response
positions only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SIZES, machine  # noqa: E402


def matmul_peak(n: int = 1024, repeats: int = 20) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n ** 3 * repeats / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["tiny", "small"], default="small")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ppo", action="store_true",
                        help="the PPO iteration's training phase (see above)")
    parser.add_argument("--iterations", type=int, default=5, help="timed PPO iterations")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.ppo:
        return ppo_phase(args)
    peak = max(matmul_peak(n) for n in (512, 1024, 2048))

    from megarlhf.config import load_config
    from megarlhf.engine.optimizer import train_step
    from megarlhf.roles.build import build_from_config
    from megarlhf.engine.steps import make_lm_loss_step
    from megarlhf.parallel.launch import init_distributed

    s = SIZES[args.size]
    cfg = load_config(None, [
        f"model.num_layers={s['layers']}", f"model.hidden_size={s['hidden']}",
        f"model.num_attention_heads={s['heads']}", f"model.num_query_groups={s['kv_heads']}",
        f"model.ffn_hidden_size={s['ffn']}", f"model.vocab_size={s['vocab']}",
        f"model.max_position_embeddings={args.seq}", "optimizer.lr=1e-4"])
    init_distributed(cfg)
    built = build_from_config(cfg, kind="lm", trained=True, total_steps=100)
    layout, chunks, role = built.layout, built.chunks, built.trained
    tokens = torch.randint(0, s["vocab"], (args.batch, args.seq))
    batch = {"tokens": tokens, "position_ids": torch.arange(args.seq).expand(args.batch, -1),
             "loss_mask": torch.ones(args.batch, args.seq)}
    step = make_lm_loss_step(tp_group=layout.tp_group, true_vocab=s["vocab"])
    run = lambda: train_step(role, step, [batch], seq_length=args.seq,  # noqa: E731
                             micro_batch_size=args.batch)
    run()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    t = sorted(times)[2]
    params = sum(p.numel() for p in chunks[0].parameters())
    n_tok = args.batch * args.seq
    attn = 12 * s["layers"] * s["hidden"] * args.seq  # per token, forward+backward (QK^T, AV)
    flops = (6 * params + attn) * n_tok
    print(f"# roofline: {args.size} model ({params / 1e6:.2f} M params), batch {args.batch} x "
          f"{args.seq} tokens, fp32; {machine()}")
    print(f"matmul peak (fp32, best of 512/1024/2048 squares): {peak / 1e9:.1f} GFLOP/s")
    print(f"training step: {t * 1e3:.1f} ms, {flops / 1e9:.2f} GFLOP (6 x params x tokens + "
          f"attention) -> {flops / t / 1e9:.1f} GFLOP/s = CPU MFU {flops / t / peak:.1%}")


def ppo_phase(args) -> None:
    import statistics
    import tempfile

    import ppo_vs_trl as pv

    from megarlhf.config import load_config
    from megarlhf.data.tokenizer import load_tokenizer
    from megarlhf.ppo.session import PPOSession

    folder = tempfile.mkdtemp(prefix=f"roofline_ppo_{args.size}_")
    pv.prepare(args.size, "fixed", folder)
    cfg = load_config(os.path.join(folder, "policy_mrl/config.yaml"),
                      pv.megarlhf_overrides(folder, "fixed"))
    session = PPOSession(cfg, load_tokenizer(cfg.tokenizer))
    s = SIZES[args.size]
    seq = pv.PROMPT + pv.RESPONSE
    attn = 12 * s["layers"] * s["hidden"] * seq  # per token, forward+backward
    last_mlp = f"decoder.layers.{s['layers'] - 1}.mlp."
    counts = {"all parameters": 0, "without embeddings": 0, "as run": 0}
    for role in (session.actor, session.critic):
        named = [(n, p.numel()) for chunk in role.chunks for n, p in chunk.named_parameters()]
        every = sum(n for _, n in named)
        embed = sum(n for name, n in named if name.startswith("embedding."))
        # computed at the response positions only: the LM head and the last MLP
        cut = sum(n for name, n in named if name.startswith(last_mlp)
                  or (role.spec.kind == "lm" and name.startswith("output_layer.")))
        for key, params, skipped in (("all parameters", every, 0),
                                     ("without embeddings", every - embed, 0),
                                     ("as run", every - embed, cut * pv.PROMPT / seq)):
            counts[key] += (6 * (params - skipped) + attn) * cfg.ppo.mini_batch_size * seq
    steps = cfg.ppo.ppo_epochs * (pv.BATCH // cfg.ppo.mini_batch_size)
    counts = {key: value * steps for key, value in counts.items()}
    session.iteration(0)  # warm-up
    rows = []
    for it in range(1, 1 + args.iterations):
        peak = max(matmul_peak(n, repeats=5) for n in (512, 1024, 2048))
        rows.append((peak, session.iteration(it)[0]["timing/train"]))
    print(f"# roofline, PPO training phase: {args.size}, ppo_vs_trl.py's shape (fixed), actor "
          f"and critic; GFLOP per phase: " + ", ".join(
              f"{key} {value / 1e9:.1f}" for key, value in counts.items()) + f"; {machine()}")
    for peak, train in rows:
        print(f"peak {peak / 1e9:6.1f} GFLOP/s  training phase {train:.3f} s  MFU " + ", ".join(
            f"{key} {value / train / peak:.1%}" for key, value in counts.items()))
    print("median MFU: " + ", ".join(
        f"{key} {statistics.median(value / t / p for p, t in rows):.1%}"
        for key, value in counts.items()))


if __name__ == "__main__":
    main()
