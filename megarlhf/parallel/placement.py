"""Which processes of the job do what: ``rollout.placement.mode``.

colocated (the default): every process joins one default process group and takes part in
everything. split: the job's last ``rollout.placement.ranks`` processes only sample. The job is then
two worlds on one rendezvous store: the training processes' default group (ranks
0 .. N - 1, every role, checkpoint and collective of the training code as before) and the
rollout processes' own (their ranks 0 .. R - 1, the inference layout). A third group over
the whole job, the *bridge* (gloo, job ranks), carries requests, weights and samples
between them point to point (``rollout.remote``). The watchdog watches the whole job, so a
stalled rollout process is reported by job rank like any other.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass

import torch.distributed as dist

from megarlhf.config import Config, check_placement
from megarlhf.parallel import watchdog
from megarlhf.parallel.launch import init_distributed, read_job_env, use_part


@dataclass(frozen=True)
class Split:
    """This process's place in a split job: ``training`` or sampling, the sizes of the two
    worlds, its job rank, and the bridge group (job ranks)."""

    training: bool
    training_world: int
    rollout_world: int
    job_rank: int
    bridge: object
    # the job's rendezvous store (a prefix of its own): in-flight weight updates are
    # agreed on through it (rollout.placement.partial)
    store: object = None

    def rollout_job_rank(self, rank: int) -> int:
        """The job rank of the rollout world's rank ``rank``."""
        return self.training_world + rank

    def describe(self) -> str:
        n, r = self.training_world, self.rollout_world
        return (f"placement split: training ranks 0..{n - 1} ({n}), rollout ranks "
                f"{n}..{n + r - 1} ({r})")


def start(cfg: Config) -> Split | None:
    """Join this process's world (``rollout.placement.mode``): None when colocated (the caller
    starts the default group as always); for split, both worlds and the bridge are up when
    this returns, and ``parallel.launch.read_dist_env`` gives this process's world."""
    if cfg.rollout.placement.mode != "split":
        return None
    job = read_job_env()
    n = check_placement(cfg, job.world_size)
    training = job.rank < n
    part = dataclasses.replace(job, rank=job.rank if training else job.rank - n,
                               world_size=n if training else cfg.rollout.placement.ranks)
    timeout = datetime.timedelta(minutes=cfg.parallel.timeout_minutes)
    store, _, _ = next(dist.rendezvous(
        f"tcp://{job.master_addr}:{job.master_port}?rank={job.rank}&world_size={job.world_size}",
        timeout=timeout))
    use_part(part)
    name = "training" if training else "rollout"
    init_distributed(cfg, part, store=dist.PrefixStore(f"megarlhf/{name}/", store), job=job)
    watchdog.name_ranks({r: f"training rank {r}" if r < n else f"rollout rank {r - n}"
                         for r in range(job.world_size)})
    bridge = dist.ProcessGroupGloo(dist.PrefixStore("megarlhf/bridge/", store), job.rank,
                                   job.world_size, timeout)
    return Split(training=training, training_world=n, rollout_world=cfg.rollout.placement.ranks,
                 job_rank=job.rank, bridge=bridge,
                 store=dist.PrefixStore("megarlhf/partial/", store))
