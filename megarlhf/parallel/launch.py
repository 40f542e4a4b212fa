"""Process start-up: torchrun or Slurm environment -> process group -> training layout.

The :class:`ParallelLayout` returned here is handed down explicitly; algorithm code
never reads megatron's global ``parallel_state``.
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

from megarlhf.config import Config, validate_layout
from megarlhf.parallel import cpu_backend


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


def read_dist_env(environ: dict | None = None) -> DistEnv:
    """torchrun's variables win; ``srun`` without torchrun provides SLURM_*; otherwise a
    single process."""
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


@dataclass(frozen=True)
class ParallelLayout:
    """One model layout: sizes, this rank's coordinates and the process groups.

    ``pg_collection`` is megatron's ``ProcessGroupCollection`` for models built in this
    layout.
    """

    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    vpp_size: int | None
    pg_collection: object

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def tp_group(self):
        return self.pg_collection.tp

    @property
    def dp_group(self):
        return self.pg_collection.dp

    def describe(self) -> str:
        return (f"TP={self.tp_size} PP={self.pp_size} DP={self.dp_size}"
                + (f" VPP={self.vpp_size}" if self.vpp_size else ""))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def init_distributed(cfg: Config, env: DistEnv | None = None) -> ParallelLayout:
    """Start the process group and megatron's training layout; validate first."""
    env = env or read_dist_env()
    validate_layout(cfg, env.world_size)
    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    if cfg.run.deterministic:
        torch.use_deterministic_algorithms(True)
    cuda = torch.cuda.is_available()
    backend = cfg.parallel.backend
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    if backend == "nccl" and not cuda:
        raise ValueError("parallel.backend=nccl needs CUDA; use 'auto' or 'gloo' on CPU")
    if cuda:
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    else:
        cpu_backend.activate()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        os.environ.setdefault("MASTER_PORT", str(env.master_port))
        dist.init_process_group(
            backend=backend, rank=env.rank, world_size=env.world_size,
            init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
            timeout=datetime.timedelta(minutes=cfg.parallel.timeout_minutes))
    return init_training_layout(cfg)


def init_training_layout(cfg: Config) -> ParallelLayout:
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    par = cfg.parallel
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=par.tensor_model_parallel_size,
        pipeline_model_parallel_size=par.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=par.virtual_pipeline_model_parallel_size,
        distributed_timeout_minutes=par.timeout_minutes,
    )
    seed_everything(cfg.run.seed)
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.run.seed)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    return ParallelLayout(
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        dp_size=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        vpp_size=par.virtual_pipeline_model_parallel_size,
        pg_collection=pgc,
    )


def shutdown() -> None:
    from megatron.core import parallel_state as ps
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
