"""Hugging Face <-> megarlhf (megatron-core GPTModel, TP=1/PP=1/EP=1 names) weight mappings
for the Llama family (Llama 2 and 3.x, Mistral and Mistral-Nemo head sizes, Qwen2/2.5, Qwen3
dense), its mixtures of experts (Qwen3-MoE, Mixtral, and DeepSeek-V3 with its multi-latent
attention) and GPT-2, causal LM and ``*ForSequenceClassification`` heads.

Pure tensor code. HF -> megatron is a table of sources (:func:`layer_sources`,
:func:`outer_sources`): each megatron tensor made from only the HF tensors it needs, so the
converter makes one at a time (and, given storage-less tensors, checks every shape before
reading anything). Every HF key must be consumed and every megatron key produced, or the
conversion fails naming the key.

Layout facts (megatron-core):
- ``linear_qkv`` rows are grouped per query group g: [q heads of g, k_g, v_g], each head
  ``head_dim`` rows.
- ``linear_fc1`` of a gated MLP is [gate; up] (megatron applies act(first) * second); so is
  each expert's (``mlp.experts.local_experts.<j>``); the router is ``mlp.router.weight``.
- HF GPT-2 stores Conv1D weights as (in, out): transposed relative to nn.Linear.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

# The files of a Hugging Face tokenizer that travel with a model directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "chat_template.jinja")
LLAMA_FAMILY = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                "deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                "smollm3": "SmolLM3ForCausalLM", "phi3": "Phi3ForCausalLM",
                "olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM",
                "gemma3_text": "Gemma3ForCausalLM", "gpt_oss": "GptOssForCausalLM"}
# Families whose local and global layers config.json's layer_types lists.
LAYER_TYPED = ("olmo3", "gemma3_text", "gpt_oss")
# OLMo 2 and 3: norms after the sublayers, queries and keys normalised over every head.
POST_NORM = ("olmo2", "olmo3")
# Where a mixture-of-experts family keeps its router and experts in a layer: (the MLP's
# prefix, the router, an expert's gate, up and down projections).
MOE_NAMES = {"qwen3_moe": ("mlp.", "gate.weight", "gate_proj.weight", "up_proj.weight",
                           "down_proj.weight"),
             "mixtral": ("block_sparse_moe.", "gate.weight", "w1.weight", "w3.weight",
                         "w2.weight"),
             "deepseek_v3": ("mlp.", "gate.weight", "gate_proj.weight", "up_proj.weight",
                             "down_proj.weight"),
             "glm4_moe": ("mlp.", "gate.weight", "gate_proj.weight", "up_proj.weight",
                          "down_proj.weight"),
             # gpt-oss keeps a layer's experts in stacked tensors (gpt_oss_expert_sources)
             "gpt_oss": ("mlp.", "router.weight", "", "", "")}
# Families whose routers choose by sigmoid scores plus an expert bias, with shared experts
# (DeepSeek-V3's MoE; GLM-4.5 has the same, under the same names).
SIGMOID_ROUTED = ("deepseek_v3", "glm4_moe")
# Families whose HF attention rotates the first partial_rotary_factor of each head.
PARTIAL_ROTARY = ("glm4_moe", "phi3")
# Families whose attention slides a window of config.json's sliding_window over every layer.
WINDOWED = ("mistral", "mixtral", "phi3")
# DeepSeek-V3's multi-latent attention: megatron's name -> HF's (in ``self_attn.``).
MLA_NAMES = {"linear_q_down_proj": "q_a_proj", "q_layernorm": "q_a_layernorm",
             "linear_q_up_proj": "q_b_proj", "linear_q_proj": "q_proj",
             "linear_kv_down_proj": "kv_a_proj_with_mqa", "kv_layernorm": "kv_a_layernorm",
             "linear_kv_up_proj": "kv_b_proj", "linear_proj": "o_proj"}
SUPPORTED = sorted(list(LLAMA_FAMILY) + ["gpt2"])


class ConversionError(ValueError):
    """A checkpoint that cannot be converted; the message names the key or option."""


def model_overrides(hf: dict) -> dict:
    """HF ``config.json`` -> megarlhf ``model.*`` values."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED:
        raise ConversionError(f"unsupported model_type {model_type!r}; supported: "
                              f"{', '.join(SUPPORTED)}")
    if model_type == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ConversionError(f"GPT-2 activation_function {act!r} is not supported "
                                  "(gelu_new / gelu_pytorch_tanh only)")
        if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"):
            raise ConversionError("GPT-2 options scale_attn_by_inverse_layer_idx / "
                                  "reorder_and_upcast_attn are not supported")
        hidden = need(hf, "n_embd")
        return dict(arch="gpt2", num_layers=need(hf, "n_layer"), hidden_size=hidden,
                    num_attention_heads=need(hf, "n_head"), num_query_groups=None,
                    ffn_hidden_size=hf.get("n_inner") or 4 * hidden,
                    max_position_embeddings=need(hf, "n_positions"),
                    vocab_size=need(hf, "vocab_size"),
                    norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
                    tie_word_embeddings=True, add_qkv_bias=True)
    refuse_unsupported(hf)
    heads = need(hf, "num_attention_heads")
    hidden = need(hf, "hidden_size")
    if model_type == "deepseek_v3":
        return dict(arch="llama", num_layers=need(hf, "num_hidden_layers"), hidden_size=hidden,
                    num_attention_heads=heads, num_query_groups=None, head_dim=None,
                    qk_layernorm=False, ffn_hidden_size=need(hf, "intermediate_size"),
                    **moe_overrides(hf), mla=mla_overrides(hf),
                    max_position_embeddings=hf.get("max_position_embeddings", 4096),
                    **rope_overrides(hf), vocab_size=need(hf, "vocab_size"),
                    norm_epsilon=hf.get("rms_norm_eps", 1e-6),
                    tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                    add_qkv_bias=False)
    head_dim = hf.get("head_dim")
    return dict(arch="llama", num_layers=need(hf, "num_hidden_layers"), hidden_size=hidden,
                num_attention_heads=heads,
                num_query_groups=hf.get("num_key_value_heads") or heads,
                head_dim=None if head_dim in (None, hidden // heads) else head_dim,
                qk_layernorm=model_type in ("qwen3", "qwen3_moe", "gemma3_text", *POST_NORM)
                or bool(hf.get("use_qk_norm")),
                rotary_percent=float(partial_rotary(hf)), no_rope_layers=no_rope_layers(hf),
                **window_overrides(hf),
                **({"norm_placement": "post", "qk_layernorm_all_heads": True}
                   if model_type in POST_NORM else {}),
                **(gemma_overrides(hf) if model_type == "gemma3_text" else {}),
                **(gpt_oss_overrides(hf) if model_type == "gpt_oss" else {}),
                ffn_hidden_size=need(hf, "intermediate_size"), **moe_overrides(hf),
                max_position_embeddings=hf.get("max_position_embeddings", 4096),
                **rope_overrides(hf), vocab_size=need(hf, "vocab_size"),
                norm_epsilon=hf.get("rms_norm_eps", 1e-6),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                add_qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias")))


def gpt_oss_overrides(hf: dict) -> dict:
    """gpt-oss's own ``model.*``: biases on every linear (attention's, the router's, the
    experts'), a sink per head, and the experts' clamped SwiGLU - act(gate) with a sigmoid
    gain of swiglu_alpha, both halves clamped at swiglu_limit, times (up + 1)."""
    if not hf.get("attention_bias", True):
        raise ConversionError("config.json attention_bias=false is not supported for gpt_oss "
                              "(megatron's linear biases are on every linear or none; the "
                              "router and experts have theirs)")
    return {"linear_bias": True, "attention_sinks": True,
            "activation_alpha": float(hf.get("swiglu_alpha", 1.702)),
            "glu_clamp": float(hf.get("swiglu_limit", 7.0)), "glu_linear_offset": 1.0}


def sliding_window(hf: dict) -> int | None:
    """The sliding window of a family that slides one over every layer (Mistral, Mixtral,
    Phi-3); None for a window at least the context long (it never applies) or none."""
    window = hf.get("sliding_window")
    if hf.get("model_type") not in WINDOWED or window is None \
            or window >= hf.get("max_position_embeddings", 4096):
        return None
    return window


def window_overrides(hf: dict) -> dict:
    """``model.sliding_window`` and ``model.full_attention_layers``: a window over every
    layer (:func:`sliding_window`), or OLMo 3's local and global layers - config.json's
    layer_types ('sliding_attention' layers see sliding_window positions,
    'full_attention' ones all); nothing for a family without windows."""
    if hf.get("model_type") not in LAYER_TYPED:
        return {"sliding_window": sliding_window(hf)}
    layers = need(hf, "num_hidden_layers")
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 4 else "full_attention"
                                      for i in range(layers)]  # transformers' default
    if len(types) != layers:
        raise ConversionError(f"config.json layer_types has {len(types)} entries for "
                              f"{layers} layers")
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    if len(full) == layers:
        return {}
    return {"sliding_window": need(hf, "sliding_window"), "full_attention_layers": full}


def gemma_overrides(hf: dict) -> dict:
    """Gemma 3's layer: sandwich norms, (1 + weight) norms, GeGLU, the embedding scaled by
    sqrt(hidden), query_pre_attn_scalar, the local layers' own RoPE base (without the
    global layers' scaling)."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ConversionError(f"config.json hidden_activation={act!r} is not supported "
                              "(gelu_pytorch_tanh only)")
    if hf.get("use_bidirectional_attention"):
        raise ConversionError("config.json use_bidirectional_attention=true is not supported "
                              "(causal attention only)")
    local = (hf.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ConversionError(f"config.json rope_parameters.sliding_attention.rope_type="
                              f"{local['rope_type']!r} is not supported (default only)")
    scalar = hf.get("query_pre_attn_scalar") or need(hf, "head_dim")
    return {"norm_placement": "sandwich", "norm_zero_centered": True,
            "activation": "gelu_tanh", "embedding_multiplier": need(hf, "hidden_size") ** 0.5,
            "softmax_scale": scalar ** -0.5,
            "local_rotary_base": float(local.get("rope_theta")
                                       or hf.get("rope_local_base_freq") or 10000.0)}


def no_rope_layers(hf: dict) -> list[int]:
    """SmolLM3's layers without RoPE: where config.json's no_rope_layers holds 0 (1: RoPE),
    or, without that list, every no_rope_layer_interval-th layer (transformers' rule)."""
    if hf.get("model_type") != "smollm3":
        return []
    layers = need(hf, "num_hidden_layers")
    uses = hf.get("no_rope_layers")
    if uses is None:
        every = hf.get("no_rope_layer_interval") or 4
        uses = [int((i + 1) % every != 0) for i in range(layers)]
    if len(uses) != layers:
        raise ConversionError(f"config.json no_rope_layers has {len(uses)} entries for "
                              f"{layers} layers")
    return [i for i, use in enumerate(uses) if not use]


def partial_rotary(hf: dict) -> float:
    """The share of a head RoPE rotates: config.json's partial_rotary_factor (top level, as
    the hub ships it, or in transformers 5's rope_parameters); 1 when absent."""
    value = hf.get("partial_rotary_factor")
    if value is None:
        value = (hf.get("rope_parameters") or {}).get("partial_rotary_factor")
    return 1.0 if value is None else value


def moe_overrides(hf: dict) -> dict:
    """``model.moe`` from a mixture-of-experts config.json (Qwen3-MoE, Mixtral); nothing for
    a dense family. What megarlhf's MoE layer does not do is refused naming the key."""
    model_type = hf.get("model_type")
    if model_type not in MOE_NAMES:
        return {}
    layers = need(hf, "num_hidden_layers")
    if model_type in SIGMOID_ROUTED:
        return {"moe": deepseek_moe(hf, layers)}
    if model_type in ("mixtral", "gpt_oss"):  # the top k of the logits, a softmax over them
        if hf.get("router_jitter_noise"):
            raise ConversionError(f"config.json router_jitter_noise="
                                  f"{hf['router_jitter_noise']} is not supported (0 only)")
        return {"moe": {"num_experts": need(hf, "num_local_experts"),
                        "top_k": need(hf, "num_experts_per_tok"),
                        "aux_loss_coeff": float(hf.get("router_aux_loss_coef") or 0.0)}}
    dense = sorted(hf.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
        raise ConversionError(f"config.json mlp_only_layers={dense} is not supported: dense "
                              "layers must be the first ones (0, 1, ...)")
    step = hf.get("decoder_sparse_step", 1)
    if step != 1 and len(dense) < layers:
        raise ConversionError(f"config.json decoder_sparse_step={step} is not supported (1 "
                              "only: every layer after the dense first ones is MoE)")
    if len(dense) >= layers:
        raise ConversionError(f"config.json mlp_only_layers={dense} leaves no "
                              "mixture-of-experts layer")
    # the hub's Qwen3-MoE configs say num_experts; transformers 5 saves num_local_experts
    experts = hf.get("num_experts") or need(hf, "num_local_experts")
    return {"moe": {"num_experts": experts,
                    "top_k": need(hf, "num_experts_per_tok"),
                    "ffn_hidden_size": need(hf, "moe_intermediate_size"),
                    "normalize_top_k": bool(hf.get("norm_topk_prob", False)),
                    "first_k_dense": len(dense),
                    "aux_loss_coeff": float(hf.get("router_aux_loss_coef") or 0.0)}}


def deepseek_moe(hf: dict, layers: int) -> dict:
    """``model.moe`` of a DeepSeek-V3 or GLM-4.5 config.json: sigmoid scores with the expert bias
    choosing (e_score_correction_bias), group-limited choice, shared experts, dense first
    layers, the router in float32. What megatron's router computes otherwise is refused."""
    experts, top_k = need(hf, "n_routed_experts"), need(hf, "num_experts_per_tok")
    groups, group_top_k = hf.get("n_group") or 1, hf.get("topk_group") or 1
    for key, wanted in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if hf.get(key, wanted) != wanted:
            raise ConversionError(f"config.json {key}={hf[key]!r} is not supported "
                                  f"({wanted} only)")
    if groups > 1 and top_k != 2 * group_top_k:
        raise ConversionError(
            f"config.json num_experts_per_tok={top_k} with topk_group={group_top_k} is not "
            "supported: transformers scores an expert group by the sum of its top 2, "
            "megatron by its top num_experts_per_tok / topk_group; they agree only when "
            "that is 2")
    if bool(hf.get("norm_topk_prob", True)) != (top_k > 1):
        raise ConversionError(f"config.json norm_topk_prob={hf.get('norm_topk_prob')} with "
                              f"num_experts_per_tok={top_k} is not supported: megatron's "
                              "sigmoid router renormalises exactly when it chooses > 1 expert")
    dense = hf.get("first_k_dense_replace") or 0
    if dense >= layers:
        raise ConversionError(f"config.json first_k_dense_replace={dense} leaves no "
                              "mixture-of-experts layer")
    width = need(hf, "moe_intermediate_size")
    scaling = float(hf.get("routed_scaling_factor") or 1.0)
    return {"num_experts": experts, "top_k": top_k, "ffn_hidden_size": width,
            "shared_expert_ffn_hidden_size": width * (hf.get("n_shared_experts") or 0),
            "score_function": "sigmoid", "normalize_top_k": top_k > 1,
            "top_k_scaling_factor": None if scaling == 1.0 else scaling,
            "expert_bias": True, "first_k_dense": dense, "router_fp32": True,
            "num_groups": groups if groups > 1 else None,
            "group_top_k": group_top_k if groups > 1 else None,
            "aux_loss_coeff": 0.0}


def mla_overrides(hf: dict) -> dict:
    """``model.mla`` of a DeepSeek-V3 config.json. Its rotary part must be interleaved
    (the default; megatron's MLA de-interleaves), its weights unquantised."""
    if hf.get("rope_interleave", True) is not True:
        raise ConversionError("config.json rope_interleave=false is not supported "
                              "(megatron's multi-latent attention rotates interleaved pairs)")
    return {"kv_lora_rank": need(hf, "kv_lora_rank"), "q_lora_rank": hf.get("q_lora_rank"),
            "qk_head_dim": need(hf, "qk_nope_head_dim"),
            "qk_pos_emb_head_dim": need(hf, "qk_rope_head_dim"),
            "v_head_dim": need(hf, "v_head_dim")}


def extra_layers(hf: dict) -> Callable[[str], bool]:
    """HF keys that are not converted: DeepSeek-V3's and GLM-4.5's multi-token-prediction
    layers (after the last decoder layer; RL training does not use them)."""
    if hf.get("model_type") not in SIGMOID_ROUTED:
        return lambda key: False
    layers = hf.get("num_hidden_layers") or 0

    def extra(key: str) -> bool:
        parts = key.split(".")
        return key.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) >= layers
    return extra


def _moe(m: dict) -> dict:
    """``m``'s ``moe`` section (empty for a dense model)."""
    moe = m.get("moe") or {}
    return moe if moe.get("num_experts") else {}


def _is_moe_layer(m: dict, i: int) -> bool:
    moe = _moe(m)
    return bool(moe) and i >= moe.get("first_k_dense", 0)


def need(hf: dict, key: str):
    """A config.json value the model cannot be built without."""
    if hf.get(key) is None:
        raise ConversionError(f"config.json has no '{key}' (model_type "
                              f"{hf.get('model_type')!r} needs it)")
    return hf[key]


def rope_overrides(hf: dict) -> dict:
    """RoPE theta and scaling from ``rope_scaling`` (config.json as the hub ships it) or
    ``rope_parameters`` (transformers 5), with the model's own values; a scaling megarlhf
    does not implement is refused naming the key."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(key) or {}
    if hf.get("model_type") == "gemma3_text":  # the global layers' here; the local ones'
        params = (hf.get("rope_parameters") or {}).get("full_attention") \
            or hf.get("rope_scaling") or {}  # own base: gemma_overrides
        key = "rope_parameters.full_attention" if hf.get("rope_parameters") else key
        factor = params.get("factor") if params.get("rope_type", params.get("type")) \
            == "linear" else None
        if factor is not None and (factor <= 0 or 2 ** round(math.log2(factor)) != factor):
            raise ConversionError(f"config.json {key}.factor={factor} is not supported for "
                                  "gemma3_text: the local layers read positions back from the "
                                  "global table, exactly only for a power-of-two factor")
    elif hf.get("model_type") == "olmo3":  # a rotary embedding per layer type
        if key == "rope_scaling":
            raise ConversionError("config.json rope_scaling is not supported for olmo3: "
                                  "transformers applies it to the full-attention layers only "
                                  "(megarlhf's model has one rotary embedding)")
        per_type = [v for v in params.values() if isinstance(v, dict)]
        if any(v != per_type[0] for v in per_type):
            raise ConversionError(f"config.json rope_parameters differ between the layer "
                                  f"types {sorted(params)}: megarlhf's model has one rotary "
                                  "embedding")
        params = per_type[0] if per_type else params
    theta = hf.get("rope_theta") or params.get("rope_theta") or 10000.0
    kind = params.get("rope_type", params.get("type", "default"))

    def value(name: str):
        if params.get(name) is None:
            raise ConversionError(f"config.json {key}.rope_type={kind!r} has no '{name}'")
        return params[name]

    if kind == "default":
        scaling = {}
    elif kind == "linear":
        scaling = {"type": "linear", "factor": float(value("factor"))}
    elif kind == "llama3":
        scaling = {"type": "llama3", "factor": float(value("factor")),
                   "low_freq_factor": float(value("low_freq_factor")),
                   "high_freq_factor": float(value("high_freq_factor")),
                   "original_max_position_embeddings":
                       int(value("original_max_position_embeddings"))}
    elif kind == "yarn":
        if params.get("attention_factor") is not None:
            raise ConversionError(f"config.json {key}.attention_factor="
                                  f"{params['attention_factor']!r} is not supported for yarn")
        scaling = {"type": "yarn", "factor": float(value("factor")),
                   "truncate": bool(params.get("truncate", True)),
                   "original_max_position_embeddings":
                       int(value("original_max_position_embeddings")),
                   "beta_fast": float(params.get("beta_fast") or 32.0),
                   "beta_slow": float(params.get("beta_slow") or 1.0),
                   "mscale": params.get("mscale"), "mscale_all_dim": params.get("mscale_all_dim")}
    else:
        raise ConversionError(f"config.json {key}.rope_type={kind!r} is not supported "
                              "(default, linear, llama3, yarn)")
    return {"rotary_base": float(theta), **({"rope_scaling": scaling} if scaling else {})}


def refuse_unsupported(hf: dict) -> None:
    """Options a Llama-family config.json may carry that megarlhf's model does not
    implement: refused naming the key, before anything is written."""
    model_type = hf.get("model_type")
    act = hf.get("hidden_act", "silu")
    if act != "silu" and model_type != "gemma3_text":  # its own: gemma_overrides
        raise ConversionError(f"config.json hidden_act={act!r} is not supported (silu only)")
    if hf.get("quantization_config"):
        kind = (hf["quantization_config"] or {}).get("quant_method", "?")
        raise ConversionError(f"config.json quantization_config ({kind}) is not supported: "
                              "dequantise the checkpoint to bfloat16 first")
    # GLM-4.5's attention_bias: biases on q, k and v (not o), as megatron's add_qkv_bias;
    # gpt-oss's: on q, k, v and o (gpt_oss_overrides)
    for key in ("mlp_bias",) if model_type in ("glm4_moe", "gpt_oss") \
            else ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ConversionError(f"config.json {key}=true is not supported for "
                                  f"model_type {model_type!r}")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(key) is not None:
            raise ConversionError(f"config.json {key}={hf[key]} is not supported "
                                  "(no logit softcapping)")
    factor = partial_rotary(hf)
    if factor != 1 and model_type not in PARTIAL_ROTARY:
        raise ConversionError(f"config.json partial_rotary_factor={factor} is not supported "
                              f"for model_type {model_type!r} (1 only)")
    head = hf.get("head_dim") or (hf.get("hidden_size") or 0) // max(
        1, hf.get("num_attention_heads") or 1)
    if not 0 < factor <= 1 or int(head * factor) % 2:
        raise ConversionError(f"config.json partial_rotary_factor={factor} is not supported: "
                              f"it rotates {int(head * factor)} of a head's {head} channels "
                              "(RoPE rotates pairs: an even number, above 0)")
    if model_type != "glm4_moe" and hf.get("use_qk_norm"):
        raise ConversionError(f"config.json use_qk_norm=true is not supported for model_type "
                              f"{model_type!r}")
    if hf.get("use_sliding_window"):
        raise ConversionError("config.json use_sliding_window=true is not supported "
                              "(full attention only)")
    allowed = ("full_attention", "sliding_attention") if model_type in LAYER_TYPED \
        else ("full_attention",)
    other = sorted({t for t in hf.get("layer_types") or () if t not in allowed})
    if other:
        raise ConversionError(f"config.json layer_types holds {other}: only full_attention "
                              "layers are supported")


def _hf_prefix(model_type: str) -> str:
    return "transformer" if model_type == "gpt2" else "model"


def _interleave_qkv(q, k, v, heads: int, groups: int, head_dim: int) -> torch.Tensor:
    per = heads // groups
    q = q.reshape(groups, per * head_dim, *q.shape[1:])
    k = k.reshape(groups, head_dim, *k.shape[1:])
    v = v.reshape(groups, head_dim, *v.shape[1:])
    return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])


def _split_qkv(qkv, heads: int, groups: int, head_dim: int):
    per = heads // groups
    grouped = qkv.reshape(groups, (per + 2) * head_dim, *qkv.shape[1:])
    q, k, v = torch.split(grouped, [per * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(-1, *qkv.shape[1:]), k.reshape(-1, *qkv.shape[1:]),
            v.reshape(-1, *qkv.shape[1:]))


def _heads(m: dict) -> tuple[int, int, int]:
    """(query heads, key/value groups, head size) of a ``model.*`` dict."""
    heads = m["num_attention_heads"]
    return (heads, m["num_query_groups"] or heads,
            m.get("head_dim") or m["hidden_size"] // heads)


def _checked(get: Callable[[str], torch.Tensor], name: str, shape: tuple) -> torch.Tensor:
    tensor = get(name)
    if tuple(tensor.shape) != shape:
        raise ConversionError(f"shape mismatch for HF '{name}': {tuple(tensor.shape)}, "
                              f"config.json implies {shape}")
    return tensor


Source = Callable[[Callable[[str], torch.Tensor]], torch.Tensor]


def layer_sources(model_type: str, i: int, m: dict) -> dict[str, Source]:
    """How each megatron tensor of transformer layer ``i`` is made: name -> a function of
    ``get`` (HF name -> tensor, recording it as consumed) that reads only the HF tensors
    it needs. Attention projections are shape-checked before reshaping."""
    heads, groups, hd = _heads(m)
    h = m["hidden_size"]
    out = f"decoder.layers.{i}."
    if model_type == "gpt2":
        p = f"transformer.h.{i}."

        def qkv(part: str):
            def make(get):
                w = _checked(get, p + f"attn.c_attn.{part}",
                             (h, 3 * h) if part == "weight" else (3 * h,))
                w = w.t() if part == "weight" else w
                return _interleave_qkv(*w.chunk(3, dim=0), heads, heads, hd)
            return make

        def plain(name: str, transpose: bool = False):
            return (lambda get: get(p + name).t()) if transpose else (lambda get: get(p + name))

        return {
            out + "input_layernorm.weight": plain("ln_1.weight"),
            out + "input_layernorm.bias": plain("ln_1.bias"),
            out + "self_attention.linear_qkv.weight": qkv("weight"),
            out + "self_attention.linear_qkv.bias": qkv("bias"),
            out + "self_attention.linear_proj.weight": plain("attn.c_proj.weight", True),
            out + "self_attention.linear_proj.bias": plain("attn.c_proj.bias"),
            out + "pre_mlp_layernorm.weight": plain("ln_2.weight"),
            out + "pre_mlp_layernorm.bias": plain("ln_2.bias"),
            out + "mlp.linear_fc1.weight": plain("mlp.c_fc.weight", True),
            out + "mlp.linear_fc1.bias": plain("mlp.c_fc.bias"),
            out + "mlp.linear_fc2.weight": plain("mlp.c_proj.weight", True),
            out + "mlp.linear_fc2.bias": plain("mlp.c_proj.bias"),
        }
    p = f"model.layers.{i}."
    a = p + "self_attn."
    ffn = m["ffn_hidden_size"]

    def checked(name: str, shape: tuple) -> Source:
        return lambda get: _checked(get, name, shape)

    def qkv(part: str) -> Source:
        def make(get):
            tail = (h,) if part == "weight" else ()
            return _interleave_qkv(
                _checked(get, a + f"q_proj.{part}", (heads * hd, *tail)),
                _checked(get, a + f"k_proj.{part}", (groups * hd, *tail)),
                _checked(get, a + f"v_proj.{part}", (groups * hd, *tail)), heads, groups, hd)
        return make

    def gated(gate: str, up: str, width: int) -> Source:
        return lambda get: torch.cat([_checked(get, gate, (width, h)),
                                      _checked(get, up, (width, h))], dim=0)

    if m.get("norm_placement") == "post":  # OLMo 2: norms on the sublayers' outputs
        sources = {
            out + "self_attention.post_layernorm.weight": checked(
                p + "post_attention_layernorm.weight", (h,)),
            out + "mlp.post_layernorm.weight": checked(p + "post_feedforward_layernorm.weight",
                                                       (h,))}
    elif m.get("norm_placement") == "sandwich":  # Gemma 3: before and after each sublayer
        sources = {
            out + "input_layernorm.weight": checked(p + "input_layernorm.weight", (h,)),
            out + "self_attention.post_layernorm.weight": checked(
                p + "post_attention_layernorm.weight", (h,)),
            out + "pre_mlp_layernorm.weight": checked(p + "pre_feedforward_layernorm.weight",
                                                      (h,)),
            out + "mlp.post_layernorm.weight": checked(p + "post_feedforward_layernorm.weight",
                                                       (h,))}
    else:
        sources = {
            out + "input_layernorm.weight": checked(p + "input_layernorm.weight", (h,)),
            out + "pre_mlp_layernorm.weight": checked(p + "post_attention_layernorm.weight",
                                                      (h,))}
    if _mla(m):
        for name, (hf_name, shape) in _mla_shapes(m).items():
            sources[out + f"self_attention.{name}.weight"] = checked(a + hf_name + ".weight",
                                                                   shape)
    elif model_type == "phi3":  # q, k and v stacked in one projection
        def fused_qkv(get):
            w = _checked(get, a + "qkv_proj.weight", ((heads + 2 * groups) * hd, h))
            return _interleave_qkv(*torch.split(w, [heads * hd, groups * hd, groups * hd]),
                                   heads, groups, hd)
        sources[out + "self_attention.linear_qkv.weight"] = fused_qkv
        sources[out + "self_attention.linear_proj.weight"] = checked(a + "o_proj.weight",
                                                                     (h, heads * hd))
    else:
        sources[out + "self_attention.linear_qkv.weight"] = qkv("weight")
        sources[out + "self_attention.linear_proj.weight"] = checked(a + "o_proj.weight",
                                                                     (h, heads * hd))
    if _is_moe_layer(m, i):
        moe = _moe(m)
        width = moe.get("ffn_hidden_size") or ffn
        mlp, router, gate, up, down = MOE_NAMES[model_type]
        sources[out + "mlp.router.weight"] = checked(p + mlp + router, (moe["num_experts"], h))
        if model_type == "gpt_oss":  # its experts stacked, its biases and sinks
            sources.update(gpt_oss_sources(p, out, m))
        else:
            for j in range(moe["num_experts"]):
                e, x = f"{p}{mlp}experts.{j}.", f"{out}mlp.experts.local_experts.{j}."
                sources[x + "linear_fc1.weight"] = gated(e + gate, e + up, width)
                sources[x + "linear_fc2.weight"] = checked(e + down, (h, width))
        if model_type in SIGMOID_ROUTED:  # the bias that chooses; shared experts
            sources[out + "mlp.router.expert_bias"] = checked(
                p + mlp + "gate.e_score_correction_bias", (moe["num_experts"],))
            shared = moe.get("shared_expert_ffn_hidden_size") or 0
            if shared:
                e, x = f"{p}{mlp}shared_experts.", f"{out}mlp.shared_experts."
                sources[x + "linear_fc1.weight"] = gated(e + "gate_proj.weight",
                                                         e + "up_proj.weight", shared)
                sources[x + "linear_fc2.weight"] = checked(e + "down_proj.weight", (h, shared))
    elif model_type == "phi3":  # [gate; up] in one projection, as megatron's fc1
        sources[out + "mlp.linear_fc1.weight"] = checked(p + "mlp.gate_up_proj.weight",
                                                         (2 * ffn, h))
        sources[out + "mlp.linear_fc2.weight"] = checked(p + "mlp.down_proj.weight", (h, ffn))
    else:
        sources[out + "mlp.linear_fc1.weight"] = gated(p + "mlp.gate_proj.weight",
                                                       p + "mlp.up_proj.weight", ffn)
        sources[out + "mlp.linear_fc2.weight"] = checked(p + "mlp.down_proj.weight", (h, ffn))
    if m.get("qk_layernorm_all_heads"):  # OLMo 2: one RMSNorm over every head's width
        sources[out + "self_attention.q_layernorm.weight"] = checked(a + "q_norm.weight",
                                                                   (heads * hd,))
        sources[out + "self_attention.k_layernorm.weight"] = checked(a + "k_norm.weight",
                                                                   (groups * hd,))
    elif m.get("qk_layernorm"):  # Qwen3: one RMSNorm over each head's width
        sources[out + "self_attention.q_layernorm.weight"] = checked(a + "q_norm.weight", (hd,))
        sources[out + "self_attention.k_layernorm.weight"] = checked(a + "k_norm.weight", (hd,))
    if m.get("add_qkv_bias"):  # Qwen2, GLM-4.5
        sources[out + "self_attention.linear_qkv.bias"] = qkv("bias")
    return sources


def gpt_oss_sources(p: str, out: str, m: dict) -> dict[str, Source]:
    """gpt-oss's tensors beyond a Llama MoE layer's (``p``: HF layer prefix, ``out``:
    megatron's): the output projection's and router's biases, the sinks, and the experts,
    which HF stacks per layer - ``gate_up_proj`` (experts, hidden, 2 x width) with gate
    and up interleaved in its columns (gate at even ones), ``down_proj`` (experts, width,
    hidden), stored as (in, out) - each expert's slice read alone."""
    heads, _, hd = _heads(m)
    h, moe = m["hidden_size"], _moe(m)
    experts = moe["num_experts"]
    width = moe.get("ffn_hidden_size") or m["ffn_hidden_size"]
    a, e = p + "self_attn.", p + "mlp.experts."

    def checked(name: str, shape: tuple) -> Source:
        return lambda get: _checked(get, name, shape)

    sources = {out + "self_attention.linear_proj.bias": checked(a + "o_proj.bias", (h,)),
               out + "self_attention.core_attention.softmax_offset": checked(a + "sinks",
                                                                             (heads,)),
               out + "mlp.router.bias": checked(p + "mlp.router.bias", (experts,))}
    for j in range(experts):
        x = f"{out}mlp.experts.local_experts.{j}."
        sources.update({
            x + "linear_fc1.weight": lambda get, j=j: _gate_then_up(_expert(
                get, e + "gate_up_proj", j, (experts, h, 2 * width)).t()),
            x + "linear_fc1.bias": lambda get, j=j: _gate_then_up(_expert(
                get, e + "gate_up_proj_bias", j, (experts, 2 * width))),
            x + "linear_fc2.weight": lambda get, j=j: _expert(
                get, e + "down_proj", j, (experts, width, h)).t(),
            x + "linear_fc2.bias": lambda get, j=j: _expert(get, e + "down_proj_bias", j,
                                                            (experts, h))})
    return sources


def _expert(get: Callable[..., torch.Tensor], name: str, j: int, shape: tuple
            ) -> torch.Tensor:
    """Expert ``j``'s slice of the stacked HF tensor ``name`` of ``shape`` (experts
    first), read alone: ``get(name, (j, experts))`` checks the stack's expert count."""
    tensor = get(name, (j, shape[0]))
    if tuple(tensor.shape) != tuple(shape[1:]):
        raise ConversionError(f"shape mismatch for HF '{name}': an expert's slice is "
                              f"{tuple(tensor.shape)}, config.json implies {shape[1:]}")
    return tensor


def _gate_then_up(rows: torch.Tensor) -> torch.Tensor:
    """gpt-oss's interleaved gate/up rows (gate, up, gate, up, ...) as megatron's fc1
    holds them: [gate; up]."""
    return torch.cat([rows[0::2], rows[1::2]])


def _interleaved(fc1: torch.Tensor) -> torch.Tensor:
    """megatron's [gate; up] rows interleaved as gpt-oss stores them (the inverse of
    :func:`_gate_then_up`)."""
    gate, up = fc1.chunk(2, dim=0)
    return torch.stack([gate, up], dim=1).reshape(fc1.shape)


def _mla(m: dict) -> dict:
    """``m``'s ``mla`` section (empty for standard attention)."""
    mla = m.get("mla") or {}
    return mla if mla.get("kv_lora_rank") else {}


def _mla_shapes(m: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Multi-latent attention: megatron's projection/norm name -> (HF's, TP=1 shape)."""
    mla, h, heads = _mla(m), m["hidden_size"], m["num_attention_heads"]
    q_head = mla["qk_head_dim"] + mla["qk_pos_emb_head_dim"]
    q_lora, kv_lora = mla.get("q_lora_rank"), mla["kv_lora_rank"]
    shapes = {"linear_kv_down_proj": (kv_lora + mla["qk_pos_emb_head_dim"], h),
              "kv_layernorm": (kv_lora,),
              "linear_kv_up_proj": (heads * (mla["qk_head_dim"] + mla["v_head_dim"]), kv_lora),
              "linear_proj": (h, heads * mla["v_head_dim"])}
    if q_lora:
        shapes.update(linear_q_down_proj=(q_lora, h), q_layernorm=(q_lora,),
                      linear_q_up_proj=(heads * q_head, q_lora))
    else:
        shapes["linear_q_proj"] = (heads * q_head, h)
    return {name: (MLA_NAMES[name], shape) for name, shape in shapes.items()}


def outer_sources(model_type: str, m: dict, has: Callable[[str], bool], role: str
                  ) -> dict[str, Source]:
    """Embeddings, final norm and the head (LM head, or ``score`` for value models), as
    :func:`layer_sources` gives a layer's. An HF head that megarlhf does not keep (GPT-2's
    ``lm_head`` tied to ``wte``, a tied Llama's) is read with the embedding, so it counts as
    consumed."""
    def with_ignored(name: str, ignored: tuple[str, ...]) -> Source:
        def make(get):
            for extra in ignored:
                get(extra)
            return get(name)
        return make

    if model_type == "gpt2":
        ignored = ("lm_head.weight",) if has("lm_head.weight") else ()
        out = {"embedding.word_embeddings.weight": with_ignored("transformer.wte.weight", ignored),
               "embedding.position_embeddings.weight": lambda get: get("transformer.wpe.weight"),
               "decoder.final_layernorm.weight": lambda get: get("transformer.ln_f.weight"),
               "decoder.final_layernorm.bias": lambda get: get("transformer.ln_f.bias")}
    else:
        keep_head = role == "lm" and not m["tie_word_embeddings"]
        ignored = ("lm_head.weight",) if not keep_head and has("lm_head.weight") else ()
        out = {"embedding.word_embeddings.weight": with_ignored("model.embed_tokens.weight",
                                                                ignored),
               "decoder.final_layernorm.weight": lambda get: get("model.norm.weight")}
        if keep_head:
            out["output_layer.weight"] = lambda get: get("lm_head.weight")
    if role == "value" and has("score.weight"):
        def score(get):
            weight = get("score.weight")
            if weight.shape[0] != 1:
                raise ConversionError(f"score.weight has {weight.shape[0]} labels; a "
                                      "reward/value head needs exactly 1")
            return weight
        out["output_layer.weight"] = score
        if has("score.bias"):
            out["output_layer.bias"] = lambda get: get("score.bias")
    return out


def megatron_to_hf(model_type: str, m: dict, sd: dict[str, torch.Tensor], vocab: int,
                   role: str = "lm") -> dict[str, torch.Tensor]:
    """TP=1 megatron state dict -> HF tensors (padded vocabulary rows dropped)."""
    out: dict[str, torch.Tensor] = {}
    for i in range(m["num_layers"]):
        out.update(hf_layer_tensors(model_type, m, i, sd))
    out.update(hf_outer_tensors(model_type, m, sd, vocab, role))
    return out


def hf_layer_tensors(model_type: str, m: dict, i: int, sd: dict[str, torch.Tensor]
                     ) -> dict[str, torch.Tensor]:
    """The HF tensors of transformer layer ``i``, from the TP=1 megatron tensors of that
    layer in ``sd`` (``decoder.layers.{i}.*``; other entries are not read)."""
    heads, groups, hd = _heads(m)
    out: dict[str, torch.Tensor] = {}
    s = f"decoder.layers.{i}."
    if model_type == "gpt2":
        p = f"transformer.h.{i}."
        q, k, v = _split_qkv(sd[s + "self_attention.linear_qkv.weight"], heads, heads, hd)
        qb, kb, vb = _split_qkv(sd[s + "self_attention.linear_qkv.bias"], heads, heads, hd)
        out.update({
            p + "ln_1.weight": sd[s + "input_layernorm.weight"],
            p + "ln_1.bias": sd[s + "input_layernorm.bias"],
            p + "attn.c_attn.weight": torch.cat([q, k, v]).t().contiguous(),
            p + "attn.c_attn.bias": torch.cat([qb, kb, vb]),
            p + "attn.c_proj.weight": sd[s + "self_attention.linear_proj.weight"].t().contiguous(),
            p + "attn.c_proj.bias": sd[s + "self_attention.linear_proj.bias"],
            p + "ln_2.weight": sd[s + "pre_mlp_layernorm.weight"],
            p + "ln_2.bias": sd[s + "pre_mlp_layernorm.bias"],
            p + "mlp.c_fc.weight": sd[s + "mlp.linear_fc1.weight"].t().contiguous(),
            p + "mlp.c_fc.bias": sd[s + "mlp.linear_fc1.bias"],
            p + "mlp.c_proj.weight": sd[s + "mlp.linear_fc2.weight"].t().contiguous(),
            p + "mlp.c_proj.bias": sd[s + "mlp.linear_fc2.bias"],
        })
        return {k: v.contiguous() for k, v in out.items()}
    p = f"model.layers.{i}."
    a = p + "self_attn."
    placement = m.get("norm_placement")
    if placement in ("post", "sandwich"):
        out.update({
            p + "post_attention_layernorm.weight": sd[s + "self_attention.post_layernorm.weight"],
            p + "post_feedforward_layernorm.weight": sd[s + "mlp.post_layernorm.weight"]})
    if placement == "sandwich":
        out.update({p + "input_layernorm.weight": sd[s + "input_layernorm.weight"],
                    p + "pre_feedforward_layernorm.weight": sd[s + "pre_mlp_layernorm.weight"]})
    elif placement != "post":
        out.update({
            p + "input_layernorm.weight": sd[s + "input_layernorm.weight"],
            p + "post_attention_layernorm.weight": sd[s + "pre_mlp_layernorm.weight"]})
    if _mla(m):
        for name, (hf_name, _) in _mla_shapes(m).items():
            out[a + hf_name + ".weight"] = sd[s + f"self_attention.{name}.weight"]
    else:
        q, k, v = _split_qkv(sd[s + "self_attention.linear_qkv.weight"], heads, groups, hd)
        out.update({a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": v,
                    a + "o_proj.weight": sd[s + "self_attention.linear_proj.weight"]})
        if model_type == "phi3":
            out[a + "qkv_proj.weight"] = torch.cat([out.pop(a + f"{x}_proj.weight")
                                                    for x in "qkv"])
    if model_type == "gpt_oss":
        out.update(gpt_oss_tensors(m, p, s, sd))
    elif _is_moe_layer(m, i):
        mlp, router, gate_name, up_name, down_name = MOE_NAMES[model_type]
        out[p + mlp + router] = sd[s + "mlp.router.weight"]
        for j in range(_moe(m)["num_experts"]):
            e, x = f"{p}{mlp}experts.{j}.", f"{s}mlp.experts.local_experts.{j}."
            gate, up = sd[x + "linear_fc1.weight"].chunk(2, dim=0)
            out.update({e + gate_name: gate, e + up_name: up,
                        e + down_name: sd[x + "linear_fc2.weight"]})
        if model_type in SIGMOID_ROUTED:
            out[p + mlp + "gate.e_score_correction_bias"] = sd[s + "mlp.router.expert_bias"]
            if _moe(m).get("shared_expert_ffn_hidden_size"):
                e, x = f"{p}{mlp}shared_experts.", f"{s}mlp.shared_experts."
                gate, up = sd[x + "linear_fc1.weight"].chunk(2, dim=0)
                out.update({e + "gate_proj.weight": gate, e + "up_proj.weight": up,
                            e + "down_proj.weight": sd[x + "linear_fc2.weight"]})
    elif model_type == "phi3":
        out.update({p + "mlp.gate_up_proj.weight": sd[s + "mlp.linear_fc1.weight"],
                    p + "mlp.down_proj.weight": sd[s + "mlp.linear_fc2.weight"]})
    else:
        gate, up = sd[s + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                    p + "mlp.down_proj.weight": sd[s + "mlp.linear_fc2.weight"]})
    if m.get("qk_layernorm"):
        out.update({a + "q_norm.weight": sd[s + "self_attention.q_layernorm.weight"],
                    a + "k_norm.weight": sd[s + "self_attention.k_layernorm.weight"]})
    if m.get("add_qkv_bias"):
        qb, kb, vb = _split_qkv(sd[s + "self_attention.linear_qkv.bias"], heads, groups, hd)
        out.update({a + "q_proj.bias": qb, a + "k_proj.bias": kb, a + "v_proj.bias": vb})
    return {k: v.contiguous() for k, v in out.items()}


def gpt_oss_tensors(m: dict, p: str, s: str, sd: dict[str, torch.Tensor]
                    ) -> dict[str, torch.Tensor]:
    """gpt-oss's HF tensors beyond attention's weights and norms (:func:`gpt_oss_sources`
    read backwards): the biases, sinks, router and the stacked experts."""
    x = [f"{s}mlp.experts.local_experts.{j}." for j in range(_moe(m)["num_experts"])]
    a, e = p + "self_attn.", p + "mlp.experts."
    return {
        a + "o_proj.bias": sd[s + "self_attention.linear_proj.bias"],
        a + "sinks": sd[s + "self_attention.core_attention.softmax_offset"],
        p + "mlp.router.weight": sd[s + "mlp.router.weight"],
        p + "mlp.router.bias": sd[s + "mlp.router.bias"],
        e + "gate_up_proj": torch.stack([_interleaved(sd[y + "linear_fc1.weight"]).t()
                                         for y in x]),
        e + "gate_up_proj_bias": torch.stack([_interleaved(sd[y + "linear_fc1.bias"])
                                              for y in x]),
        e + "down_proj": torch.stack([sd[y + "linear_fc2.weight"].t() for y in x]),
        e + "down_proj_bias": torch.stack([sd[y + "linear_fc2.bias"] for y in x])}


def hf_outer_tensors(model_type: str, m: dict, sd: dict[str, torch.Tensor], vocab: int,
                     role: str = "lm") -> dict[str, torch.Tensor]:
    """The HF embeddings, final norm and head, from the megatron tensors outside the
    layers (padded vocabulary rows dropped)."""
    return {name: make(sd[source]).contiguous() for name, (source, make) in
            hf_outer_sources(model_type, m, vocab, role).items()}


def hf_outer_sources(model_type: str, m: dict, vocab: int, role: str = "lm"
                     ) -> dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]]:
    """HF name -> (the megatron tensor it is made from, how) for the tensors outside the
    layers: each from one megatron tensor, so they can be made one at a time."""
    def rows(t):
        return t[:vocab]  # the vocabulary's padding rows dropped

    def same(t):
        return t

    if model_type == "gpt2":
        out = {"transformer.wte.weight": ("embedding.word_embeddings.weight", rows),
               "transformer.wpe.weight": ("embedding.position_embeddings.weight", same),
               "transformer.ln_f.weight": ("decoder.final_layernorm.weight", same),
               "transformer.ln_f.bias": ("decoder.final_layernorm.bias", same)}
    else:
        out = {"model.embed_tokens.weight": ("embedding.word_embeddings.weight", rows),
               "model.norm.weight": ("decoder.final_layernorm.weight", same)}
        if role == "lm" and not m["tie_word_embeddings"]:
            out["lm_head.weight"] = ("output_layer.weight", rows)
    if role == "value":
        out["score.weight"] = ("output_layer.weight", same)
    return out
