"""Megatron DDP, the (distributed) optimizer and the LR schedule for a trained role,
and one training step through the pipeline schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megarlhf.config import OptimizerConfig
from megarlhf.engine.schedule import run_schedule
from megarlhf.models import moe
from megarlhf.models.gpt import unwrap
from megarlhf.parallel import cpu_backend
from megarlhf.parallel.layout import RankLayout
from megarlhf import speedups
from megarlhf.speedups import fused_adam
from megarlhf.parallel import watchdog


def wrap_ddp(model_chunks: list, use_distributed_optimizer: bool, pg_collection) -> list:
    """Megatron DDP around each chunk: contiguous fp32 gradient buffers, reduced over the
    data-parallel group (reduce-scatter with the distributed optimizer)."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=use_distributed_optimizer,
        overlap_grad_reduce=False,
        check_for_nan_in_grad=False,
    )
    for chunk in model_chunks:
        # The loss functions return (sum, num_tokens, logs); megatron then divides by the
        # number of valid tokens across micro-batches and data-parallel ranks. DDP reads
        # this flag when it is built (it then stops averaging over DP ranks itself).
        chunk.config.calculate_per_token_loss = True
    wrapped = []
    for i, chunk in enumerate(model_chunks):
        wrapped.append(DistributedDataParallel(
            config=chunk.config, ddp_config=ddp_config, module=chunk,
            # Later chunks in the interleaved schedule are reduced without bucketing.
            disable_bucketing=i > 0, pg_collection=pg_collection))
    config = wrapped[0].config
    config.no_sync_func = [m.no_sync for m in wrapped] if len(wrapped) > 1 \
        else wrapped[0].no_sync
    config.finalize_model_grads_func = partial(finalize_grads, pg_collection=pg_collection)
    return wrapped


def finalize_grads(model: list, num_tokens=None, *, pg_collection, **kwargs) -> None:
    """megatron's ``finalize_model_grads`` (gradients reduced over the groups in
    ``pg_collection``; ``kwargs`` as the schedule passes them), then the routers' expert bias moved (``model.moe.expert_bias``):
    megatron's own update sums the token counts on its global tensor-and-data-parallel
    group, which megarlhf's per-role groups do not set, so it is done by
    ``moe.update_expert_bias`` on the role's own TP x DP x CP group instead."""
    config = unwrap(model[0]).config
    if not config.moe_router_enable_expert_bias:
        return finalize_model_grads(model, num_tokens, pg_collection=pg_collection, **kwargs)
    config.moe_router_enable_expert_bias = False  # read only here, by megatron's finalize
    try:
        finalize_model_grads(model, num_tokens, pg_collection=pg_collection, **kwargs)
    finally:
        config.moe_router_enable_expert_bias = True
    moe.update_expert_bias(model, config.moe_router_bias_update_rate,
                           pg_collection.tp_dp_cp)


@dataclass
class TrainedRole:
    """A trained model with its optimizer and schedule."""

    model: list  # DDP-wrapped chunks
    optimizer: Any
    scheduler: OptimizerParamScheduler
    layout: RankLayout  # its split, for the pipeline schedule
    num_skipped_steps: int = 0
    # the runaway guard (optimizer.max_consecutive_skipped_steps, max_skipped_fraction)
    max_consecutive_skipped: int = 0
    max_skipped_fraction: float = 1.0
    consecutive_skipped: int = 0
    num_steps: int = 0  # attempted in this process


class RunawayError(RuntimeError):
    """Too many optimizer steps skipped for non-finite gradients, or a metric out of its
    configured band: the run stops."""


MIN_STEPS_FOR_FRACTION = 20


def check_runaway(role: TrainedRole, name: str = "model", final: bool = False) -> None:
    """Stop a run whose steps keep being skipped (non-finite gradients: a learning rate
    far too high, NaN rewards or data) instead of finishing with ruined or unchanged
    weights and exit 0. ``final``: the run's end, where the skipped fraction counts
    however few steps there were (except under fp16's loss-scale search)."""
    if role.max_consecutive_skipped and role.consecutive_skipped >= role.max_consecutive_skipped:
        raise RunawayError(
            f"{name}: {role.consecutive_skipped} optimizer steps in a row were skipped for "
            "non-finite gradients (optimizer.max_consecutive_skipped_steps="
            f"{role.max_consecutive_skipped}); check optimizer.lr and the rewards/data. "
            "The run stops; its last checkpoint is unchanged")
    enough = role.num_steps >= MIN_STEPS_FOR_FRACTION or (
        final and role.num_steps > 0 and not unwrap(role.model[0]).config.fp16)
    if enough and role.max_skipped_fraction < 1.0 \
            and role.num_skipped_steps / role.num_steps > role.max_skipped_fraction:
        raise RunawayError(
            f"{name}: {role.num_skipped_steps} of {role.num_steps} optimizer steps were "
            "skipped for non-finite gradients (optimizer.max_skipped_fraction="
            f"{role.max_skipped_fraction}); check optimizer.lr and the rewards/data")


def ensure_optimizer_state(optimizer) -> None:
    """Give a distributed optimizer that never stepped (every step so far skipped, or a
    fresh one about to load) its Adam state, which megatron's (sharded) state dict needs
    (``assert len(steps) == 1``). One step with zero gradients, zero learning rate and no
    weight decay, then the step counters back to 0: weights and the next real step are as
    if it never happened."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None or len(inner.state) or \
                not hasattr(opt, "_init_optimizer_states_with_dummy_values"):
            continue
        saved = [(g["lr"], g.get("weight_decay", 0.0)) for g in inner.param_groups]
        for g in inner.param_groups:
            g["lr"], g["weight_decay"] = 0.0, 0.0
        opt._init_optimizer_states_with_dummy_values()
        for g, (lr, wd) in zip(inner.param_groups, saved):
            g["lr"], g["weight_decay"] = lr, wd
        for state in inner.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"].zero_()
            elif "step" in state:
                state["step"] = 0


def build_optimizer(opt: OptimizerConfig, model: list, *, lr: float, total_steps: int,
                    pg_collection=None) -> tuple[Any, OptimizerParamScheduler]:
    params_dtype = model[0].config.params_dtype
    mcfg = MegatronOptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=min(opt.min_lr, lr),
        weight_decay=opt.weight_decay,
        decoupled_weight_decay=opt.optimizer == "adamw",
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        adam_eps=opt.adam_eps,
        clip_grad=opt.clip_grad,
        use_distributed_optimizer=opt.use_distributed_optimizer,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        params_dtype=params_dtype,
    )
    # A role's own groups (pg_collection) exclude megatron's gloo side groups.
    optimizer = get_megatron_optimizer(mcfg, model, pg_collection=pg_collection,
                                       use_gloo_process_groups=pg_collection is None)
    if speedups.enabled("fused_adam"):
        fused_adam.use_fused_torch_adam(optimizer)
    decay_steps = max(total_steps, opt.warmup_steps + 1)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if opt.warmup_steps else lr, max_lr=lr,
        min_lr=min(opt.min_lr, lr), lr_warmup_steps=opt.warmup_steps,
        lr_decay_steps=decay_steps, lr_decay_style=opt.lr_schedule,
        start_wd=opt.weight_decay, end_wd=opt.weight_decay, wd_incr_steps=decay_steps,
        wd_incr_style="constant")
    return optimizer, scheduler


@cpu_backend.at_megatron()
def forward_backward(role: TrainedRole, forward_step: Callable, microbatches: list, *,
                     seq_length: int, micro_batch_size: int) -> list:
    """Zero the gradients, then forward/backward every micro-batch through the pipeline
    schedule; gradients end reduced over data-parallel ranks and divided by the number of
    loss tokens. Returns the last stage's loss-function logs."""
    for chunk in role.model:
        # Chunks change mode whole (train() walks every module), but the forward-only
        # passes put the bare model in eval mode under its DDP wrapper: ask the model.
        if not unwrap(chunk).training:
            chunk.train()
        chunk.zero_grad_buffer()
    with cpu_backend.suspended():  # megatron's zero_grad only sets .grad attributes
        role.optimizer.zero_grad()
    return run_schedule(role.model, forward_step, microbatches, layout=role.layout,
                        seq_length=seq_length,
                        micro_batch_size=micro_batch_size, forward_only=False)


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


@torch.no_grad()
@cpu_backend.at_megatron()
def prepare_step(role: TrainedRole) -> tuple[bool, float]:
    """Unscale (fp16) and measure the global gradient norm. Returns (finite, norm); the
    norm is reduced over all ranks holding the model, so every rank gets the same verdict.
    megatron's fp32 optimizer never reports non-finite gradients itself; the norm does."""
    with cpu_backend.suspended():  # grads to main grads (and unscale): names no device
        found_inf = bool(role.optimizer.prepare_grads())
    norm = float(role.optimizer.get_grad_norm()) if not found_inf else float("inf")
    return (not found_inf and math.isfinite(norm)), norm


@torch.no_grad()
@cpu_backend.at_megatron()
def apply_step(role: TrainedRole, grad_norm: float) -> None:
    """Clip by the measured norm and step (as megatron's ChainedOptimizer.step does).
    megatron's clip scales only when ``clip_grad / (norm + 1e-6) < 1``; otherwise its loop
    over the parameters does nothing, so it is not called."""
    for opt in _sub_optimizers(role.optimizer):
        max_norm = opt.config.clip_grad
        if max_norm <= 0.0 or max_norm / (grad_norm + 1.0e-6) >= 1.0:
            continue
        params = opt.get_parameters()
        if params:
            clip_grad_by_total_norm_fp32(params, max_norm=max_norm, total_norm=grad_norm)
    role.optimizer.step_with_ready_grads()
    role.scheduler.step(increment=1)


def step_together(roles: list[TrainedRole]) -> tuple[bool, list[float]]:
    """One optimizer step for every role, or for none: when any role's gradients are not
    finite, all skip (PPO: actor and critic together) and each counts a skipped step."""
    verdicts = [prepare_step(role) for role in roles]
    ok = all(finite for finite, _ in verdicts)
    for role, (_, norm) in zip(roles, verdicts):
        role.num_steps += 1
        if ok:
            apply_step(role, norm)
            role.consecutive_skipped = 0
        else:
            role.num_skipped_steps += 1
            role.consecutive_skipped += 1
    return ok, [norm for _, norm in verdicts]


@watchdog.labelled("training step")
def train_step(role: TrainedRole, forward_step: Callable, microbatches: list, *,
               seq_length: int, micro_batch_size: int) -> tuple[list, bool, float]:
    """Forward/backward over ``microbatches`` and one optimizer step (skipped and counted
    when the gradients are not finite). Returns (logs, applied, gradient norm)."""
    logs = forward_backward(role, forward_step, microbatches, seq_length=seq_length,
                            micro_batch_size=micro_batch_size)
    applied, norms = step_together([role])
    return logs, applied, norms[0]
