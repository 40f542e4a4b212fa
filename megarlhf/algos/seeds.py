"""Every seed megarlhf derives from ``run.seed``, in one function: which random stream each
draw comes from, and why each is a function of the run's position (so a resumed run, at
any layout, draws what an unbroken one would)."""

from __future__ import annotations

# The multipliers are primes far apart, so the streams of nearby arguments do not meet.
_ROW = 1_000_003


def derive_seed(stream: str, seed: int, i: int = 0, j: int = 0) -> int:
    """The seed of ``stream`` at position (``i``, ``j``) of a run seeded ``seed``:

    - ``"row"``: row ``i`` of a rollout batch seeded ``seed`` (its own generator: a
      prompt's samples do not depend on the layout or the process sampling it);
    - ``"turn"``: row ``i``'s turn ``j`` of a multi-turn episode;
    - ``"refill"``: round ``i`` of DAPO's dynamic sampling in a batch seeded ``seed``;
    - ``"prompt_round"``: the prompt stream of sampling round ``i`` (0: the batch itself);
    - ``"prompt_epoch"``: epoch ``i``'s permutation of a prompt stream seeded ``seed``;
    - ``"ptx"``: PPO-ptx's one shuffled order of the pretraining rows;
    - ``"update"``: the mini-batch shuffles of PPO iteration ``i``'s update;
    - ``"supervised_epoch"``: epoch ``i``'s order of an SFT / RM / DPO dataset."""
    if stream == "row":
        return seed * _ROW + i
    if stream == "turn":
        return (seed * _ROW + i) * 64 + j
    if stream == "refill":
        return seed * 65537 + i
    if stream in ("prompt_round", "supervised_epoch"):
        return seed + 7919 * i
    if stream == "prompt_epoch":
        return seed + 104729 * i
    if stream == "ptx":
        return seed + 31
    if stream == "update":
        return seed * 7 + i
    raise ValueError(f"no seed stream {stream!r}")
