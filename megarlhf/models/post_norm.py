"""OLMo 2 / OLMo 3's layer (``model.norm_placement: post``) from megatron-core's local
modules: no norm before attention or the MLP, an RMSNorm on each one's output before it
joins the residual (``h = x + norm(attention(x))``, ``out = h + norm(mlp(h))``), and the
queries and keys normalised over all heads together - one RMSNorm over a token's
``heads x head`` query channels, where megatron's ``q_layernorm`` normalises head by head.

Under tensor parallelism a rank holds some of the heads: the query/key norm's weight is
split over TP like the heads (axis 0, as the column-parallel QKV projection's rows), and
the mean square is summed over the TP group (an all-reduce whose backward sums too). The
output norms act on whole hidden states (after the row-parallel projection's reduction),
so their weights are whole on every rank - marked ``sequence_parallel`` where the sequence
is split, as megarlhf's other norms are.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed.nn.functional as dist_fn
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.transformer.utils import (is_layer_window_attention,
                                             make_sharded_tensors_for_checkpoint)


class _AllHeadsRMSNorm(MegatronModule):
    """RMSNorm over a token's queries (or keys) of every head; megatron's SelfAttention
    builds it as ``q_layernorm`` / ``k_layernorm`` with one head's width and calls it on
    (sq, b, heads on this rank, head). ``tp_group`` is set by the attention that owns it
    (:class:`PostNormSelfAttention`)."""

    keys = False  # the keys' norm (query groups) or the queries' (heads)

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(config=config)
        heads = config.num_query_groups if self.keys else config.num_attention_heads
        self.width = heads * hidden_size  # over every TP rank
        self.eps = eps
        local = self.width // config.tensor_model_parallel_size
        self.weight = torch.nn.Parameter(torch.ones(local, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        self.tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(*shape[:-2], -1).float()
        square = flat.pow(2).sum(-1, keepdim=True)
        if self.tp_group is not None and self.tp_group.size() > 1:
            square = dist_fn.all_reduce(square, group=self.tp_group)
        normed = flat * torch.rsqrt(square / self.width + self.eps)
        return (self.weight.float() * normed).to(x.dtype).reshape(shape)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0},
            sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])


class AllHeadsQueryNorm(_AllHeadsRMSNorm):
    keys = False


class AllHeadsKeyNorm(_AllHeadsRMSNorm):
    keys = True


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, centred: bool):
    """RMSNorm in float32, scaled by ``weight`` or, zero-centred (Gemma), by 1 + weight."""
    if not centred:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


class ZeroCenteredRMSNorm(torch.nn.Module):
    """Gemma's RMSNorm (``model.norm_zero_centered``): scales by 1 + weight, the weight
    starting at zero; built as megatron builds a norm (config, hidden_size, eps)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.weight, self.eps, True)


class _OutputNorm(MegatronModule):
    """RMSNorm of a sublayer's output (whole hidden states; the weight whole on every TP
    rank - ``tp_group`` set by the owner, for megatron's checkpoint replica ids)."""

    def __init__(self, config, tp_group, centred: bool = False):
        super().__init__(config=config)
        self.eps, self.tp_group, self.centred = config.layernorm_epsilon, tp_group, centred
        self.weight = torch.nn.Parameter((torch.zeros if centred else torch.ones)(
            config.hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.weight, self.eps, self.centred)


class AllHeadsNormSelfAttention(SelfAttention):
    """megatron's SelfAttention whose query/key norms (over all heads) learn the TP
    group, and whose sliding-window layers may rotate with a RoPE base of their own
    (``local_rotary_base``: Gemma 3's local layers); its output as it is (pre-norm
    layers)."""

    local_rotary_base: float | None = None  # set on the class by post_norm_spec
    global_position_scale: float = 1.0  # the global table's linear scaling factor

    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        for norm in (self.q_layernorm, self.k_layernorm):
            if isinstance(norm, _AllHeadsRMSNorm):
                norm.tp_group = self.pg_collection.tp
        self.local = self.local_rotary_base is not None and is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, self.layer_number)

    def forward(self, *args, rotary_pos_emb=None, **kwargs):
        if self.local and rotary_pos_emb is not None:
            rotary_pos_emb = (tuple(map(self._local_angles, rotary_pos_emb))
                              if isinstance(rotary_pos_emb, tuple)
                              else self._local_angles(rotary_pos_emb))
        return super().forward(*args, rotary_pos_emb=rotary_pos_emb, **kwargs)

    def _local_angles(self, angles: torch.Tensor) -> torch.Tensor:
        """megatron's rotary angles (..., dim) - [p f, p f] with f[0] = 1 - turned into
        this layer's own base at the same positions p (read from the first channel; the
        global table's positions divided by its linear scaling factor, a power of two)."""
        dim = angles.shape[-1]
        position = angles[..., :1].float() * self.global_position_scale
        inv = 1.0 / (self.local_rotary_base ** (
            torch.arange(0, dim, 2, dtype=torch.float32, device=angles.device) / dim))
        freqs = position * inv
        return torch.cat([freqs, freqs], dim=-1).to(angles.dtype)


class PostNormSelfAttention(AllHeadsNormSelfAttention):
    """megatron's SelfAttention whose output is RMS-normalised before the residual
    (``post_layernorm``)."""

    centred = False  # Gemma's (1 + weight) norm (set on a subclass by post_norm_spec)

    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.post_layernorm = _OutputNorm(config, self.pg_collection.tp, self.centred)

    def forward(self, *args, **kwargs):
        out, bias = super().forward(*args, **kwargs)
        if bias is not None:
            out, bias = out + bias, None
        return self.post_layernorm(out), bias


class PostNormMLP(MLP):
    centred = False  # Gemma's (1 + weight) norm (set on a subclass by post_norm_spec)

    """megatron's MLP whose output is RMS-normalised before the residual (built by
    :class:`PostNormLayer`, which hands it the TP group as megatron's layer does a plain
    MLP)."""

    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.post_layernorm = _OutputNorm(config, self.tp_group, self.centred)

    def forward(self, hidden_states, *args, **kwargs):
        out, bias = super().forward(hidden_states, *args, **kwargs)
        if bias is not None:
            out, bias = out + bias, None
        return self.post_layernorm(out), bias


@dataclasses.dataclass
class _BoundSpec:
    """What megatron's ``build_module`` reads from a ModuleSpec (module, submodules,
    params), as a type the TransformerLayer does not inspect: it passes its TP group to a
    ModuleSpec MLP only when the class is exactly ``MLP``, and warns for any other."""

    module: type
    submodules: object
    params: dict


class PostNormLayer(TransformerLayer):
    """megatron's TransformerLayer with a :class:`PostNormMLP`, given the layer's TP group
    as megatron gives it to a plain ``MLP``."""

    def __init__(self, config, submodules, *args, pg_collection=None, **kwargs):
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        mlp = submodules.mlp
        submodules = dataclasses.replace(submodules, mlp=_BoundSpec(
            mlp.module, mlp.submodules, {**mlp.params, "tp_group": pg_collection.tp}))
        super().__init__(config, submodules, *args, pg_collection=pg_collection, **kwargs)


def post_norm_spec(spec: ModuleSpec, model) -> ModuleSpec:
    """The local layer ``spec`` turned into megarlhf's own for ``model``: output norms
    after the sublayers (norm_placement post: none before them, OLMo; sandwich: both,
    Gemma), q/k norms over all heads (OLMo), zero-centred (1 + weight) norms (Gemma), a
    RoPE base of the sliding-window layers' own (Gemma 3). Classes carrying the settings
    are made per model (megatron builds modules from classes)."""
    sub = spec.submodules
    outputs = model.norm_placement in ("post", "sandwich")
    centred = model.norm_zero_centered
    if model.norm_placement == "post":
        sub.input_layernorm = IdentityOp
        sub.pre_mlp_layernorm = IdentityOp
    elif centred:
        sub.input_layernorm = ZeroCenteredRMSNorm
        sub.pre_mlp_layernorm = ZeroCenteredRMSNorm
    if outputs:
        spec.module = PostNormLayer
        sub.mlp.module = type("PostNormMLP", (PostNormMLP,), {"centred": centred})
    base = PostNormSelfAttention if outputs else AllHeadsNormSelfAttention
    sub.self_attention.module = type(base.__name__, (base,), {
        "centred": centred, "local_rotary_base": model.local_rotary_base,
        "global_position_scale": model.rope_scaling.factor
        if model.rope_scaling.type == "linear" else 1.0})
    if model.qk_layernorm_all_heads:
        sub.self_attention.submodules.q_layernorm = AllHeadsQueryNorm
        sub.self_attention.submodules.k_layernorm = AllHeadsKeyNorm
    elif centred and model.qk_layernorm:
        sub.self_attention.submodules.q_layernorm = ZeroCenteredRMSNorm
        sub.self_attention.submodules.k_layernorm = ZeroCenteredRMSNorm
    return spec
