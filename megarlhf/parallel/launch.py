"""Process start-up: torchrun or Slurm environment -> the default process group.

Each role's layout and process groups are built afterwards (``parallel.layout``) and handed
down explicitly; nothing reads megatron's global ``parallel_state``.
"""

from __future__ import annotations

import datetime
import os
import random
import re
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megarlhf.config import Config
from megarlhf.parallel import cpu_backend, watchdog


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, as the launcher told it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "single"


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list: ``gpu[003-005,9],cpu1`` -> ``gpu003``."""
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot parse Slurm node list {nodelist!r}")
    prefix, _, ranges = match.groups()
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


_WORLD: list[DistEnv] = []  # this process's world when it is a part of the job's


def read_dist_env(environ: dict | None = None) -> DistEnv:
    """torchrun's variables win; ``srun`` without torchrun provides SLURM_*; otherwise a
    single process. Once :func:`use_part` named a part of the job as this process's world
    (``parallel.placement``), that part."""
    if environ is None and _WORLD:
        return _WORLD[0]
    return read_job_env(environ)


def use_part(env: DistEnv) -> None:
    """From now on :func:`read_dist_env` gives ``env``: the part of the job (its ranks and
    size) whose default process group this process joins."""
    _WORLD[:] = [env]


def read_job_env(environ: dict | None = None) -> DistEnv:
    """The whole job, as the launcher told it (see :func:`read_dist_env`)."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                       local_rank=int(env.get("LOCAL_RANK", 0)),
                       master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                       master_port=int(env.get("MASTER_PORT", 29500)), launcher="torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") \
            or env.get("SLURM_NODELIST") or "127.0.0.1"
        job_id = int(env.get("SLURM_JOB_ID", "0"))
        return DistEnv(rank=int(env["SLURM_PROCID"]), world_size=int(env["SLURM_NTASKS"]),
                       local_rank=int(env.get("SLURM_LOCALID", 0)),
                       master_addr=env.get("MASTER_ADDR", first_slurm_host(nodelist)),
                       master_port=int(env.get("MASTER_PORT", 20000 + job_id % 20000)),
                       launcher="slurm")
    # A lone process needs a store only for itself: any free port, so that several
    # single-process jobs can share a machine.
    port = int(env["MASTER_PORT"]) if "MASTER_PORT" in env else _free_port()
    return DistEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1",
                   master_port=port, launcher="single")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def process_group_backend(choice: str, cuda: bool) -> str:
    """The backend string for ``init_process_group``. On CUDA, model tensors travel over
    NCCL while host-side bookkeeping (metric sums, the preemption flag, object gathers)
    stays on CPU tensors and travels over gloo: ``cuda:nccl,cpu:gloo``. Every subgroup
    (megatron's layouts) inherits both."""
    if choice == "nccl" and not cuda:
        raise ValueError("parallel.backend=nccl needs CUDA; use 'auto' or 'gloo' on CPU")
    if choice == "gloo" and cuda:
        raise ValueError("parallel.backend=gloo with CUDA: the models live on the GPU and "
                         "their tensors need NCCL; use 'auto' (NCCL plus gloo for host "
                         "tensors)")
    return "cuda:nccl,cpu:gloo" if cuda else "gloo"


def uses_nccl() -> bool:
    """Whether GPU tensors travel over NCCL in the default process group."""
    return dist.is_initialized() and "nccl" in str(dist.get_backend())


def compute_device() -> torch.device:
    """Where models and their passes run: this process's GPU with CUDA, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_device(batch: dict, device: torch.device) -> dict:
    """A micro-batch's tensors on ``device`` (other entries as they are)."""
    if device.type == "cpu":
        return batch
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()}


def init_distributed(cfg: Config, env: DistEnv | None = None, *, store=None,
                     job: DistEnv | None = None) -> DistEnv:
    """Start the default process group (NCCL with CUDA, gloo without) and seed every RNG.
    Layouts and their groups come later, per role (``parallel.layout.build_layout``); the
    config is validated before this is called. ``store`` (with ``env`` a part of the job
    ``job``, see ``parallel.placement``): the group meets there, and the watchdog watches
    the whole job."""
    env = env or read_dist_env()
    job = job or env
    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    if cfg.run.deterministic:
        torch.use_deterministic_algorithms(True)
    cuda = torch.cuda.is_available()
    backend = process_group_backend(cfg.parallel.backend, cuda)
    if cuda:
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
        # NCCL's own watchdog: a collective past parallel.timeout_minutes aborts its
        # communicator and ends the process (3: without a cleanup that could itself hang)
        # instead of leaving the rank blocked; the user's setting wins
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    else:
        cpu_backend.activate()
    if not dist.is_initialized():
        if env.launcher != "single":
            # A lone process keeps its port to itself: children it starts (a converter,
            # another CLI run) must not inherit it and bind the same port.
            os.environ.setdefault("MASTER_ADDR", env.master_addr)
            os.environ.setdefault("MASTER_PORT", str(env.master_port))
        where = {"store": store} if store is not None else \
            {"init_method": f"tcp://{env.master_addr}:{env.master_port}"}
        dist.init_process_group(
            backend=backend, rank=env.rank, world_size=env.world_size,
            timeout=datetime.timedelta(minutes=cfg.parallel.timeout_minutes), **where)
    watchdog.start(job.rank, job.world_size, job.master_addr, job.master_port,
                   cfg.parallel.timeout_minutes)
    seed_everything(cfg.run.seed)
    return env


def shutdown() -> None:
    from megarlhf.parallel.layout import reset_layouts
    watchdog.stop()
    if dist.is_initialized():
        dist.destroy_process_group()
    reset_layouts()
    _WORLD.clear()
