"""The one role builder: any role (actor, critic, reference, reward model, SFT policy, ...)
at its own layout - process groups, model chunks, seeded init, checkpoint load, then frozen
or wrapped in megatron DDP with its own (distributed) optimizer and LR schedule."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megarlhf.engine.checkpoint import RoleState, base_of, load_checkpoint, read_meta
from megarlhf.engine.optimizer import TrainedRole, build_optimizer, wrap_ddp
from megarlhf.roles.spec import RoleSpec
from megarlhf.models import lora
from megarlhf.models.gpt import build_model, fold_head_affine, init_weights
from megarlhf.parallel.launch import compute_device
from megarlhf.parallel.layout import RankLayout, build_layout
from megarlhf.parallel import cpu_backend


@dataclass
class Role:
    """A built role: its spec, layout, bare model chunks and, when trained, the DDP-wrapped
    chunks with optimizer and schedule."""

    spec: RoleSpec
    layout: RankLayout
    chunks: list  # bare model chunks (one, or VPP chunks)
    trained: TrainedRole | None = None
    saved: dict = dataclasses.field(default_factory=dict)  # the checkpoint's entry (RM gain)
    source: str = ""
    base: dict | None = None  # LoRA: the whole checkpoint its frozen base weights came from

    @property
    def model(self) -> list:
        """What runs through the pipeline schedule (DDP-wrapped when trained)."""
        return self.trained.model if self.trained is not None else self.chunks

    @property
    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for chunk in self.chunks for p in chunk.parameters()]

    def state(self, adapters_only: bool = False) -> RoleState:
        """What this role contributes to a checkpoint (with its kind and model); with
        ``adapters_only`` (``checkpoint.adapters_only``) a LoRA role whose base came from a
        checkpoint gives what trains only, naming that base."""
        extra = {"kind": self.spec.kind, "model": dataclasses.asdict(self.spec.model)}
        base = self.base if adapters_only else None
        if self.trained is None:
            return RoleState(self.chunks, extra=extra, base=base)
        return RoleState(self.trained.model, self.trained.optimizer, self.trained.scheduler,
                         extra, base=base)


def build_chunks(spec: RoleSpec, layout: RankLayout) -> list:
    """This rank's model chunks of ``spec`` (one, or ``vpp`` for the interleaved schedule),
    on this process's compute device (megatron builds them on the host:
    ``use_cpu_initialization``)."""
    vpp = layout.vpp or 1
    device = compute_device()
    return [build_model(spec.model, kind=spec.kind, padded_vocab=spec.padded_vocab,
                        layout=layout.layout, pg_collection=layout.pg_collection,
                        pre_process=layout.is_first_stage and vp_stage == 0,
                        post_process=layout.is_last_stage and vp_stage == vpp - 1,
                        vp_stage=vp_stage if layout.vpp else None).to(device)
            for vp_stage in range(vpp)]


@cpu_backend.at_megatron()
def build_role(spec: RoleSpec, *, seed: int, total_steps: int = 1) -> Role:
    """Build ``spec`` on its own process groups: seeded init (the same global weights at
    every layout), then its checkpoint when it has one; frozen roles are put in eval mode
    without gradients, trained roles get DDP + optimizer + LR schedule over
    ``total_steps``. Every rank must build the same roles in the same order."""
    layout = build_layout(spec.layout)
    if torch.cuda.is_available() or cpu_backend.is_active():
        # megatron's named generator states (on CPU the backend's tracker keeps them)
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(seed, tp_rank=layout.tp_rank, ep_rank=0,
                                        etp_rank=0, force_reset_rng=True)
    chunks = build_chunks(spec, layout)
    for chunk in chunks:
        init_weights(chunk, spec.model, seed)
    role = Role(spec, layout, chunks, source=f"random init (seed {seed})")
    if spec.checkpoint:
        load_checkpoint(spec.checkpoint, {spec.checkpoint_role: RoleState(chunks)},
                        load_optimizer=False, load_rng=False, skip_head=spec.trunk_only)
        role.saved = read_meta(spec.checkpoint)["roles"][spec.checkpoint_role]
        if spec.model.lora.enabled:
            role.base = base_of(spec.checkpoint, spec.checkpoint_role)
        role.source = (f"{spec.checkpoint} role '{spec.checkpoint_role}'"
                       + (" (trunk only; new scalar head)" if spec.trunk_only else ""))
    start = spec.model.lora.init_from
    if start and not (role.saved.get("model") or {}).get("lora", {}).get("rank", 0):
        lora.load_peft(chunks, lora.read_peft(start, spec.model))
        role.source += f"; LoRA adapters from {start}"
    if spec.head_affine is not None:
        fold_head_affine(chunks, *spec.head_affine)
        role.source += " (score normalisation folded into the head)"
    if spec.optimizer is None:
        for chunk in chunks:
            chunk.eval()
            for p in chunk.parameters():
                p.requires_grad_(False)
        return role
    opt_cfg = spec.optimizer
    model = wrap_ddp(chunks, opt_cfg.use_distributed_optimizer, layout.pg_collection)
    optimizer, scheduler = build_optimizer(opt_cfg, model, lr=opt_cfg.lr,
                                           total_steps=total_steps,
                                           pg_collection=layout.pg_collection)
    role.trained = TrainedRole(model, optimizer, scheduler, layout,
                               max_consecutive_skipped=opt_cfg.max_consecutive_skipped_steps,
                               max_skipped_fraction=opt_cfg.max_skipped_fraction)
    return role


def build_from_config(cfg, *, kind: str, trained: bool = False, name: str = "model",
                      total_steps: int = 1, seed: int | None = None) -> Role:
    """The role that ``cfg.model`` / ``cfg.parallel`` (and ``checkpoint.load``) describe,
    on the already started process group - what benchmarks, tools and tests build."""
    import torch.distributed as dist

    from megarlhf.roles.spec import single_role_spec

    spec = single_role_spec(cfg, name=name, kind=kind, world_size=dist.get_world_size(),
                            trained=trained)
    return build_role(spec, seed=cfg.run.seed if seed is None else seed,
                      total_steps=total_steps)
