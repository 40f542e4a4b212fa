"""Mixture-of-experts models on megatron-core's MoE layer: ``model.moe`` mapped onto
``TransformerConfig``, and what megatron-core 0.16.1 needs to run that layer without
TransformerEngine or CUDA.

The layer is megatron's own (``MoELayer``: ``TopKRouter``, a token dispatcher, the experts
as ``SequentialMLP`` or, on a GPU with grouped GEMM, ``TEGroupedMLP``), chosen per layer by
megatron's block spec (``first_k_dense`` dense layers, then MoE). Expert parallelism uses
the role's expert groups (``parallel.layout``). On CPU the dispatcher is the all-gather
one: the all-to-all dispatcher creates a CUDA stream in its constructor. Tokens are
gathered over the expert-parallel group with gloo, each rank runs its own experts, and the
outputs are reduce-scattered back.
"""

from __future__ import annotations

import contextlib

import torch

from megarlhf.config import Layout, ModelConfig


def transformer_fields(model: ModelConfig, layout: Layout) -> dict:
    """``TransformerConfig`` keyword arguments of ``model.moe`` at ``layout`` (none for a
    dense model).

    Under context parallelism each rank's routers see its part of every sequence, and
    megatron weighs a rank's auxiliary losses by its own token count while megarlhf's
    reduction over DP x CP divides by a token count every CP rank counted in full
    (``parallel.context.gather_sequence``): the losses' gradients would be 1/CP of one
    process's. The coefficients megatron gets are therefore CP times the configured ones;
    it logs each loss divided by its coefficient, so the metrics do not change."""
    moe = model.moe
    if not moe.enabled:
        return {}
    cuda = torch.cuda.is_available()
    balancing = "aux_loss" if moe.aux_loss_coeff > 0 else "none"
    cp = layout.cp
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=model.expert_ffn_size,
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size or None,
        moe_router_score_function=moe.score_function,
        # megatron's softmax router takes the top k of the logits and a softmax over those
        # k: the chosen experts' softmax scores renormalised. Without renormalising, the
        # softmax over all experts comes first ("pre-softmax").
        moe_router_pre_softmax=moe.score_function == "softmax" and not moe.normalize_top_k,
        moe_router_topk_scaling_factor=moe.top_k_scaling_factor,
        moe_router_num_groups=moe.num_groups,
        moe_router_group_topk=moe.group_top_k,
        moe_router_dtype="fp32" if moe.router_fp32 else None,
        moe_router_enable_expert_bias=moe.expert_bias,
        moe_router_bias_update_rate=moe.expert_bias_update_rate,
        moe_layer_freq=[0] * moe.first_k_dense + [1] * (model.num_layers - moe.first_k_dense),
        moe_router_load_balancing_type=balancing,
        moe_aux_loss_coeff=moe.aux_loss_coeff * cp,
        moe_z_loss_coeff=moe.z_loss_coeff * cp or None,
        moe_expert_capacity_factor=moe.capacity_factor,
        moe_token_drop_policy=moe.drop_policy,
        moe_token_dispatcher_type="alltoall" if cuda else "allgather",
        moe_grouped_gemm=False,
        moe_enable_routing_replay=True,  # idle unless rollout.routing_replay asks
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
    )


def prepare_megatron() -> None:
    """What megatron-core 0.16.1's MoE layer needs beyond its constructor arguments:

    - ``moe_utils`` names ``te_general_gemm`` only when TransformerEngine imports, and its
      router gating reads the name unconditionally (a ``NameError`` without TE); it is
      defined as None, which selects the router's own torch matmul;
    - the all-gather dispatcher gathers into megatron's global memory buffer (an allocator,
      not a process group), which ``parallel_state`` creates only when it initialises
      model parallelism: it is created here, once;
    - multi-latent attention (no TE needed) believes TE is there when its import
      succeeded with TE's classes as mocks, and then calls ``isinstance`` on a mock: it is
      told the truth.
    Called for MoE and MLA models."""
    from megatron.core import parallel_state
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    if multi_latent_attention.HAVE_TE and not isinstance(multi_latent_attention.TELinear,
                                                         type):
        multi_latent_attention.HAVE_TE = False

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()


def clone_biased_expert_outputs(model) -> None:
    """megatron-core 0.16.1's expert MLP adds its second linear's bias in place
    (``output += bias * probs``) to the output of that row-parallel linear, which is its
    input returned as-is when the expert has one tensor-parallel rank - as biased experts
    always have (gpt-oss, ``model.linear_bias``): autograd refuses the in-place change of a
    custom function's view in a training pass. The output is copied first, in passes
    that record gradients only."""
    def cloned(module, args, output):
        if not torch.is_grad_enabled():
            return None
        out, bias = output
        return out.clone(), bias

    for name, module in model.named_modules():
        if name.endswith("linear_fc2") and ".experts." in f".{name}" \
                and getattr(module, "bias", None) is not None:
            module.register_forward_hook(cloned)


_DROPS: dict[int, list[int]] = {}  # layer -> [dropped, routed] (token, expert) choices


def drop_counting_router():
    """megatron's ``TopKRouter`` counting, in training passes, the (token, expert) choices
    its capacity limit (``model.moe.capacity_factor``) drops, for :func:`take_losses`;
    used in the block spec only when a capacity is set."""
    global _DropCountingRouter
    if _DropCountingRouter is None:
        from megatron.core.transformer.moe.router import TopKRouter

        class DropCountingRouter(TopKRouter):
            def routing(self, logits, padding_mask=None):
                probs, routing_map = super().routing(logits, padding_mask)
                if self.training and self.config.moe_expert_capacity_factor is not None:
                    routed = logits.numel() // self.config.num_moe_experts * self.topk
                    counts = _DROPS.setdefault(self.layer_number - 1, [0, 0])
                    counts[0] += routed - int(routing_map.sum())
                    counts[1] += routed
                return probs, routing_map

        _DropCountingRouter = DropCountingRouter
    return _DropCountingRouter


_DropCountingRouter = None


def biased_routers(model) -> list:
    """The routers with an expert bias in ``model`` (a list of chunks, DDP-wrapped or
    bare, or one model)."""
    out = []
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        while hasattr(chunk, "module"):
            chunk = chunk.module
        out += [m for m in chunk.modules() if getattr(m, "expert_bias", None) is not None]
    return out


@torch.no_grad()
def update_expert_bias(model, rate: float, group) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing after a step: each router's expert bias
    moves by ``rate`` towards even load (up for an expert chosen less often than the mean
    over the step's training passes, down for one chosen more; megatron's formula), the
    counts summed over ``group`` - the role's TP x DP x CP ranks, as megatron sums them -
    so every rank makes the same move; the counts are then reset. (Tensor-parallel peers
    without sequence parallelism count the same tokens, which scales the counts but not
    the sign of the move; stages hold their own layers.)"""
    import torch.distributed as dist

    routers = biased_routers(model)
    if not routers:
        return
    counts = torch.stack([r.local_tokens_per_expert.float() for r in routers])
    if dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    offset = counts.mean(dim=-1, keepdim=True) - counts
    for router, move in zip(routers, torch.sign(offset) * rate):
        router.expert_bias.add_(move.to(router.expert_bias.dtype))
        router.local_tokens_per_expert.zero_()


def copy_expert_bias(src_chunks: list, dst, pp_group) -> None:
    """The trained model's expert biases into the rollout's inference model (which holds
    every layer), by global layer: each pipeline stage contributes its own layers
    (``pp_group``; every rank calls it). Weights are resharded by megatron; the bias is a
    buffer it does not move."""
    import torch.distributed as dist

    dst_routers = {r.layer_number - 1: r for r in biased_routers(dst)}
    if not dst_routers:
        return
    first = next(iter(dst_routers.values()))
    biases = torch.zeros(max(dst_routers) + 1, first.expert_bias.numel(), dtype=torch.float32)
    for router in biased_routers(src_chunks):
        biases[router.layer_number - 1] = router.expert_bias.float().cpu()
    if dist.get_world_size(pp_group) > 1:
        dist.all_reduce(biases, group=pp_group)
    for layer, router in dst_routers.items():
        router.expert_bias.copy_(biases[layer].to(router.expert_bias))


# megatron's names for the routers' auxiliary losses -> megarlhf's metrics
LOSS_METRICS = {"load_balancing_loss": "moe/aux_loss", "z_loss": "moe/z_loss"}


def take_losses(model: ModelConfig, layout, micro_batches: int) -> dict[str, float]:
    """The auxiliary losses megatron's routers recorded in the training passes since the
    last call (its layer-wise tracker, which is then cleared), as metrics: ``moe/aux_loss``
    and ``moe/z_loss``, each without its coefficient, averaged over the MoE layers, the
    ``micro_batches`` and the data-parallel ranks (``layout``: a RankLayout; under sequence
    and context parallelism put together from the TP and CP ranks' parts of the sequence,
    as megatron's own logging reduces them over its ``tp_cp`` group); with a
    capacity, the fraction of expert choices dropped (``moe/dropped_frac``, and per layer).
    Every rank of the layout calls it (the sums over pipeline stages and replicas are
    collectives)."""
    if not model.moe.enabled:
        return {}
    import torch.distributed as dist
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker)

    tracker = get_moe_layer_wise_logging_tracker()
    wanted = [name for name, on in (("load_balancing_loss", model.moe.aux_loss_coeff > 0),
                                    ("z_loss", model.moe.z_loss_coeff > 0)) if on]
    out = {}
    moe_layers = model.num_layers - model.moe.first_k_dense
    for name in wanted:  # every rank reduces the same names (a stage may hold no MoE layer)
        values = tracker[name]["values"].detach().float().clone() if name in tracker \
            else torch.zeros(model.num_layers)
        for group in _sequence_split(layout):  # each rank's loss covers its part: the
            # load-balancing loss is a part of the whole's (its sum), the z-loss a mean
            dist.all_reduce(values, group=group)
            if name == "z_loss":
                values /= group.size()
        if layout.pp > 1:  # each stage holds its own layers' values
            dist.all_reduce(values, group=layout.pp_group)
        if layout.dp > 1:
            dist.all_reduce(values, group=layout.dp_group)
            values /= layout.dp
        out[LOSS_METRICS[name]] = float(values.sum()) / (moe_layers * max(micro_batches, 1))
    clear_aux_losses_tracker()
    if model.moe.capacity_factor is not None:
        out.update(_take_drops(model, layout))
    return out


def _sequence_split(layout) -> list:
    """The groups whose ranks route other parts of each sequence: TP under sequence
    parallelism, CP."""
    return [group for on, group in ((layout.layout.sp, layout.tp_group),
                                    (layout.cp > 1, layout.cp_group)) if on]


def _take_drops(model: ModelConfig, layout) -> dict[str, float]:
    """``moe/dropped_frac[/layer<i>]``: the (token, expert) choices the capacity limit
    dropped over those made, per MoE layer and over all, summed over stages, replicas and
    the parts of a split sequence."""
    import torch.distributed as dist

    counts = torch.zeros(model.num_layers, 2, dtype=torch.float64)
    for layer, (dropped, routed) in _DROPS.items():
        counts[layer] += torch.tensor([dropped, routed], dtype=torch.float64)
    _DROPS.clear()
    for size, group in ((layout.pp, layout.pp_group), (layout.dp, layout.dp_group)):
        if size > 1:
            dist.all_reduce(counts, group=group)
    for group in _sequence_split(layout):
        dist.all_reduce(counts, group=group)
    out = {f"moe/dropped_frac/layer{layer}": float(counts[layer, 0] / counts[layer, 1])
           for layer in range(model.moe.first_k_dense, model.num_layers) if counts[layer, 1]}
    total = counts.sum(dim=0)
    if total[1]:
        out["moe/dropped_frac"] = float(total[0] / total[1])
    return out


# Routing replay: megatron's routers (``moe_enable_routing_replay``) record the experts
# they choose or take given ones, per router. A model's routers are walked here (not
# megatron's process-wide list: the actor, the reference and the rollout's model are all
# in one process).


def _sequence_group(model):
    """The TP group a model's sequence is split over (sequence parallelism), else None."""
    while hasattr(model, "module"):
        model = model.module
    if not model.config.sequence_parallel:
        return None
    return model.pg_collection.tp


def _routers(model) -> list:
    """``(layer index, RouterReplay)`` of the model's MoE routers (a DDP-wrapped or bare
    chunk; layer indices global, 0-based)."""
    from megatron.core.transformer.moe.router import TopKRouter

    while hasattr(model, "module"):
        model = model.module
    return [(m.layer_number - 1, m.router_replay) for m in model.modules()
            if isinstance(m, TopKRouter) and m.router_replay is not None]


@contextlib.contextmanager
def recording(model):
    """Record the experts chosen in one forward pass: yields a function returning
    ``{layer: (tokens, top_k) indices}`` (tokens in the pass's (sequence, batch) order; under
    sequence parallelism every TP rank routes its own part of the sequence, and the parts
    are gathered)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = _routers(model)
    for _, replay in routers:
        replay.clear_indices()
        replay.set_router_replay_action(RouterReplayAction.RECORD)
    group = _sequence_group(model)

    def got():
        out = {layer: replay.get_recorded_indices() for layer, replay in routers}
        if group is None:
            return out
        import torch.distributed as dist
        for layer, idx in out.items():
            parts = [torch.empty_like(idx) for _ in range(group.size())]
            dist.all_gather(parts, idx.contiguous(), group=group)
            out[layer] = torch.cat(parts)
        return out

    try:
        yield got
    finally:
        for _, replay in routers:
            replay.clear_router_replay_action()
            replay.clear_indices()


@contextlib.contextmanager
def replaying(model, routing_BLSK: torch.Tensor | None):
    """One forward pass routing every token to the experts in ``routing_BLSK`` (rows,
    layers, sequence positions, top_k: the rows and positions of the pass's tokens)
    instead of choosing them; nothing changes when it is None."""
    if routing_BLSK is None:
        yield
        return
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = _routers(model)
    B, _, S, k = routing_BLSK.shape
    group = _sequence_group(model)
    part = slice(None) if group is None else \
        slice(group.rank() * S // group.size(), (group.rank() + 1) * S // group.size())
    for layer, replay in routers:
        replay.clear_indices()
        replay.set_target_indices(routing_BLSK[:, layer, part].permute(1, 0, 2)
                                  .reshape(-1, k).long())
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for _, replay in routers:
            replay.clear_router_replay_action()
            replay.clear_indices()


def unrouted(B: int, num_layers: int, S: int, k: int) -> torch.Tensor:
    """``(B, L, S, k)`` int16 routing that sends every token to experts 0..k-1: what a
    position no pass recorded holds (a replay needs k distinct experts everywhere; such
    positions are padding or the last sampled token, whose outputs are never read)."""
    return torch.arange(k, dtype=torch.int16).expand(B, num_layers, S, k).clone()


def spread(routing_BLSK: torch.Tensor, place: torch.Tensor, length: int) -> torch.Tensor:
    """``(B, L, length, k)``: ``routing_BLSK``'s positions at ``place`` of a longer
    sequence (context parallelism's lengthened packed row), the others to experts 0..k-1
    (:func:`unrouted`)."""
    B, L, _, k = routing_BLSK.shape
    return unrouted(B, L, length, k).to(routing_BLSK.dtype).index_copy_(2, place, routing_BLSK)


def routing_of(recorded: dict, B: int, S: int, num_layers: int, k: int) -> torch.Tensor:
    """``(B, L, S, k)`` int16 expert indices of one pass from :func:`recording`'s
    ``{layer: (S * B, k)}`` (dense layers: experts 0..k-1, see :func:`unrouted`)."""
    out = unrouted(B, num_layers, S, k)
    for layer, idx in recorded.items():
        out[:, layer] = idx.reshape(S, B, k).permute(1, 0, 2).to(torch.int16).cpu()
    return out


def to_packed(routing_BLSK: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """The routing of a padded (B, L, S, k) layout for the tokens of a packed row
    (``data.packing.pack_prompt_response``: ``source`` (N,) each token's flat index in the
    (B, S) layout, -1 for padding) -> (1, L, N, k); padding to experts 0..k-1."""
    B, L, S, k = routing_BLSK.shape
    flat = routing_BLSK.permute(0, 2, 1, 3).reshape(B * S, L, k)
    out = flat[source.clamp(min=0)]
    out[source < 0] = unrouted(1, L, 1, k)[0, :, 0]
    return out.permute(1, 0, 2).unsqueeze(0).contiguous()


def from_packed(recorded: dict, source: torch.Tensor, B: int, S: int, k: int) -> dict:
    """:func:`recording`'s ``{layer: (N, k)}`` of a packed row (``source`` as in
    :func:`to_packed`) -> ``{layer: (S * B, k)}`` in the (sequence, batch) order of the
    padded layout a padded pass would have recorded (positions the row did not feed: experts
    0..k-1, see :func:`unrouted`)."""
    real = source >= 0
    s, b = source[real] % S, source[real] // S
    out = {}
    for layer, idx in recorded.items():
        grid = torch.arange(k, dtype=idx.dtype, device=idx.device).repeat(S * B, 1)
        grid[(s * B + b).to(idx.device)] = idx[real.to(idx.device)]
        out[layer] = grid
    return out


_KEPT: list[tuple[torch.Tensor, dict]] = []  # (rows, recorded) of the passes since the take


def keep_routing(rows: torch.Tensor, recorded: dict) -> None:
    """Keep one pass's choices (:func:`recording`'s ``{layer: (S * b, k)}``; ``rows``: the
    ``b`` batch rows it fed, repeats allowed) for :func:`take_routing`."""
    _KEPT.append((rows.cpu(), {layer: idx.detach().cpu() for layer, idx in recorded.items()}))


def take_routing(B: int, num_layers: int, S: int, k: int, layout) -> torch.Tensor:
    """``(B, L, S, k)`` int16: the experts the passes kept since the last call chose for
    every row, position and MoE layer (dense layers: see :func:`unrouted`), on every rank
    of ``layout`` (a RankLayout: each pipeline stage kept its own layers and each
    data-parallel replica its own rows; every rank of the layout calls it); then cleared."""
    import torch.distributed as dist

    out = torch.full((B, num_layers, S, k), -1, dtype=torch.int32)
    for rows, recorded in _KEPT:
        for layer, idx in recorded.items():
            out[rows, layer] = idx.reshape(S, rows.numel(), k).permute(1, 0, 2).to(torch.int32)
    _KEPT.clear()
    for size, group in ((layout.pp, layout.pp_group), (layout.dp, layout.dp_group)):
        if size > 1:  # one rank of the group set each entry; the others hold -1
            dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return torch.where(out < 0, unrouted(B, num_layers, S, k).to(torch.int32), out) \
        .to(torch.int16)


def same_experts(a_BLSK: torch.Tensor, b_BLSK: torch.Tensor) -> torch.Tensor:
    """``(B, L, S)`` bool: the two routings chose the same set of experts (order aside)."""
    return (a_BLSK.sort(dim=-1).values == b_BLSK.sort(dim=-1).values).all(dim=-1)


_MISMATCH = {"tokens": 0, "differ": 0}  # (token, MoE layer) pairs since the last take


def count_mismatch(recorded: dict, rollout_BLSK: torch.Tensor, mask_BS: torch.Tensor) -> None:
    """Count the real tokens (``mask_BS``) of one pass that a layer sent to other experts
    than the rollout did (``rollout_BLSK``), for :func:`take_mismatch`."""
    B, _, S, k = rollout_BLSK.shape
    if not recorded:
        return
    layers = sorted(recorded)
    mine = routing_of(recorded, B, S, rollout_BLSK.shape[1], k)[:, layers]
    same = same_experts(mine, rollout_BLSK[:, layers])  # (B, L', S)
    real = mask_BS[:, :S].bool().unsqueeze(1).expand_as(same)  # (a lengthened batch's mask)
    _MISMATCH["tokens"] += int(real.sum())
    _MISMATCH["differ"] += int((~same & real).sum())


def take_mismatch(layout) -> dict[str, float]:
    """``moe/routing_mismatch_frac``: the fraction of (token, MoE layer) pairs of the
    actor's first training-side pass routed to other experts than in the rollout, summed
    over this layout's pipeline stages and data-parallel replicas (every rank of the
    layout calls it); then reset."""
    import torch.distributed as dist

    counts = torch.tensor([_MISMATCH["differ"], _MISMATCH["tokens"]], dtype=torch.float64)
    if layout.pp > 1:
        dist.all_reduce(counts, group=layout.pp_group)
    if layout.dp > 1:
        dist.all_reduce(counts, group=layout.dp_group)
    _MISMATCH.update(tokens=0, differ=0)
    return {"moe/routing_mismatch_frac": float(counts[0] / counts[1]) if counts[1] else 0.0}


def load_metrics(routing_BLSK: torch.Tensor, mask_BS: torch.Tensor, model: ModelConfig
                 ) -> dict[str, float]:
    """How evenly the rollout spread its tokens over each MoE layer's experts: per layer,
    the busiest expert's token count over the mean count (1: perfectly even; k experts per
    token each count once), as ``moe/load_imbalance/layer<i>``, and their mean over the
    layers as ``moe/load_imbalance``. ``mask_BS``: the tokens the rollout fed."""
    E = model.moe.num_experts
    out = {}
    real = mask_BS.bool()
    for layer in range(model.moe.first_k_dense, model.num_layers):
        chosen = routing_BLSK[:, layer][real].long().reshape(-1)  # (tokens x k,)
        counts = torch.bincount(chosen, minlength=E).double()
        if counts.sum() > 0:
            out[f"moe/load_imbalance/layer{layer}"] = float(counts.max() / counts.mean())
    if out:
        out["moe/load_imbalance"] = sum(out.values()) / len(out)
    return out
