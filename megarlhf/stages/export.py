"""``megarlhf export``: a trained role of a checkpoint as a Hugging Face directory that
``transformers`` loads with ``from_pretrained`` (no remote code): config.json, safetensors
weights, the tokenizer files of the run's tokenizer (with its chat template) and a
``generation_config.json`` with the run's stop tokens and sampling settings.

The checkpoint may have been saved at any TP/PP; it is read in one process, by default a
layer at a time: the model is built on the meta device (its layout, no weights), the
safetensors headers are written from the converted tensors' shapes, and each layer is read
from the checkpoint (megatron's loader, only that layer's bytes), converted and written to
its place (:class:`~megarlhf.engine.streaming.SafetensorsFiles`). ``stream=False`` builds
the model whole first; the files are the same bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import torch

from megarlhf.config import Config, Written
from megarlhf.models import lora
from megarlhf.models.hf_mapping import TOKENIZER_FILES

# The families transformers has a *ForSequenceClassification of (a value model's export).
VALUE_HEADS = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral",
               "deepseek_v3", "smollm3", "phi3", "olmo2", "olmo3", "gemma3_text", "gpt_oss")


def hf_config(model_type: str, m: dict, role: str) -> dict:
    from megarlhf.models.hf_mapping import LLAMA_FAMILY, WINDOWED

    if model_type == "gpt2":
        cfg = {"architectures": ["GPT2LMHeadModel" if role == "lm" else
                                 "GPT2ForSequenceClassification"],
               "model_type": "gpt2", "n_embd": m["hidden_size"], "n_layer": m["num_layers"],
               "n_head": m["num_attention_heads"], "n_inner": m["ffn_hidden_size"],
               "n_positions": m["max_position_embeddings"], "vocab_size": m["vocab_size"],
               "layer_norm_epsilon": m["norm_epsilon"], "activation_function": "gelu_new",
               "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
               "tie_word_embeddings": True}
    else:
        arch = LLAMA_FAMILY[model_type]
        cfg = {"architectures": [arch if role == "lm" else
                                 arch.replace("ForCausalLM", "ForSequenceClassification")],
               "model_type": model_type, "hidden_size": m["hidden_size"],
               "num_hidden_layers": m["num_layers"],
               "num_attention_heads": m["num_attention_heads"],
               "num_key_value_heads": m["num_query_groups"] or m["num_attention_heads"],
               "intermediate_size": m["ffn_hidden_size"],
               "max_position_embeddings": m["max_position_embeddings"],
               "rope_theta": m["rotary_base"], "rms_norm_eps": m["norm_epsilon"],
               "vocab_size": m["vocab_size"], "hidden_act": "silu",
               "tie_word_embeddings": bool(m["tie_word_embeddings"]),
               "attention_dropout": 0.0,
               # the tokenizer's when known (export_checkpoint); not a family default that
               # may lie outside this vocabulary (SmolLM3's 128004)
               "pad_token_id": None}
        if m.get("head_dim"):
            cfg["head_dim"] = m["head_dim"]
        scaling = m.get("rope_scaling") or {}
        if scaling.get("type", "none") == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": scaling["factor"]}
        elif scaling.get("type") == "yarn":
            cfg["rope_scaling"] = {"rope_type": "yarn", **{
                k: scaling[k] for k in ("factor", "original_max_position_embeddings",
                                        "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
                if scaling.get(k) is not None},
                **({} if scaling.get("truncate", True) else {"truncate": False})}
        elif scaling.get("type") == "llama3":
            cfg["rope_scaling"] = {"rope_type": "llama3", **{
                k: scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                        "original_max_position_embeddings")}}
        if model_type in WINDOWED:
            cfg["sliding_window"] = m["sliding_window"]
        if model_type == "phi3":
            cfg.update(partial_rotary_factor=m["rotary_percent"], resid_pdrop=0.0,
                       embd_pdrop=0.0, original_max_position_embeddings=m[
                           "max_position_embeddings"])
        if model_type == "deepseek_v3":
            cfg.update(hf_mla_config(m))
        if model_type in ("olmo2", "olmo3"):
            cfg["attention_bias"] = False
        if model_type == "olmo3":  # one rotary embedding for both layer types
            full = m["full_attention_layers"] if m["sliding_window"] else \
                list(range(m["num_layers"]))
            cfg.update(sliding_window=m["sliding_window"] or m["max_position_embeddings"],
                       layer_types=["full_attention" if i in full else "sliding_attention"
                                    for i in range(m["num_layers"])],
                       rope_parameters={t: {"rope_type": "default",
                                            "rope_theta": m["rotary_base"]}
                                        for t in ("sliding_attention", "full_attention")})
        if model_type == "gemma3_text":  # its rotary settings per layer type instead
            for key in ("hidden_act", "rope_theta", "rope_scaling"):
                cfg.pop(key, None)
            cfg.update(gemma_config(m))
            if role == "value":
                cfg["architectures"] = ["Gemma3TextForSequenceClassification"]
        if model_type == "smollm3":
            cfg.update(no_rope_layers=[int(i not in m["no_rope_layers"])
                                       for i in range(m["num_layers"])],
                       use_sliding_window=False)
        if model_type == "gpt_oss":  # its rotary settings in rope_parameters instead
            for key in ("rope_theta", "rope_scaling"):
                cfg.pop(key, None)
            cfg.update(gpt_oss_config(m))
        if model_type == "glm4_moe":
            cfg.update(attention_bias=bool(m["add_qkv_bias"]),
                       partial_rotary_factor=m["rotary_percent"],
                       use_qk_norm=bool(m["qk_layernorm"]), num_nextn_predict_layers=0)
        cfg.update(hf_moe_config(model_type, m))
    if role == "value":
        cfg["num_labels"] = 1
    cfg["torch_dtype"] = m["params_dtype"]  # the checkpoint's own: bf16 in, bf16 out
    return cfg


def gemma_config(m: dict) -> dict:
    """config.json's Gemma 3 fields: its local and global layers' rotary settings, window
    pattern, attention scale and activation (``model.*`` of a converted Gemma 3)."""
    full = m["full_attention_layers"] if m["sliding_window"] else list(range(m["num_layers"]))
    scaling = m.get("rope_scaling") or {}
    glob = {"rope_type": "default", "rope_theta": m["rotary_base"]}
    if scaling.get("type") == "linear":
        glob = {"rope_type": "linear", "factor": scaling["factor"],
                "rope_theta": m["rotary_base"]}
    head = m["head_dim"] or m["hidden_size"] // m["num_attention_heads"]
    scalar = (m["softmax_scale"] or head ** -0.5) ** -2  # an int in transformers' config
    return {"hidden_activation": "gelu_pytorch_tanh", "head_dim": head,
            "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-6
            else scalar,
            "sliding_window": m["sliding_window"] or m["max_position_embeddings"],
            "layer_types": ["full_attention" if i in full else "sliding_attention"
                            for i in range(m["num_layers"])],
            "rope_parameters": {"sliding_attention": {
                "rope_type": "default", "rope_theta": m["local_rotary_base"] or
                m["rotary_base"]}, "full_attention": glob},
            "final_logit_softcapping": None, "attn_logit_softcapping": None,
            "use_bidirectional_attention": False, "attention_bias": False}


def gpt_oss_config(m: dict) -> dict:
    """config.json's gpt-oss fields: its window pattern, rotary settings (in
    rope_parameters, where transformers 5 reads them) and clamped SwiGLU."""
    full = m["full_attention_layers"] if m["sliding_window"] else list(range(m["num_layers"]))
    rope = {"rope_type": "default", "rope_theta": m["rotary_base"]}
    scaling = m.get("rope_scaling") or {}
    if scaling.get("type") == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": m["rotary_base"], **{
            k: scaling[k] for k in ("factor", "original_max_position_embeddings",
                                    "beta_fast", "beta_slow", "truncate")}}
    return {"sliding_window": m["sliding_window"] or m["max_position_embeddings"],
            "layer_types": ["full_attention" if i in full else "sliding_attention"
                            for i in range(m["num_layers"])],
            "rope_parameters": rope, "attention_bias": True,
            "head_dim": m["head_dim"] or m["hidden_size"] // m["num_attention_heads"],
            "swiglu_alpha": m["activation_alpha"], "swiglu_limit": m["glu_clamp"]}


def refuse_inexpressible(model_type: str, model) -> None:
    """What the Hugging Face family cannot express (partial rotary, layers without RoPE,
    a router of another kind): refused naming the field."""
    from megarlhf.models.hf_mapping import (LAYER_TYPED, PARTIAL_ROTARY, POST_NORM,
                                            SIGMOID_ROUTED, WINDOWED, ConversionError)

    if model.rotary_percent != 1 and model_type not in PARTIAL_ROTARY:
        raise ConversionError(f"model.rotary_percent={model.rotary_percent} cannot be written "
                              f"as {model_type} (its attention rotates whole heads)")
    if model.sliding_window is not None and model_type not in LAYER_TYPED and (
            model_type not in WINDOWED or model.full_attention_layers):
        raise ConversionError(f"model.sliding_window={model.sliding_window} (full attention "
                              f"in layers {model.full_attention_layers}) cannot be written as "
                              f"{model_type}" + (" (a window in every layer only)"
                                                 if model_type in WINDOWED else ""))
    gemma = model.norm_placement == "sandwich" or model.norm_zero_centered \
        or model.local_rotary_base is not None or model.embedding_multiplier != 1.0 \
        or model.activation == "gelu_tanh" or model.softmax_scale is not None
    if gemma != (model_type == "gemma3_text"):
        raise ConversionError(f"--model-type {model_type} does not fit the checkpoint's "
                              + ("Gemma 3 layer (model.norm_placement, norm_zero_centered, "
                                 "activation, embedding_multiplier, softmax_scale, "
                                 "local_rotary_base)" if gemma else "layer (not Gemma 3's)"))
    post = model.norm_placement == "post" or model.qk_layernorm_all_heads
    if post != (model_type in POST_NORM):
        raise ConversionError(f"--model-type {model_type} does not fit the checkpoint's "
                              + ("norms after the sublayers and over all heads (OLMo 2 / 3)"
                                 if post else "norms before the sublayers"))
    oss = model.attention_sinks or model.linear_bias or model.activation_alpha != 1.0 \
        or model.glu_clamp is not None or model.glu_linear_offset != 0.0
    if oss != (model_type == "gpt_oss"):
        raise ConversionError(f"--model-type {model_type} does not fit the checkpoint's "
                              + ("gpt-oss layer (model.attention_sinks, linear_bias, "
                                 "activation_alpha, glu_clamp, glu_linear_offset)" if oss
                                 else "layer (not gpt-oss's)"))
    if oss and not (model.attention_sinks and model.linear_bias and model.glu_clamp
                    is not None and model.glu_linear_offset == 1.0):
        raise ConversionError("gpt_oss needs model.attention_sinks=true, linear_bias=true, "
                              "a glu_clamp and glu_linear_offset=1 together (its layer has "
                              "all of them)")
    if model.no_rope_layers and model_type != "smollm3":
        raise ConversionError(f"model.no_rope_layers={model.no_rope_layers} cannot be "
                              f"written as {model_type} (RoPE in every layer)")
    moe = model.moe
    if not moe.enabled:
        return
    if model_type in SIGMOID_ROUTED:
        wanted = {"score_function": "sigmoid", "expert_bias": True, "router_fp32": True}
    else:  # Qwen3-MoE, Mixtral: softmax over the experts, nothing else
        wanted = {"score_function": "softmax", "expert_bias": False, "num_groups": None,
                  "top_k_scaling_factor": None, "shared_expert_ffn_hidden_size": 0,
                  "router_fp32": False}
    for key, value in wanted.items():
        if getattr(moe, key) != value:
            raise ConversionError(f"model.moe.{key}={getattr(moe, key)!r} cannot be written "
                                  f"as {model_type} (it needs {value!r})")
    if model_type in SIGMOID_ROUTED and \
            moe.shared_expert_ffn_hidden_size % model.expert_ffn_size:
        raise ConversionError(f"model.moe.shared_expert_ffn_hidden_size="
                              f"{moe.shared_expert_ffn_hidden_size} cannot be written as "
                              f"{model_type}: not a multiple of the expert width "
                              f"{model.expert_ffn_size} (n_shared_experts)")


def hf_mla_config(m: dict) -> dict:
    """config.json's multi-latent attention fields (DeepSeek-V3) of ``m['mla']``."""
    mla = m["mla"]
    return {"q_lora_rank": mla["q_lora_rank"], "kv_lora_rank": mla["kv_lora_rank"],
            "qk_nope_head_dim": mla["qk_head_dim"],
            "qk_rope_head_dim": mla["qk_pos_emb_head_dim"], "v_head_dim": mla["v_head_dim"],
            "head_dim": mla["qk_pos_emb_head_dim"], "rope_interleave": True,
            "attention_bias": False, "num_nextn_predict_layers": 0}


def hf_moe_config(model_type: str, m: dict) -> dict:
    """config.json's mixture-of-experts fields (Qwen3-MoE, Mixtral, DeepSeek-V3, GLM-4.5)
    of ``m['moe']``."""
    from megarlhf.models.hf_mapping import SIGMOID_ROUTED

    moe = m.get("moe") or {}
    if not moe.get("num_experts"):
        return {}
    if model_type in SIGMOID_ROUTED:
        width = moe["ffn_hidden_size"] or m["ffn_hidden_size"]
        return {"n_routed_experts": moe["num_experts"], "num_experts_per_tok": moe["top_k"],
                "moe_intermediate_size": width,
                "n_shared_experts": (moe["shared_expert_ffn_hidden_size"] or 0) // width,
                "n_group": moe["num_groups"] or 1, "topk_group": moe["group_top_k"] or 1,
                "first_k_dense_replace": moe["first_k_dense"],
                "routed_scaling_factor": moe["top_k_scaling_factor"] or 1.0,
                "norm_topk_prob": moe["normalize_top_k"], "output_router_logits": False}
    common = {"num_experts_per_tok": moe["top_k"],
              "router_aux_loss_coef": moe["aux_loss_coeff"], "output_router_logits": False}
    if model_type == "mixtral":
        return {**common, "num_local_experts": moe["num_experts"], "router_jitter_noise": 0.0}
    if model_type == "gpt_oss":
        return {**common, "num_local_experts": moe["num_experts"]}
    return {**common, "num_experts": moe["num_experts"],
            "moe_intermediate_size": moe["ffn_hidden_size"] or m["ffn_hidden_size"],
            "norm_topk_prob": moe["normalize_top_k"], "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(moe["first_k_dense"]))}


def generation_config(cfg: Config, tokenizer) -> dict:
    """transformers' generation_config.json from the run's rollout settings."""
    r = cfg.rollout
    eos = list(dict.fromkeys([tokenizer.eos_id, *r.stop_token_ids, *tokenizer.end_ids]))
    out = {"bos_token_id": tokenizer.bos_id, "eos_token_id": eos[0] if len(eos) == 1 else eos,
           "pad_token_id": tokenizer.pad_id, "max_new_tokens": r.max_new_tokens,
           "do_sample": not r.greedy}
    if not r.greedy:
        out.update(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
    return out


def tokenizer_files(cfg: Config, fallback_dir: str | None) -> list[str]:
    """The tokenizer's files: everything transformers reads beside ``tokenizer.path``
    (tokenizer.json, its config, the chat template), else those in ``fallback_dir``."""
    path = cfg.tokenizer.path
    folder = (path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))) \
        if path else fallback_dir
    files = [os.path.join(folder, f) for f in TOKENIZER_FILES
             if folder and os.path.exists(os.path.join(folder, f))]
    if path and cfg.tokenizer.type == "sentencepiece" and os.path.isfile(path):
        files.append(path)  # as tokenizer.model
    return files


def export_checkpoint(cfg: Config, out: str, ckpt: str, role_name: str | None = None,
                      model_type: str | None = None, shard_layers: int = 0,
                      tokenizer=None, tokenizer_dir: str | None = None,
                      written: Written | None = None, stream: bool = True,
                      peft: bool = False) -> dict:
    """Write ``ckpt``'s role ``role_name`` (default: its actor/policy, else its only role)
    to ``out``. ``tokenizer`` (when given) fills generation_config.json. ``stream``: read
    and write a layer at a time (else load the model whole first). A model with LoRA
    adapters is written with them merged into its weights, or with ``peft`` as the PEFT
    adapter folder alone (``models.lora.write_peft``)."""
    from megarlhf.engine.checkpoint import policy_role, read_meta, resolve_checkpoint
    from megarlhf.models.hf_mapping import MOE_NAMES, ConversionError
    from megarlhf.roles.spec import single_role_spec
    from megarlhf.parallel.launch import init_distributed, shutdown

    ckpt = resolve_checkpoint(ckpt)
    meta = read_meta(ckpt)
    role = policy_role(meta, role_name, ckpt)
    kind = meta["roles"][role].get("kind", "lm")
    written = written or Written.differing(cfg)  # before the changes below
    cfg = dataclasses.replace(
        cfg, checkpoint=dataclasses.replace(cfg.checkpoint, load=ckpt),
        parallel=dataclasses.replace(cfg.parallel, tensor_model_parallel_size=1,
                                     pipeline_model_parallel_size=1,
                                     virtual_pipeline_model_parallel_size=None))
    # The model is the checkpoint's own (the config's written fields must agree with it).
    spec = single_role_spec(cfg, name=role, kind=kind, world_size=1, trained=False,
                            checkpoint_role=role, written=written)
    model_cfg = spec.model
    m = dataclasses.asdict(model_cfg)
    m["num_query_groups"] = model_cfg.query_groups
    m["ffn_hidden_size"] = model_cfg.ffn_size
    m["tie_word_embeddings"] = model_cfg.tied
    moe, mla = model_cfg.moe.enabled, model_cfg.mla.enabled
    model_type = model_type or meta["trainer"].get("hf_model_type") or (
        "gpt2" if model_cfg.arch == "gpt2" else "deepseek_v3" if mla else
        ("glm4_moe" if model_cfg.moe.score_function == "sigmoid" else
         "gpt_oss" if model_cfg.attention_sinks else
         "qwen3_moe" if model_cfg.qk_layernorm else "mixtral") if moe else
        "gemma3_text" if model_cfg.norm_zero_centered else
        ("olmo3" if model_cfg.sliding_window else "olmo2")
        if model_cfg.norm_placement == "post" else
        "qwen3" if model_cfg.qk_layernorm else "qwen2" if model_cfg.qkv_bias else
        "smollm3" if model_cfg.no_rope_layers else
        "mistral" if model_cfg.sliding_window else "llama")
    if moe != (model_type in MOE_NAMES):
        raise ConversionError(f"--model-type {model_type} does not fit the checkpoint's "
                              f"{'mixture-of-experts' if moe else 'dense'} model")
    if mla != (model_type == "deepseek_v3"):
        raise ConversionError(f"--model-type {model_type} does not fit the checkpoint's "
                              f"{'multi-latent' if mla else 'grouped-query'} attention")
    refuse_inexpressible(model_type, model_cfg)
    if kind == "value" and model_type not in VALUE_HEADS:
        raise ConversionError(f"transformers has no {model_type} sequence-classification "
                              f"model to hold role '{role}' (a value model)")
    if peft and model_type == "phi3":
        raise ConversionError("--peft writes adapters on q_proj / k_proj / v_proj / gate_proj "
                              "/ up_proj, which Phi-3 fuses (qkv_proj, gate_up_proj): export "
                              "without --peft (the adapters merged into the weights)")
    if peft and not (model_cfg.lora.enabled and kind == "lm"):
        raise ConversionError(f"--peft writes a causal LM's LoRA adapters; role '{role}' "
                              + ("is a value model" if model_cfg.lora.enabled else
                                 "has none (model.lora.rank is 0)") + ": export it without "
                              "--peft")
    init_distributed(cfg)
    try:
        if peft:
            tensors = _adapters(spec, role, kind)
            lora.write_peft(out, tensors, model_cfg)
            return {"role": f"{role} ({kind})", "checkpoint": ckpt,
                    "parameters": sum(t.numel() for t in tensors.values()),
                    "files": ["adapter_config.json", "adapter_model.safetensors"]}
        os.makedirs(out, exist_ok=True)
        write = _write_streamed if stream else _write_whole
        files, count = write(spec, role, kind, model_type, m, out, shard_layers, cfg.run.seed)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump({**hf_config(model_type, m, kind),
                       **({"pad_token_id": tokenizer.pad_id} if tokenizer is not None and
                          model_type != "gpt2" else {})}, f, indent=1)
        copied = []
        for path in tokenizer_files(cfg, tokenizer_dir):
            name = os.path.basename(path)
            name = "tokenizer.model" if name.endswith(".model") else name
            if os.path.abspath(path) != os.path.abspath(os.path.join(out, name)):
                shutil.copy(path, os.path.join(out, name))
            copied.append(name)
        if tokenizer is not None and kind == "lm":
            with open(os.path.join(out, "generation_config.json"), "w") as f:
                json.dump(generation_config(cfg, tokenizer), f, indent=1)
            copied.append("generation_config.json")
        return {"model_type": model_type, "role": f"{role} ({kind})", "checkpoint": ckpt,
                "parameters": count, "files": ["config.json", *files, *copied]}
    finally:
        shutdown()


def _check_value_bias(kind: str, sd: dict) -> None:
    from megarlhf.models.hf_mapping import ConversionError

    if kind == "value" and sd.get("output_layer.bias", torch.zeros(1)).abs().max() > 0:
        raise ConversionError("the value head has a non-zero bias, which HF's "
                              "*ForSequenceClassification 'score' layer cannot hold")


def _write_whole(spec, role: str, kind: str, model_type: str, m: dict, out: str,
                 shard_layers: int, seed: int) -> tuple[list[str], int]:
    """The model loaded whole, converted and saved by safetensors (the reference)."""
    from safetensors.torch import save_file

    from megarlhf.models.hf_mapping import megatron_to_hf
    from megarlhf.roles.build import build_role

    (chunk,) = build_role(spec, seed=seed).chunks
    sd = lora.merged({k: v.detach() for k, v in chunk.state_dict().items()
                      if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")},
                     spec.model)
    _check_value_bias(kind, sd)
    tensors = megatron_to_hf(model_type, m, sd, spec.model.vocab_size, kind)
    plan = shard_files(list(tensors), m["num_layers"], shard_layers)
    for fname, names in plan.items():
        save_file({n: tensors[n] for n in names}, os.path.join(out, fname),
                  metadata={"format": "pt"})
    return _index(out, plan), sum(t.numel() for t in tensors.values())


def _write_streamed(spec, role: str, kind: str, model_type: str, m: dict, out: str,
                    shard_layers: int, seed: int) -> tuple[list[str], int]:
    """The model read, converted and written a layer at a time (module docstring)."""
    from megarlhf.engine.checkpoint import load_parameters
    from megarlhf.engine.streaming import SafetensorsFiles
    from megarlhf.models.hf_mapping import hf_layer_tensors, hf_outer_sources, megatron_to_hf

    chunk, everything = _meta_chunk(spec, kind)
    params = {k: v for k, v in everything.items() if not lora.is_adapter(k)}
    vocab = spec.model.vocab_size
    shapes = megatron_to_hf(model_type, m, params, vocab, kind)  # meta: shapes only
    plan = shard_files(list(shapes), m["num_layers"], shard_layers)
    writer = SafetensorsFiles(out, {f: {n: shapes[n] for n in names}
                                    for f, names in plan.items()}, {"format": "pt"})
    try:
        if kind == "value" and "output_layer.bias" in params:
            _check_value_bias(kind, load_parameters(spec.checkpoint, role, chunk,
                                                    ["output_layer.bias"]))
        # one outer tensor at a time (the embedding and the LM head are the largest)
        for name, (source, make) in hf_outer_sources(model_type, m, vocab, kind).items():
            loaded = load_parameters(spec.checkpoint, role, chunk, [source])
            writer.write(name, make(loaded.pop(source)))
        for i in range(m["num_layers"]):  # (a LoRA layer's adapters merged as it is read)
            names = [n for n in everything if n.startswith(f"decoder.layers.{i}.")]
            sd = lora.merged(load_parameters(spec.checkpoint, role, chunk, names), spec.model)
            for name, tensor in hf_layer_tensors(model_type, m, i, sd).items():
                writer.write(name, tensor)
            del sd
        writer.finish()
    finally:
        writer.close()
    return _index(out, plan), sum(t.numel() for t in shapes.values())


def _meta_chunk(spec, kind: str):
    """The model at TP=1 on the meta device (megatron's modules, no storage) and its
    tensors' names and shapes."""
    from megarlhf.models.gpt import build_model
    from megarlhf.parallel.layout import build_layout

    layout = build_layout(spec.layout)
    with torch.device("meta"):
        chunk = build_model(spec.model, kind=kind, padded_vocab=spec.padded_vocab,
                            layout=layout.layout, pg_collection=layout.pg_collection,
                            pre_process=True, post_process=True)
    return chunk, {k: v for k, v in chunk.state_dict(keep_vars=True).items()
                   if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}


def _adapters(spec, role: str, kind: str) -> dict[str, torch.Tensor]:
    """The checkpoint's LoRA adapters, whole, by PEFT key (only they are read)."""
    from megarlhf.engine.checkpoint import load_parameters

    chunk, everything = _meta_chunk(spec, kind)
    names = [k for k in everything if lora.is_adapter(k)]
    return lora.peft_from_state(load_parameters(spec.checkpoint, role, chunk, names))


def shard_files(names: list[str], num_layers: int, shard_layers: int) -> dict[str, list[str]]:
    """The safetensors files of an export and the HF tensors in each: one file, or one per
    ``shard_layers`` layers (embeddings, final norm and head with the first)."""
    if shard_layers <= 0 or shard_layers >= num_layers:
        return {"model.safetensors": list(names)}
    groups: dict[int, list[str]] = {}
    for name in names:
        parts = name.split(".")
        layer = int(parts[parts.index("layers") + 1]) if "layers" in parts else \
            int(parts[parts.index("h") + 1]) if ".h." in name else -1
        groups.setdefault(max(layer, 0) // shard_layers, []).append(name)
    total = len(groups)
    return {f"model-{i + 1:05d}-of-{total:05d}.safetensors": group
            for i, (_, group) in enumerate(sorted(groups.items()))}


def _index(out: str, plan: dict[str, list[str]]) -> list[str]:
    """Write the index of a sharded export; the files written."""
    files = list(plan)
    if len(plan) > 1:
        weight_map = {n: fname for fname, names in plan.items() for n in names}
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
        files.append("model.safetensors.index.json")
    return files
