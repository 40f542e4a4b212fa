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
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint


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


class _OutputNorm(MegatronModule):
    """RMSNorm of a sublayer's output (whole hidden states; the weight whole on every TP
    rank - ``tp_group`` set by the owner, for megatron's checkpoint replica ids)."""

    def __init__(self, config, tp_group):
        super().__init__(config=config)
        self.eps, self.tp_group = config.layernorm_epsilon, tp_group
        self.weight = torch.nn.Parameter(torch.ones(config.hidden_size,
                                                    dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class AllHeadsNormSelfAttention(SelfAttention):
    """megatron's SelfAttention whose query/key norms (over all heads) learn the TP
    group; its output as it is (pre-norm layers)."""

    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        for norm in (self.q_layernorm, self.k_layernorm):
            if isinstance(norm, _AllHeadsRMSNorm):
                norm.tp_group = self.pg_collection.tp


class PostNormSelfAttention(AllHeadsNormSelfAttention):
    """megatron's SelfAttention whose output is RMS-normalised before the residual
    (``post_layernorm``)."""

    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.post_layernorm = _OutputNorm(config, self.pg_collection.tp)

    def forward(self, *args, **kwargs):
        out, bias = super().forward(*args, **kwargs)
        if bias is not None:
            out, bias = out + bias, None
        return self.post_layernorm(out), bias


class PostNormMLP(MLP):
    """megatron's MLP whose output is RMS-normalised before the residual (built by
    :class:`PostNormLayer`, which hands it the TP group as megatron's layer does a plain
    MLP)."""

    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.post_layernorm = _OutputNorm(config, self.tp_group)

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


def post_norm_spec(spec: ModuleSpec, *, post: bool, all_heads: bool) -> ModuleSpec:
    """The local layer ``spec`` turned into OLMo 2's: no norms before the sublayers and
    output norms after them (``post``), q/k norms over all heads (``all_heads``; ``spec``
    built with q/k norms)."""
    sub = spec.submodules
    if post:
        spec.module = PostNormLayer
        sub.input_layernorm = IdentityOp
        sub.pre_mlp_layernorm = IdentityOp
        sub.mlp.module = PostNormMLP
    sub.self_attention.module = PostNormSelfAttention if post else AllHeadsNormSelfAttention
    if all_heads:
        sub.self_attention.submodules.q_layernorm = AllHeadsQueryNorm
        sub.self_attention.submodules.k_layernorm = AllHeadsKeyNorm
    return spec
