"""A router that flips on purpose, in a real PPO run through the CLI. In the passes WHERE
names (``rollout``: the sampler's generation; ``train``: the passes that build a graph,
i.e. the actor's updates), every third token a router sees goes to its best unchosen
expert instead of its k-th choice, with the router's own score for that expert (the scores
are untouched: only the choice flips). A pass that replays given experts is not changed.
argv: WHERE, then the CLI's arguments."""

from __future__ import annotations

import sys

import torch

from megarlhf import speedups
speedups.install()

from megatron.core.transformer.moe.router_replay import (  # noqa: E402
    RouterReplay, RouterReplayAction)

from megarlhf import cli  # noqa: E402
from megarlhf.rollout import sampling  # noqa: E402

WHERE = sys.argv[1]
GENERATING = [False]
REPLAYS = (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD)


def flipped_topk(scores, topk, num_groups=None, group_topk=None):
    """The top ``topk`` experts of every row, every third row's k-th swapped for its
    (k+1)-th; the scores at the chosen experts (megatron's top-k contract)."""
    indices = torch.topk(scores, k=topk + 1, dim=1).indices
    chosen = indices[:, :topk].clone()
    chosen[::3, topk - 1] = indices[::3, topk]
    return scores.gather(1, chosen), chosen


def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None,
                    default_compute_topk=None):
    flipping = GENERATING[0] if WHERE == "rollout" else torch.is_grad_enabled()
    if flipping and self.router_replay_action not in REPLAYS:
        default_compute_topk = flipped_topk  # recorded too, when recording
    return natural_topk(self, scores, topk, num_groups, group_topk, default_compute_topk)


def generate(*args, **kwargs):
    GENERATING[0] = True
    try:
        return natural_generate(*args, **kwargs)
    finally:
        GENERATING[0] = False


natural_topk, RouterReplay.get_replay_topk = RouterReplay.get_replay_topk, get_replay_topk
natural_generate, sampling.generate = sampling.generate, generate

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[2:]))
