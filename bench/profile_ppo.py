"""Where a PPO iteration's time goes: megarlhf alone on ppo_vs_trl.py's shape (same
checkpoints, settings and overrides), the phase timings of a few iterations and the torch
profiler's top operators over two more.

    .venv/bin/python bench/profile_ppo.py [--size small] [--variant fixed] [--iterations 4]
                                          [--top 25] [--matmuls [--speedup F]]
                                          [override ...]

``--matmuls``: also the iteration's time budget. Every matrix product of one profiled
iteration by shape (GFLOP from the shapes, GFLOP/s where it ran), the fp32 matmul peak
measured right after (``roofline.py``'s), and the median unprofiled iteration split by the
products' share of the profiled operator time: the products at that peak (the least time
their work can take here), what they lost to it, and everything else (other operators and
Python). ``--speedup F`` adds how much of everything else would have to go for an iteration
F times as fast, with the products at the peak and as they ran. A speed-up, not a time: this
VM's speed drifts by 25% between runs, so a target in seconds from another run (TRL's) says
little; take F from a ratio measured side by side (``ppo_vs_trl.py``), e.g. 1.25 / 1.09.

Overrides (``key=value``) go on top of the bench's own, e.g.
``optimizer.use_distributed_optimizer=true``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ppo_vs_trl as pv  # noqa: E402
from common import SIZES, machine  # noqa: E402

PHASES = ("timing/rollout", "timing/experience", "timing/reward", "timing/train",
          "timing/iteration")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--variant", choices=["fixed", "stop"], default="fixed")
    parser.add_argument("--iterations", type=int, default=4, help="timed iterations")
    parser.add_argument("--top", type=int, default=25, help="operators listed")
    parser.add_argument("--matmuls", action="store_true",
                        help="the matrix products by shape and the iteration's time budget")
    parser.add_argument("--speedup", type=float, default=None,
                        help="with --matmuls: budget for an iteration this many times as fast")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(2)

    from torch.profiler import ProfilerActivity, profile

    from megarlhf.config import load_config
    from megarlhf.data.tokenizer import load_tokenizer
    from megarlhf.ppo.session import PPOSession

    folder = tempfile.mkdtemp(prefix=f"profile_ppo_{args.size}_")
    pv.prepare(args.size, args.variant, folder)
    cfg = load_config(os.path.join(folder, "policy_mrl/config.yaml"),
                      pv.megarlhf_overrides(folder, args.variant) + args.overrides)
    session = PPOSession(cfg, load_tokenizer(cfg.tokenizer))
    session.iteration(0)  # warm-up
    rows = [session.iteration(it)[0] for it in range(1, 1 + args.iterations)]
    print(f"# megarlhf PPO iteration, {args.size}/{args.variant}, ppo_vs_trl.py's shape; "
          f"overrides {args.overrides or 'none'}; {machine()}")
    print("phase medians (s): " + ", ".join(
        f"{k[7:]} {statistics.median(r[k] for r in rows):.3f}" for k in PHASES))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for it in range(1 + args.iterations, 3 + args.iterations):
            session.iteration(it)
    print(f"torch profiler, 2 iterations, top {args.top} operators by self CPU time:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    if args.matmuls:
        iteration = statistics.median(r["timing/iteration"] for r in rows)
        matmul_budget(session, 3 + args.iterations, iteration, args.speedup)
    session.close()


def _product_flops(name: str, shapes: list) -> int | None:
    """Multiply-adds x 2 of one call of a matrix product, from its input shapes."""
    if name == "aten::mm":
        (m, k), (_, n) = shapes[0], shapes[1]
        return 2 * m * k * n
    if name == "aten::addmm":
        (m, k), (_, n) = shapes[1], shapes[2]
        return 2 * m * k * n
    if name == "aten::bmm":
        (b, m, k), (_, _, n) = shapes[0], shapes[1]
        return 2 * b * m * k * n
    if name == "aten::baddbmm":
        (b, m, k), (_, _, n) = shapes[1], shapes[2]
        return 2 * b * m * k * n
    return None


def matmul_budget(session, it: int, iteration_s: float, speedup: float | None) -> None:
    """One more iteration profiled with shapes: its matrix products against the peak."""
    from torch.profiler import ProfilerActivity, profile

    from roofline import matmul_peak

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        session.iteration(it)
    rows, op_s = [], 0.0
    for e in prof.key_averages(group_by_input_shape=True):
        op_s += e.self_cpu_time_total / 1e6
        flops = _product_flops(e.key, e.input_shapes)
        if flops:
            rows.append((e.self_cpu_time_total / 1e6, e.count, flops * e.count, e.key,
                         e.input_shapes))
    peak = max(matmul_peak(n, repeats=5) for n in (512, 1024, 2048))
    mm_s = sum(r[0] for r in rows)
    mm_flops = sum(r[2] for r in rows)
    print(f"matrix products of one iteration by shape (profiled with shapes; peak "
          f"{peak / 1e9:.1f} GFLOP/s measured after it):")
    print(f"{'ms':>8} {'calls':>6} {'GFLOP':>7} {'GFLOP/s':>8} {'of peak':>8}  op, shapes")
    for seconds, count, flops, name, shapes in sorted(rows, key=lambda r: r[0], reverse=True):
        rate = flops / seconds if seconds else 0.0
        print(f"{seconds * 1e3:8.1f} {count:6d} {flops / 1e9:7.2f} {rate / 1e9:8.1f} "
              f"{rate / peak:8.0%}  {name} {shapes}")
    # the profiled iteration runs slower than a plain one: its shares, the plain time
    share = mm_s / op_s
    at_peak, as_ran = mm_flops / peak, share * iteration_s
    print(f"budget: iteration {iteration_s:.3f} s (median, unprofiled); matrix products "
          f"{mm_flops / 1e9:.1f} GFLOP, {share:.0%} of the profiled operator time, at "
          f"{mm_flops / mm_s / 1e9:.1f} GFLOP/s where they ran")
    print(f"  products at the peak {at_peak:.3f} s + lost to the peak "
          f"{as_ran - at_peak:.3f} s + everything else {iteration_s - as_ran:.3f} s")
    if speedup is not None:
        target_s = iteration_s / speedup
        for label, products in (("at the peak", at_peak), ("as they ran", as_ran)):
            other = iteration_s - products
            cut = 1 - (target_s - products) / other
            print(f"  {speedup:.3f}x as fast ({target_s:.3f} s), products {label}: {cut:.0%} "
                  f"of the other {other:.3f} s would have to go")


if __name__ == "__main__":
    main()
