"""The training layout (``parallel``) and a role's layout on top of it
(``roles.<name>.parallel``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megarlhf.config.fields import require
from megarlhf.config.layout import Layout


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """Tensor-parallel size of the training layout."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size of the training layout."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline stage (interleaved 1F1B schedule); None disables."""
    expert_model_parallel_size: int = 1
    """Expert-parallel size: a mixture-of-experts model's experts are split over this many
    ranks (each holds num_experts / EP); the world must be a multiple of it x
    expert_tensor_parallel_size x pipeline_model_parallel_size."""
    expert_tensor_parallel_size: int | None = None
    """Tensor-parallel size inside each expert; None: tensor_model_parallel_size."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (needs tensor_model_parallel_size > 1): the parts
    of each layer that TP does not split (norms, dropout, residual adds) work on 1/TP of
    the sequence, so their activations shrink by TP; the linears gather and reduce-scatter
    along the sequence in place of TP's all-reduce. Required to train a mixture of experts
    at TP > 1. Micro-batches are lengthened to a multiple of TP (positions no loss reads).
    The rollout's KV-cached decode never uses it (one token a step)."""
    context_parallel_size: int = 1
    """Context parallelism: each sequence is split over this many ranks along its
    positions (2 x CP chunks, an early one with a late one on each rank, megatron's
    load-balanced split) and attention gathers the keys and values of the others, so a
    layer's activations shrink by CP. Micro-batches are lengthened to a multiple of 2 x CP
    (x TP under sequence parallelism; a packed one sample by sample); the outputs are put
    back together for the losses. Gradients are reduced over DP x CP. A mixture of
    experts routes each rank's part (its experts split over TP x CP x DP ranks, EP
    included; a replayed routing split the same way). The rollout's inference layout
    stays at CP = 1 (a decode step has one position)."""
    make_vocab_size_divisible_by: int = 128
    """The vocabulary is padded to a multiple of this times the TP size."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend. With CUDA, ``auto`` and ``nccl`` are NCCL for tensors on
    the GPU plus gloo for host-side bookkeeping (``cuda:nccl,cpu:gloo``); without CUDA,
    ``auto`` and ``gloo`` are gloo."""
    timeout_minutes: float = 30.0
    """How long a rank waits for the others: the timeout of every process group (the
    default one and each role's) and the watchdog's deadline for a rank that stopped
    answering, after which every live rank exits naming the phase and the silent ranks
    (``parallel/watchdog.py``)."""

    def __post_init__(self):
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "make_vocab_size_divisible_by", "expert_model_parallel_size",
                     "context_parallel_size"):
            require(getattr(self, name) >= 1, f"parallel.{name}", getattr(self, name),
                    "must be >= 1")
        require(self.timeout_minutes > 0, "parallel.timeout_minutes", self.timeout_minutes,
                "must be > 0")
        if self.expert_tensor_parallel_size is not None:
            require(self.expert_tensor_parallel_size >= 1, "parallel.expert_tensor_parallel_size",
                    self.expert_tensor_parallel_size, "must be >= 1 or null")
        require(not self.sequence_parallel or self.tensor_model_parallel_size > 1,
                "parallel.sequence_parallel", self.sequence_parallel,
                "needs tensor_model_parallel_size > 1 (it splits the sequence over the "
                "tensor-parallel ranks)")

    @property
    def layout(self) -> Layout:
        """The training layout this section writes."""
        tp = self.tensor_model_parallel_size
        return Layout(tp=tp, pp=self.pipeline_model_parallel_size,
                      vpp=self.virtual_pipeline_model_parallel_size,
                      ep=self.expert_model_parallel_size,
                      etp=self.expert_tensor_parallel_size, sp=self.sequence_parallel,
                      cp=self.context_parallel_size)


@dataclass(kw_only=True, frozen=True)
class RoleParallelConfig:
    tensor_model_parallel_size: int | None = None
    """Tensor-parallel size of this role; None: the actor's."""
    pipeline_model_parallel_size: int | None = None
    """Pipeline-parallel size of this role; None: the actor's."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline stage; None: the actor's when this role keeps the actor's
    pipeline size, otherwise off; 1: off."""
    expert_model_parallel_size: int | None = None
    """Expert-parallel size of this role (a mixture-of-experts model); None: the actor's
    when this role's model has experts, else 1."""
    expert_tensor_parallel_size: int | None = None
    """Tensor-parallel size inside this role's experts; None: its tensor-parallel size."""
    sequence_parallel: bool | None = None
    """Sequence parallelism for this role (``parallel.sequence_parallel``); None: the
    actor's while this role's TP > 1, else off."""
    context_parallel_size: int | None = None
    """Context-parallel size of this role (``parallel.context_parallel_size``); None: the
    actor's."""

    def __post_init__(self):
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "virtual_pipeline_model_parallel_size", "expert_model_parallel_size",
                     "expert_tensor_parallel_size", "context_parallel_size"):
            value = getattr(self, name)
            if value is not None:
                require(value >= 1, f"parallel.{name}", value, "must be >= 1 or null")

    def over(self, base: Layout, experts: bool = True) -> Layout:
        """``base`` (the actor's layout) with the sizes this role writes on top; VPP is
        kept only while PP is (``vpp: 1`` turns it off). ``experts``: the role's model has
        experts (otherwise EP is 1 unless written)."""
        tp = self.tensor_model_parallel_size or base.tp
        pp = self.pipeline_model_parallel_size or base.pp
        if self.virtual_pipeline_model_parallel_size is not None:
            vpp = self.virtual_pipeline_model_parallel_size
            vpp = None if vpp == 1 else vpp
        else:
            vpp = base.vpp if pp == base.pp else None
        ep = self.expert_model_parallel_size or (base.ep if experts else 1)
        etp = self.expert_tensor_parallel_size or base.etp
        sp = self.sequence_parallel if self.sequence_parallel is not None \
            else base.sp and tp > 1
        return Layout(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, sp=sp,
                      cp=self.context_parallel_size or base.cp)
