"""Multi-turn decoding with the episodes' keys and values kept across turns
(``speedups.turn_kv``) against re-prefilling each conversation at every turn (what
``rollout.environment`` episodes did before), on the same converted weights.

    .venv/bin/python bench/multiturn_kv.py [--size medium] [--episodes 16] [--turns 3]
                                           [--prompt 128] [--observation 32] [--new 32]

Synthetic episodes: random prompts; each turn samples ``--new`` tokens (no stop token) and
the "environment" answers with ``--observation`` fixed tokens. The two are timed in turn,
one call of each per round after one warm-up (this VM's speed drifts); medians.
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
from common import convert, hf_llama, machine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["tiny", "small", "medium"], default="medium")
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--observation", type=int, default=32)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from megarlhf import speedups
    speedups.install()
    torch.set_num_threads(2)
    os.environ.setdefault("MASTER_PORT", "29913")
    tmp = tempfile.mkdtemp()
    hf_llama(args.size, os.path.join(tmp, "hf"))
    convert(os.path.join(tmp, "hf"), os.path.join(tmp, "mrl"))

    from megarlhf.config import load_config
    from megarlhf.inference.generate import SamplingParams, generate, stop_tensor
    from megarlhf.parallel.launch import init_distributed
    from megarlhf.roles.build import build_from_config
    from megarlhf.inference.turns import TurnCache

    cfg = load_config(os.path.join(tmp, "mrl", "config.yaml"))
    init_distributed(cfg)
    (model,) = build_from_config(cfg, kind="lm").chunks
    vocab = cfg.model.vocab_size
    params = SamplingParams(max_new_tokens=args.new, temperature=1.0, stop_at_eos=False)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (args.episodes, args.prompt), generator=gen).tolist()
    answer = torch.randint(3, vocab, (args.observation,), generator=gen).tolist()
    n = args.episodes

    def again():
        talks = [list(p) for p in prompts]
        for turn in range(args.turns):
            g = generate(model, talks, params, eos_id=-1, pad_id=0, true_vocab=vocab,
                         row_seeds=[1000 * turn + i for i in range(n)])
            for i in range(n):
                talks[i] += g.response_tokens_BT[i].tolist() + answer
        return talks

    def kept():
        talks = [list(p) for p in prompts]
        cache = TurnCache(model, n, pad_id=0, true_vocab=vocab, columns=2 * len(talks[0]))
        for turn in range(args.turns):
            out = cache.turn({i: talks[i] for i in range(n)}, {i: args.new for i in range(n)},
                             params, {i: 1000 * turn + i for i in range(n)},
                             stop_tensor(params, -1, "cpu"), {})
            for i in range(n):
                talks[i] += out[i][0] + answer
        return talks

    same = kept() == again()
    times = ([], [])
    for _ in range(args.repeats):
        for fn, out in zip((kept, again), times):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    t_kept, t_again = (statistics.median(t) for t in times)
    tokens = n * args.turns * args.new
    print(f"# multi-turn decoding: {args.size} model, {n} episodes x {args.turns} turns, "
          f"prompt {args.prompt}, observation {args.observation}, {args.new} new tokens a "
          f"turn, sampled, fp32; {machine()}")
    print(f"kept across turns {tokens / t_kept:.0f} tok/s, re-prefilled {tokens / t_again:.0f} "
          f"tok/s: {t_again / t_kept:.2f}x (same episodes: {same})")


if __name__ == "__main__":
    main()
