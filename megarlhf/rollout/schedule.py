"""Which policy version samples which batch: bounded staleness (``ppo.max_staleness`` k).

Version v is the actor after v iterations. Batch i is sampled by version max(0, i - k):
at the start of iteration i the actor (version i) samples batch i + k, then batch i -
sampled k iterations earlier - is scored and trained. The first iteration samples batches
0 .. k. So up to k batches wait, sampled ahead of the update that trains them, and every
trained token is at most k versions old. With k = 0 each batch is sampled by the actor
that trains on it, as the synchronous loop always did.

The schedule is fixed, not a race between sampler and trainer: which version samples a
batch depends on the batch's number only, so a run is a function of its seed and config.
The waiting batches are saved with each checkpoint (:meth:`StaleSchedule.state_dict`): a
resume trains exactly the batches the uninterrupted run would have (regenerating them
would need the old versions' weights, which the checkpoint does not hold).
"""

from __future__ import annotations

from typing import Callable

import torch

from megarlhf.rollout.experience import Sampled


class Later:
    """A batch being sampled elsewhere (the rollout ranks of a split job): ``finish()``
    waits for it and returns it, scored by the reward."""

    def __init__(self, finish: Callable[[], Sampled]):
        self.finish = finish


def sampling_version(batch: int, k: int) -> int:
    """The policy version that samples batch ``batch`` under staleness ``k``."""
    return max(0, batch - k)


class StaleSchedule:
    """The batches of a run of ``num_batches`` iterations under staleness ``k``;
    ``sample(batch, version)`` samples batch ``batch`` with the actor as it is (version
    ``version``), or starts sampling it elsewhere and returns a :class:`Later`. At most
    one batch is sampled elsewhere at a time: the next waits until it is in."""

    def __init__(self, k: int, num_batches: int,
                 sample: Callable[[int, int], Sampled | Later],
                 log: Callable[[str], None] = print):
        self.k, self.num_batches, self.sample, self.log = k, num_batches, sample, log
        self.waiting: dict[int, Sampled | Later] = {}

    def take(self, it: int) -> Sampled:
        """Batch ``it``, at the start of iteration ``it`` (the actor is version ``it``):
        first every batch up to ``it + k`` that is not sampled yet is sampled now (the
        last of them may still be sampling elsewhere when this returns)."""
        last = max(it, min(it + self.k, self.num_batches - 1))
        late = []
        for batch in range(it, last + 1):
            if batch not in self.waiting:
                if sampling_version(batch, self.k) != it:
                    late.append(batch)
                self.settle()
                self.waiting[batch] = self.sample(batch, it)
        if late:  # a resume without the waiting batches (see load_state_dict)
            self.log(f"[ppo] batches {late} sampled by version {it}, not by the schedule's "
                     f"versions {[sampling_version(b, self.k) for b in late]}: less stale, "
                     "not the uninterrupted run's")
        got = self.waiting.pop(it)
        return got.finish() if isinstance(got, Later) else got

    def settle(self) -> None:
        """Wait for the batch being sampled elsewhere, if any."""
        for batch, entry in self.waiting.items():
            if isinstance(entry, Later):
                self.waiting[batch] = entry.finish()

    def state_dict(self) -> dict:
        self.settle()
        return {"k": self.k, "batches": {str(b): s.state_dict()
                                         for b, s in sorted(self.waiting.items())}}

    def load_state_dict(self, state: dict | None, start: int, why: str = "") -> None:
        """The batches that were waiting when the checkpoint of iteration ``start`` was
        saved. Batches the current settings cannot train (a smaller k than they were
        sampled under, or past ``num_batches``) are dropped and sampled again when due
        (:meth:`take` says so); ``state`` None (a checkpoint without them: ``why``) drops
        them all."""
        self.waiting = {}
        if state is None:
            if self.k > 0 and start > 0:
                self.log(f"[ppo] the checkpoint holds no batches sampled ahead ({why}): "
                         "they are sampled again by the resumed actor")
            return
        dropped = []
        for key, entry in state["batches"].items():
            batch, sampled = int(key), Sampled.from_state_dict(entry)
            versions = sampled.gen.versions_BT
            version = int(versions.max()) if versions is not None and versions.numel() else 0
            if start <= batch < self.num_batches and batch - version <= self.k:
                self.waiting[batch] = sampled
            else:
                dropped.append(batch)
        if dropped:
            self.log(f"[ppo] batches {dropped} sampled ahead under ppo.max_staleness="
                     f"{state['k']} do not fit ppo.max_staleness={self.k} and "
                     f"ppo.num_iterations={self.num_batches}: dropped")


def staleness_metrics(versions_BT: torch.Tensor, mask_BT: torch.Tensor, version: int,
                      k: int) -> dict[str, float]:
    """``rollout/staleness_mean`` and ``_max`` of the trained tokens (``mask_BT``) of a batch
    trained by policy ``version``; a token older than ``k`` versions is a bug, refused."""
    mask = mask_BT.bool()
    age = (version - versions_BT)[mask]
    if not age.numel():
        return {"rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0}
    oldest = int(age.max())
    if oldest > k or int(age.min()) < 0:
        raise RuntimeError(f"a batch trained by policy version {version} holds tokens of "
                           f"versions {sorted(set(versions_BT[mask].tolist()))}: outside "
                           f"ppo.max_staleness={k}")
    return {"rollout/staleness_mean": float(age.double().mean()),
            "rollout/staleness_max": float(oldest)}
