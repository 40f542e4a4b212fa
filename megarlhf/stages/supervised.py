"""The one supervised loop that runs SFT, reward modelling, DPO and distillation: batch
arithmetic, the global batch order, building the trained role, resume, evaluation,
metrics, preemption and checkpoints."""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from megarlhf.algos.experience import exact_div
from megarlhf.config import Config, Written, check_supervised
from megarlhf.data.tokenizer import fingerprint
from megarlhf.data.budgets import train_budget
from megarlhf.engine.checkpoint import LATEST_FILE, load_checkpoint, save_checkpoint
from megarlhf.engine.metrics import METRICS_FILE, MetricsLogger
from megarlhf.engine.optimizer import check_runaway, train_step
from megarlhf.data.packing import budget_groups
from megarlhf.models import moe
from megarlhf.parallel.gather import gather_objects
from megarlhf.parallel.preemption import PreemptionGuard, mark_preempted
from megarlhf.roles.spec import RoleSpec, check_positions, single_role_spec
from megarlhf.roles.build import Role, build_role
from megarlhf.engine.schedule import run_schedule
from megarlhf.engine.steps import reduce_logs
from megarlhf.parallel.launch import init_distributed, read_dist_env, seed_everything
from megarlhf.parallel.layout import RankLayout
from megarlhf.parallel.rank import print0
from megarlhf.stages.common import (MetricBands, check_writable, explain_resume, progress,
                                    run_dir)
from megarlhf.algos.seeds import derive_seed


@dataclass(frozen=True)
class StepPlan:
    """Global batch -> per-rank samples -> micro-batches: by exact division, or packed
    (``max_tokens``): shares of balanced token counts cut into micro-batches of at most
    ``max_tokens`` tokens (``data.packing``)."""

    global_batch: int
    micro_batch: int
    dp_size: int
    num_samples: int
    num_epochs: int
    max_steps: int | None
    max_tokens: int | None = None

    def validate(self) -> None:
        """Bad arithmetic raises (before any work)."""
        if self.max_tokens is None:
            _ = self.micro_batches
        elif self.global_batch < self.dp_size:
            raise ValueError(f"train.global_batch_size={self.global_batch} leaves a "
                             f"data-parallel rank without samples (DP={self.dp_size})")
        _ = self.total_steps

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
        steps = f"{self.steps_per_epoch} steps/epoch, {self.total_steps} steps"
        if self.max_tokens is not None:
            return (f"global batch {self.global_batch} over DP {self.dp_size} by token count, "
                    f"packed micro-batches of at most {self.max_tokens} tokens; {steps}")
        return (f"global batch {self.global_batch} = DP {self.dp_size} x {self.micro_batches} "
                f"micro-batches x {self.micro_batch}; {steps}")


def global_batches(plan: StepPlan, seed: int, start_step: int
                   ) -> Iterator[tuple[int, int, list[int]]]:
    """(step, epoch, sample indices of the global batch), from ``start_step`` on. The order
    depends only on the seed and the epoch, so a resumed run - at any layout - sees the
    same batches as an unbroken one."""
    for step in range(start_step, plan.total_steps):
        epoch, within = divmod(step, plan.steps_per_epoch)
        order = torch.randperm(plan.num_samples,
                               generator=torch.Generator().manual_seed(
                                   derive_seed("supervised_epoch", seed, epoch)))
        start = within * plan.global_batch
        yield step, epoch, order[start:start + plan.global_batch].tolist()


def rank_share(items: list, layout: RankLayout) -> list:
    """This data-parallel rank's contiguous share of a global batch."""
    block = layout.block_share(len(items), "batch")
    return items[block.start:block.stop]


def save_role(cfg: Config, role: Role, name: str, tag: str, trainer_state: dict,
              extra: dict | None = None) -> str:
    """One trained role as a checkpoint of the run (weights, optimizer, schedule, RNG)."""
    state = role.state(cfg.checkpoint.adapters_only)
    state.extra.update(extra or {})
    path = save_checkpoint(os.path.join(run_dir(cfg), "checkpoints"), tag, {name: state},
                           trainer_state=trainer_state, config=dataclasses.asdict(cfg),
                           layout=role.layout.describe(),
                           keep_last=cfg.checkpoint.keep_last,
                           records=(os.path.join(run_dir(cfg), METRICS_FILE),))
    print0(f"saved checkpoint {path}")
    return path


@dataclass
class SupervisedTask:
    """What separates one supervised stage from another (SFT, reward modelling)."""

    name: str  # stage name: progress bar, messages
    train_items: list  # samples (SFT examples, preference pairs)
    eval_items: list
    make_step: Callable[[Role], Callable]  # role -> megatron forward step with its loss
    make_batches: Callable[[list, bool], tuple[list[dict], int]]  # (items, training) ->
    # (micro-batches, sequence length)
    rows_per_micro_batch: int  # rows the schedule sees (pairs are two rows each)
    summarize: Callable[[dict[str, float]], dict[str, float]]  # summed logs -> metrics
    describe: str = ""  # extra start-up line
    finish: Callable[[Role], dict] | None = None  # after training: values saved with the role
    before_batch: Callable[[list], None] | None = None  # every rank, the whole global (or
    # evaluation) batch's items before they are split: e.g. a frozen model scores them
    extra_eval: Callable[[Role], dict] | None = None  # more eval/* metrics (gold score)
    tokens: Callable[[object], int] | None = None  # an item's token count (all its rows)
    make_packed: Callable[[list], dict] | None = None  # items -> one packed micro-batch
    sequences: int = 1  # sequences per item (a pair: 2): train.max_tokens_per_micro_batch's
    # auto budget is micro_batch_size items of data.max_seq_len each
    on_built: Callable[[Role], None] | None = None  # the trained role once built (DPO's
    # reference may be the LoRA policy with its adapters off)


def supervised_spec(cfg: Config, name: str, kind: str, tokenizer,
                    written: Written | None = None) -> RoleSpec:
    """The trained role of ``sft`` / ``rm`` (``name``: its name in checkpoints), resolved
    and checked against the launcher's world size before any process group exists."""
    check_supervised(cfg)
    spec = single_role_spec(cfg, name=name, kind=kind, world_size=read_dist_env().world_size,
                            trained=True, tokenizer=fingerprint(tokenizer), written=written)
    check_positions(spec, cfg.data.max_seq_len, "data.max_seq_len")  # its longest sequence
    return spec


def step_plan(cfg: Config, spec: RoleSpec, num_items: int, sequences: int = 1) -> StepPlan:
    """The batch arithmetic of training ``spec`` on ``num_items`` of ``sequences``
    sequences each (``config.train_budget``); bad arithmetic raises here, before any
    work."""
    train = cfg.train
    world = read_dist_env().world_size
    plan = StepPlan(train.global_batch_size, train.micro_batch_size,
                    spec.layout.dp(world), num_items, train.num_epochs,
                    train.max_steps, train_budget(cfg, sequences))
    plan.validate()
    return plan


def check_budget(cfg: Config, items: list, tokens: Callable[[object], int], what: str,
                 sequences: int = 1) -> None:
    """Every item (of ``sequences`` sequences) fits ``train.max_tokens_per_micro_batch``
    (when packed), checked before any work: a packed micro-batch takes whole items (a
    pair: both sequences), and one over the budget would break the memory bound it sets
    mid-run."""
    budget = train_budget(cfg, sequences)
    if budget is None or not items:
        return
    longest = max(range(len(items)), key=lambda i: tokens(items[i]))
    if tokens(items[longest]) > budget:
        raise ValueError(f"train.max_tokens_per_micro_batch={budget} cannot hold {what} "
                         f"{longest + 1}, {tokens(items[longest])} tokens: a packed "
                         f"micro-batch takes whole samples. Set it to at least "
                         f"{tokens(items[longest])}")


def run_supervised(cfg: Config, spec: RoleSpec, task: SupervisedTask, tokenizer) -> dict:
    """Train ``spec`` on ``task``: build it (or resume the run's latest checkpoint, at any
    layout), then global batches -> micro-batches -> one optimizer step each, with
    evaluation, metrics, progress, preemption and checkpoints."""
    plan = step_plan(cfg, spec, len(task.train_items), task.sequences)
    if plan.max_tokens is not None:
        if task.make_packed is None or task.tokens is None:
            raise ValueError(f"{task.name} does not pack micro-batches: unset "
                             "train.max_tokens_per_micro_batch")
        check_budget(cfg, task.train_items, task.tokens, "training sample", task.sequences)
        check_budget(cfg, task.eval_items, task.tokens, "evaluation sample", task.sequences)
    check_writable(cfg)
    init_distributed(cfg)
    role = build_role(spec, seed=cfg.run.seed, total_steps=plan.total_steps)
    if task.on_built:
        task.on_built(role)
    start_step = resume(cfg, role, spec.name)
    layout = role.layout
    print0(f"[{task.name}] layout {layout.describe()}; {spec.optimizer_kind}; "
           f"weights: {role.source}")
    print0(f"[{task.name}] {len(task.train_items)} train / {len(task.eval_items)} eval; "
           f"{plan.describe()}" + (f"; {task.describe}" if task.describe else ""))
    logger = MetricsLogger(run_dir(cfg), tensorboard=cfg.logging.tensorboard,
                           wandb_project=cfg.logging.wandb_project,
                           config=dataclasses.asdict(cfg), resume_step=start_step or None)
    bar = progress(plan.total_steps, start_step, task.name, cfg.logging.progress_bar)
    try:
        result = _loop(cfg, task, role, plan, start_step, logger, bar,
                       {"tokenizer": fingerprint(tokenizer)})
    finally:
        bar.close()
        logger.close()
    print0(f"[{task.name}] done: {result}")
    return result


def resume(cfg: Config, role: Role, name: str) -> int:
    """Continue from the run's own latest checkpoint (weights, optimizer, schedule, RNG -
    the RNG only at the same layout); returns the step to start from."""
    ckpt_dir = os.path.join(run_dir(cfg), "checkpoints")
    if not (cfg.checkpoint.resume and os.path.exists(os.path.join(ckpt_dir, LATEST_FILE))):
        return 0
    explain_resume(cfg, ckpt_dir)
    meta = load_checkpoint(ckpt_dir, {name: role.state(cfg.checkpoint.adapters_only)},
                           layout=role.layout.describe())
    start = int(meta["trainer"]["step"])
    role.trained.num_skipped_steps = int(meta["trainer"].get("skipped_steps", 0))
    role.source = (f"resumed {meta['tag']} (saved at {meta['layout']}, RNG "
                   f"{'restored' if meta['rng_restored'] else 're-seeded: layout changed'})")
    if not meta["rng_restored"]:
        seed_everything(cfg.run.seed + start)
    return start


def micro_batches(task: SupervisedTask, items: list, layout: RankLayout, training: bool,
                  budget: int | None) -> tuple[list[dict], int, int]:
    """This data-parallel rank's micro-batches of ``items`` (a global or evaluation batch,
    every rank the same list) -> (micro-batches, sequence length, rows per micro-batch).
    Padded: a contiguous share (training; evaluation: strided, no exact division) in
    ``task.make_batches``' micro-batches. Packed (``budget`` tokens): a share of balanced
    token count, first-fit into micro-batches of whole items (``data.packing``)."""
    if budget is None:
        share = rank_share(items, layout) if training else rank_share_strided(items, layout)
        batches, length = task.make_batches(share, training)
        return batches, length, task.rows_per_micro_batch
    lengths = [task.tokens(item) for item in items]
    share = layout.balanced_share(lengths)
    batches = [task.make_packed([items[i] for i in group])
               for group in budget_groups(share, lengths, budget,
                                          what="train.max_tokens_per_micro_batch")]
    return batches, max((b["tokens"].shape[1] for b in batches), default=0), 1


def padding_fraction(batches: list[dict], real: int, layout: RankLayout) -> float:
    """The share of the token positions a step's micro-batches (every data-parallel
    replica's) computed that were padding, ``real`` tokens being the global batch's."""
    mine = sum(int(b["tokens"].numel()) for b in batches) if layout.writes_results else 0
    computed = sum(gather_objects(mine))
    return (computed - real) / computed if computed else 0.0


def _evaluate(task: SupervisedTask, role: Role, step_fn, budget: int | None
              ) -> dict[str, float] | None:
    if not task.eval_items:
        return None
    if task.before_batch:
        task.before_batch(task.eval_items)
    batches, length, rows = micro_batches(task, task.eval_items, role.layout, False, budget)
    for chunk in role.model:
        chunk.eval()
    with torch.no_grad():
        logs = run_schedule(role.model, step_fn, batches, layout=role.layout, seq_length=length,
                            micro_batch_size=rows, forward_only=True)  # every rank: EP
    out = {f"eval/{k}": v for k, v in task.summarize(reduce_logs(logs, role.layout)).items()}
    if task.extra_eval:
        out.update(task.extra_eval(role))
    return out


def rank_share_strided(items: list, layout: RankLayout) -> list:
    """Items ``dp_rank::dp_size`` (evaluation: every item once, no exact division)."""
    return [items[i] for i in layout.strided_share(len(items))]


def _loop(cfg: Config, task: SupervisedTask, role: Role, plan: StepPlan, start_step: int,
          logger: MetricsLogger, bar, saved: dict) -> dict:
    """``saved``: what every checkpoint records with the role (its tokenizer)."""
    train, layout = cfg.train, role.layout
    budget = plan.max_tokens
    guard = PreemptionGuard()
    step_fn = task.make_step(role)
    bands = MetricBands(cfg)
    result: dict = {}
    if start_step == 0:
        first = _evaluate(task, role, step_fn, budget)
        if first:
            logger.log(0, first)
            result["eval_start"] = first
            bands.check(first, "the evaluation before training")
    for step, epoch, indices in global_batches(plan, cfg.run.seed, start_step):
        started = time.perf_counter()
        if task.before_batch:
            task.before_batch([task.train_items[i] for i in indices])
        batches, length, rows = micro_batches(task, [task.train_items[i] for i in indices],
                                              layout, True, budget)
        logs, applied, grad_norm = train_step(role.trained, step_fn, batches,
                                              seq_length=length, micro_batch_size=rows)
        if not applied:
            print0(f"[{role.spec.name}] step {step + 1}: skipped for non-finite gradients")
        check_runaway(role.trained, role.spec.name)
        done = step + 1
        metrics = {f"train/{k}": v for k, v in task.summarize(reduce_logs(logs, layout)).items()}
        metrics.update(moe.take_losses(role.spec.model, layout, len(batches)))
        if task.tokens is not None:
            metrics["perf/padding_fraction/train"] = padding_fraction(
                batches, sum(task.tokens(task.train_items[i]) for i in indices), layout)
        metrics.update({"perf/step_seconds": time.perf_counter() - started,
                        "train/grad_norm": grad_norm,
                        "train/lr": role.trained.optimizer.param_groups[0]["lr"],
                        "train/epoch": epoch,
                        "train/skipped_steps": role.trained.num_skipped_steps})
        if done % cfg.logging.log_interval == 0 or done == plan.total_steps:
            logger.log(done, metrics)
        bands.check(metrics, f"step {done}", skipped=() if applied else ("train/", "moe/"))
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['train/loss']:.4f}",
                        gnorm=f"{grad_norm:.2f}" if math.isfinite(grad_norm) else "nan")
        result["train_loss"] = metrics["train/loss"]
        if done == plan.total_steps:
            break
        if train.eval_interval and done % train.eval_interval == 0:
            evaluation = _evaluate(task, role, step_fn, budget) or {}
            logger.log(done, evaluation)
            bands.check(evaluation, f"the evaluation at step {done}")
        trainer_state = {"step": done, "skipped_steps": role.trained.num_skipped_steps}
        if cfg.checkpoint.save_interval and done % cfg.checkpoint.save_interval == 0:
            save_role(cfg, role, role.spec.name, f"step_{done:07d}", trainer_state, saved)
        if guard.requested():
            mark_preempted(run_dir(cfg), save_role(cfg, role, role.spec.name,
                                                   f"step_{done:07d}", trainer_state, saved),
                           guard.signalled)
            return {"preempted_at": done}
    last = _evaluate(task, role, step_fn, budget)
    if last:
        logger.log(plan.total_steps, last)
        result["eval_end"] = last
        bands.check(last, "the final evaluation")
    extra = task.finish(role) if task.finish else {}
    bands.check(extra, "the end of training")  # e.g. a reward model's normalisation
    result.update(extra)
    save_role(cfg, role, role.spec.name, f"step_{plan.total_steps:07d}",
              {"step": plan.total_steps, "skipped_steps": role.trained.num_skipped_steps},
              {**saved, **extra})
    check_runaway(role.trained, role.spec.name, final=True)  # a short run that went wrong
    bands.report_unseen()
    return result
