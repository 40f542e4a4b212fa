"""Low-rank adapters (LoRA, ``model.lora``) on megatron-core's linears, at any layout.

Each targeted linear keeps its weights, frozen, and gains ``(alpha / r) B A dropout(x)``
per PEFT projection it holds: megatron's ``linear_qkv`` holds q_proj, k_proj and v_proj,
``linear_fc1`` gate_proj and up_proj, so each has an adapter of its own - the same
parameters as PEFT's on the Hugging Face model, which makes a PEFT adapter load and save
without approximation. The adapters of a linear live beside it (``linear_qkv_lora`` next
to ``linear_qkv``: the linear's own checkpoint entries stay as they are) and run in a
forward hook on it, so every layer spec, recomputation and pipeline schedule takes them.

**Tensor parallelism**, as megatron splits the base weight:
- a column-parallel linear (``linear_qkv``, ``linear_fc1``) splits ``B`` by output rows;
  ``A`` is whole on every TP rank. ``A x`` passes megatron's copy-to-TP region (its
  backward sums the TP ranks' gradients), so ``A`` and the input get their whole gradient
  on every rank. Under sequence parallelism the input is gathered first, and its backward
  keeps this rank's positions (the gradient is already whole);
- a row-parallel linear (``linear_proj``, ``linear_fc2``) splits ``A`` by input columns;
  ``A x`` is summed over TP (r numbers a token) and ``B`` is whole; under sequence
  parallelism each rank keeps its positions of the output.
Within a fused linear's TP part the adapters' outputs are laid out as megatron lays out
the base's: ``linear_qkv`` by query group ([q heads, k, v] of each local group),
``linear_fc1`` as [gate part, up part].
"""

from __future__ import annotations

import contextlib

import torch

from megarlhf.config import LoRAConfig, ModelConfig

# megatron's linear -> the PEFT projections it holds, in its output (or input) order
PARTS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
         "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
COLUMN = ("linear_qkv", "linear_fc1")
SUFFIX = "_lora"


def part_rows(linear: str, part: str, widths: dict[str, int], groups: int) -> torch.Tensor:
    """The rows of a fused column-parallel weight that ``part`` of ``linear`` fills, given
    each part's width and the query groups there (one TP rank's, or the whole model's):
    ``linear_qkv`` by query group ([q heads, k, v] of each), ``linear_fc1`` [gate, up]."""
    parts = PARTS[linear]
    sizes = [widths[p] for p in parts]
    at = parts.index(part)
    if linear != "linear_qkv":
        start = sum(sizes[:at])
        return torch.arange(start, start + sizes[at])
    per_group = [w // groups for w in sizes]  # q, k, v rows of one group
    start, size, width = sum(per_group[:at]), per_group[at], sum(per_group)
    return torch.cat([torch.arange(g * width + start, g * width + start + size)
                      for g in range(groups)])


class Adapters(torch.nn.Module):
    """The adapters of one megatron linear (``name`` in :data:`PARTS`): for each targeted
    projection ``p``, ``<p>.lora_A`` and ``<p>.lora_B`` as this TP rank holds them."""

    def __init__(self, name: str, model: ModelConfig, tp_group, sequence_parallel: bool):
        super().__init__()
        self.name, self.column = name, name in COLUMN
        self.tp_group, self.sp = tp_group, sequence_parallel
        self.off = False  # :func:`disabled`
        cfg: LoRAConfig = model.lora
        self.scale, self.p = cfg.scale, cfg.dropout
        tp = tp_group.size()
        self.groups = model.query_groups // tp  # linear_qkv's local query groups
        self.shapes = model.lora_shapes()
        self.parts = PARTS[name]
        self.targeted = [p for p in self.parts if p in cfg.target_modules]
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        self.adapters = torch.nn.ModuleDict()
        for part in self.targeted:
            inp, out = self.shapes[part]
            pair = torch.nn.Module()
            pair.lora_A = torch.nn.Parameter(torch.zeros(
                cfg.rank, inp if self.column else inp // tp))
            pair.lora_B = torch.nn.Parameter(torch.zeros(
                out // tp if self.column else out, cfg.rank))
            # the TP-split one is megatron's tensor-parallel parameter (the gradient norm
            # counts every rank's part; a whole one, once)
            split = "lora_B" if self.column else "lora_A"
            set_tensor_model_parallel_attributes(getattr(pair, split), True,
                                                 0 if self.column else 1, 1)
            self.adapters[part] = pair

    def _hidden(self, x: torch.Tensor, part: str) -> torch.Tensor:
        x = torch.nn.functional.dropout(x, self.p, self.training) if self.p else x
        return x @ self.adapters[part].lora_A.t().to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """What the adapters add to the linear's output for its input ``x``."""
        from megatron.core.tensor_parallel import mappings

        group = self.tp_group
        if not self.column:  # x: this rank's input columns
            outs = []
            for part in self.targeted:
                h = mappings.reduce_from_tensor_model_parallel_region(self._hidden(x, part),
                                                                      group=group)
                outs.append(h @ self.adapters[part].lora_B.t().to(h.dtype))
            delta = sum(outs) * self.scale
            return mappings.scatter_to_sequence_parallel_region(delta, group=group) \
                if self.sp else delta
        if self.sp:
            x = mappings.gather_from_sequence_parallel_region(
                x, tensor_parallel_output_grad=False, group=group)
        outs = {}
        for part in self.targeted:
            h = mappings.copy_to_tensor_model_parallel_region(self._hidden(x, part),
                                                              group=group)
            outs[part] = h @ self.adapters[part].lora_B.t().to(h.dtype) * self.scale
        return self._lay_out(outs, x)

    def local_rows(self, part: str) -> torch.Tensor:
        """The rows of this rank's part of the fused column-parallel weight that ``part``
        fills (the layout :meth:`_lay_out` writes)."""
        tp = self.tp_group.size()
        return part_rows(self.name, part, {p: self.shapes[p][1] // tp for p in self.parts},
                         self.groups)

    def _lay_out(self, outs: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """The parts' outputs in the fused linear's local output order (an untargeted
        part adds zeros)."""
        tp = self.tp_group.size()
        lead = x.shape[:-1]
        full = [outs.get(p) if p in outs else
                x.new_zeros(*lead, self.shapes[p][1] // tp) for p in self.parts]
        if self.name != "linear_qkv":
            return torch.cat(full, dim=-1)
        q, k, v = (t.reshape(*lead, self.groups, -1) for t in full)
        return torch.cat([q, k, v], dim=-1).reshape(*lead, -1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """megatron's sharded entries: the TP-split matrix along its split axis, the other
        replicated over TP."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        split = "lora_B" if self.column else "lora_A"
        axes = {f"adapters.{p}.{split}": 0 if self.column else 1 for p in self.targeted}
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, axes, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])


def _add_adapters(linear, adapters: Adapters):
    def hook(module, args, output):
        if adapters.off:
            return output
        out, bias = output
        return out + adapters(args[0]).to(out.dtype), bias
    return linear.register_forward_hook(hook)


@contextlib.contextmanager
def disabled(chunks: list):
    """The models' passes without their adapters: the base model (a LoRA actor's
    reference)."""
    every = [a for chunk in chunks for _, a in layer_adapters(unwrap_chunk(chunk))]
    for adapters in every:
        adapters.off = True
    try:
        yield
    finally:
        for adapters in every:
            adapters.off = False


def unwrap_chunk(chunk):
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def attach(model, model_cfg: ModelConfig) -> None:
    """Adapters on every targeted linear of ``model`` (one bare chunk) - its attention and
    dense MLPs; a mixture of experts' experts, routed and shared, keep none - and the base
    parameters frozen but a value model's scalar head (PEFT's ``modules_to_save`` for a
    sequence classifier: the head is new, so it trains)."""
    if not model_cfg.lora.enabled:
        return
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.mlp import MLP

    for name, p in model.named_parameters():
        p.requires_grad_(trains(name, model.kind))
    for where, module in list(model.named_modules()):
        if not isinstance(module, (Attention, MLP)) or "experts" in where:
            continue
        for name in PARTS:
            linear = getattr(module, name, None)
            if linear is None:
                continue
            adapters = Adapters(name, model_cfg, linear.tp_group,
                                model.config.sequence_parallel)
            if adapters.targeted:
                adapters.to(device=linear.weight.device)
                module.add_module(name + SUFFIX, adapters)
                object.__setattr__(adapters, "linear", linear)  # (not a submodule)
                _add_adapters(linear, adapters)


def adapter_parameters(model) -> list[torch.nn.Parameter]:
    return [p for name, p in model.named_parameters() if SUFFIX + "." in name]


def trains(key: str, kind: str) -> bool:
    """Whether the parameter (a state-dict or sharded key, prefixed or not) trains under
    LoRA: the adapters and a value model's new scalar head; the base is frozen."""
    return is_adapter(key) or (kind == "value" and (key.startswith("output_layer.")
                                                    or ".output_layer." in key))


def is_adapter(key: str) -> bool:
    """A state-dict or sharded key of an adapter's tensor."""
    return SUFFIX + ".adapters." in key


@torch.no_grad()
def merge_into_weights(model) -> int:
    """Fold every adapter of ``model`` (a bare chunk at any TP) into its linear's local
    weight, ``W + (B @ A) * alpha / r`` on this rank's rows or columns, and switch the
    adapters off: the rollout's inference model then decodes at the base model's cost.
    Returns the adapters folded. (The next reshard rewrites the weights and adapters.)"""
    folded = 0
    for _, adapters in layer_adapters(unwrap_chunk(model)):
        linear = adapters.linear
        for part in adapters.targeted:
            pair = adapters.adapters[part]
            delta = (pair.lora_B.float() @ pair.lora_A.float()) * adapters.scale
            rows = adapters.local_rows(part) if adapters.column else slice(None)
            linear.weight[rows] += delta.to(linear.weight.dtype)
            folded += 1
        adapters.off = True
    return folded


# ------------------------------------------------------------------ PEFT's adapters

def peft_key(layer: int, part: str, matrix: str) -> str:
    """PEFT's name of one adapter matrix (``lora_A`` / ``lora_B``) of a causal LM's
    ``layer`` (0-based) in its saved ``adapter_model.safetensors``."""
    block = "mlp" if part in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"base_model.model.model.layers.{layer}.{block}.{part}.{matrix}.weight"


def layer_adapters(chunk):
    """``(layer index (global, 0-based), Adapters)`` of a bare chunk's layers."""
    for layer in chunk.decoder.layers:
        for block in (layer.self_attention, layer.mlp):
            for name in PARTS:
                adapters = getattr(block, name + SUFFIX, None)
                if adapters is not None:
                    yield layer.layer_number - 1, adapters


def _split(adapters: Adapters, matrix: str) -> int | None:
    """The axis along which TP splits ``matrix`` of ``adapters`` (None: whole)."""
    if adapters.column:
        return 0 if matrix == "lora_B" else None
    return 1 if matrix == "lora_A" else None


def expected_keys(model: ModelConfig) -> dict[str, tuple[int, int]]:
    """Every PEFT key a model's adapters take, with its full shape."""
    out = {}
    shapes = model.lora_shapes()
    dense = model.moe.first_k_dense if model.moe.enabled else model.num_layers
    for layer in range(model.num_layers):
        for part in model.lora.target_modules:
            if part in ("gate_proj", "up_proj", "down_proj") and layer >= dense:
                continue
            inp, out_ = shapes[part]
            out[peft_key(layer, part, "lora_A")] = (model.lora.rank, inp)
            out[peft_key(layer, part, "lora_B")] = (out_, model.lora.rank)
    return out


def read_peft(folder: str, model: ModelConfig) -> dict[str, torch.Tensor]:
    """A PEFT LoRA adapter folder (``adapter_config.json`` and
    ``adapter_model.safetensors``) checked against ``model`` (its ``lora`` section and
    shapes): its tensors by PEFT key. Anything that does not fit is an error naming the
    file and the setting or key."""
    import json
    import os

    from safetensors.torch import load_file

    conf_path = os.path.join(folder, "adapter_config.json")
    weights_path = os.path.join(folder, "adapter_model.safetensors")
    for path in (conf_path, weights_path):
        if not os.path.isfile(path):
            raise ValueError(f"PEFT adapter {folder}: {os.path.basename(path)} is missing")
    try:
        with open(conf_path) as f:
            conf = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"{conf_path}: not a readable JSON file ({err})") from err
    lora = model.lora
    targets = conf.get("target_modules")
    targets = sorted(targets) if isinstance(targets, list) else targets
    for key, got, want in (("peft_type", conf.get("peft_type"), "LORA"),
                           ("r", conf.get("r"), lora.rank),
                           ("lora_alpha", conf.get("lora_alpha"), lora.alpha),
                           ("target_modules", targets, sorted(lora.target_modules)),
                           ("use_dora", bool(conf.get("use_dora")), False),
                           ("use_rslora", bool(conf.get("use_rslora")), False),
                           ("fan_in_fan_out", bool(conf.get("fan_in_fan_out")), False),
                           ("bias", conf.get("bias", "none"), "none")):
        if got != want:
            raise ValueError(f"{conf_path}: {key}={got!r} does not match this model's "
                             f"{want!r} (model.lora: rank={lora.rank}, alpha={lora.alpha}, "
                             f"target_modules={lora.target_modules})")
    try:
        tensors = load_file(weights_path)
    except Exception as err:  # safetensors raises its own error types
        raise ValueError(f"{weights_path}: not a readable safetensors file ({err})") from err
    want = expected_keys(model)
    extra = sorted(set(tensors) - set(want))
    missing = sorted(set(want) - set(tensors))
    if extra or missing:
        raise ValueError(f"{weights_path}: " + "; ".join(
            f"{what} {len(keys)} tensors, e.g. {keys[0]}" for what, keys in
            (("holds adapters this model does not take:", extra),
             ("lacks", missing)) if keys))
    for key, shape in want.items():
        if tuple(tensors[key].shape) != shape:
            raise ValueError(f"{weights_path}: {key} has shape {tuple(tensors[key].shape)}, "
                             f"this model's is {shape} - an adapter of another base model?")
    return tensors


@torch.no_grad()
def load_peft(chunks: list, tensors: dict[str, torch.Tensor]) -> None:
    """This rank's parts of PEFT's adapter ``tensors`` (:func:`read_peft`) into the
    adapters of ``chunks`` (bare)."""
    for chunk in chunks:
        for layer, adapters in layer_adapters(chunk):
            tp, rank = adapters.tp_group.size(), adapters.tp_group.rank()
            for part in adapters.targeted:
                for matrix in ("lora_A", "lora_B"):
                    full = tensors[peft_key(layer, part, matrix)]
                    axis = _split(adapters, matrix)
                    if axis is not None:
                        full = full.chunk(tp, dim=axis)[rank]
                    param = getattr(adapters.adapters[part], matrix)
                    param.copy_(full.to(param.dtype))


def peft_tensors(chunks: list, pp_group, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every adapter matrix of the model (or its gradient, ``grads``) whole, by PEFT key,
    on every rank: gathered over TP and the pipeline stages (every rank of the layout
    calls it)."""
    import torch.distributed as dist

    out = {}
    for chunk in chunks:
        for layer, adapters in layer_adapters(chunk):
            for part in adapters.targeted:
                for matrix in ("lora_A", "lora_B"):
                    param = getattr(adapters.adapters[part], matrix)
                    local = (param.grad if grads else param).detach().float().cpu()
                    axis = _split(adapters, matrix)
                    group = adapters.tp_group
                    if axis is not None and group.size() > 1:
                        parts = [torch.empty_like(local) for _ in range(group.size())]
                        dist.all_gather(parts, local.contiguous(), group=group)
                        local = torch.cat(parts, dim=axis)
                    out[peft_key(layer, part, matrix)] = local
    if pp_group.size() > 1:
        stages = [None] * pp_group.size()
        dist.all_gather_object(stages, out, group=pp_group)
        out = {key: value for stage in stages for key, value in stage.items()}
    return out


def parse_key(key: str) -> tuple[str, str, str]:
    """``(the linear's prefix, PEFT part, lora_A / lora_B)`` of an adapter's state-dict
    key (``decoder.layers.0.self_attention.linear_qkv_lora.adapters.q_proj.lora_A``)."""
    prefix, rest = key.split(SUFFIX + ".adapters.")
    part, matrix = rest.split(".")
    return prefix, part, matrix


@torch.no_grad()
def merged(sd: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """A whole (TP=1) state dict with every adapter folded into its linear's weight -
    ``W + (B @ A) * alpha / r``, as PEFT's ``merge_and_unload`` computes it - and the
    adapters' entries gone."""
    out = {k: v for k, v in sd.items() if not is_adapter(k)}
    shapes = model.lora_shapes()
    for key in sorted(k for k in sd if is_adapter(k) and k.endswith(".lora_A")):
        prefix, part, _ = parse_key(key)
        delta = (sd[key[:-len("lora_A")] + "lora_B"] @ sd[key]) * model.lora.scale
        name = prefix + ".weight"
        linear = prefix.rsplit(".", 1)[1]
        rows = part_rows(linear, part, {p: shapes[p][1] for p in PARTS[linear]},
                         model.query_groups) if linear in COLUMN else slice(None)
        weight = out[name] = out[name].clone() if out[name] is sd.get(name) else out[name]
        weight[rows] += delta.to(weight.dtype)
    return out


def peft_from_state(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a whole (TP=1) state dict by PEFT key."""
    out = {}
    for key, value in sd.items():
        if is_adapter(key):
            prefix, part, matrix = parse_key(key)
            layer = int(prefix.split("decoder.layers.")[1].split(".")[0])
            out[peft_key(layer, part, matrix)] = value
    return out


def write_peft(folder: str, tensors: dict[str, torch.Tensor], model: ModelConfig) -> None:
    """A PEFT LoRA adapter folder: ``adapter_model.safetensors`` (``tensors`` by PEFT key,
    as PEFT saves them) and ``adapter_config.json`` - the one the adapters started from
    (``model.lora.init_from``) byte for byte when it still describes them, else PEFT's
    fields for ``model.lora``. Each file is written whole or not at all."""
    import json
    import os

    from safetensors.torch import save_file

    def written(name: str, write) -> None:  # whole or not at all
        tmp = os.path.join(folder, f".{name}.tmp")
        write(tmp)
        os.replace(tmp, os.path.join(folder, name))

    os.makedirs(folder, exist_ok=True)
    source = model.lora.init_from and os.path.join(model.lora.init_from, "adapter_config.json")
    text = None
    if source and os.path.isfile(source):
        with open(source) as f:
            text = f.read()
        try:
            conf = json.loads(text)
        except ValueError:
            conf = {}
        if (conf.get("r"), conf.get("lora_alpha"), sorted(conf.get("target_modules") or [])) \
                != (model.lora.rank, model.lora.alpha, sorted(model.lora.target_modules)):
            text = None
    if text is None:
        text = json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": model.lora.rank,
            "lora_alpha": model.lora.alpha, "lora_dropout": model.lora.dropout,
            "target_modules": sorted(model.lora.target_modules), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
            "base_model_name_or_path": None}, indent=2, sort_keys=True) + "\n"
    written("adapter_model.safetensors", lambda tmp: save_file(
        {k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={"format": "pt"}))

    def config(tmp):
        with open(tmp, "w") as f:
            f.write(text)
    written("adapter_config.json", config)
