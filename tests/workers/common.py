"""Helpers shared by the multi-rank test workers (run under torchrun)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarlhf.config import load_config
from megarlhf.roles.build import build_from_config
from megarlhf.parallel.launch import init_distributed


# A Qwen3-shaped llama: a head size of its own (32 where hidden / heads is 16), q/k RMSNorm,
# llama3 RoPE scaling from an original context of 8 (the test sequences are longer).
QWEN3_FIELDS = ("model.head_dim=32", "model.qk_layernorm=true", "model.rope_scaling.type=llama3",
                "model.rope_scaling.factor=4",
                "model.rope_scaling.original_max_position_embeddings=8")
# A Qwen3-MoE-shaped one: 4 experts, top 2, no load-balancing loss (a padded pass's routers
# would count the padding tokens a packed one does not feed).
MOE_FIELDS = (*QWEN3_FIELDS, "model.moe.num_experts=4", "model.moe.top_k=2",
              "model.moe.ffn_hidden_size=32", "model.moe.aux_loss_coeff=0")
# An OLMo-3-shaped one with GLM's partial rotary: norms after the sublayers, q/k normalised
# over all heads (a weight split over TP), a window of 6 in layers 0-2, half of each head
# rotated.
OLMO3_FIELDS = ("model.norm_placement=post", "model.qk_layernorm=true",
                "model.qk_layernorm_all_heads=true", "model.sliding_window=6",
                "model.full_attention_layers=[3]", "model.rotary_percent=0.5")
# A Gemma-3-shaped one: sandwich and (1 + w) norms, GeGLU, a scaled embedding, a softmax
# scale of its own, a window of 6 in layers 0-2 with a RoPE base of their own.
GEMMA3_FIELDS = ("model.norm_placement=sandwich", "model.norm_zero_centered=true",
                 "model.qk_layernorm=true", "model.activation=gelu_tanh",
                 "model.embedding_multiplier=2.0", "model.softmax_scale=0.3",
                 "model.sliding_window=6", "model.full_attention_layers=[3]",
                 "model.local_rotary_base=100.0")
# A gpt-oss-shaped one: 4 experts (top 2) with biases on every linear, a sink per head, the
# clamped SwiGLU (limit 0.5: these small activations reach it) with its +1 offset, windows
# of 6 in layers 0 and 2, YaRN untruncated from an original context of 8; each expert
# whole on one rank (ETP=1, as megatron-core needs for biased experts).
GPT_OSS_FIELDS = ("model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden_size=32",
                  "model.moe.aux_loss_coeff=0", "model.linear_bias=true",
                  "model.attention_sinks=true", "model.activation_alpha=1.702",
                  "model.glu_clamp=0.5", "model.glu_linear_offset=1.0",
                  "model.sliding_window=6", "model.full_attention_layers=[1,3]",
                  "model.rope_scaling.type=yarn", "model.rope_scaling.factor=4",
                  "model.rope_scaling.original_max_position_embeddings=8",
                  "model.rope_scaling.truncate=false", "parallel.expert_tensor_parallel_size=1")
FAMILIES = {"llama": ("llama", ()), "gpt2": ("gpt2", ()), "qwen3": ("llama", QWEN3_FIELDS),
            "qwen3moe": ("llama", MOE_FIELDS), "olmo3": ("llama", OLMO3_FIELDS),
            "gemma3": ("llama", GEMMA3_FIELDS), "gptoss": ("llama", GPT_OSS_FIELDS)}


def make_config(arch: str, tp: int, pp: int, *, vocab: int = 300, layers: int = 4,
                hidden: int = 64, extra: tuple = ()):
    """A tiny model config; ``arch`` is a key of FAMILIES (llama, gpt2, qwen3, qwen3moe,
    olmo3, gemma3, gptoss)."""
    arch, fields = FAMILIES[arch]
    extra = (*fields, *extra)
    return load_config(None, [
        f"model.arch={arch}", f"model.vocab_size={vocab}", f"model.num_layers={layers}",
        f"model.hidden_size={hidden}", "model.num_attention_heads=4", "model.num_query_groups=2",
        "model.max_position_embeddings=64", "parallel.make_vocab_size_divisible_by=16",
        f"parallel.tensor_model_parallel_size={tp}",
        f"parallel.pipeline_model_parallel_size={pp}", "run.seed=7", *extra])


def start(cfg) -> None:
    """Start the process group once (later cases reuse it)."""
    if not dist.is_initialized():
        init_distributed(cfg)


def build(cfg, kind: str = "lm", *, trained: bool = False, seed_offset: int = 0,
          total_steps: int = 10, name: str = "model"):
    """A role from the config's ``model``/``parallel`` (and ``checkpoint.load``), built by
    the one role builder the stages use."""
    start(cfg)
    return build_from_config(cfg, kind=kind, trained=trained, name=name,
                             total_steps=total_steps, seed=cfg.run.seed + seed_offset)


def fixed_sequences(num: int = 6, vocab: int = 300, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [5, 17, 9, 2, 13, 8, 11, 16][:num]
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
