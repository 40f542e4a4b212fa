"""Where the PPO training phase goes, per step: megarlhf alone on ppo_vs_trl.py's shape
(same checkpoints and overrides), the median wall time of each role's forward/backward
micro-batch pass and of the joint optimizer step, over a few iterations.

    .venv/bin/python bench/train_steps.py [--size small] [--iterations 3]

Medians over many steps are steadier on this noisy VM than a phase total. To compare two
checkouts, run each with its own tree first on the path, alternating (BENCHMARKS.md):

    PYTHONPATH=/tmp/before .venv/bin/python /tmp/before/bench/train_steps.py --size tiny
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ppo_vs_trl as pv  # noqa: E402
from common import SIZES, machine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--iterations", type=int, default=3, help="timed iterations")
    args = parser.parse_args()
    torch.set_num_threads(2)

    from megarlhf.config import load_config
    from megarlhf.data.tokenizer import load_tokenizer
    from megarlhf.stages import ppo

    folder = tempfile.mkdtemp(prefix=f"train_steps_{args.size}_")
    pv.prepare(args.size, "fixed", folder)
    cfg = load_config(os.path.join(folder, "policy_mrl/config.yaml"),
                      pv.megarlhf_overrides(folder, "fixed"))
    session = ppo.PPOSession(cfg, load_tokenizer(cfg.tokenizer))
    times = collections.defaultdict(list)

    def timed(name_of, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            out = fn(*a, **k)
            times[name_of(*a)].append(time.perf_counter() - start)
            return out
        return wrapper

    names = {id(session.actor.trained): "actor forward/backward",
             id(session.critic.trained): "critic forward/backward"}
    ppo.forward_backward = timed(lambda role, *_: names[id(role)], ppo.forward_backward)
    ppo.step_together = timed(lambda *_: "optimizer step (both)", ppo.step_together)
    session.iteration(0)  # warm-up
    times.clear()
    train = [session.iteration(it)[0]["timing/train"] for it in range(1, 1 + args.iterations)]
    print(f"# megarlhf PPO training steps, {args.size}/fixed, ppo_vs_trl.py's shape; {machine()}")
    print(f"training phase per iteration (s): {', '.join(f'{t:.3f}' for t in train)}")
    for name, values in times.items():
        print(f"{name:>24}: {len(values)} calls, median {statistics.median(values) * 1e3:.1f} ms, "
              f"{sum(values) / args.iterations * 1e3:.0f} ms per iteration")
    session.close()


if __name__ == "__main__":
    main()
