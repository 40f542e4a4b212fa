"""The parameters one rank's model chunk holds, from the config alone (no process groups,
no allocation): names, shapes and megatron's ``shared_embedding`` flag, in the order of
``named_parameters()`` of the chunk :func:`~megarlhf.models.gpt.build_model` builds with the
local layer spec. The memory planner reads them; a test compares them with built chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarlhf.config import Layout, ModelConfig


@dataclass(frozen=True)
class ParamShape:
    name: str
    shape: tuple[int, ...]
    shared_embedding: bool = False  # tied word embedding/output layer split over PP
    frozen: bool = False  # a LoRA model's base weight: no gradient, no optimizer state

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _layer(model: ModelConfig, tp: int, prefix: str, moe_layer: bool = False, ep: int = 1,
           etp: int = 1) -> list[ParamShape]:
    """One transformer layer with tensor parallelism ``tp`` (local spec order); a
    mixture-of-experts layer (``moe_layer``) with its experts split over ``ep`` ranks and
    each over ``etp``."""
    h = model.hidden_size
    gated = model.arch == "llama"
    fc1 = (2 if gated else 1) * model.ffn_size // tp
    bias = model.arch == "gpt2" or model.linear_bias  # add_bias_linear
    norm_bias = model.arch == "gpt2"  # LayerNorm's
    out: list[ParamShape] = []

    def norm(name: str) -> None:
        out.append(ParamShape(f"{prefix}{name}.weight", (h,)))
        if norm_bias:
            out.append(ParamShape(f"{prefix}{name}.bias", (h,)))

    def mlp(p: str, fc1_rows: int, width: int) -> None:
        """An MLP's (an expert's) two linears: fc1 of ``fc1_rows``, fc2 from ``width``."""
        out.append(ParamShape(p + "linear_fc1.weight", (fc1_rows, h)))
        if bias:
            out.append(ParamShape(p + "linear_fc1.bias", (fc1_rows,)))
        out.append(ParamShape(p + "linear_fc2.weight", (h, width)))
        if bias:
            out.append(ParamShape(p + "linear_fc2.bias", (h,)))

    post = model.norm_placement == "post"  # OLMo 2: norms on the sublayers' outputs
    if not post:
        norm("input_layernorm")
    if model.mla.enabled:
        out += _mla(model, tp, prefix)
    else:
        out += _attention(model, tp, prefix, norm_bias=norm_bias)
        out += _adapters(model, tp, prefix + "self_attention.", ("linear_qkv", "linear_proj"))
    if not post:
        norm("pre_mlp_layernorm")
    if moe_layer:  # the router (whole on every rank), this rank's experts, shared experts
        moe, width = model.moe, model.expert_ffn_size // etp
        out.append(ParamShape(f"{prefix}mlp.router.weight", (moe.num_experts, h)))
        if bias:
            out.append(ParamShape(f"{prefix}mlp.router.bias", (moe.num_experts,)))
        for j in range(moe.num_experts // ep):
            mlp(f"{prefix}mlp.experts.local_experts.{j}.", 2 * width, width)
        if moe.shared_expert_ffn_hidden_size:
            shared = moe.shared_expert_ffn_hidden_size // tp
            mlp(f"{prefix}mlp.shared_experts.", 2 * shared, shared)
        return out
    mlp(f"{prefix}mlp.", fc1, model.ffn_size // tp)
    if model.norm_placement != "pre":  # OLMo 2, Gemma 3: the MLP's output norm
        out.append(ParamShape(f"{prefix}mlp.post_layernorm.weight", (h,)))
    return out + _adapters(model, tp, prefix + "mlp.", ("linear_fc1", "linear_fc2"))


def _adapters(model: ModelConfig, tp: int, prefix: str, linears: tuple[str, ...]
              ) -> list[ParamShape]:
    """LoRA's matrices of ``linears`` (``models.lora``), after the block's own
    parameters: a column-parallel linear's B split over TP, a row-parallel one's A."""
    from megarlhf.models.lora import COLUMN, PARTS, SUFFIX

    lora, shapes, out = model.lora, model.lora_shapes(), []
    if not lora.enabled:
        return out
    for linear in linears:
        column = linear in COLUMN
        for part in (p for p in PARTS[linear] if p in lora.target_modules):
            inp, width = shapes[part]
            name = f"{prefix}{linear}{SUFFIX}.adapters.{part}."
            out += [ParamShape(name + "lora_A", (lora.rank, inp if column else inp // tp)),
                    ParamShape(name + "lora_B", (width // tp if column else width, lora.rank))]
    return out


def _attention(model: ModelConfig, tp: int, prefix: str, norm_bias: bool) -> list[ParamShape]:
    """Grouped-query attention's parameters (local spec order)."""
    h, kv = model.hidden_size, model.head_size
    qkv = (model.num_attention_heads + 2 * model.query_groups) * kv // tp
    attn = model.num_attention_heads * kv  # the attention's width (hidden unless head_dim)
    a = f"{prefix}self_attention."
    out = []
    if model.attention_sinks:  # one per head, split over TP as the heads
        out.append(ParamShape(a + "core_attention.softmax_offset",
                              (model.num_attention_heads // tp,)))
    out.append(ParamShape(a + "linear_proj.weight", (h, attn // tp)))
    if model.arch == "gpt2" or model.linear_bias:  # a row-parallel bias: whole on each rank
        out.append(ParamShape(a + "linear_proj.bias", (h,)))
    out.append(ParamShape(a + "linear_qkv.weight", (qkv, h)))
    if model.qkv_bias:
        out.append(ParamShape(a + "linear_qkv.bias", (qkv,)))
    if model.qk_layernorm_all_heads:  # over every head: split over TP as the heads
        out += [ParamShape(a + "q_layernorm.weight", (model.num_attention_heads * kv // tp,)),
                ParamShape(a + "k_layernorm.weight", (model.query_groups * kv // tp,))]
    elif model.qk_layernorm:  # one norm per head size, shared by the heads
        for name in ("q_layernorm", "k_layernorm"):
            out.append(ParamShape(a + f"{name}.weight", (kv,)))
            if norm_bias:
                out.append(ParamShape(a + f"{name}.bias", (kv,)))
    if model.norm_placement != "pre":  # OLMo 2, Gemma 3: the attention's output norm
        out.append(ParamShape(a + "post_layernorm.weight", (h,)))
    return out


def _mla(model: ModelConfig, tp: int, prefix: str) -> list[ParamShape]:
    """Multi-latent attention's parameters (megatron's local MLA spec order): every
    projection split over TP by rows (the down projections are gathered after), the
    latents' norms whole."""
    h, mla, heads = model.hidden_size, model.mla, model.num_attention_heads
    q_head = mla.qk_head_dim + mla.qk_pos_emb_head_dim
    a = f"{prefix}self_attention."
    out = [ParamShape(a + "linear_proj.weight", (h, heads * mla.v_head_dim // tp))]
    if mla.q_lora_rank is None:
        out.append(ParamShape(a + "linear_q_proj.weight", (heads * q_head // tp, h)))
    else:
        out += [ParamShape(a + "linear_q_down_proj.weight", (mla.q_lora_rank // tp, h)),
                ParamShape(a + "linear_q_up_proj.weight",
                           (heads * q_head // tp, mla.q_lora_rank))]
    out += [ParamShape(a + "linear_kv_down_proj.weight",
                       ((mla.kv_lora_rank + mla.qk_pos_emb_head_dim) // tp, h)),
            ParamShape(a + "linear_kv_up_proj.weight",
                       (heads * (mla.qk_head_dim + mla.v_head_dim) // tp, mla.kv_lora_rank))]
    if mla.q_lora_rank is not None:
        out.append(ParamShape(a + "q_layernorm.weight", (mla.q_lora_rank,)))
    out.append(ParamShape(a + "kv_layernorm.weight", (mla.kv_lora_rank,)))
    return out


def chunk_params(model: ModelConfig, *, kind: str, padded_vocab: int, tp: int, pp: int,
                 pp_rank: int, vpp: int | None = None, vp_stage: int = 0, ep: int = 1,
                 etp: int | None = None) -> list[ParamShape]:
    """The parameters of pipeline rank ``pp_rank``'s chunk ``vp_stage`` (layers
    ``num_layers / (pp x vpp)`` of them), for an ``"lm"`` or ``"value"`` model; a
    mixture-of-experts model's experts over ``ep`` ranks, each over ``etp`` (default TP)."""
    chunks = pp * (vpp or 1)
    per_chunk = model.num_layers // chunks
    first = vp_stage * (model.num_layers // (vpp or 1)) + pp_rank * per_chunk  # megatron's
    etp = etp or tp
    pre = pp_rank == 0 and vp_stage == 0
    post = pp_rank == pp - 1 and vp_stage == (vpp or 1) - 1
    tied = model.tied and kind == "lm"
    h = model.hidden_size
    out: list[ParamShape] = []
    if pre:
        out.append(ParamShape("embedding.word_embeddings.weight", (padded_vocab // tp, h),
                              shared_embedding=tied and pp > 1))
        if model.arch == "gpt2":
            out.append(ParamShape("embedding.position_embeddings.weight",
                                  (model.max_position_embeddings, h)))
    for i in range(per_chunk):
        moe_layer = model.moe.enabled and first + i >= model.moe.first_k_dense
        out += _layer(model, tp, f"decoder.layers.{i}.", moe_layer, ep, etp)
    if post:
        out.append(ParamShape("decoder.final_layernorm.weight", (h,)))
        if model.arch == "gpt2":
            out.append(ParamShape("decoder.final_layernorm.bias", (h,)))
        if kind == "value":
            out += [ParamShape("output_layer.weight", (1, h)),
                    ParamShape("output_layer.bias", (1,))]
        elif not (tied and pre):  # tied on one stage: the embedding is the output layer
            out.append(ParamShape("output_layer.weight", (padded_vocab // tp, h),
                                  shared_embedding=tied))
    if model.lora.enabled:  # only the adapters train (and a value model's head)
        out = [ParamShape(p.name, p.shape, p.shared_embedding, frozen="_lora." not in p.name
                          and not (kind == "value" and p.name.startswith("output_layer.")))
               for p in out]
    return out


def rank_chunks(model: ModelConfig, *, kind: str, padded_vocab: int, layout: Layout,
                pp_rank: int) -> list[list[ParamShape]]:
    """Every chunk pipeline rank ``pp_rank`` holds (one, or ``vpp``)."""
    return [chunk_params(model, kind=kind, padded_vocab=padded_vocab, tp=layout.tp,
                         pp=layout.pp, pp_rank=pp_rank, vpp=layout.vpp, vp_stage=v,
                         ep=layout.ep, etp=layout.expert_tp)
            for v in range(layout.vpp or 1)]
