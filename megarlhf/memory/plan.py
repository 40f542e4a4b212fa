"""Memory per rank before anything is built: ``megarlhf plan``.

For every role, phase and rank the planner predicts what :mod:`memory.accounting` measures:

- **exact** (equal to the measured bytes): parameters (with the distributed optimizer, the
  padded contiguous buffer megatron allocates), gradient buffers (fp32, padded the same
  way), optimizer state (Adam's two moments and step per parameter shard, fp32 master
  copies of low-precision weights), the inference model, the KV cache;
- **estimated**: activations saved for backward (per-layer terms of this implementation's
  layers, times the micro-batches a pipeline stage holds), and transient forward buffers
  (logits) of the experience passes and of generation, which CPU runs do not measure.

Phases and what is resident in each mirror the PPO loop and ``RoleConfig.offload``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from megarlhf import speedups
from megarlhf.config import (
    Config, ConfigError, Layout, RecomputeConfig, Written, check_model_layout, check_placement,
    padded_vocab_size)
from megarlhf.data.packing import MIN_ROWS
from megarlhf.roles.offload import LEVEL_PARTS, OFFLOAD_LEVELS
from megarlhf.roles.spec import RoleSpec, batch_sizes, ppo_role_specs
from megarlhf.models.shapes import ParamShape, rank_chunks

PHASES = ("rollout", "experience", "train", "save")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 2**30


def parse_bytes(text: str) -> int:
    """'80GiB', '80GB', '81920MiB', '85899345920' -> bytes (GB is 10^9, GiB 2^30)."""
    units = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
    raw = text.strip().lower().replace(" ", "")
    num = raw.rstrip("kmgtib")
    unit = raw[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise ConfigError(f"memory size {text!r}: write a positive number with a unit, "
                          "e.g. 80GiB or 141GB")
    return int(value * units[unit])


# ------------------------------------------------------------------ exact parts

def ddp_buffer(params: list[ParamShape], dp: int, distributed: bool
               ) -> tuple[int, dict[str, tuple[int, int]], list[tuple[int, int]]]:
    """megatron DDP's contiguous buffer for one chunk (bucketing off, as megarlhf builds
    it): (padded numel, {name: (start, end)}, buckets). Parameters are laid out in
    reverse order; with the distributed optimizer each starts 64-aligned, a shared
    embedding gets its own bucket, and buckets end on a multiple of lcm(DP, 128)."""
    def pad(n: int, d: int) -> int:
        return -(-n // d) * d

    end_pad = math.lcm(dp, 128) if distributed else 1
    index: dict[str, tuple[int, int]] = {}
    buckets: list[tuple[int, int]] = []
    start = bucket_start = 0
    in_bucket = 0
    end = 0

    def close(at: int) -> int:
        nonlocal bucket_start, in_bucket
        stop = pad(at, end_pad)
        buckets.append((bucket_start, stop))
        bucket_start, in_bucket = stop, 0
        return stop

    for p in reversed(params):
        if distributed:
            start = pad(start, 64)
        own = p.shared_embedding and distributed
        if own and in_bucket:
            start = close(start)
        end = start + p.numel
        index[p.name] = (start, end)
        in_bucket += 1
        start = close(end) if own else end
    if in_bucket:
        close(end)
    return (buckets[-1][1] if buckets else 0), index, buckets


def static_bytes(spec: RoleSpec, dp: int, pp_rank: int, dp_rank: int) -> dict[str, int]:
    """This rank's parameters, gradients and optimizer state of a built role (a frozen
    role: parameters only; optimizer state as after the first step)."""
    dsize = DTYPE_BYTES[spec.model.params_dtype]
    chunks = rank_chunks(spec.model, kind=spec.kind, padded_vocab=spec.padded_vocab,
                         layout=spec.layout, pp_rank=pp_rank)
    if spec.optimizer is None:
        return {"params": sum(p.numel for chunk in chunks for p in chunk) * dsize}
    distributed = spec.optimizer.use_distributed_optimizer
    out = {"params": 0, "grads": 0, "optimizer": 0}
    master = 4 if dsize != 4 else 0  # fp32 master copy of a low-precision weight
    for chunk in chunks:
        numel, index, buckets = ddp_buffer(chunk, dp, distributed)
        out["grads"] += numel * 4  # grad_reduce_in_fp32
        if not distributed:
            out["params"] += sum(p.numel for p in chunk) * dsize
            out["optimizer"] += sum((8 + master) * p.numel + 4 for p in chunk)
            continue
        out["params"] += numel * dsize
        for b_start, b_end in buckets:
            shard = (b_end - b_start) // dp
            lo, hi = b_start + dp_rank * shard, b_start + (dp_rank + 1) * shard
            for start, end in index.values():
                if b_start <= start < b_end:
                    n = max(0, min(end, hi) - max(start, lo))
                    if n:
                        out["optimizer"] += (8 + master) * n + 4  # exp_avg, exp_avg_sq, step
    return out


def kv_cache_bytes(model, *, tp: int, batch: int, seq: int) -> int:
    """megatron's static KV cache: key and value, (seq, batch, groups / TP, head dim) per
    layer, in the model's dtype; multi-latent attention caches the up-projected keys
    (heads / TP, its query/key width with the rotary part) and values (heads / TP, its
    value width)."""
    if model.mla.enabled:
        mla = model.mla
        per_token = (model.num_attention_heads // tp) * (
            mla.qk_head_dim + mla.qk_pos_emb_head_dim + mla.v_head_dim)
    else:
        per_token = 2 * (model.query_groups // tp) * model.head_size
    return model.num_layers * seq * batch * per_token * DTYPE_BYTES[model.params_dtype]


# ------------------------------------------------------------------ estimates

def layer_activation_floats(model, tp: int, batch: int, seq: int, packed: bool = False
                            ) -> float:
    """Values one transformer layer of this implementation keeps for backward per token
    (local layers, SDPA): norms and residuals whole, attention and MLP split over TP,
    SDPA's float mask (seq per token), RoPE tables (llama). The attention half here, the
    MLP half in :func:`mlp_activation_floats`. Query-sized values are heads x head size
    (hidden, unless ``model.head_dim`` is set). ``packed``: one SDPA call per sample
    (``models.spec.SDPACoreAttention.forward_packed``) keeps no mask but its own
    contiguous copies of each sample's queries, keys and values."""
    h, heads = model.hidden_size, model.num_attention_heads
    kv = model.head_size
    q, gkv = heads * kv, model.query_groups * kv
    if model.arch == "llama":
        whole = 3 * h + 1
        split = 4 * q + 3 * gkv + heads
        rope = 4 * kv / batch
    else:
        whole = h + 2
        split = 3 * q + 2 * gkv + heads
        rope = 0.0
    if model.qk_layernorm:  # the normalised queries and keys
        split += q + gkv
    if packed:
        return whole + (split + q + 2 * gkv) / tp + rope + mlp_activation_floats(model, tp)
    return whole + split / tp + seq + rope + mlp_activation_floats(model, tp)


def mlp_activation_floats(model, tp: int) -> float:
    """The part of :func:`layer_activation_floats` that the MLP half of a layer keeps per
    token: its norm's input and statistics, fc1's input and output, the activation's
    inputs and fc2's input."""
    if model.arch == "llama":
        return 2 * model.hidden_size + 1 + 5 * model.ffn_size / tp
    return 2 * model.hidden_size + 2 + 2 * model.ffn_size / tp


def chunk_activation_bytes(spec: RoleSpec, *, batch: int, seq: int, response: int,
                           layers: int, pre: bool, post: bool, span: int | None = None
                           ) -> float:
    """One micro-batch through one chunk, bytes saved for backward. On the last chunk the
    last layer's MLP and the head run at the ``response`` positions the PPO losses read
    with ``speedups.positions`` (the MLP not with fp8 or recomputation, where the head
    cuts instead);
    without it everything runs at every position and the losses slice the output. A
    packed micro-batch is one row (``batch`` 1) whose samples attend over at most
    ``span`` tokens each (``seq`` when None); packed, the head always runs at the kept
    positions only (``response`` of them)."""
    model, tokens = spec.model, batch * seq
    dsize = DTYPE_BYTES[model.params_dtype]
    cut = speedups.enabled("positions") or span is not None
    layer = layer_activation_floats(model, spec.layout.tp, batch, seq,
                                    packed=span is not None) * tokens * dsize
    total = layers * layer - recomputed_bytes(spec, layer, layers=layers, tokens=tokens)
    # the last MLP is cut, but not under recomputation (its recomputed forward would see
    # no positions)
    if cut and post and layers and not model.fp8.enabled and model.recompute.granularity is None:
        total -= mlp_activation_floats(model, spec.layout.tp) * batch * (seq - response) * dsize
    if pre:
        total += tokens * 8 * (2 if model.arch == "gpt2" else 1)  # token (and position) ids
    if post:
        total += head_activation_bytes(spec, batch=batch, seq=seq, response=response, cut=cut)
    return total


def head_activation_bytes(spec: RoleSpec, *, batch: int, seq: int, response: int, cut: bool
                          ) -> float:
    """The last chunk's final norm and head, bytes saved for backward: their inputs at
    the kept positions with the cut, and an LM's logits and softmax (fp32)."""
    model = spec.model
    dsize = DTYPE_BYTES[model.params_dtype]
    head_tokens = batch * response if cut and not model.fp8.enabled else batch * seq
    total = (3 * model.hidden_size + 2) * head_tokens * dsize + 12 * batch * response * 4
    if spec.kind == "lm":  # the logits (response's, or all) and the softmax, fp32
        rows = response if cut else seq
        total += batch * (rows + response) * (spec.padded_vocab // spec.layout.tp) * 4
    return total


def recomputed_bytes(spec: RoleSpec, layer: float, *, layers: int, tokens: int) -> float:
    """What ``model.recompute`` keeps out of one micro-batch's activations in a chunk of
    ``layers`` layers of ``layer`` bytes each. Full: a group's (uniform) or a recomputed
    layer's (block) activations less its input, which is kept. Selective: the MLP's
    activations but its input (``mlp``); core attention keeps its inputs (queries, keys,
    values and the mask) for the recomputation, which are what SDPA's kernels keep
    anyway, so it saves nothing here."""
    model = spec.model
    recompute = model.recompute
    hidden = model.hidden_size * tokens * DTYPE_BYTES[model.params_dtype]
    if recompute.granularity == "full":
        dropped = layers if recompute.method == "uniform" else min(recompute.num_layers, layers)
        kept_inputs = layers // recompute.num_layers if recompute.method == "uniform" \
            else dropped
        return dropped * layer - kept_inputs * hidden
    if recompute.granularity == "selective" and "mlp" in recompute.modules:
        inner = mlp_activation_floats(model, spec.layout.tp) - 2 * model.hidden_size - 1 \
            if model.arch == "llama" else mlp_activation_floats(model, spec.layout.tp) \
            - 2 * model.hidden_size - 2
        return layers * inner * tokens * DTYPE_BYTES[model.params_dtype]
    return 0.0


def recompute_peak_bytes(spec: RoleSpec, *, micro: int, seq: int, span: int | None = None
                         ) -> float:
    """The activations a recomputation brings back in the backward pass of one
    micro-batch, at most at once: a group of layers (full, uniform), one layer (full,
    block), one layer's MLP (selective ``mlp``)."""
    model = spec.model
    recompute = model.recompute
    layer = layer_activation_floats(model, spec.layout.tp, micro, seq, packed=span is not None) \
        * micro * seq * DTYPE_BYTES[model.params_dtype]
    if recompute.granularity == "full":
        return layer * (recompute.num_layers if recompute.method == "uniform" else 1)
    return recomputed_bytes(spec, layer, layers=1, tokens=micro * seq)


def train_activation_bytes(spec: RoleSpec, *, pp_rank: int, micro: int, micro_batches: int,
                           seq: int, response: int, span: int | None = None) -> float:
    """Peak activations of pipeline rank ``pp_rank``: one micro-batch without a pipeline;
    1F1B holds min(PP - stage, micro-batches); the interleaved schedule holds its warm-up
    of chunk forwards. ``span``: packed (see :func:`chunk_activation_bytes`)."""
    pp, vpp = spec.layout.pp, spec.layout.vpp or 1
    layers = spec.model.num_layers // (pp * vpp)
    per_chunk = [chunk_activation_bytes(
        spec, batch=micro, seq=seq, response=response, layers=layers,
        pre=pp_rank == 0 and v == 0, post=pp_rank == pp - 1 and v == vpp - 1, span=span)
        for v in range(vpp)]
    if pp == 1:
        held = max(per_chunk)
    elif vpp == 1:
        held = per_chunk[0] * min(pp - pp_rank, micro_batches)
    else:
        in_flight = min((pp - pp_rank - 1) * 2 + (vpp - 1) * pp + 1, micro_batches * vpp)
        held = sum(per_chunk) / vpp * in_flight
    # recomputation: a group of layers comes back in the backward pass, by which time the
    # last stage's head has freed its part
    peak = recompute_peak_bytes(spec, micro=micro, seq=seq, span=span)
    if peak and pp_rank == pp - 1:
        cut = speedups.enabled("positions") or span is not None
        peak = max(0.0, peak - head_activation_bytes(spec, batch=micro, seq=seq,
                                                     response=response, cut=cut))
    return held + peak


def prefill_bytes(spec: RoleSpec, *, batch: int, prompt: int) -> float:
    """Transient buffers of generation's prefill (no autograd): one layer's hidden states,
    MLP intermediates and SDPA's masks for the whole prompt, and the last position's
    logits with the sampler's copies (megatron materialises only the last token)."""
    m = spec.model
    dsize = DTYPE_BYTES[m.params_dtype]
    tokens = batch * prompt
    return (tokens * (4 * m.hidden_size + 6 * m.ffn_size / spec.layout.tp) * dsize
            + 5 * batch * prompt * prompt + 5 * batch * spec.padded_vocab * 4)


def packed_shape(budget: int, prompt: int, response: int, kind: str) -> dict:
    """A packed micro-batch of at most ``budget`` tokens as the estimates take it: one row
    of ``budget`` tokens whose samples attend over at most prompt + response tokens each,
    and its most kept outputs: a sample of length L keeps min(L - 1, response) (an LM's
    predictions of response tokens; a value model's one more, at most L), so at most
    ``budget`` - ceil(``budget`` / (response + 1)) (LM) or ``budget`` (value). A row, and
    its kept outputs, are topped up to ``data.packing.MIN_ROWS`` when fewer (a budget that
    small is a test's, not a run's)."""
    kept = budget if kind == "value" else budget - -(-budget // (response + 1))
    return {"batch": 1, "seq": max(budget, MIN_ROWS), "response": max(kept, MIN_ROWS),
            "span": prompt + response}


def forward_bytes(spec: RoleSpec, *, batch: int, seq: int, response: int,
                  span: int | None = None) -> float:
    """Transient buffers of a forward-only pass on the last stage: the fp32 logits at the
    response positions and their softmax (LM), or a few hidden-state copies (value
    model). ``span`` marks a packed micro-batch (:func:`packed_shape`); unused here."""
    if spec.kind == "lm":
        return 2 * batch * response * (spec.padded_vocab // spec.layout.tp) * 4
    return 4 * batch * seq * spec.model.hidden_size * DTYPE_BYTES[spec.model.params_dtype]


# ------------------------------------------------------------------ the plan

@dataclass
class Plan:
    """Bytes per rank: ``ranks[rank][phase][(role, part)]``; ``exact`` names the parts that
    equal measurement; totals follow the tracker's rules (activations of the trained
    roles peak one after the other; in the experience phase offloaded frozen roles are
    resident one at a time)."""

    world: int
    specs: dict[str, RoleSpec]
    rollout_tp: int
    ranks: list[dict[str, dict[tuple[str, str], float]]]
    totals: list[dict[str, float]]
    notes: list[str] = field(default_factory=list)
    # totals as the run's tracker measures them: without the forward-only estimates
    # (generation prefill, experience passes), which only a GPU allocator sees
    measurable: list[dict[str, float]] = field(default_factory=list)
    # rollout.placement.mode=split: the rollout ranks, after the ``world`` training ranks in
    # ``ranks`` and ``totals``
    rollout_ranks: int = 0

    def worst(self) -> tuple[float, int, str]:
        """(bytes, rank, phase) of the largest total."""
        return max((total, rank, phase) for rank, by_phase in enumerate(self.totals)
                   for phase, total in by_phase.items())

    def largest_part(self, rank: int, phase: str) -> tuple[str, str, float]:
        (role, part), value = max(self.ranks[rank][phase].items(), key=lambda kv: kv[1])
        return role, part, value

    def phase_max(self) -> dict[str, dict[tuple[str, str], float]]:
        """Per phase, each (role, part)'s largest value over ranks (what the run's
        memory/* metrics report)."""
        out: dict[str, dict[tuple[str, str], float]] = {p: {} for p in PHASES}
        for by_phase in self.ranks:
            for phase, parts in by_phase.items():
                for key, value in parts.items():
                    out[phase][key] = max(out[phase].get(key, 0.0), value)
        return out


def _resident(spec: RoleSpec, phase: str, part: str) -> bool:
    """Whether ``part`` of ``spec`` stays on the device throughout ``phase`` (offloaded
    frozen roles come on for their own pass in the experience phase, counted apart)."""
    level = spec.offload or "none"
    if not spec.trained:
        return level == "none"
    away = LEVEL_PARTS[level]
    if phase == "rollout":
        return part not in away
    if phase == "experience":
        return part == "params" or part not in away
    return True


def plan_ppo(cfg: Config, world: int, *, specs: dict[str, RoleSpec] | None = None,
             rollout_tp: int | None = None, prompt_len: int | None = None,
             response_len: int | None = None, written: Written | None = None) -> Plan:
    """Predict every rank's memory in every PPO phase. ``prompt_len`` / ``response_len``
    default to the longest the config allows (data.max_prompt_len, rollout.max_new_tokens);
    a measured run passes its batch's own to compare. ``written`` as in
    ``roles.spec.ppo_role_specs``. Under rollout.placement.mode=split the job's last
    rollout.placement.ranks processes only sample: they follow the training ranks."""
    place = cfg.rollout.placement
    split = place.mode == "split"
    if split:
        world = check_placement(cfg, world)
    specs = specs or ppo_role_specs(cfg, world, written=written, planning=True)
    ppo_plan = _PPOPlanner(cfg, world, specs, rollout_tp, prompt_len, response_len, split)
    rows = [ppo_plan.training_rank(rank) for rank in range(world)]
    if split:
        rows += [ppo_plan.rollout_rank(rank) for rank in range(place.ranks)]
    return Plan(world, specs, ppo_plan.inference.layout.tp, [r[0] for r in rows],
                [r[1] for r in rows], ppo_plan.notes(), [r[2] for r in rows],
                rollout_ranks=place.ranks if split else 0)


class _PPOPlanner:
    """One PPO config's shapes - sequence lengths, the inference model, the micro-batches
    of every pass - and each rank's bytes per phase from them: (parts by phase, totals,
    measurable totals)."""

    def __init__(self, cfg: Config, world: int, specs: dict[str, RoleSpec],
                 rollout_tp: int | None, prompt_len: int | None, response_len: int | None,
                 split: bool):
        ppo, r = cfg.ppo, cfg.rollout
        self.r, self.world, self.specs, self.split = r, world, specs, split
        self.P = prompt_len if prompt_len is not None else cfg.data.max_prompt_len
        self.T = response_len if response_len is not None else r.max_new_tokens
        self.S = self.P + self.T
        self.inference = dataclasses.replace(
            specs["actor"], name="inference",
            layout=Layout(tp=rollout_tp or r.tensor_parallel_size), optimizer=None)
        self.ema = dataclasses.replace(specs["actor"], name="ema", optimizer=None) \
            if ppo.ema_decay else None
        self.samples = ppo.rollout_batch_size * ppo.group_size
        self.inf_dp = self.inference.layout.dp(world)
        self.sizes = batch_sizes(ppo, specs, world)  # the updates' micro-batches, per role
        self.budget = ppo.max_tokens_per_micro_batch  # packed updates (None: padded)
        self.micro_batch_size = ppo.micro_batch_size
        self.forward_budget = r.forward_max_tokens_per_micro_batch or self.budget
        self.forward_rows = r.forward_micro_batch_size or ppo.micro_batch_size
        self.eval_prompts = ppo.num_eval_prompts if cfg.data.eval_path else 0
        self._static: dict = {}

    def rollout_kv(self, rows: int) -> float:
        """A replica's KV cache for ``rows`` prompts: one static batch, or continuous
        batching's ``rollout.decode_slots`` rows of its longer columns (inference.continuous)."""
        slots, inf = self.r.decode_slots, self.inference
        if slots is not None and slots < rows:
            return float(kv_cache_bytes(inf.model, tp=inf.layout.tp, batch=slots,
                                        seq=self.P + self.T * (-(-rows // slots) + 1)))
        return float(kv_cache_bytes(inf.model, tp=inf.layout.tp, batch=rows, seq=self.S))

    def static(self, spec: RoleSpec, rank: int) -> dict[str, int]:
        _, d, s = spec.layout.coordinates(rank, self.world)
        key = (spec.name, s, d)
        if key not in self._static:
            self._static[key] = static_bytes(spec, spec.layout.dp(self.world), s, d)
        return self._static[key]

    def training_rank(self, rank: int) -> tuple[dict, dict, dict]:
        r, specs, inference, P, S = self.r, self.specs, self.inference, self.P, self.S
        inf_replica = inference.layout.coordinates(rank, self.world)[1]
        # split: the training ranks generate for evaluation only
        rollout_rows = 0 if self.split else len(range(inf_replica, self.samples, self.inf_dp))
        eval_rows = len(range(inf_replica, self.eval_prompts, self.inf_dp))
        kv = self.rollout_kv(rollout_rows)
        by_phase: dict[str, dict[tuple[str, str], float]] = {p: {} for p in PHASES}
        total: dict[str, float] = {}
        for phase in PHASES:
            parts = by_phase[phase]
            for name, spec in specs.items():
                for part, value in self.static(spec, rank).items():
                    if _resident(spec, phase, part):
                        parts[(name, part)] = float(value)
            if phase == "rollout" or not r.release_inference_weights:
                parts[("inference", "params")] = float(self.static(inference, rank)["params"])
            if self.ema is not None:
                parts[("ema", "params")] = float(self.static(self.ema, rank)["params"])
            total[phase] = sum(parts.values())
        # the KV cache, and generation's prefill buffers (an estimate)
        by_phase["rollout"][("inference", "kv_cache")] = float(kv)
        total["rollout"] += kv
        measurable = dict(total)
        gen_rows = max(min(rollout_rows, r.decode_slots or rollout_rows), eval_rows)
        prefill = prefill_bytes(inference, batch=gen_rows, prompt=P)
        by_phase["rollout"][("inference", "activations")] = prefill
        eval_kv = kv_cache_bytes(inference.model, tp=inference.layout.tp, batch=eval_rows,
                                 seq=S)
        total["rollout"] += prefill + max(0, eval_kv - kv)
        # experience: offloaded frozen roles come on one at a time; one pass's buffers
        frozen_on = [float(self.static(spec, rank)["params"]) for spec in specs.values()
                     if not spec.trained and spec.offload == "all"]
        for name, spec in specs.items():
            if not spec.trained and spec.offload == "all":
                by_phase["experience"][(name, "params")] = \
                    float(self.static(spec, rank)["params"])
        passes = {}
        for name, spec in specs.items():
            _, _, s = spec.layout.coordinates(rank, self.world)
            if s == spec.layout.pp - 1:
                shape = packed_shape(self.forward_budget, P, self.T, spec.kind) \
                    if self.forward_budget else \
                    {"batch": self.forward_rows, "seq": S, "response": self.T}
                passes[name] = forward_bytes(spec, **shape)
                by_phase["experience"][(name, "activations")] = passes[name]
        measurable["experience"] += max(frozen_on, default=0.0)
        total["experience"] += max(frozen_on, default=0.0) + max(passes.values(), default=0.0)
        # train: each trained role's activations, one role at a time
        acts = {name: self.train_activations(spec, rank)
                for name, spec in specs.items() if spec.trained}
        for name, value in acts.items():
            by_phase["train"][(name, "activations")] = value
        total["train"] += max(acts.values(), default=0.0)
        measurable["train"] += max(acts.values(), default=0.0)
        return by_phase, total, measurable

    def train_activations(self, spec: RoleSpec, rank: int) -> float:
        """A trained role's activations in its updates on ``rank``: packed, the heaviest
        rank's tokens at most full samples; padded, its micro-batches of full samples."""
        _, _, s = spec.layout.coordinates(rank, self.world)
        sizes = self.sizes[spec.name]
        if self.budget:
            shape = packed_shape(self.budget, self.P, self.T, spec.kind)
            micro, micro_batches = 1, sizes.most_packed_micro_batches(self.S)
            seq, response, span = shape["seq"], shape["response"], shape["span"]
        else:
            micro, seq, response, span = self.micro_batch_size, self.S, self.T, None
            micro_batches = sizes.micro_batches_per_mini_batch
        return train_activation_bytes(spec, pp_rank=s, micro=micro,
                                      micro_batches=micro_batches, seq=seq,
                                      response=response, span=span)

    def rollout_rank(self, rank: int) -> tuple[dict, dict, dict]:
        """A rollout rank under split placement: the inference model, always resident, its
        KV cache and prefill buffers."""
        inference, ranks = self.inference, self.r.placement.ranks
        r_dp = ranks // inference.layout.tp
        replica = inference.layout.coordinates(rank, ranks)[1]
        rows = len(range(replica, self.samples, r_dp))
        params = float(static_bytes(inference, r_dp, 0, replica)["params"])
        by_phase = {p: {("inference", "params"): params} for p in PHASES}
        kv = self.rollout_kv(rows)
        by_phase["rollout"][("inference", "kv_cache")] = kv
        prefill = prefill_bytes(inference, batch=min(rows, self.r.decode_slots or rows),
                                prompt=self.P)
        by_phase["rollout"][("inference", "activations")] = prefill
        total = {p: params for p in PHASES}
        total["rollout"] += kv
        measurable = dict(total)
        total["rollout"] += prefill
        return by_phase, total, measurable

    def notes(self) -> list[str]:
        micro_note = "; ".join(
            f"{what}: " + (f"packed micro-batches of {b} tokens, each taken full, with the "
                           "most kept outputs its samples can have" if b
                           else f"micro-batch {rows}")
            for what, b, rows in (("updates", self.budget, self.micro_batch_size),
                                  ("experience passes", self.forward_budget,
                                   self.forward_rows)))
        inference, world = self.inference, self.world
        sampling = f"{self.inf_dp} inference replica(s) of TP={inference.layout.tp}"
        if self.split:
            ranks = self.r.placement.ranks
            sampling = (f"{ranks // inference.layout.tp} inference replica(s) of "
                        f"TP={inference.layout.tp} on the {ranks} rollout rank(s) "
                        f"{world}..{world + ranks - 1} (the training ranks keep a copy for "
                        "the weight sync and evaluation)")
        notes = [f"sequences of {self.P} prompt + {self.T} response tokens; {micro_note}; "
                 f"{self.samples} rollout samples over {sampling}"]
        if self.eval_prompts > self.samples and not self.split:
            notes.append(f"evaluation generates for {self.eval_prompts} prompts "
                         "(ppo.num_eval_prompts), more than a rollout: its KV cache is in "
                         "the rollout total")
        return notes


# ------------------------------------------------------------------ reporting

def _unit(worst: float) -> tuple[str, float]:
    return ("GiB", GIB) if worst >= GIB else ("MiB", 2.0**20)


def missing_checkpoints(cfg: Config) -> list[str]:
    """Role checkpoints the config names that are not on this machine: the plan sizes
    those roles from the config's model instead."""
    import os

    named = {f"roles.{name}.checkpoint": getattr(cfg.roles, name).checkpoint
             for name in ("actor", "reference", "reward", "critic")}
    return [f"{k}={v}" for k, v in named.items() if v and not os.path.exists(v)]


def model_params(spec: RoleSpec) -> int:
    """Global parameter count (TP=1, PP=1; the embedding at the padded vocabulary)."""
    (chunk,) = rank_chunks(spec.model, kind=spec.kind, padded_vocab=spec.padded_vocab,
                           layout=Layout(), pp_rank=0)
    return sum(p.numel for p in chunk)


def fits(plan: Plan, capacity: float, headroom: float) -> bool:
    return plan.worst()[0] <= capacity * (1.0 - headroom)


def format_plan(plan: Plan, capacity: float | None, headroom: float) -> str:
    lines = []
    lines.append(f"{'role':10s} {'model':34s} {'layout':22s} offload")
    for name, spec in plan.specs.items():
        m = spec.model
        n = model_params(spec)
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
        model = f"{m.arch} {m.num_layers}x{m.hidden_size} {spec.kind} {size} {m.params_dtype}"
        layout = spec.layout.describe(plan.world)
        opt = ""
        if spec.optimizer is not None:
            opt = " (distributed optimizer)" if spec.optimizer.use_distributed_optimizer \
                else " (plain optimizer)"
        lines.append(f"{name:10s} {model:34s} {layout:22s} {spec.offload}{opt}")
    replicas = (plan.rollout_ranks or plan.world) // plan.rollout_tp
    lines.append(f"inference  rollout TP={plan.rollout_tp}, {replicas} replica(s)"
                 + (f" on {plan.rollout_ranks} rollout rank(s) (placement split)"
                    if plan.rollout_ranks else ""))
    lines += [f"  {n}" for n in plan.notes]
    lines.append("")
    total, rank, phase = plan.worst()
    unit, scale = _unit(total)
    lines.append(f"{unit} per rank (the largest rank per phase); * = estimate, the rest is "
                 "exact")
    head = f"{'role':10s} {'part':12s}" + "".join(f"{p:>11s}" for p in PHASES)
    lines += [head, "-" * len(head)]
    per_phase = plan.phase_max()
    keys = sorted({k for parts in per_phase.values() for k in parts})
    for role, part in keys:
        star = "*" if part == "activations" else " "
        lines.append(f"{role:10s} {part + star:12s}" + "".join(
            f"{per_phase[p][(role, part)] / scale:11.2f}" if (role, part) in per_phase[p]
            else f"{'-':>11s}" for p in PHASES))
    worst_by_phase = {p: max(t[p] for t in plan.totals) for p in PHASES}
    lines.append(f"{'total':23s}" + "".join(f"{worst_by_phase[p] / scale:11.2f}"
                                             for p in PHASES))
    role, part, value = plan.largest_part(rank, phase)
    lines.append("")
    where = f"rank {rank} in the {phase} phase"
    lines.append(f"peak: {total / scale:.2f} {unit} on {where}; largest consumer there: "
                 f"{role} {part} ({value / scale:.2f} {unit})")
    if capacity is not None:
        limit = capacity * (1.0 - headroom)
        verdict = "fits" if total <= limit else "does NOT fit"
        cunit, cscale = _unit(capacity)
        lines.append(f"{verdict}: {capacity / cscale:.1f} {cunit} per GPU, {headroom:.0%} kept "
                     f"for the CUDA context and fragmentation -> {limit / cscale:.1f} {cunit} "
                     "usable")
    return "\n".join(lines)


def relayout(specs: dict[str, RoleSpec], cfg: Config, world: int, tp: int, pp: int,
             level: str, recompute: bool = False) -> dict[str, RoleSpec]:
    """``specs`` with every role at TP x PP (rollout TP = TP) and the trained roles
    offloading at ``level`` (and, with ``recompute``, recomputing every layer in the
    backward pass); ConfigError when a model does not split that way."""
    out = {}
    for name, spec in specs.items():
        layout = Layout(tp=tp, pp=pp)
        model = dataclasses.replace(spec.model, recompute=FULL_RECOMPUTE) \
            if recompute and spec.trained else spec.model
        check_model_layout(spec.where, model, layout, world)
        padded = padded_vocab_size(spec.model.vocab_size,
                                   cfg.parallel.make_vocab_size_divisible_by, tp)
        out[name] = dataclasses.replace(spec, layout=layout, padded_vocab=padded, model=model,
                                        offload=level if spec.trained else spec.offload)
    return out


# the search's recomputation: every layer, its input kept (the most memory saved)
FULL_RECOMPUTE = RecomputeConfig(granularity="full", method="uniform", num_layers=1)


def layouts_that_fit(cfg: Config, specs: dict[str, RoleSpec], world: int, gpus_per_node: int,
                     capacity: float, headroom: float, limit: int = 6
                     ) -> list[tuple[int, int, bool, str, float]]:
    """(TP, PP, full recomputation of the trained roles, their offload, peak bytes) of
    uniform layouts that fit: TP within a node; fewest model-parallel ranks first, then
    without recomputation (it costs a forward pass of the layers), then the least
    offloading. Without recomputation a trained role keeps its own setting."""
    found = []
    for tp in (1, 2, 4, 8, 16):
        if tp > gpus_per_node or world % tp:
            continue
        for pp in (1, 2, 4, 8, 16):
            if world % (tp * pp):
                continue
            for recompute in (False, True):
                fit = None
                for level in OFFLOAD_LEVELS:
                    try:
                        plan = plan_ppo(cfg, world, rollout_tp=tp, specs=relayout(
                            specs, cfg, world, tp, pp, level, recompute))
                    except (ConfigError, ValueError):
                        break
                    peak = plan.worst()[0]
                    if peak <= capacity * (1.0 - headroom):
                        fit = (tp, pp, recompute, level, peak)
                        break
                if fit is not None:
                    found.append(fit)
                    break
    found.sort(key=lambda f: (f[0] * f[1], f[2], OFFLOAD_LEVELS.index(f[3])))
    return found[:limit]


def explain(cfg: Config, world: int, capacity: float, gpus_per_node: int,
            headroom: float = 0.1, written: Written | None = None) -> tuple[bool, str]:
    """(fits, the plan's report with the layouts that would fit when it does not)."""
    plan = plan_ppo(cfg, world, written=written)
    ok = fits(plan, capacity, headroom)
    text = format_plan(plan, capacity, headroom)
    missing = missing_checkpoints(cfg)
    if missing:
        text += ("\nnot on this machine, sized from the config's model: "
                 + ", ".join(missing))
    if not ok:
        options = layouts_that_fit(cfg, plan.specs, world, gpus_per_node, capacity, headroom)
        if options:
            text += "\nlayouts that fit on these GPUs (every role, rollout TP = TP):"
            trained = [name for name in ("actor", "critic") if name in plan.specs]
            for tp, pp, recompute, level, peak in options:
                text += (f"\n  parallel.tensor_model_parallel_size={tp} "
                         f"parallel.pipeline_model_parallel_size={pp} "
                         f"rollout.tensor_parallel_size={tp}"
                         + "".join(f" roles.{name}.offload={level}" for name in trained)
                         + ("".join(f" roles.{name}.model.recompute.granularity=full"
                                    for name in trained) if recompute else "")
                         + f"  (peak {peak / _unit(peak)[1]:.1f} {_unit(peak)[0]})")
        else:
            text += ("\nno uniform layout of TP x PP on these GPUs fits: more GPUs, smaller "
                     "micro-batches or shorter sequences")
    return ok, text
