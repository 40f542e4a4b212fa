"""Megatron DDP, the (distributed) optimizer and the LR schedule for a trained role,
and one training step through the pipeline schedule."""

from __future__ import annotations

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
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megarlhf.config import OptimizerConfig
from megarlhf.engine.schedule import run_schedule


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
    config.finalize_model_grads_func = partial(finalize_model_grads,
                                               pg_collection=pg_collection)
    return wrapped


@dataclass
class TrainedRole:
    """A trained model with its optimizer and schedule."""

    model: list  # DDP-wrapped chunks
    optimizer: Any
    scheduler: OptimizerParamScheduler
    num_skipped_steps: int = 0


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
    optimizer = get_megatron_optimizer(mcfg, model, pg_collection=pg_collection)
    decay_steps = max(total_steps, opt.warmup_steps + 1)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if opt.warmup_steps else lr, max_lr=lr,
        min_lr=min(opt.min_lr, lr), lr_warmup_steps=opt.warmup_steps,
        lr_decay_steps=decay_steps, lr_decay_style=opt.lr_schedule,
        start_wd=opt.weight_decay, end_wd=opt.weight_decay, wd_incr_steps=decay_steps,
        wd_incr_style="constant")
    return optimizer, scheduler


def train_step(role: TrainedRole, forward_step: Callable, microbatches: list, *,
               seq_length: int, micro_batch_size: int) -> tuple[list, bool, float]:
    """Forward/backward over ``microbatches`` and one optimizer step.

    Returns (the loss functions' logs from the last stage, whether the step was applied,
    the gradient norm). A step with non-finite gradients is skipped and counted."""
    for chunk in role.model:
        chunk.train()
        chunk.zero_grad_buffer()
    role.optimizer.zero_grad()
    logs = run_schedule(role.model, forward_step, microbatches, seq_length=seq_length,
                        micro_batch_size=micro_batch_size, forward_only=False)
    applied, grad_norm, _ = role.optimizer.step()
    if applied:
        role.scheduler.step(increment=1)
    else:
        role.num_skipped_steps += 1
    return logs, bool(applied), float(grad_norm) if grad_norm is not None else float("nan")
