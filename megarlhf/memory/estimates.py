"""The planner's per-part sizes: what a role, the KV cache and one micro-batch's
activations take, from the shapes alone (:mod:`megarlhf.memory.plan` puts them together
per rank and phase).

- **exact** (equal to the measured bytes): parameters (with the distributed optimizer, the
  padded contiguous buffer megatron allocates), gradient buffers (fp32, padded the same
  way), optimizer state (Adam's two moments and step per parameter shard, fp32 master
  copies of low-precision weights), the inference model, the KV cache;
- **estimated**: activations saved for backward (per-layer terms of this implementation's
  layers, times the micro-batches a pipeline stage holds, less what recomputation drops),
  and transient forward buffers (logits) of the experience passes and of generation, which
  CPU runs do not measure.
"""

from __future__ import annotations

import math

from megarlhf import speedups
from megarlhf.data.packing import MIN_ROWS
from megarlhf.models.logprobs import CHUNK_TOKENS
from megarlhf.roles.spec import RoleSpec
from megarlhf.models.shapes import ParamShape, rank_chunks

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 2**30


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
        # a LoRA model's frozen base: parameters only, outside DDP's buffers
        out["params"] += sum(p.numel for p in chunk if p.frozen) * dsize
        chunk = [p for p in chunk if not p.frozen]
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

def layer_activation_floats(model, tp: int, batch: int, seq: int, packed: bool = False,
                            sp: bool = False) -> float:
    """Values one transformer layer of this implementation keeps for backward per token
    (local layers, SDPA): norms and residuals whole, attention and MLP split over TP,
    SDPA's float mask (seq per token), RoPE tables (llama). The attention half here, the
    MLP half in :func:`mlp_activation_floats`. Query-sized values are heads x head size
    (hidden, unless ``model.head_dim`` is set). ``packed``: one SDPA call per sample
    (``models.spec.SDPACoreAttention.forward_packed``) keeps no mask but its own
    contiguous copies of each sample's queries, keys and values. ``sp`` (sequence
    parallelism): the whole values are each TP rank's part of the sequence."""
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
    if sp:
        whole /= tp
    mlp = mlp_activation_floats(model, tp, sp)
    if packed:
        return whole + (split + q + 2 * gkv) / tp + rope + mlp
    return whole + split / tp + seq + rope + mlp


def layer_bytes(spec: RoleSpec, *, batch: int, seq: int, span: int | None = None) -> float:
    """One layer's activations of one micro-batch on a rank of ``spec``'s layout, bytes
    (:func:`layer_activation_floats`). Under context parallelism each rank keeps its 1/CP
    of the tokens, with the keys and values of the others that its attention gathered
    (``parallel.context``: SDPA keeps them). A packed row's causal attention takes a
    lower-right causal bias that the GPU kernels apply without making a mask (on the CPU
    torch makes it, and the attention keeps it: not counted, the plan is the GPU's)."""
    model, layout = spec.model, spec.layout
    per_token = layer_activation_floats(model, layout.tp, batch, seq, packed=span is not None,
                                        sp=layout.sp)
    if layout.cp > 1:
        per_token += 2 * model.query_groups * model.head_size * (layout.cp - 1) / layout.tp
    return per_token * batch * seq / layout.cp * DTYPE_BYTES[model.params_dtype]


def mlp_norm_floats(model, tp: int, sp: bool = False) -> float:
    """What the MLP half's norm keeps per token (its input and statistics, and fc1's input:
    the norm's output), each TP rank's part of it under sequence parallelism."""
    return (2 * model.hidden_size + (1 if model.arch == "llama" else 2)) / (tp if sp else 1)


def mlp_activation_floats(model, tp: int, sp: bool = False) -> float:
    """The part of :func:`layer_activation_floats` that the MLP half of a layer keeps per
    token: its norm's input and statistics, fc1's input and output, the activation's
    inputs and fc2's input."""
    inner = 5 * model.ffn_size if model.arch == "llama" else 2 * model.ffn_size
    return mlp_norm_floats(model, tp, sp) + inner / tp


def chunk_activation_bytes(spec: RoleSpec, *, batch: int, seq: int, response: int,
                           layers: int, pre: bool, post: bool, span: int | None = None,
                           own: int | None = None) -> float:
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
    cut = head_cut(spec, span)
    layer = layer_bytes(spec, batch=batch, seq=seq, span=span)
    total = layers * layer - recomputed_bytes(spec, layer, layers=layers, batch=batch,
                                              seq=seq, packed=span is not None)
    # the last MLP is cut, but not under recomputation (its recomputed forward would see
    # no positions)
    if cut and post and layers and not model.fp8.enabled and model.recompute.granularity is None:
        total -= mlp_activation_floats(model, spec.layout.tp, spec.layout.sp) \
            * batch * (seq - response) * dsize
    if pre:  # token (and position) ids
        total += tokens / spec.layout.cp * 8 * (2 if model.arch == "gpt2" else 1)
    if post:
        total += head_activation_bytes(spec, batch=batch, seq=seq, response=response, cut=cut,
                                       own=own)
    return total


def head_cut(spec: RoleSpec, span: int | None) -> bool:
    """Whether the head runs at the kept positions only: with ``speedups.positions`` or
    packed (``span``), and not under sequence or context parallelism, whose head input is
    split along the sequence (``models.gpt.RoleModel``, ``engine.steps.model_forward``)."""
    return (speedups.enabled("positions") or span is not None) and not spec.layout.sp \
        and spec.layout.cp == 1


def head_activation_bytes(spec: RoleSpec, *, batch: int, seq: int, response: int, cut: bool,
                          own: int | None = None) -> float:
    """The last chunk's final norm and head, bytes saved for backward: their inputs at
    the kept positions with the cut, and an LM head's input once more (whole on every TP
    rank, in the model's dtype), and its logits when they are one chunk
    (``models.logprobs.CHUNK_TOKENS`` positions or fewer): ``models.logprobs``'s
    ``head_logprobs`` keeps those for the backward pass and makes longer logits and their
    fp32 softmax a chunk of positions at a time, forward and backward."""
    model = spec.model
    dsize = DTYPE_BYTES[model.params_dtype]
    head_tokens = batch * response if cut and not model.fp8.enabled else batch * seq
    if spec.layout.sp:  # the final norm and the head keep their part of the sequence
        head_tokens /= spec.layout.tp
    head_tokens /= spec.layout.cp  # the final norm's part; the head reads it gathered
    total = (3 * model.hidden_size + 2) * head_tokens * dsize + 12 * batch * response * 4
    if spec.kind == "lm":  # the head's input the log-probs keep (response's, or all of the
        # micro-batch's ``own`` positions: a lengthened one's outputs are cut back)
        rows = response if cut else (own or seq)
        total += batch * rows * model.hidden_size * dsize
        if max(1, CHUNK_TOKENS // batch) >= response:  # the logits of one chunk: the
            # log-probs read the response positions of it
            total += batch * response * spec.padded_vocab // spec.layout.tp * dsize
    return total


def recomputed_bytes(spec: RoleSpec, layer: float, *, layers: int, batch: int, seq: int,
                     packed: bool) -> float:
    """What ``model.recompute`` keeps out of one micro-batch's activations in a chunk of
    ``layers`` layers of ``layer`` bytes each. Full: a group's (uniform) or a recomputed
    layer's (block) activations less its input, which is kept, and less the block's
    attention mask (a padded micro-batch's (B, 1, S, S) booleans), which the recomputation
    keeps for every group. Selective: the MLP's activations but its input (``mlp``); core
    attention keeps its inputs (queries, keys, values and the mask) for the recomputation,
    which are what SDPA's kernels keep anyway, so it saves nothing here."""
    model = spec.model
    recompute = model.recompute
    tokens = batch * seq
    hidden = model.hidden_size * tokens * DTYPE_BYTES[model.params_dtype]
    if spec.layout.sp:  # a group's input: this rank's part of the sequence
        hidden /= spec.layout.tp
    hidden /= spec.layout.cp
    if recompute.granularity == "full":
        dropped = layers if recompute.method == "uniform" else min(recompute.num_layers, layers)
        kept_inputs = layers // recompute.num_layers if recompute.method == "uniform" \
            else dropped
        mask = 0 if packed or not dropped else batch * seq * seq / spec.layout.cp
        return dropped * layer - kept_inputs * hidden - mask
    if recompute.granularity == "selective" and "mlp" in recompute.modules:
        tp, sp = spec.layout.tp, spec.layout.sp
        inner = mlp_activation_floats(model, tp, sp) - mlp_norm_floats(model, tp, sp)
        return layers * inner * tokens / spec.layout.cp * DTYPE_BYTES[model.params_dtype]
    return 0.0


def recompute_peak_bytes(spec: RoleSpec, *, micro: int, seq: int, span: int | None = None
                         ) -> float:
    """The activations a recomputation brings back in the backward pass of one
    micro-batch, at most at once: a group of layers (full, uniform), one layer (full,
    block), one layer's MLP (selective ``mlp``)."""
    model = spec.model
    recompute = model.recompute
    layer = layer_bytes(spec, batch=micro, seq=seq, span=span)
    if recompute.granularity == "full":
        return layer * (recompute.num_layers if recompute.method == "uniform" else 1)
    return recomputed_bytes(spec, layer, layers=1, batch=micro, seq=seq,
                            packed=span is not None)


def train_activation_bytes(spec: RoleSpec, *, pp_rank: int, micro: int, micro_batches: int,
                           seq: int, response: int, span: int | None = None) -> float:
    """Peak activations of pipeline rank ``pp_rank``: one micro-batch without a pipeline;
    1F1B holds min(PP - stage, micro-batches); the interleaved schedule holds its warm-up
    of chunk forwards. ``span``: packed (see :func:`chunk_activation_bytes`). Under
    sequence parallelism a micro-batch runs lengthened to a multiple of TP, under context
    parallelism to a multiple of 2 x CP (and TP)."""
    layout = spec.layout
    unit = (layout.tp if layout.sp else 1) * (2 * layout.cp if layout.cp > 1 else 1)
    own, seq = seq, -(-seq // unit) * unit
    pp, vpp = spec.layout.pp, spec.layout.vpp or 1
    layers = spec.model.num_layers // (pp * vpp)
    per_chunk = [chunk_activation_bytes(
        spec, batch=micro, seq=seq, response=response, layers=layers,
        pre=pp_rank == 0 and v == 0, post=pp_rank == pp - 1 and v == vpp - 1, span=span,
        own=own) for v in range(vpp)]
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
        cut = head_cut(spec, span)
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
    """Transient buffers of a forward-only pass on the last stage: an LM head's input at
    the response positions, and one chunk's logits (``models.logprobs.CHUNK_TOKENS``
    positions) in the model's dtype with their fp32 copy, softmax and log-softmax; a few
    hidden-state copies of a value model. ``span`` marks a packed micro-batch
    (:func:`packed_shape`); unused here."""
    dsize = DTYPE_BYTES[spec.model.params_dtype]
    if spec.kind == "lm":
        shard = spec.padded_vocab // spec.layout.tp
        chunk = min(batch * response, CHUNK_TOKENS)
        return batch * response * spec.model.hidden_size * dsize \
            + chunk * shard * (dsize + 3 * 4)
    return 4 * batch * seq * spec.model.hidden_size * DTYPE_BYTES[spec.model.params_dtype]
