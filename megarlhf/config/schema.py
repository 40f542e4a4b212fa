"""The typed config tree: one dataclass per component, a docstring under every field.

YAML files in ``configs/`` set fields of this tree and nothing else; ``key.sub=value``
overrides on the command line do the same. Validation that concerns one component lives
in that component's ``__post_init__``; checks that span components (the parallel layout
against the model shape and the world size) live in :func:`validate_layout`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megarlhf.config.layout import Layout


def _require(ok: bool, name: str, value, valid: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: {valid}")


@dataclass(kw_only=True)
class RunConfig:
    name: str = "megarlhf"
    """Run name; outputs go to ``{output_dir}/{name}``."""
    output_dir: str = "runs"
    """Parent folder of run directories (metrics, checkpoints, plots)."""
    seed: int = 1234
    """Seed for model initialisation, data order and sampling."""
    deterministic: bool = False
    """Use deterministic algorithms (bitwise-reproducible resumes on CPU)."""
    num_threads: int = 0
    """torch intra-op threads per process; 0 leaves torch's default."""

    def __post_init__(self):
        _require(bool(self.name) and "/" not in self.name, "run.name", self.name,
                 "a non-empty name without '/'")
        _require(self.num_threads >= 0, "run.num_threads", self.num_threads, "must be >= 0")


@dataclass(kw_only=True)
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
        _require(self.amax_history_len >= 1, "model.fp8.amax_history_len",
                 self.amax_history_len, "must be >= 1")
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16", "margin"):
            _require(getattr(self, name) >= 0, f"model.fp8.{name}", getattr(self, name),
                     "must be >= 0")


@dataclass(kw_only=True)
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
    ffn_hidden_size: int | None = None
    """MLP width; None means 4 x hidden (gpt2) or the Llama 8/3 x hidden rounded to 64."""
    max_position_embeddings: int = 512
    """Longest sequence the model handles (size of learned position table)."""
    rotary_base: float = 10000.0
    """RoPE theta (llama)."""
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
    """Layer implementation: TransformerEngine when it imports and CUDA is present
    (auto), megatron-core's local layers with SDPA attention otherwise."""
    value_head_init: Literal["zero", "normal"] = "zero"
    """Scalar head init for value models: zero (critic, lm-human-preferences) or
    N(0, 1/sqrt(hidden+1)) (reward model)."""
    fp8: FP8Config = field(default_factory=FP8Config)
    """fp8 settings (GPU with TransformerEngine only)."""

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "num_attention_heads",
                     "max_position_embeddings"):
            _require(getattr(self, name) >= 1, f"model.{name}", getattr(self, name), "must be >= 1")
        if self.ffn_hidden_size is not None:
            _require(self.ffn_hidden_size >= 1, "model.ffn_hidden_size", self.ffn_hidden_size,
                     "must be >= 1 or null")
        _require(0 < self.norm_epsilon < 1, "model.norm_epsilon", self.norm_epsilon,
                 "must be in (0, 1)")
        _require(self.init_method_std > 0, "model.init_method_std", self.init_method_std,
                 "must be > 0")
        _require(self.hidden_size % self.num_attention_heads == 0, "model.hidden_size",
                 self.hidden_size,
                 f"must be divisible by model.num_attention_heads={self.num_attention_heads}")
        if self.num_query_groups is not None:
            _require(self.num_query_groups >= 1
                     and self.num_attention_heads % self.num_query_groups == 0,
                     "model.num_query_groups", self.num_query_groups,
                     f"must divide model.num_attention_heads={self.num_attention_heads}")
        if self.vocab_size is not None:
            _require(self.vocab_size >= 2, "model.vocab_size", self.vocab_size, "must be >= 2")
        for name in ("hidden_dropout", "attention_dropout"):
            _require(0.0 <= getattr(self, name) < 1.0, f"model.{name}", getattr(self, name),
                     "must be in [0, 1)")

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
        if self.add_qkv_bias is not None:
            return self.add_qkv_bias
        return self.arch == "gpt2"


@dataclass(kw_only=True)
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """Tensor-parallel size of the training layout."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size of the training layout."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline stage (interleaved 1F1B schedule); None disables."""
    make_vocab_size_divisible_by: int = 128
    """The vocabulary is padded to a multiple of this times the TP size."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend. With CUDA, ``auto`` and ``nccl`` are NCCL for tensors on
    the GPU plus gloo for host-side bookkeeping (``cuda:nccl,cpu:gloo``); without CUDA,
    ``auto`` and ``gloo`` are gloo."""
    timeout_minutes: int = 30
    """Collective timeout."""

    def __post_init__(self):
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "make_vocab_size_divisible_by", "timeout_minutes"):
            _require(getattr(self, name) >= 1, f"parallel.{name}", getattr(self, name),
                     "must be >= 1")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None:
            _require(vpp >= 2 and self.pipeline_model_parallel_size >= 2,
                     "parallel.virtual_pipeline_model_parallel_size", vpp,
                     "must be >= 2 and needs parallel.pipeline_model_parallel_size >= 2 "
                     "(or null to disable)")

    @property
    def layout(self) -> Layout:
        """The training layout this section writes."""
        return Layout(tp=self.tensor_model_parallel_size,
                      pp=self.pipeline_model_parallel_size,
                      vpp=self.virtual_pipeline_model_parallel_size)


@dataclass(kw_only=True)
class TokenizerConfig:
    type: Literal["sentencepiece", "hf"] = "sentencepiece"
    """sentencepiece model file, or a Hugging Face ``tokenizer.json``."""
    path: str | None = None
    """Path of the tokenizer file; None allowed only with a random model and token input."""
    add_bos: bool = True
    """Prepend BOS when encoding prompts (text rows; a chat template writes its own)."""
    chat_template: str = "auto"
    """How conversations (``messages`` rows) become text: auto (the model directory's
    template: ``chat_template`` in tokenizer_config.json or chat_template.jinja; none if it
    has none), none (conversations are refused), or the path of a jinja template file."""


@dataclass(kw_only=True)
class DataConfig:
    train_path: str | None = None
    """Training data: a .jsonl/.json or .parquet file (or a folder of them)."""
    eval_path: str | None = None
    """Held-out data; None splits ``eval_fraction`` off the training data."""
    eval_fraction: float = 0.0
    """Fraction of training rows held out for evaluation when eval_path is None."""
    prompt_key: str = "prompt"
    """Column holding the prompt."""
    response_key: str = "response"
    """Column holding the SFT response."""
    chosen_key: str = "chosen"
    """Column holding the preferred response."""
    rejected_key: str = "rejected"
    """Column holding the dispreferred response."""
    messages_key: str = "messages"
    """Column holding a conversation (a list of {role, content}): SFT trains on every
    assistant turn; PPO prompts end before the assistant's answer (the generation prompt
    is appended). Preference rows may instead hold conversations in chosen/rejected
    (sharing their first turns, HH-RLHF style) with an optional prompt (UltraFeedback
    style). Needs a chat template (tokenizer.chat_template)."""
    max_prompt_len: int = 128
    """Prompts longer than this (in tokens) are dropped and counted."""
    max_seq_len: int = 256
    """Prompt+response longer than this are dropped and counted."""
    ptx_path: str | None = None
    """PPO-ptx: pretraining/SFT data (prompt, response) whose next-token loss is mixed into
    the actor's updates (InstructGPT); used when ppo.ptx_coef > 0."""
    packing: bool = False
    """Pack several SFT samples into one sequence (attention isolated per sample)."""

    def __post_init__(self):
        _require(0.0 <= self.eval_fraction < 1.0, "data.eval_fraction", self.eval_fraction,
                 "must be in [0, 1)")
        _require(self.max_prompt_len >= 1, "data.max_prompt_len", self.max_prompt_len,
                 "must be >= 1")
        _require(self.max_seq_len > self.max_prompt_len, "data.max_seq_len", self.max_seq_len,
                 f"must exceed data.max_prompt_len={self.max_prompt_len}")


@dataclass(kw_only=True)
class OptimizerConfig:
    optimizer: Literal["adam", "adamw"] = "adamw"
    """Adam with L2 or decoupled weight decay."""
    lr: float = 1e-5
    """Peak learning rate (the actor's in PPO)."""
    min_lr: float = 0.0
    """Floor of the decay schedules."""
    critic_lr: float = 5e-6
    """Peak learning rate of the critic in PPO (Qwen: 5e-6 with actor 1e-6)."""
    weight_decay: float = 0.0
    """Weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.95
    """Adam beta2."""
    adam_eps: float = 1e-5
    """Adam epsilon (PyTorch form: applied after bias correction)."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Decay after warm-up."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    use_distributed_optimizer: bool | Literal["auto"] = "auto"
    """Shard optimizer state across data-parallel ranks (Megatron's distributed optimizer).
    ``auto``: per role, sharded where the role has more than one data-parallel rank, plain
    at DP=1, where sharding saves nothing and costs whole-buffer copies every step (1.3-2x
    slower PPO iterations on CPU, BENCHMARKS.md). Both write the same checkpoint format, so
    a run resumes at any DP whichever optimizer saved it."""
    max_consecutive_skipped_steps: int = 10
    """Stop the run (exit 2) after this many optimizer steps in a row were skipped for
    non-finite gradients - a learning rate far too high, NaN rewards or data; 0 never
    stops. fp16's loss-scale search skips a few steps at the start."""
    max_skipped_fraction: float = 0.5
    """Stop the run when more than this fraction of its optimizer steps (once there are 20)
    were skipped; 1 never stops."""

    def __post_init__(self):
        for name in ("lr", "critic_lr"):
            _require(getattr(self, name) > 0, f"optimizer.{name}", getattr(self, name),
                     "must be > 0")
        _require(0 <= self.min_lr <= self.lr, "optimizer.min_lr", self.min_lr,
                 f"must be in [0, optimizer.lr={self.lr}]")
        for name in ("adam_beta1", "adam_beta2"):
            _require(0 <= getattr(self, name) < 1, f"optimizer.{name}", getattr(self, name),
                     "must be in [0, 1)")
        _require(self.adam_eps > 0, "optimizer.adam_eps", self.adam_eps, "must be > 0")
        _require(self.clip_grad >= 0, "optimizer.clip_grad", self.clip_grad, "must be >= 0")
        _require(self.weight_decay >= 0, "optimizer.weight_decay", self.weight_decay,
                 "must be >= 0")
        _require(self.warmup_steps >= 0, "optimizer.warmup_steps", self.warmup_steps,
                 "must be >= 0")
        _require(self.max_consecutive_skipped_steps >= 0, "optimizer.max_consecutive_skipped_steps",
                 self.max_consecutive_skipped_steps, "must be >= 0 (0: never stop)")
        _require(0 < self.max_skipped_fraction <= 1, "optimizer.max_skipped_fraction",
                 self.max_skipped_fraction, "must be in (0, 1] (1: never stop)")


@dataclass(kw_only=True)
class TrainConfig:
    global_batch_size: int = 32
    """Samples per optimizer step, all data-parallel ranks (SFT: sequences; RM: pairs)."""
    micro_batch_size: int = 4
    """Samples per forward/backward pass on one data-parallel rank."""
    num_epochs: int = 1
    """Passes over the training data."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (None: run all epochs)."""
    eval_interval: int = 0
    """Evaluate every N steps; 0 evaluates only at the end."""
    rm_normalize_path: str | None = None
    """RM stage: SFT-format data (prompt, response) whose scores are normalised to mean 0,
    std 1 after training; None uses the training pairs' chosen and rejected responses."""

    def __post_init__(self):
        for name in ("global_batch_size", "micro_batch_size", "num_epochs"):
            _require(getattr(self, name) >= 1, f"train.{name}", getattr(self, name),
                     "must be >= 1")
        if self.max_steps is not None:
            _require(self.max_steps >= 1, "train.max_steps", self.max_steps,
                     "must be >= 1 or null")
        _require(self.eval_interval >= 0, "train.eval_interval", self.eval_interval,
                 "must be >= 0")


@dataclass(kw_only=True)
class PPOConfig:
    rollout_batch_size: int = 64
    """Prompts per PPO iteration (global, all data-parallel ranks)."""
    mini_batch_size: int = 16
    """Samples per optimizer step (global)."""
    micro_batch_size: int = 4
    """Samples per forward/backward pass on one data-parallel rank."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    num_iterations: int = 100
    """PPO iterations to run."""
    clip_eps: float = 0.2
    """Policy ratio clip (1 +- clip_eps)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 for negative advantages; None disables."""
    cliprange_value: float | None = 0.2
    """Value clip around the old values; None disables value clipping."""
    value_loss_coef: float = 0.5
    """Weight of the critic's loss: value_loss_coef * max((V - R)^2, (V_clip - R)^2). The
    critic has its own optimizer, so with Adam this mostly matters through gradient
    clipping and epsilon; 0.5 is the usual 0.5 * squared error."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""
    gamma: float = 1.0
    """Discount (InstructGPT: 1)."""
    lam: float = 0.95
    """GAE lambda."""
    kl_estimator: Literal["k1", "k2", "k3", "abs"] = "k1"
    """Per-token KL estimator in the shaped reward (and the reported objective/kl)."""
    kl_in_reward: bool | None = None
    """Subtract beta x KL to the reference from the reward (beta: init_kl_coef, then the
    controller): per token for gae and reinforce_pp; summed over the response and taken off
    the score before the group baseline for rloo and grpo (TRL's RLOO). None: on for gae,
    reinforce_pp and rloo, off for grpo (which regularises with kl_loss_coef instead)."""
    kl_loss_coef: float = 0.0
    """Weight of a KL-to-reference term in the actor's loss (DeepSeekMath's GRPO: 0.04;
    0.001 is common); 0 disables. Works with every estimator."""
    kl_loss_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator of the loss term (k3: DeepSeekMath; k2's gradient is the true KL's)."""
    kl_controller: Literal["fixed", "adaptive"] = "fixed"
    """KL coefficient controller (Ziegler et al. 2019)."""
    init_kl_coef: float = 0.05
    """Initial beta."""
    kl_target: float = 6.0
    """Adaptive controller target KL (per sequence)."""
    kl_horizon: int = 10000
    """Adaptive controller horizon."""
    clip_reward_value: float = 5.0
    """Reward-model score clip (DeepSpeed-Chat: 5)."""
    missing_stop_penalty: float | None = -1.0
    """Score for responses without a stop token (lm-human-preferences: -1); None disables."""
    missing_stop_mode: Literal["replace", "subtract"] = "replace"
    """Replace the score by missing_stop_penalty, or subtract it (TRL's missing_eos_penalty)."""
    whiten_advantages: bool = True
    """Whiten advantages (global across data-parallel ranks)."""
    whiten_rewards: bool = False
    """Scale rewards by their std (no mean shift)."""
    whiten_unbiased: bool = True
    """Variance in whitening: unbiased n/(n-1) (torch, TRL) or biased (TF, lm-human-prefs)."""
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = "token_mean"
    """How per-token losses are reduced."""
    ptx_coef: float = 0.0
    """PPO-ptx weight of next-token loss on pretraining data; 0 disables."""
    critic_warmup_iterations: int = 0
    """Iterations at the start that train the critic only (Qwen)."""
    ema_decay: float | None = None
    """Decay of an EMA copy of the actor for evaluation (0.992 in InstructGPT); None off."""
    group_size: int = 1
    """Responses per prompt (GRPO/RLOO)."""
    advantage_estimator: Literal["gae", "grpo", "rloo", "reinforce_pp"] = "gae"
    """GAE with a critic, or a critic-free group/global baseline."""
    grpo_normalization: Literal["sequence", "token", "center"] = "sequence"
    """GRPO advantages: sequence = (score - group mean) / unbiased group std per sample
    (DeepSeekMath, TRL: the default, so runs compare with the paper and TRL); token = mean
    and population std over all valid tokens of the group (AReaL: long responses weigh
    more); center = score - group mean, no std (Dr. GRPO: no difficulty re-weighting)."""
    policy_loss: Literal["ppo", "decoupled"] = "ppo"
    """ppo: clipped surrogate around the old log-probs. decoupled (AReaL): clip around the
    proximal policy (the log-probs recomputed before the update) and weight each token by
    exp(proximal - behaviour), the behaviour policy being the sampler's log-probs; needs
    rollout.recompute_logprobs=true."""
    behavior_weight_cap: float | None = None
    """Decoupled loss: drop tokens whose behaviour importance weight exceeds this (AReaL
    uses 5); None keeps every token."""
    rollout_is_cap: float | None = None
    """Rollout/training mismatch correction: weight each token's policy loss by the
    truncated importance ratio min(p_train / p_rollout, cap) (truncated IS; ~2 is usual);
    None disables. Needs rollout.recompute_logprobs=true."""
    rollout_mask_low: float | None = None
    """Mismatch correction: drop from the policy loss every sample whose per-token
    geometric-mean ratio p_train / p_rollout is below this (e.g. 0.5); None: no lower bound."""
    rollout_mask_high: float | None = None
    """Mismatch correction: drop every sample whose geometric-mean ratio is above this
    (e.g. 2); None: no upper bound."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal (no learning signal for group
    baselines) and sample more prompts until rollout_batch_size groups are kept."""
    max_sampling_rounds: int = 4
    """Dynamic sampling: rollouts per iteration at most; a batch still short after them is
    topped up with dropped groups (counted in rollout/dynamic_sampling_shortfall)."""
    overlong_buffer: int = 0
    """DAPO's overlong shaping: responses longer than max_new_tokens - overlong_buffer lose
    up to overlong_penalty linearly, the full amount at max_new_tokens; 0 disables."""
    overlong_penalty: float = 1.0
    """The largest overlong penalty (DAPO: 1.0)."""
    ptx_batch_size: int | None = None
    """PPO-ptx: pretraining samples mixed into each actor mini-batch (global); None: as
    many as mini_batch_size."""
    sft_checkpoint: str | None = None
    """Checkpoint the actor and the reference model start from (an SFT run's folder)."""
    reward_checkpoint: str | None = None
    """Reward-model checkpoint (also the critic's start); None needs rollout.reward_fn."""
    critic_init: Literal["reward", "sft", "random"] = "reward"
    """Critic trunk from the reward model (InstructGPT), the SFT model, or random."""
    gold_reward_fn: str | None = None
    """Evaluation-only reward 'module:function(prompt, response) -> float' on held-out
    prompts (known gold reward of synthetic tasks)."""
    eval_interval: int = 5
    """Evaluate on held-out prompts every N iterations (and before the first and at the end)."""
    num_eval_prompts: int = 64
    """Held-out prompts per evaluation."""

    def __post_init__(self):
        for name in ("rollout_batch_size", "mini_batch_size", "micro_batch_size",
                     "ppo_epochs", "num_iterations", "group_size", "kl_horizon"):
            _require(getattr(self, name) >= 1, f"ppo.{name}", getattr(self, name), "must be >= 1")
        # Batch divisibility counts samples (prompts x group_size) per trained role's
        # data-parallel size: checked by algos.BatchSizes once the layouts are known.
        _require(0 < self.clip_eps < 1, "ppo.clip_eps", self.clip_eps, "must be in (0, 1)")
        if self.dual_clip is not None:
            _require(self.dual_clip > 1, "ppo.dual_clip", self.dual_clip, "must be > 1 or null")
        _require(0 <= self.gamma <= 1, "ppo.gamma", self.gamma, "must be in [0, 1]")
        _require(0 <= self.lam <= 1, "ppo.lam", self.lam, "must be in [0, 1]")
        _require(self.value_loss_coef > 0, "ppo.value_loss_coef", self.value_loss_coef,
                 "must be > 0")
        _require(self.init_kl_coef >= 0, "ppo.init_kl_coef", self.init_kl_coef, "must be >= 0")
        _require(self.kl_target > 0, "ppo.kl_target", self.kl_target, "must be > 0")
        if self.ema_decay is not None:
            _require(0 < self.ema_decay < 1, "ppo.ema_decay", self.ema_decay,
                     "must be in (0, 1) or null")
        _require(self.kl_loss_coef >= 0, "ppo.kl_loss_coef", self.kl_loss_coef, "must be >= 0")
        if self.cliprange_value is not None:
            _require(self.cliprange_value > 0, "ppo.cliprange_value", self.cliprange_value,
                     "must be > 0 or null (no value clipping)")
        _require(self.entropy_coef >= 0, "ppo.entropy_coef", self.entropy_coef, "must be >= 0")
        _require(self.clip_reward_value > 0, "ppo.clip_reward_value", self.clip_reward_value,
                 "must be > 0 (scores are clipped to +-clip_reward_value)")
        for name in ("critic_warmup_iterations",):
            _require(getattr(self, name) >= 0, f"ppo.{name}", getattr(self, name), "must be >= 0")
        for name in ("eval_interval", "num_eval_prompts"):
            _require(getattr(self, name) >= 1, f"ppo.{name}", getattr(self, name), "must be >= 1")
        _require(self.ptx_coef >= 0, "ppo.ptx_coef", self.ptx_coef, "must be >= 0")
        if self.ptx_batch_size is not None:
            _require(self.ptx_batch_size >= 1, "ppo.ptx_batch_size", self.ptx_batch_size,
                     "must be >= 1 or null")
        if self.behavior_weight_cap is not None:
            _require(self.behavior_weight_cap > 1, "ppo.behavior_weight_cap",
                     self.behavior_weight_cap, "must be > 1 or null")
        if self.rollout_is_cap is not None:
            _require(self.rollout_is_cap >= 1, "ppo.rollout_is_cap", self.rollout_is_cap,
                     "must be >= 1 or null")
        if self.rollout_mask_low is not None:
            _require(0 < self.rollout_mask_low < 1, "ppo.rollout_mask_low",
                     self.rollout_mask_low, "must be in (0, 1) or null")
        if self.rollout_mask_high is not None:
            _require(self.rollout_mask_high > 1, "ppo.rollout_mask_high",
                     self.rollout_mask_high, "must be > 1 or null")
        _require(self.max_sampling_rounds >= 1, "ppo.max_sampling_rounds",
                 self.max_sampling_rounds, "must be >= 1")
        _require(self.overlong_buffer >= 0, "ppo.overlong_buffer", self.overlong_buffer,
                 "must be >= 0")
        _require(self.overlong_penalty > 0, "ppo.overlong_penalty", self.overlong_penalty,
                 "must be > 0")
        if self.dynamic_sampling:
            _require(self.group_size >= 2, "ppo.group_size", self.group_size,
                     "must be >= 2 with ppo.dynamic_sampling (it filters groups)")
        if not self.kl_reward_on and self.kl_controller == "adaptive":
            raise ValueError(
                "ppo.kl_controller=adaptive tunes the KL coefficient of the reward, but the "
                f"KL is not in the reward (ppo.kl_in_reward={self.kl_in_reward}, estimator "
                f"{self.advantage_estimator}): set ppo.kl_in_reward=true or "
                "ppo.kl_controller=fixed")
        if self.policy_loss == "decoupled":
            _require(self.dual_clip is None and self.rollout_is_cap is None,
                     "ppo.policy_loss", self.policy_loss,
                     "the decoupled loss has its own importance weight and no dual clip: "
                     "leave ppo.rollout_is_cap and ppo.dual_clip null")
        if self.advantage_estimator in ("grpo", "rloo"):
            _require(self.group_size >= 2, "ppo.group_size", self.group_size,
                     f"must be >= 2 for ppo.advantage_estimator={self.advantage_estimator}")


    @property
    def kl_reward_on(self) -> bool:
        """Whether beta x KL is taken off the reward (``kl_in_reward`` resolved)."""
        if self.kl_in_reward is not None:
            return self.kl_in_reward
        return self.advantage_estimator != "grpo"


@dataclass(kw_only=True)
class RolloutConfig:
    tensor_parallel_size: int = 1
    """TP of the inference layout; data-parallel replicas follow from the world size."""
    max_new_tokens: int = 32
    """Longest response."""
    temperature: float = 1.0
    """Sampling temperature; log-probs are computed from logits / temperature."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 disables."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1 disables."""
    greedy: bool = False
    """Argmax decoding (evaluation)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end a response (EOS always does)."""
    stop_at_eos: bool = True
    """Stop a sequence at EOS; false keeps sampling to max_new_tokens (OpenAI's first code)."""
    min_response_tokens: int = 0
    """Responses shorter than this get no trainable tokens (DeepSpeed-Chat drops <= 1)."""
    recompute_logprobs: bool = True
    """Recompute old log-probs with the training-layout actor instead of using the
    sampler's."""
    reward_fn: str | None = None
    """Programmatic reward 'package.module:function(prompt_text, response_text) -> float'
    (decoded text, the response without its stop token) used instead of a reward model;
    None uses the reward model."""
    offload_frozen_models: bool = True
    """Offload reference and reward models between their scoring passes (the default of
    roles.reference.offload / roles.reward.offload)."""
    forward_micro_batch_size: int | None = None
    """Rows per forward pass of the experience passes (reference and old log-probs,
    reward, critic values); None: ppo.micro_batch_size. These passes keep nothing for a
    backward pass, so larger micro-batches than training's usually fit (verl's
    log_prob_micro_batch_size, TRL's local_rollout_forward_batch_size)."""
    release_inference_weights: bool = True
    """Free the inference model's weights (the actor at the rollout layout) after each
    generation: the next reshard rewrites all of them, so nothing is copied; the actor's
    size at rollout TP less per GPU in the experience, train and save phases."""
    ref_cache_size: int = 4096
    """Sequences whose reference log-probs are kept (the least recently used dropped first)
    and saved with each checkpoint, so a sequence sampled again - twice in one batch, as in
    GRPO groups with short answers, or in a later iteration - is not scored again. Memory
    and checkpoint space: about 4 bytes per response token per sequence (16 MB at 4096
    sequences of 1024 tokens). 0 turns the cache off."""

    def __post_init__(self):
        _require(self.tensor_parallel_size >= 1, "rollout.tensor_parallel_size",
                 self.tensor_parallel_size, "must be >= 1")
        _require(self.max_new_tokens >= 1, "rollout.max_new_tokens", self.max_new_tokens,
                 "must be >= 1")
        _require(self.temperature > 0, "rollout.temperature", self.temperature,
                 "must be > 0 (use rollout.greedy=true for argmax)")
        _require(self.top_k >= 0, "rollout.top_k", self.top_k, "must be >= 0")
        _require(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "must be in (0, 1]")
        _require(self.min_response_tokens >= 0, "rollout.min_response_tokens",
                 self.min_response_tokens, "must be >= 0")
        _require(self.forward_micro_batch_size is None or self.forward_micro_batch_size >= 1,
                 "rollout.forward_micro_batch_size", self.forward_micro_batch_size,
                 "must be >= 1, or null for ppo.micro_batch_size")
        _require(self.ref_cache_size >= 0, "rollout.ref_cache_size", self.ref_cache_size,
                 "must be >= 0 (0 turns the reference log-prob cache off)")


@dataclass(kw_only=True)
class DPOConfig:
    """Direct preference optimisation (``megarlhf dpo``): the policy learns from chosen /
    rejected pairs against a frozen reference, whose log-probs come from the cache."""

    beta: float = 0.1
    """Strength of the implicit KL to the reference (the reward scale beta)."""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: DPO's -log sigmoid(beta * margin); ipo: (margin - 1 / (2 beta))^2."""
    label_smoothing: float = 0.0
    """cDPO: the fraction of pairs assumed mislabelled (sigmoid loss only), in [0, 0.5)."""
    reference_checkpoint: str | None = None
    """The frozen reference; None: the policy's initial checkpoint (checkpoint.load)."""
    use_cache: bool = True
    """Reference log-probs from the cache (built once, the reference not resident while the
    policy learns); false: the reference stays built and scores every global batch."""
    gold_reward_fn: str | None = None
    """``module:function(prompt, response) -> float`` scoring greedy samples of the policy
    on ``gold_eval_path``'s prompts at every evaluation (eval/gold_score); None: off."""
    gold_eval_path: str | None = None
    """Prompt rows for the gold evaluation (rollout.* sets the sampling)."""
    num_gold_prompts: int = 64
    """How many of those prompts."""

    def __post_init__(self):
        _require(self.beta > 0, "dpo.beta", self.beta, "must be > 0")
        _require(0.0 <= self.label_smoothing < 0.5, "dpo.label_smoothing",
                 self.label_smoothing, "must be in [0, 0.5)")
        _require(self.loss == "sigmoid" or self.label_smoothing == 0.0,
                 "dpo.label_smoothing", self.label_smoothing,
                 "applies to the sigmoid loss only (dpo.loss=ipo)")
        _require(self.num_gold_prompts >= 1, "dpo.num_gold_prompts", self.num_gold_prompts,
                 "must be >= 1")
        _require((self.gold_reward_fn is None) == (self.gold_eval_path is None),
                 "dpo.gold_reward_fn", self.gold_reward_fn,
                 "and dpo.gold_eval_path go together: set both or neither")


@dataclass(kw_only=True)
class DistillConfig:
    """Knowledge distillation (``megarlhf distill``): a student learns the teacher's next-
    token distribution on the response tokens of SFT-format rows, from the teacher's
    cached top-k log-probs."""

    teacher_checkpoint: str | None = None
    """The teacher (any size; its layout: roles.teacher.parallel)."""
    top_k: int = 16
    """Teacher log-probs kept per position; the rest of its mass is one remaining bucket."""
    divergence: Literal["forward", "reverse"] = "forward"
    """forward: KL(teacher || student) over the top-k plus the remaining mass (mode
    covering); reverse: KL(student || teacher) on the same k + 1 buckets (mode seeking)."""
    temperature: float = 1.0
    """Softmax temperature of teacher and student."""
    nll_coef: float = 0.0
    """Weight of the ordinary next-token loss on the data's responses, added to the KL."""

    def __post_init__(self):
        _require(self.top_k >= 1, "distill.top_k", self.top_k, "must be >= 1")
        _require(self.temperature > 0, "distill.temperature", self.temperature, "must be > 0")
        _require(self.nll_coef >= 0, "distill.nll_coef", self.nll_coef, "must be >= 0")


@dataclass(kw_only=True)
class CacheConfig:
    """The frozen-model cache (reference log-probs for DPO, teacher top-k for distill)."""

    path: str | None = None
    """Folder of the cache; None: {run.output_dir}/{run.name}/cache/<role>."""
    on_stale: Literal["rebuild", "error"] = "rebuild"
    """A cache built from another checkpoint, data, temperature or top-k: rebuild it, or
    stop with what differs."""
    micro_batch_size: int = 8
    """Rows per forward micro-batch while building."""

    def __post_init__(self):
        _require(self.micro_batch_size >= 1, "cache.micro_batch_size", self.micro_batch_size,
                 "must be >= 1")


@dataclass(kw_only=True)
class CheckpointConfig:
    load: str | None = None
    """Checkpoint to initialise weights from (a run's checkpoint folder or one step)."""
    resume: bool = True
    """Continue from the run's own latest checkpoint (weights, optimizer, data position,
    RNG) when one exists."""
    save_interval: int = 0
    """Save every N steps; 0 saves only at the end."""
    keep_last: int = 2
    """How many checkpoints to keep."""

    def __post_init__(self):
        _require(self.save_interval >= 0, "checkpoint.save_interval", self.save_interval,
                 "must be >= 0")
        _require(self.keep_last >= 1, "checkpoint.keep_last", self.keep_last, "must be >= 1")


@dataclass(kw_only=True)
class LoggingConfig:
    log_interval: int = 1
    """Write metrics every N steps."""
    tensorboard: bool = True
    """Write TensorBoard event files."""
    wandb_project: str | None = None
    """Log to Weights & Biases under this project when wandb is installed."""
    sample_table_interval: int = 10
    """Print a table of sample prompts and responses every N iterations."""
    progress_bar: bool = True
    """Show a progress bar on rank 0."""
    memory_metrics: bool = True
    """PPO: per-phase memory accounting of every role (memory/* metrics in MiB and a table
    at the end of the run); false skips the bookkeeping."""

    def __post_init__(self):
        _require(self.log_interval >= 1, "logging.log_interval", self.log_interval,
                 "must be >= 1")
        _require(self.sample_table_interval >= 0, "logging.sample_table_interval",
                 self.sample_table_interval, "must be >= 0 (0: no sample tables)")


@dataclass(kw_only=True)
class LaunchConfig:
    nodes: int = 1
    """Slurm nodes."""
    tasks_per_node: int = 8
    """Processes per node: one per GPU (on CPU, one per process you want)."""
    gpus_per_node: int = 8
    """GPUs requested per node (0 on CPU-only clusters)."""
    cpus_per_task: int = 8
    """CPU cores per process."""
    time: str = "04:00:00"
    """Wall-time limit (Slurm format)."""
    partition: str | None = None
    """Slurm partition; None uses the cluster default."""
    account: str | None = None
    """Slurm account."""
    preempt_signal_seconds: int = 120
    """Slurm sends SIGUSR1 this long before the time limit; the job checkpoints and
    requeues itself."""
    log_dir: str = "logs"
    """Where job logs go (one file per job)."""
    python: str = "python"
    """Python executable on the compute nodes (e.g. a venv's)."""
    gpu_memory_gib: float | None = None
    """Memory of one GPU in GiB (e.g. 80): ``megarlhf launch`` then refuses a config whose
    predicted per-GPU memory (``megarlhf plan``) does not fit. None: no check."""

    def __post_init__(self):
        for name in ("nodes", "tasks_per_node", "cpus_per_task"):
            _require(getattr(self, name) >= 1, f"launch.{name}", getattr(self, name),
                     "must be >= 1")
        _require(self.gpus_per_node >= 0, "launch.gpus_per_node", self.gpus_per_node,
                 "must be >= 0")
        _require(self.preempt_signal_seconds >= 1, "launch.preempt_signal_seconds",
                 self.preempt_signal_seconds, "must be >= 1")
        if self.gpu_memory_gib is not None:
            _require(self.gpu_memory_gib > 0, "launch.gpu_memory_gib", self.gpu_memory_gib,
                     "must be > 0 or null")



@dataclass(kw_only=True)
class RoleParallelConfig:
    tensor_model_parallel_size: int | None = None
    """Tensor-parallel size of this role; None: the actor's."""
    pipeline_model_parallel_size: int | None = None
    """Pipeline-parallel size of this role; None: the actor's."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline stage; None: the actor's when this role keeps the actor's
    pipeline size, otherwise off; 1: off."""

    def __post_init__(self):
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "virtual_pipeline_model_parallel_size"):
            value = getattr(self, name)
            if value is not None:
                _require(value >= 1, f"parallel.{name}", value, "must be >= 1 or null")

    def over(self, base: Layout) -> Layout:
        """``base`` (the actor's layout) with the sizes this role writes on top; VPP is
        kept only while PP is (``vpp: 1`` turns it off)."""
        tp = self.tensor_model_parallel_size or base.tp
        pp = self.pipeline_model_parallel_size or base.pp
        if self.virtual_pipeline_model_parallel_size is not None:
            vpp = self.virtual_pipeline_model_parallel_size
            vpp = None if vpp == 1 else vpp
        else:
            vpp = base.vpp if pp == base.pp else None
        return Layout(tp=tp, pp=pp, vpp=vpp, ep=base.ep, etp=base.etp)


@dataclass(kw_only=True)
class RoleConfig:
    checkpoint: str | None = None
    """Checkpoint this role loads (a run's ``checkpoints`` folder, one checkpoint, or a
    converter's output folder). None: the ``ppo.*_checkpoint`` shorthand, see ``roles``."""
    model: ModelConfig | None = None
    """Model of this role. By default the checkpoint's saved model; the fields written here
    replace it (e.g. ``params_dtype``). Shape fields must agree with the checkpoint."""
    parallel: RoleParallelConfig = field(default_factory=RoleParallelConfig)
    """This role's TP / PP / VPP (each defaults to the actor's layout)."""
    optimizer: OptimizerConfig | None = None
    """Trained roles only (actor, critic): the fields written here replace the top-level
    ``optimizer``'s (lr, schedule, use_distributed_optimizer, ...)."""
    offload: Literal["none", "optimizer", "optimizer+grads", "all"] | None = None
    """What leaves the accelerator (to pinned host memory) while it is not needed.
    Trained roles (actor, critic) during the rollout: none (default); optimizer (Adam
    state and fp32 master weights); optimizer+grads (also megatron's gradient buffers,
    dropped rather than copied); all (also the parameters, after the actor is resharded
    into the inference model; they return for the experience passes). Frozen roles
    (reference, reward): none or all (parameters between their scoring passes); null
    follows rollout.offload_frozen_models. ``megarlhf plan`` shows what each saves."""


@dataclass(kw_only=True)
class RolesConfig:
    """The four PPO roles, each with its own checkpoint, model and layout (all colocated
    on the same ranks, time-shared).

    - actor: ``roles.actor.checkpoint`` or ``ppo.sft_checkpoint``; model = that checkpoint's,
      with the fields written in the top-level ``model`` and ``roles.actor.model`` on top;
      layout = ``parallel`` with ``roles.actor.parallel`` on top; optimizer = ``optimizer``.
    - reference: ``roles.reference.checkpoint`` or the actor's checkpoint; model as the actor.
    - reward: ``roles.reward.checkpoint`` or ``ppo.reward_checkpoint``; model = its
      checkpoint's (another size or architecture just works).
    - critic: ``roles.critic.checkpoint`` or, by ``ppo.critic_init``, the reward model's
      checkpoint, the actor's, or none (random, the actor's shape); optimizer = ``optimizer``
      with lr = ``optimizer.critic_lr``, then ``roles.critic.optimizer`` on top.
    Every role's layout defaults to the actor's. The precision fields written in the
    top-level ``model`` (params_dtype, transformer_impl, fp8) apply to every role. Dropout
    is always off in PPO (it would make old and new log-probs different networks)."""

    actor: RoleConfig = field(default_factory=RoleConfig)
    """The trained policy."""
    critic: RoleConfig = field(default_factory=RoleConfig)
    """The trained value model (GAE only)."""
    reference: RoleConfig = field(default_factory=RoleConfig)
    """The frozen reference policy of the KL penalty (PPO) or of DPO."""
    teacher: RoleConfig = field(default_factory=RoleConfig)
    """The frozen teacher of ``megarlhf distill`` (its checkpoint: distill.teacher_checkpoint
    or roles.teacher.checkpoint)."""
    reward: RoleConfig = field(default_factory=RoleConfig)
    """The frozen reward model (unless ``rollout.reward_fn`` is set)."""


@dataclass(kw_only=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    """Run identity and reproducibility."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model architecture."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Training layout."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """Tokenizer."""
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimisation."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """SFT and reward-model training loops."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """PPO algorithm."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation and the inference layout."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics and progress."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """Slurm resources for `megarlhf launch`."""
    roles: RolesConfig = field(default_factory=RolesConfig)
    """Per-role checkpoint, model, layout and optimizer for PPO (see RolesConfig)."""
    dpo: DPOConfig = field(default_factory=DPOConfig)
    """DPO (megarlhf dpo)."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """Distillation (megarlhf distill)."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    """The frozen-model cache of dpo and distill."""


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Round the vocabulary up so every TP rank holds an equal slice that is a multiple
    of ``divisible_by`` (Megatron's convention)."""
    multiple = divisible_by * tp_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


def check_model_layout(where: str, model: ModelConfig, layout: Layout,
                       world_size: int | None = None, model_name: str = "model") -> None:
    """The one place where a model's split is checked: heads, query groups and MLP width
    divisible by TP, layers by the pipeline chunks, the world by TP x PP. ``where`` names
    the layout's config section (``parallel``, ``roles.critic.parallel``) and
    ``model_name`` the model's (``model``, ``roles.reward.model``) in the messages."""
    tp, pp, vpp = layout.tp, layout.pp, layout.vpp
    _require(model.num_attention_heads % tp == 0, f"{where}.tensor_model_parallel_size", tp,
             f"must divide {model_name}.num_attention_heads={model.num_attention_heads}")
    _require(model.query_groups % tp == 0, f"{where}.tensor_model_parallel_size", tp,
             f"must divide the number of query groups ({model_name}.num_query_groups="
             f"{model.query_groups})")
    _require(model.ffn_size % tp == 0, f"{where}.tensor_model_parallel_size", tp,
             f"must divide the MLP width {model.ffn_size} of {model_name}")
    if vpp is not None:
        _require(pp >= 2 and vpp >= 2, f"{where}.virtual_pipeline_model_parallel_size", vpp,
                 f"needs pipeline_model_parallel_size >= 2 (it is {pp}) and a value >= 2")
    chunks = pp * (vpp or 1)
    _require(model.num_layers % chunks == 0, f"{model_name}.num_layers", model.num_layers,
             f"must be divisible by the number of pipeline chunks {chunks} "
             f"({where}.pipeline_model_parallel_size x virtual_pipeline_model_parallel_size)")
    if world_size is not None:
        _require(world_size % (tp * pp) == 0, "world size", world_size,
                 f"must be a multiple of tensor x pipeline parallel size = {tp} x {pp} = "
                 f"{tp * pp} ({where})")


def check_rollout_layout(model: ModelConfig, rollout_tp: int, world_size: int) -> None:
    """The inference layout: TP = rollout.tensor_parallel_size, no PP, DP replicas."""
    _require(world_size % rollout_tp == 0, "rollout.tensor_parallel_size", rollout_tp,
             f"must divide the world size {world_size}")
    _require(model.num_attention_heads % rollout_tp == 0
             and model.query_groups % rollout_tp == 0, "rollout.tensor_parallel_size",
             rollout_tp, f"must divide the actor's num_attention_heads="
             f"{model.num_attention_heads} and query groups {model.query_groups}")


def validate_layout(cfg: Config, world_size: int) -> None:
    """Check that ``cfg.model`` can be split as ``cfg.parallel`` asks on ``world_size``
    processes (SFT, RM, score; PPO checks every role in ``roles.spec``). Runs before
    any process group exists."""
    par, model = cfg.parallel, cfg.model
    check_model_layout("parallel", model, par.layout, world_size)
    check_rollout_layout(model, cfg.rollout.tensor_parallel_size, world_size)
    check_precision(model)


def check_precision(model: ModelConfig, where: str = "model") -> None:
    if model.fp8.enabled and model.params_dtype == "float32":
        raise ValueError(f"{where}.fp8.enabled=true needs {where}.params_dtype bfloat16 or "
                         "float16 (fp8 training keeps master weights in the optimizer)")
