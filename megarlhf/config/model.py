"""The model's shape and precision: ``model`` (and ``model.fp8``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from megarlhf.config.fields import require


RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "moe", "moe_act", "shared_experts",
                     "mla_up_proj")


@dataclass(kw_only=True, frozen=True)
class RecomputeConfig:
    """Activation recomputation (megatron-core's): activations are dropped after the
    forward pass and computed again in the backward pass, trading compute for memory. The
    numbers do not change (the recomputed forward is the same arithmetic). Set per role
    with ``roles.<name>.model.recompute``; frozen roles have no backward pass and ignore
    it."""

    granularity: Literal["full", "selective"] | None = None
    """full: whole transformer layers are recomputed, only their inputs kept (the most
    memory saved, about a forward pass more compute); selective: only ``modules`` of each
    layer are (core attention by default: its scores are the largest activation of a long
    sequence and the cheapest to recompute). None: every activation is kept."""
    method: Literal["uniform", "block"] = "uniform"
    """full: uniform splits each pipeline stage's layers into groups of ``num_layers`` and
    keeps each group's input; block recomputes the first ``num_layers`` layers of each
    stage and keeps every activation of the others."""
    num_layers: int = 1
    """full: the layers of a group (uniform; must divide a stage's layers), or the layers
    recomputed per stage (block; at most a stage's layers)."""
    modules: list[str] = field(default_factory=lambda: ["core_attn"])
    """selective: the parts recomputed - core_attn (attention scores and softmax), mlp (a
    dense MLP), layernorm (the norms before attention and MLP), moe (a whole MoE layer),
    shared_experts, moe_act (needs grouped GEMM experts), mla_up_proj (multi-latent
    attention's up projections)."""

    def __post_init__(self):
        require(self.num_layers >= 1, "model.recompute.num_layers", self.num_layers,
                "must be >= 1")
        bad = [m for m in self.modules if m not in RECOMPUTE_MODULES]
        require(not bad, "model.recompute.modules", self.modules,
                f"has unknown modules {bad}: choose from {', '.join(RECOMPUTE_MODULES)}")
        require(bool(self.modules) or self.granularity != "selective",
                "model.recompute.modules", self.modules,
                "must name at least one module with granularity=selective")


@dataclass(kw_only=True, frozen=True)
class FP8Config:
    enabled: bool = False
    """Run linear layers in fp8 through TransformerEngine (GPU with TE only)."""
    format: Literal["e4m3", "hybrid"] = "hybrid"
    """fp8 format: e4m3 everywhere, or hybrid (e4m3 forward, e5m2 backward)."""
    recipe: Literal["delayed", "tensorwise", "blockwise", "mxfp8"] = "delayed"
    """Scaling recipe passed to TransformerEngine."""
    amax_history_len: int = 1024
    """Length of the amax history window (delayed scaling)."""
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    """How the scale is derived from the amax history (delayed scaling)."""
    margin: int = 0
    """Scaling-factor margin (delayed scaling)."""
    num_layers_at_start_in_bf16: int = 0
    """Keep this many first transformer layers in bf16."""
    num_layers_at_end_in_bf16: int = 0
    """Keep this many last transformer layers in bf16."""

    def __post_init__(self):
        require(self.amax_history_len >= 1, "model.fp8.amax_history_len",
                self.amax_history_len, "must be >= 1")
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16", "margin"):
            require(getattr(self, name) >= 0, f"model.fp8.{name}", getattr(self, name),
                    "must be >= 0")


@dataclass(kw_only=True, frozen=True)
class RopeScalingConfig:
    type: Literal["none", "linear", "llama3", "yarn"] = "none"
    """How RoPE's frequencies are stretched for a context longer than pretraining: none;
    linear (positions divided by ``factor``); llama3 (Llama 3.1 and later: wavelengths
    longer than original_max_position_embeddings / low_freq_factor divided by ``factor``,
    those shorter than original_max_position_embeddings / high_freq_factor kept, a smooth
    ramp between); yarn (YaRN, as Qwen's long-context configs: frequencies blended between
    the original and the divided ones by a ramp from beta_fast to beta_slow rotations, and
    cos / sin scaled by 0.1 ln(factor) + 1, or by the mscale ratio). The converter reads
    it from config.json's rope_scaling."""
    factor: float = 1.0
    """Scaling factor (linear, llama3)."""
    low_freq_factor: float = 1.0
    """llama3: where the ramp starts (Llama 3.1: 1)."""
    high_freq_factor: float = 4.0
    """llama3: where the ramp ends (Llama 3.1: 4)."""
    original_max_position_embeddings: int = 8192
    """llama3, yarn: the context the model was pretrained at (Llama 3.1: 8192)."""
    beta_fast: float = 32.0
    """yarn: rotations where the ramp starts (dimensions kept as they were)."""
    beta_slow: float = 1.0
    """yarn: rotations where the ramp ends (dimensions fully divided by factor)."""
    mscale: float | None = None
    """yarn: with mscale_all_dim, the attention factor is their ratio of 0.1 m ln(factor) + 1
    (DeepSeek's form); null: 0.1 ln(factor) + 1."""
    mscale_all_dim: float | None = None
    """yarn: see mscale."""
    truncate: bool = True
    """yarn: the ramp's ends rounded to whole dimensions (transformers' truncate, true by
    default); false keeps them fractional, as gpt-oss's config says."""

    def __post_init__(self):
        require(self.factor > 0, "model.rope_scaling.factor", self.factor, "must be > 0")
        for name in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
            require(getattr(self, name) > 0, f"model.rope_scaling.{name}",
                    getattr(self, name), "must be > 0")
        for name in ("mscale", "mscale_all_dim"):
            value = getattr(self, name)
            if value is not None:
                require(value >= 0, f"model.rope_scaling.{name}", value, "must be >= 0 or null")
        require(self.original_max_position_embeddings >= 1,
                "model.rope_scaling.original_max_position_embeddings",
                self.original_max_position_embeddings, "must be >= 1")


@dataclass(kw_only=True, frozen=True)
class MoEConfig:
    num_experts: int = 0
    """Routed experts per mixture-of-experts layer; 0: a dense model (every other field is
    then unused)."""
    top_k: int = 2
    """Experts each token is sent to."""
    ffn_hidden_size: int | None = None
    """One expert's MLP width; None: model.ffn_hidden_size."""
    shared_expert_ffn_hidden_size: int = 0
    """Width of the shared expert MLP every token also passes through (DeepSeek, Qwen2-MoE:
    the shared experts together); 0: none."""
    score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax (Mixtral, Qwen3-MoE) or sigmoid (DeepSeek-V3)."""
    normalize_top_k: bool = True
    """Renormalise the chosen experts' scores to sum to 1 (Mixtral; Qwen3-MoE's
    norm_topk_prob). With softmax and false, the weights are the softmax over all experts."""
    top_k_scaling_factor: float | None = None
    """Multiply the chosen experts' weights by this (DeepSeek-V3's routed_scaling_factor)."""
    expert_bias: bool = False
    """A per-expert bias added to the scores for choosing experts only, moved towards
    balanced load after each step (DeepSeek-V3's aux-loss-free balancing)."""
    expert_bias_update_rate: float = 1e-3
    """How far the expert bias moves per step (with expert_bias)."""
    first_k_dense: int = 0
    """The first layers keep a dense MLP of model.ffn_hidden_size (DeepSeek-V3: 3)."""
    aux_loss_coeff: float = 0.0
    """Load-balancing loss coefficient (Switch / GShard form, megatron's aux_loss); added
    to every training loss and logged as moe/aux_loss."""
    z_loss_coeff: float = 0.0
    """Router z-loss coefficient (logged as moe/z_loss)."""
    num_groups: int | None = None
    """Group-limited routing (DeepSeek-V3's n_group): the experts fall into this many
    groups, each scored by the sum of its top top_k / group_top_k scores, and a token
    chooses its experts within its best group_top_k groups only; None: no groups."""
    group_top_k: int | None = None
    """Groups a token may route to (DeepSeek-V3's topk_group), with num_groups."""
    router_fp32: bool = False
    """Compute the router's logits and scores in float32 whatever params_dtype is
    (DeepSeek-V3's gate does)."""
    capacity_factor: float | None = None
    """Tokens an expert takes per step, as a multiple of an even share; None: no limit
    (no token is dropped)."""
    drop_policy: Literal["probs", "position"] = "probs"
    """Which tokens an over-full expert drops: the lowest scores, or the latest."""

    def __post_init__(self):
        require(self.num_experts >= 0, "model.moe.num_experts", self.num_experts,
                "must be >= 0 (0: a dense model)")
        require(self.top_k >= 1, "model.moe.top_k", self.top_k, "must be >= 1")
        if self.num_experts:
            require(self.top_k <= self.num_experts, "model.moe.top_k", self.top_k,
                    f"must be between 1 and model.moe.num_experts={self.num_experts}")
        if self.ffn_hidden_size is not None:
            require(self.ffn_hidden_size >= 1, "model.moe.ffn_hidden_size",
                    self.ffn_hidden_size, "must be >= 1 or null")
        for name in ("shared_expert_ffn_hidden_size", "first_k_dense", "aux_loss_coeff",
                     "z_loss_coeff", "expert_bias_update_rate"):
            require(getattr(self, name) >= 0, f"model.moe.{name}", getattr(self, name),
                    "must be >= 0")
        if self.top_k_scaling_factor is not None:
            require(self.top_k_scaling_factor > 0, "model.moe.top_k_scaling_factor",
                    self.top_k_scaling_factor, "must be > 0 or null")
        if self.capacity_factor is not None:
            require(self.capacity_factor > 0, "model.moe.capacity_factor",
                    self.capacity_factor, "must be > 0 or null")
        if self.num_experts and self.score_function == "sigmoid":
            require(self.normalize_top_k == (self.top_k > 1), "model.moe.normalize_top_k",
                    self.normalize_top_k, f"must be {str(self.top_k > 1).lower()} with "
                    f"score_function=sigmoid and top_k={self.top_k} (megatron's sigmoid "
                    "router renormalises the chosen experts' scores exactly when top_k > 1)")
        require((self.num_groups is None) == (self.group_top_k is None),
                "model.moe.group_top_k", self.group_top_k,
                f"must be set exactly when model.moe.num_groups is (it is {self.num_groups})")
        if self.num_groups is not None and self.num_experts:
            require(self.num_groups >= 1 and self.num_experts % self.num_groups == 0,
                    "model.moe.num_groups", self.num_groups,
                    f"must divide model.moe.num_experts={self.num_experts}")
            require(1 <= self.group_top_k <= self.num_groups, "model.moe.group_top_k",
                    self.group_top_k, f"must be between 1 and model.moe.num_groups="
                    f"{self.num_groups}")
            require(self.top_k % self.group_top_k == 0 and self.top_k // self.group_top_k
                    <= self.num_experts // self.num_groups, "model.moe.top_k", self.top_k,
                    f"must be a multiple of model.moe.group_top_k={self.group_top_k} whose "
                    f"quotient fits in a group of {self.num_experts // self.num_groups} "
                    "experts (each group is scored by its top top_k / group_top_k)")

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0


# PEFT's names of a Llama-style layer's linears (megatron fuses q/k/v into linear_qkv and
# gate/up into linear_fc1; each keeps its own adapter inside the fused linear)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(kw_only=True, frozen=True)
class LoRAConfig:
    """Low-rank adapters (LoRA, as PEFT defines them): each targeted linear computes
    ``W x + (alpha / rank) B A dropout(x)``, ``A`` (rank x in) and ``B`` (out x rank) its
    only trained weights; the base weights are frozen (no gradients, no optimizer state).
    ``A`` starts as PEFT's (uniform within 1/sqrt(in), seeded per tensor so every layout
    starts alike) and ``B`` at zero, so a new adapter leaves the model as it was. Set per
    role with ``roles.<name>.model.lora``. Llama-style models (dense or MoE: a mixture of
    experts' routed experts are not adapted, its attention and dense layers are)."""

    rank: int = 0
    """Adapter rank r; 0: no adapters (the whole model trains)."""
    alpha: float = 16.0
    """Scale numerator: the adapter's output is multiplied by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input (PEFT's lora_dropout), in training passes only."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """The linears that get adapters, by PEFT's names: q_proj, k_proj, v_proj, o_proj,
    gate_proj, up_proj, down_proj (all of them by default; PEFT's all-linear)."""
    init_from: str | None = None
    """A PEFT LoRA adapter folder (adapter_config.json, adapter_model.safetensors) the
    adapters start from, checked against rank, alpha, target_modules and the model's
    shapes before any work; a checkpoint that holds adapters (a resume) wins over it."""

    def __post_init__(self):
        require(self.rank >= 0, "model.lora.rank", self.rank, "must be >= 0 (0: no adapters)")
        require(self.alpha > 0, "model.lora.alpha", self.alpha, "must be > 0")
        require(0.0 <= self.dropout < 1.0, "model.lora.dropout", self.dropout,
                "must be in [0, 1)")
        unknown = [t for t in self.target_modules if t not in LORA_TARGETS]
        require(not unknown, "model.lora.target_modules", self.target_modules,
                f"names {unknown}, which a Llama-style layer does not have: choose from "
                f"{', '.join(LORA_TARGETS)}")
        require(bool(self.target_modules) or not self.rank, "model.lora.target_modules",
                self.target_modules, "must name at least one linear with model.lora.rank > 0")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass(kw_only=True, frozen=True)
class MLAConfig:
    kv_lora_rank: int = 0
    """Multi-latent attention (DeepSeek-V2/V3): keys and values are projected up from a
    compressed latent of this width, shared by the heads; 0: standard attention (every
    other field is then unused)."""
    q_lora_rank: int | None = None
    """Width of the queries' compressed latent; None: queries projected directly."""
    qk_head_dim: int = 128
    """Per head, the query/key width that carries no rotary embedding (qk_nope_head_dim)."""
    qk_pos_emb_head_dim: int = 64
    """Per head, the query/key width that carries the rotary embedding (qk_rope_head_dim;
    the key's part is shared by the heads)."""
    v_head_dim: int = 128
    """Per head, the value width."""

    def __post_init__(self):
        require(self.kv_lora_rank >= 0, "model.mla.kv_lora_rank", self.kv_lora_rank,
                "must be >= 0 (0: standard attention)")
        if self.q_lora_rank is not None:
            require(self.q_lora_rank >= 1, "model.mla.q_lora_rank", self.q_lora_rank,
                    "must be >= 1 or null")
        for name in ("qk_head_dim", "v_head_dim"):
            require(getattr(self, name) >= 1, f"model.mla.{name}", getattr(self, name),
                    "must be >= 1")
        require(self.qk_pos_emb_head_dim >= 2 and self.qk_pos_emb_head_dim % 2 == 0,
                "model.mla.qk_pos_emb_head_dim", self.qk_pos_emb_head_dim,
                "must be an even number >= 2")

    @property
    def enabled(self) -> bool:
        return self.kv_lora_rank > 0


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    arch: Literal["llama", "gpt2"] = "llama"
    """Llama-style (RMSNorm, SwiGLU, RoPE, untied) or GPT-2-style (LayerNorm, GELU,
    learned positions, tied embeddings, biases)."""
    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 64
    """Model width."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention; None means one per query head."""
    head_dim: int | None = None
    """Size of one attention head; None means hidden_size / num_attention_heads. Qwen3 and
    Mistral-Nemo-style models set their own (the attention width heads x head_dim then
    differs from hidden_size)."""
    qk_layernorm: bool = False
    """Normalise each query and key head (RMSNorm for llama, LayerNorm for gpt2) before
    RoPE, as Qwen3 does."""
    qk_layernorm_all_heads: bool = False
    """With qk_layernorm: one RMSNorm over a token's queries (and one over its keys) of
    every head together, as OLMo 2 and 3 do, instead of head by head."""
    norm_placement: Literal["pre", "post", "sandwich"] = "pre"
    """Where a layer's norms sit: pre (Llama: before attention and before the MLP), post
    (OLMo 2 and 3: none before, one on each sublayer's output before the residual) or
    sandwich (Gemma 3: both)."""
    norm_zero_centered: bool = False
    """Every RMSNorm scales by (1 + weight), its weight stored zero-centred (Gemma)."""
    activation: Literal["silu", "gelu_tanh"] | None = None
    """The gated MLP's activation (llama): silu (SwiGLU) or gelu_tanh (GeGLU, Gemma's
    gelu_pytorch_tanh). None: the architecture's default (silu; gpt2's ungated GELU)."""
    activation_alpha: float = 1.0
    """The gated MLP's silu as x * sigmoid(alpha * x): 1 is silu itself; gpt-oss's experts
    use 1.702 (its swiglu_alpha)."""
    glu_clamp: float | None = None
    """The gated MLP's inputs clamped before the gate: the activated half at most this, the
    linear half within +-this (gpt-oss: 7, its swiglu_limit; megatron's
    activation_func_clamp_value). None: no clamp."""
    glu_linear_offset: float = 0.0
    """Added to the gated MLP's linear half before the product (gpt-oss: 1: act(gate) *
    (up + 1); megatron's glu_linear_offset)."""
    linear_bias: bool = False
    """Biases on every linear of a layer (llama): the query/key/value and output
    projections, the MLP's, a router's and each expert's, as gpt-oss has them (megatron's
    add_bias_linear; gpt2 always has them)."""
    attention_sinks: bool = False
    """A learned logit per query head that joins every query's softmax over the keys and
    takes its share of the attention to no value (gpt-oss's sinks; megatron's
    softmax_type='learnable')."""
    embedding_multiplier: float = 1.0
    """The word embeddings are multiplied by this before the first layer (Gemma:
    sqrt(hidden_size))."""
    softmax_scale: float | None = None
    """Attention's softmax scale; None: 1 / sqrt(head size) (Gemma 3: query_pre_attn_scalar
    ** -0.5)."""
    local_rotary_base: float | None = None
    """RoPE theta of the sliding-window layers (Gemma 3's local layers, its
    rope_local_base_freq), without rope_scaling; None: rotary_base in every layer."""
    ffn_hidden_size: int | None = None
    """MLP width; None means 4 x hidden (gpt2) or the Llama 8/3 x hidden rounded to 64."""
    max_position_embeddings: int = 512
    """Longest sequence the model handles (size of learned position table)."""
    rotary_base: float = 10000.0
    """RoPE theta (llama)."""
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    """RoPE frequency scaling for long context (llama)."""
    rotary_percent: float = 1.0
    """The share of each query/key head's width that RoPE rotates, from its start (the rest
    passes unrotated): partial rotary, as GLM-4.5 (0.5) and Phi-4-mini (0.75) have it
    (config.json's partial_rotary_factor). 1: the whole head."""
    sliding_window: int | None = None
    """Sliding-window attention: a token sees itself and the sliding_window - 1 tokens
    before it (config.json's sliding_window, as transformers masks it; megatron's
    window_size is (sliding_window - 1, 0)), in every layer but full_attention_layers.
    None: every layer sees the whole context."""
    full_attention_layers: list[int] = field(default_factory=list)
    """With sliding_window: the layers (0-based) that see the whole context, as the local
    and global layers of gpt-oss, Gemma 3 and OLMo 3 alternate (config.json's layer_types;
    megatron's window_attn_skip_freq)."""
    no_rope_layers: list[int] = field(default_factory=list)
    """Layers (0-based) whose attention uses no rotary embedding at all (NoPE), as SmolLM3
    has every fourth (megatron's no_rope_freq). Empty: RoPE in every layer."""
    vocab_size: int | None = None
    """Vocabulary size before TP padding; None takes it from the tokenizer."""
    tie_word_embeddings: bool | None = None
    """Share input embedding and LM head; None means the architecture's default."""
    add_qkv_bias: bool | None = None
    """Biases on the QKV projection (Qwen2); None means the architecture's default."""
    norm_epsilon: float = 1e-5
    """Epsilon of LayerNorm / RMSNorm."""
    init_method_std: float = 0.02
    """Std of the normal weight initialisation."""
    hidden_dropout: float = 0.0
    """Dropout after attention and MLP (keep 0 for RM and PPO)."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities (keep 0 for RM and PPO)."""
    params_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter and compute dtype. CPU runs use float32."""
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    """Layer implementation: TransformerEngine when it imports and CUDA is present and the
    model is in bfloat16 or float16 or uses fp8 (auto), megatron-core's local layers with
    SDPA attention otherwise. TransformerEngine in float32 takes padded micro-batches only
    (its attention has no float32 kernel for packed ones)."""
    value_head_init: Literal["zero", "normal"] = "zero"
    """Scalar head init for value models: zero (critic, lm-human-preferences) or
    N(0, 1/sqrt(hidden+1)) (reward model)."""
    fp8: FP8Config = field(default_factory=FP8Config)
    """fp8 settings (GPU with TransformerEngine only)."""
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    """Activation recomputation in training (see RecomputeConfig)."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture of experts (llama only): routed experts in place of the dense MLP."""
    mla: MLAConfig = field(default_factory=MLAConfig)
    """Multi-latent attention (llama only) in place of grouped-query attention."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters (see LoRAConfig): only they train."""

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "num_attention_heads",
                     "max_position_embeddings"):
            require(getattr(self, name) >= 1, f"model.{name}", getattr(self, name), "must be >= 1")
        if self.head_dim is not None:
            require(self.head_dim >= 2 and self.head_dim % 2 == 0, "model.head_dim",
                    self.head_dim, "must be an even number >= 2 or null")
        require(0 < self.rotary_percent <= 1 and int(self.head_size * self.rotary_percent)
                % 2 == 0, "model.rotary_percent", self.rotary_percent,
                f"must be in (0, 1] and rotate an even number of the head's "
                f"{self.head_size} channels")
        require(self.rotary_percent == 1 or self.arch == "llama", "model.rotary_percent",
                self.rotary_percent, "is for llama (RoPE); gpt2 learns its positions")
        require(all(0 <= i < self.num_layers for i in self.no_rope_layers)
                and len(set(self.no_rope_layers)) == len(self.no_rope_layers),
                "model.no_rope_layers", self.no_rope_layers,
                f"must list distinct layers in 0..{self.num_layers - 1}")
        require(not self.qk_layernorm_all_heads or self.qk_layernorm,
                "model.qk_layernorm_all_heads", True, "needs model.qk_layernorm=true")
        for name in ("softmax_scale", "local_rotary_base"):
            require(getattr(self, name) is None or getattr(self, name) > 0, f"model.{name}",
                    getattr(self, name), "must be > 0 or null")
        require(self.embedding_multiplier > 0, "model.embedding_multiplier",
                self.embedding_multiplier, "must be > 0")
        require(self.activation_alpha > 0, "model.activation_alpha", self.activation_alpha,
                "must be > 0")
        require(self.glu_clamp is None or self.glu_clamp > 0, "model.glu_clamp",
                self.glu_clamp, "must be > 0 or null")
        require(math.isfinite(self.glu_linear_offset), "model.glu_linear_offset",
                self.glu_linear_offset, "must be a finite number")
        gated = self.arch == "llama" and self.activation in (None, "silu")
        for name, default in (("activation_alpha", 1.0), ("glu_clamp", None),
                              ("glu_linear_offset", 0.0)):
            require(getattr(self, name) == default or gated, f"model.{name}",
                    getattr(self, name), "shapes llama's SwiGLU: it needs model.arch=llama "
                    "and model.activation silu (or null)")
        require(not self.linear_bias or self.arch == "llama", "model.linear_bias", True,
                "is for llama; gpt2's linears always have biases")
        require(not self.attention_sinks or not self.mla.enabled, "model.attention_sinks",
                True, "is not supported with multi-latent attention (model.mla.kv_lora_rank)")
        require(self.local_rotary_base is None or self.sliding_window is not None,
                "model.local_rotary_base", self.local_rotary_base,
                "is the sliding-window layers' RoPE theta: set model.sliding_window")
        if self.own_layer:
            what = ("model.norm_placement", self.norm_placement) \
                if self.norm_placement != "pre" else ("model.qk_layernorm_all_heads", True) \
                if self.qk_layernorm_all_heads else ("model.norm_zero_centered", True) \
                if self.norm_zero_centered else ("model.local_rotary_base",
                                                 self.local_rotary_base)
            require(self.arch == "llama" and not self.moe.enabled and not self.mla.enabled,
                    *what, "is for a dense llama model (OLMo 2's layer; no mixture of "
                    "experts or latent attention yet)")
            require(self.transformer_impl != "transformer_engine", *what,
                    "is built from megatron's local layers: use model.transformer_impl "
                    "auto or local")
        require(self.sliding_window is None or self.sliding_window >= 1,
                "model.sliding_window", self.sliding_window, "must be >= 1 or null")
        require(all(0 <= i < self.num_layers for i in self.full_attention_layers)
                and len(set(self.full_attention_layers)) == len(self.full_attention_layers)
                and (self.sliding_window is not None or not self.full_attention_layers),
                "model.full_attention_layers", self.full_attention_layers,
                f"must list distinct layers in 0..{self.num_layers - 1}, with "
                "model.sliding_window set")
        require(not self.no_rope_layers or self.arch == "llama", "model.no_rope_layers",
                self.no_rope_layers, "is for llama (RoPE); gpt2 learns its positions")
        if self.ffn_hidden_size is not None:
            require(self.ffn_hidden_size >= 1, "model.ffn_hidden_size", self.ffn_hidden_size,
                    "must be >= 1 or null")
        require(0 < self.norm_epsilon < 1, "model.norm_epsilon", self.norm_epsilon,
                "must be in (0, 1)")
        require(self.init_method_std > 0, "model.init_method_std", self.init_method_std,
                "must be > 0")
        if self.vocab_size is not None:
            require(self.vocab_size >= 2, "model.vocab_size", self.vocab_size, "must be >= 2")
        for name in ("hidden_dropout", "attention_dropout"):
            require(0.0 <= getattr(self, name) < 1.0, f"model.{name}", getattr(self, name),
                    "must be in [0, 1)")
        if self.moe.enabled:
            require(self.arch == "llama", "model.arch", self.arch,
                    "must be llama for a mixture-of-experts model (model.moe.num_experts > 0)")
            require(self.moe.first_k_dense < self.num_layers, "model.moe.first_k_dense",
                    self.moe.first_k_dense,
                    f"must be below model.num_layers={self.num_layers} (some layer must be MoE)")

        if self.mla.enabled:
            require(self.arch == "llama", "model.arch", self.arch,
                    "must be llama for multi-latent attention (model.mla.kv_lora_rank > 0)")
            for name, bad in (("num_query_groups", self.num_query_groups not in
                               (None, self.num_attention_heads)),
                              ("head_dim", self.head_dim is not None),
                              ("qk_layernorm", self.qk_layernorm),
                              ("add_qkv_bias", bool(self.add_qkv_bias)),
                              ("rotary_percent", self.rotary_percent != 1),
                              ("no_rope_layers", bool(self.no_rope_layers)),
                              ("sliding_window", self.sliding_window is not None)):
                require(not bad, f"model.{name}", getattr(self, name),
                        "is not used by multi-latent attention (model.mla.kv_lora_rank > 0): "
                        "leave it unset")
            require(self.rope_scaling.type in ("none", "yarn"), "model.rope_scaling.type",
                    self.rope_scaling.type,
                    "must be none or yarn with multi-latent attention")
        if self.lora.enabled:
            self._check_lora()
        selective = self.recompute.modules if self.recompute.granularity == "selective" else []
        for module, missing in (("moe", not self.moe.enabled),
                                ("shared_experts", not self.moe.shared_expert_ffn_hidden_size),
                                ("moe_act", True),
                                ("mla_up_proj", not self.mla.enabled),
                                ("mlp", self.moe.enabled and self.moe.first_k_dense == 0)):
            require(module not in selective or not missing, "model.recompute.modules",
                    self.recompute.modules,
                    f"recomputes {module}, which this model does not have"
                    if module != "moe_act" else "recomputes moe_act, which needs grouped "
                    "GEMM experts (megarlhf's experts are not grouped): use moe")

    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear LoRA can target, by PEFT's name."""
        attn = self.num_attention_heads * self.head_size
        kv = self.query_groups * self.head_size
        h, f = self.hidden_size, self.ffn_size
        return {"q_proj": (h, attn), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (attn, h),
                "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}

    def _check_lora(self) -> None:
        require(self.arch == "llama", "model.arch", self.arch,
                "must be llama with LoRA adapters (model.lora.rank > 0): GPT-2's fused "
                "c_attn / c_fc are not PEFT's targets")
        require(not self.mla.enabled, "model.mla.kv_lora_rank", self.mla.kv_lora_rank,
                "does not take LoRA adapters yet (model.lora.rank > 0): its projections "
                "are not q_proj / k_proj / v_proj")
        require(self.transformer_impl != "transformer_engine", "model.transformer_impl",
                self.transformer_impl, "does not take LoRA adapters (model.lora.rank > 0): "
                "TransformerEngine's layers normalise inside linear_qkv / linear_fc1, whose "
                "input the adapters read; use auto or local")
        shapes = self.lora_shapes()
        for target in self.lora.target_modules:
            inp, out = shapes[target]
            require(self.lora.rank <= min(inp, out), "model.lora.rank", self.lora.rank,
                    f"is larger than {target} ({inp} -> {out}): an adapter's rank is at most "
                    "the smaller of the layer's widths")

    @property
    def own_layer(self) -> bool:
        """Whether the layer is megarlhf's own (``models.post_norm``: OLMo's and Gemma's
        norms, a rotary base per layer type) rather than megatron's stock local one."""
        return self.norm_placement != "pre" or self.qk_layernorm_all_heads \
            or self.norm_zero_centered or self.local_rotary_base is not None

    @property
    def expert_ffn_size(self) -> int:
        """One routed expert's MLP width."""
        return self.moe.ffn_hidden_size or self.ffn_size

    @property
    def head_size(self) -> int:
        """One attention head's width (``head_dim``, or hidden / heads)."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.arch == "gpt2":
            return 4 * self.hidden_size
        return 64 * ((8 * self.hidden_size // 3 + 63) // 64)

    @property
    def tied(self) -> bool:
        if self.tie_word_embeddings is not None:
            return self.tie_word_embeddings
        return self.arch == "gpt2"

    @property
    def qkv_bias(self) -> bool:
        if self.linear_bias:  # megatron's add_bias_linear reaches linear_qkv too
            return True
        if self.add_qkv_bias is not None:
            return self.add_qkv_bias
        return self.arch == "gpt2"


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Round the vocabulary up so every TP rank holds an equal slice that is a multiple
    of ``divisible_by`` (Megatron's convention)."""
    multiple = divisible_by * tp_size
    return ((vocab_size + multiple - 1) // multiple) * multiple
