"""What the SFT and reward-model stages share: building a trained role, the global batch
order, resume, evaluation passes and checkpoint saving."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from megarlhf.algos.experience import exact_div
from megarlhf.config import Config
from megarlhf.engine.checkpoint import (
    LATEST_FILE, RoleState, checkpoint_role, load_checkpoint, read_meta, save_checkpoint)
from megarlhf.engine.metrics import MetricsLogger
from megarlhf.engine.optimizer import TrainedRole, build_optimizer, wrap_ddp
from megarlhf.engine.schedule import build_model_chunks, run_schedule
from megarlhf.models.gpt import init_weights
from megarlhf.parallel.launch import ParallelLayout, init_distributed


def run_dir(cfg: Config) -> str:
    return os.path.join(cfg.run.output_dir, cfg.run.name)


def print0(*args) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(*args, flush=True)


@dataclass(frozen=True)
class StepPlan:
    """Global batch -> per-rank samples -> micro-batches, by exact division."""

    global_batch: int
    micro_batch: int
    dp_size: int
    num_samples: int
    num_epochs: int
    max_steps: int | None

    @property
    def per_rank(self) -> int:
        return exact_div(self.global_batch, self.dp_size, "train.global_batch_size",
                         "the data-parallel size")

    @property
    def micro_batches(self) -> int:
        return exact_div(self.per_rank, self.micro_batch,
                         "train.global_batch_size per data-parallel rank",
                         "train.micro_batch_size")

    @property
    def steps_per_epoch(self) -> int:
        steps = self.num_samples // self.global_batch
        if steps == 0:
            raise ValueError(f"the training data has {self.num_samples} samples, fewer than "
                             f"one global batch (train.global_batch_size={self.global_batch})")
        return steps

    @property
    def total_steps(self) -> int:
        total = self.steps_per_epoch * self.num_epochs
        return min(total, self.max_steps) if self.max_steps else total

    def describe(self) -> str:
        return (f"global batch {self.global_batch} = DP {self.dp_size} x {self.micro_batches} "
                f"micro-batches x {self.micro_batch}; {self.steps_per_epoch} steps/epoch, "
                f"{self.total_steps} steps")


def check_plan(cfg: Config, plan_for: Callable[[int], StepPlan]) -> None:
    """Batch arithmetic for the launcher's world size, before any process group exists."""
    from megarlhf.parallel.launch import read_dist_env

    model_parallel = (cfg.parallel.tensor_model_parallel_size
                      * cfg.parallel.pipeline_model_parallel_size)
    plan = plan_for(max(1, read_dist_env().world_size // model_parallel))
    _ = (plan.micro_batches, plan.steps_per_epoch)


def global_batches(plan: StepPlan, seed: int, start_step: int
                   ) -> Iterator[tuple[int, int, list[int]]]:
    """(step, epoch, sample indices of the global batch), from ``start_step`` on. The order
    depends only on the seed and the epoch, so a resumed run - at any layout - sees the
    same batches as an unbroken one."""
    for step in range(start_step, plan.total_steps):
        epoch, within = divmod(step, plan.steps_per_epoch)
        order = torch.randperm(plan.num_samples,
                               generator=torch.Generator().manual_seed(seed + 7919 * epoch))
        start = within * plan.global_batch
        yield step, epoch, order[start:start + plan.global_batch].tolist()


def rank_share(indices: list[int], layout: ParallelLayout) -> list[int]:
    per_rank = len(indices) // layout.dp_size
    return indices[layout.dp_rank * per_rank:(layout.dp_rank + 1) * per_rank]


@dataclass
class Stage:
    """A trained role with its layout, checkpoints and metrics."""

    cfg: Config
    layout: ParallelLayout
    name: str  # role name in checkpoints: "policy" (SFT) or "reward" (RM)
    kind: str  # "lm" or "value"
    role: TrainedRole
    chunks: list  # bare model chunks
    logger: MetricsLogger
    start_step: int = 0
    extra: dict = dataclasses.field(default_factory=dict)

    @property
    def ckpt_dir(self) -> str:
        return os.path.join(run_dir(self.cfg), "checkpoints")

    def save(self, step: int, trainer_state: dict | None = None) -> str:
        path = save_checkpoint(
            self.ckpt_dir, f"step_{step:07d}",
            {self.name: RoleState(self.role.model, self.role.optimizer, self.role.scheduler,
                                  {"kind": self.kind, **self.extra})},
            trainer_state={"step": step, "skipped_steps": self.role.num_skipped_steps,
                           **(trainer_state or {})},
            config=dataclasses.asdict(self.cfg), layout=self.layout.describe(),
            keep_last=self.cfg.checkpoint.keep_last)
        print0(f"saved checkpoint {path}")
        return path


def setup_stage(cfg: Config, *, name: str, kind: str, total_steps: Callable[[int], int]
                ) -> Stage:
    """Process groups, model, DDP, optimizer, LR schedule; then resume from the run's own
    latest checkpoint, or initialise from ``checkpoint.load``, or seeded random weights.
    ``total_steps(dp_size)`` sizes the LR schedule."""
    layout = init_distributed(cfg)
    chunks = build_model_chunks(cfg, layout, kind)
    for chunk in chunks:
        init_weights(chunk, cfg)
    model = wrap_ddp(chunks, cfg.optimizer.use_distributed_optimizer, layout.pg_collection)
    optimizer, scheduler = build_optimizer(cfg.optimizer, model, lr=cfg.optimizer.lr,
                                           total_steps=total_steps(layout.dp_size))
    role = TrainedRole(model, optimizer, scheduler)
    ckpt_dir = os.path.join(run_dir(cfg), "checkpoints")
    start_step, source = 0, f"random init (seed {cfg.run.seed})"
    if cfg.checkpoint.resume and os.path.exists(os.path.join(ckpt_dir, LATEST_FILE)):
        meta = load_checkpoint(ckpt_dir, {name: RoleState(model, optimizer, scheduler)},
                               layout=layout.describe())
        start_step = int(meta["trainer"]["step"])
        role.num_skipped_steps = int(meta["trainer"].get("skipped_steps", 0))
        source = (f"resumed {meta['tag']} (saved at {meta['layout']}, RNG "
                  f"{'restored' if meta['rng_restored'] else 're-seeded: layout changed'})")
        if not meta["rng_restored"]:
            from megarlhf.parallel.launch import seed_everything
            seed_everything(cfg.run.seed + start_step)
    elif cfg.checkpoint.load:
        meta = read_meta(cfg.checkpoint.load)
        src = checkpoint_role(meta, None, cfg.checkpoint.load)
        src_kind = meta["roles"][src].get("kind", kind)
        load_checkpoint(cfg.checkpoint.load, {name: RoleState(model)},
                        source_roles={name: src}, load_optimizer=False, load_rng=False,
                        skip_head=src_kind != kind)
        source = (f"{cfg.checkpoint.load} role '{src}'"
                  + (" (trunk only; new scalar head)" if src_kind != kind else ""))
    logger = MetricsLogger(run_dir(cfg), tensorboard=cfg.logging.tensorboard,
                           wandb_project=cfg.logging.wandb_project,
                           config=dataclasses.asdict(cfg),
                           resume_step=start_step if start_step else None)
    print0(f"[{name}] layout {layout.describe()}; weights: {source}")
    return Stage(cfg, layout, name, kind, role, chunks, logger, start_step)


def evaluate(stage: Stage, forward_step, microbatches: list, seq_length: int,
             micro_batch_size: int, log_key: str, size: int) -> list[float]:
    """Forward-only pass over this rank's evaluation micro-batches; the summed logs."""
    from megarlhf.engine.steps import sum_logs

    for chunk in stage.role.model:
        chunk.eval()
    with torch.no_grad():
        logs = run_schedule(stage.role.model, forward_step, microbatches,
                            seq_length=seq_length, micro_batch_size=micro_batch_size,
                            forward_only=True) if microbatches else []
    return sum_logs(logs, log_key, size, stage.layout)


def progress(total: int, initial: int, desc: str, enabled: bool):
    from tqdm import tqdm
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    return tqdm(total=total, initial=initial, desc=desc, disable=not (enabled and rank0),
                dynamic_ncols=True)
