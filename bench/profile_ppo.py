"""Where a PPO iteration's time goes: megarlhf alone on ppo_vs_trl.py's shape (same
checkpoints, settings and overrides), the phase timings of a few iterations and the torch
profiler's top operators over two more.

    .venv/bin/python bench/profile_ppo.py [--size small] [--variant fixed] [--iterations 4]
                                          [--top 25] [override ...]

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
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(2)

    from torch.profiler import ProfilerActivity, profile

    from megarlhf.config import load_config
    from megarlhf.data.tokenizer import load_tokenizer
    from megarlhf.stages.ppo import PPOSession

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
    session.close()


if __name__ == "__main__":
    main()
