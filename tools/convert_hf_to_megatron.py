"""Convert a Hugging Face checkpoint (Llama 2 / 3.x, Mistral, Qwen2 / 2.5, Qwen3 dense,
Qwen3-MoE, Mixtral, GPT-2: *ForCausalLM / GPT2LMHeadModel, or their
*ForSequenceClassification heads) into a megarlhf checkpoint.

    python tools/convert_hf_to_megatron.py --hf-dir HF --out OUT [--tp N --pp M --ep E]
        [--role actor|critic|reward] [--dtype auto|float32|bfloat16|float16]

Writes OUT/checkpoints/ (megatron dist_checkpointing, loadable at any TP/PP) in the
checkpoint's own dtype (--dtype auto) and OUT/config.yaml (model, tokenizer and the
requested --tp/--pp/--ep layout), copies the tokenizer files and generation_config.json, and
prints what it did. The checkpoint is written one tensor at a time, each made from the HF
tensors it needs when megatron's writer asks for it (a meta-device model gives the layout;
megarlhf/engine/streaming.py), so peak memory does not grow with the depth
(bench/convert.py); --in-memory builds the model whole first (the reference the streamed
write is tested against). Shapes and keys are checked from the safetensors headers before
anything is read. An option the model's config.json carries that megarlhf does not
implement is refused naming the key; a failed conversion leaves no OUT behind.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import sys

import torch
import yaml

from megarlhf.models.hf_mapping import TOKENIZER_FILES, ConversionError

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
           "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "BOOL": torch.bool,
           "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16}
# Buffers some HF checkpoints carry that are not weights.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


def _opened(path: str):
    """``safe_open`` with the file named when its header is truncated or not safetensors."""
    from safetensors import safe_open

    try:
        return safe_open(path, "pt")
    except Exception as err:  # SafetensorError, OSError
        raise ValueError(f"{path} is not a readable safetensors file ({err}); it is "
                         "truncated or damaged") from None


class ShardReader:
    """Lazy access to (possibly sharded) safetensors; records which keys were read."""

    def __init__(self, hf_dir: str, skip=lambda key: False):
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        single = os.path.join(hf_dir, "model.safetensors")
        if os.path.exists(index):
            weight_map = json.load(open(index))["weight_map"]
        elif os.path.exists(single):
            with _opened(single) as f:
                weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(f"{hf_dir}: no model.safetensors or "
                                    "model.safetensors.index.json (only safetensors are read)")
        for shard in sorted(set(weight_map.values())):
            if not os.path.exists(os.path.join(hf_dir, shard)):
                raise FileNotFoundError(f"{hf_dir}: shard {shard} listed in the index is missing")
        self.dir, self.weight_map, self.used = hf_dir, weight_map, set()
        self.skipped = sorted(k for k in weight_map if skip(k))  # never read
        self._open = {}
        self.last_file = None  # the file of the tensor read last (named in shape errors)

    def has(self, key: str) -> bool:
        return key in self.weight_map

    def get(self, key: str, expert: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor ``key``; with ``expert`` (j, experts), only expert j's slice of a
        tensor that stacks a layer's experts first (gpt-oss), its count checked."""
        if key not in self.weight_map:
            raise KeyError(f"HF checkpoint has no tensor '{key}'")
        shard = self.weight_map[key]
        path = os.path.join(self.dir, shard)
        self.last_file = path
        self.used.add(key)
        try:
            # Opened for this tensor alone: the file is memory-mapped while open, and every
            # page read stays resident until it is closed (a whole shard, otherwise).
            with _opened(path) as f:
                if expert is None:
                    tensor = f.get_tensor(key)
                else:
                    part = f.get_slice(key)
                    _check_experts(key, part.get_shape(), expert)
                    tensor = part[expert[0]].clone()  # its own memory, not a view
        except ConversionError:
            raise
        except Exception as err:  # safetensors raises its own error types
            raise ValueError(f"{path}: tensor '{key}' cannot be read ({err}); the file is "
                             "truncated or damaged") from None
        bad = non_finite(tensor)
        if bad:
            raise ValueError(f"{path}: tensor '{key}' holds {bad} non-finite values (NaN/inf) "
                             f"of {tensor.numel()}; the file is damaged")
        return tensor

    def meta(self, key: str, expert: tuple[int, int] | None = None) -> torch.Tensor:
        """A storage-less tensor of ``key``'s shape and dtype (of an expert's slice, as
        :meth:`get`), from the file's header (no data read); recorded as consumed, as
        :meth:`get` does."""
        if key not in self.weight_map:
            raise KeyError(f"HF checkpoint has no tensor '{key}'")
        shard = self.weight_map[key]
        path = os.path.join(self.dir, shard)
        self.last_file = path
        if shard not in self._open:
            self._open = {shard: _opened(path)}
        part = self._open[shard].get_slice(key)
        self.used.add(key)
        shape = part.get_shape()
        if expert is not None:
            _check_experts(key, shape, expert)
            shape = shape[1:]
        return torch.empty(shape, dtype=_DTYPES[part.get_dtype()], device="meta")

    def unused(self) -> list[str]:
        skipped = set(self.skipped)
        return sorted(k for k in self.weight_map if k not in self.used and k not in skipped
                      and not k.endswith(IGNORED_SUFFIXES))


def _check_experts(key: str, shape: list[int], expert: tuple[int, int]) -> None:
    """A stacked experts tensor holds the config's number of experts, first."""
    if not shape or shape[0] != expert[1]:
        raise ConversionError(f"shape mismatch for HF '{key}': {tuple(shape)}, config.json "
                              f"implies {expert[1]} experts first")


def non_finite(tensor: torch.Tensor, chunk: int = 1 << 22) -> int:
    """How many of ``tensor``'s values are NaN or infinite, counted a slice at a time: a
    check of the whole tensor at once would hold a mask (and for bf16 a float32 copy) as
    large as a 70B model's embedding."""
    if not tensor.is_floating_point():
        return 0
    flat = tensor.reshape(-1)
    return sum(int((~torch.isfinite(flat[i:i + chunk])).sum())
               for i in range(0, flat.numel(), chunk))


def check_sources(sources: dict, params: dict, reader: "ShardReader", kind: str) -> None:
    """Before anything is read or written: every source made from the HF tensors' headers
    (shapes checked, on the meta device), every HF key consumed, every parameter of the
    model filled (a value model may start a fresh head), no source without a parameter."""
    from megarlhf.models.hf_mapping import ConversionError

    for name, make in sources.items():
        if name not in params:
            raise ConversionError(f"megarlhf model has no parameter '{name}'")
        try:
            made = make(reader.meta)
        except ConversionError as err:  # a tensor's shape: name its file
            raise ConversionError(f"{reader.last_file}: {err}") from None
        target = params[name]
        padded = name in ("embedding.word_embeddings.weight", "output_layer.weight") \
            and made.shape[1:] == target.shape[1:] and target.shape[0] >= made.shape[0]
        if not padded and tuple(made.shape) != tuple(target.shape):
            raise ConversionError(f"shape mismatch for '{name}': HF {tuple(made.shape)} vs "
                                  f"megarlhf {tuple(target.shape)}")
    unused = reader.unused()
    if unused:
        raise ConversionError(f"unknown HF keys (not converted): {', '.join(unused[:8])}"
                              + (" ..." if len(unused) > 8 else ""))
    fresh = {"output_layer.weight", "output_layer.bias"} if kind == "value" else set()
    missing = sorted(set(params) - set(sources) - fresh)
    if missing:
        raise ConversionError(f"megarlhf parameters not filled from HF: {', '.join(missing)}")


def convert(hf_dir: str, out: str, tp: int, pp: int, role: str, dtype: str = "auto",
            stream: bool = True, ep: int = 1) -> dict:
    """Convert into ``out``, built in a sibling folder and renamed at the end: a conversion
    that fails leaves no output folder behind."""
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise FileExistsError(f"--out {out} exists and is not an empty folder: choose a "
                              "new one (nothing was converted)")
    partial = f"{out.rstrip(os.sep)}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        info = _convert(hf_dir, partial, out, tp, pp, role, dtype, stream, ep)
        if os.path.isdir(out):
            os.rmdir(out)  # empty, checked above
        os.replace(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return info


def _convert(hf_dir: str, out: str, final: str, tp: int, pp: int, role: str,
             dtype: str, stream: bool, ep: int = 1) -> dict:
    from megarlhf.config import Layout, config_from_dict, padded_vocab_size, validate_layout
    from megarlhf.engine.checkpoint import RoleState, save_checkpoint
    from megarlhf.engine.streaming import StreamingSave
    from megarlhf.roles.spec import RoleSpec
    from megarlhf.roles.build import build_chunks
    from megarlhf.models.gpt import build_model, initial_value
    from megarlhf.parallel.layout import build_layout
    from megarlhf.models.hf_mapping import (
        ConversionError, extra_layers, layer_sources, model_overrides, outer_sources)
    from megarlhf.parallel.launch import init_distributed, shutdown

    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{hf_dir}: no config.json")
    try:
        with open(config_path) as f:
            hf = json.load(f)
    except json.JSONDecodeError as err:
        raise ConversionError(f"{config_path} is not valid JSON: {err}") from None
    try:
        model = model_overrides(hf)
    except ConversionError as err:
        raise ConversionError(f"{config_path}: {err}") from None
    kind = "lm" if role == "actor" else "value"
    reader = ShardReader(hf_dir, skip=extra_layers(hf))
    if dtype == "auto":  # the checkpoint's own: bf16 in, bf16 out
        dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ConversionError(f"{config_path}: dtype {dtype!r} is not float32, bfloat16 "
                                  "or float16: pass --dtype")
    model = {**model, "params_dtype": dtype}
    model_tree = {**model, "value_head_init": "normal"}
    parallel = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                **({"expert_model_parallel_size": ep} if ep > 1 else {}),
                # experts with biases (gpt-oss) stay whole on a rank at any TP
                **({"expert_tensor_parallel_size": 1}
                   if model.get("linear_bias") and model.get("moe") else {})}
    target_cfg = config_from_dict({"model": model_tree, "parallel": parallel})
    validate_layout(target_cfg, math.lcm(tp * pp, ep * pp))  # the layout must be possible
    cfg = config_from_dict({"model": model_tree})
    init_distributed(cfg)
    try:
        # One process (the checkpoint loads at any layout), the vocabulary padded for TP.
        layout = build_layout(Layout())
        spec = RoleSpec(name=role, kind=kind, model=target_cfg.model, layout=Layout(),
                        padded_vocab=padded_vocab_size(
                            target_cfg.model.vocab_size,
                            target_cfg.parallel.make_vocab_size_divisible_by, tp))
        if stream:  # megatron's modules with no storage: the layout and names only
            with torch.device("meta"):
                chunk = build_model(spec.model, kind=kind, padded_vocab=spec.padded_vocab,
                                    layout=layout.layout, pg_collection=layout.pg_collection,
                                    pre_process=True, post_process=True)
        else:
            (chunk,) = build_chunks(spec, layout)
        params = {k: v for k, v in chunk.state_dict(keep_vars=True).items()
                  if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
        sources = {}
        for i in range(model["num_layers"]):
            sources.update(layer_sources(hf["model_type"], i, model))
        sources.update(outer_sources(hf["model_type"], model, reader.has, kind))
        check_sources(sources, params, reader, kind)  # shapes and keys, no tensor read
        fresh_head = kind == "value" and "output_layer.weight" not in sources

        failed: list[Exception] = []  # what a tensor made during the save raised

        def produce(name: str) -> torch.Tensor:
            """The parameter ``name`` at TP=1: converted from the HF tensors it needs (the
            padded vocabulary rows zero), or a fresh value head's seeded initial value."""
            target = params[name]
            if name not in sources:
                return initial_value(name, tuple(target.shape), spec.model, kind,
                                     target_cfg.run.seed).to(target.dtype)
            try:
                tensor = sources[name](reader.get)
            except ConversionError as err:
                failed.append(ConversionError(f"{reader.last_file}: {err}"))
                raise failed[-1] from None
            except ValueError as err:  # a damaged file (NaN, truncated): read only now
                failed.append(err)
                raise
            if tensor.shape[0] < target.shape[0]:  # the vocabulary's padding rows
                tensor = torch.cat([tensor, tensor.new_zeros(
                    target.shape[0] - tensor.shape[0], *tensor.shape[1:])])
            return tensor.to(target.dtype).contiguous()

        strategy = None
        if stream:
            strategy = StreamingSave(params, produce)
        else:
            with torch.no_grad():
                for name_, target in params.items():
                    target.copy_(produce(name_))
        name = {"actor": "policy", "critic": "critic", "reward": "reward"}[role]
        cfg_dict = __import__("dataclasses").asdict(target_cfg)
        try:
            path = save_checkpoint(
                os.path.join(out, "checkpoints"), "step_0000000",
                {name: RoleState([chunk], extra={"kind": kind, "model": cfg_dict["model"]})},
                trainer_state={"step": 0, "converted_from": hf_dir,
                               "hf_model_type": hf["model_type"]},
                config=cfg_dict, layout=layout.describe(), sharded_strategy=strategy)
        except RuntimeError:
            if failed:  # the save wraps it: say what was wrong with the input
                raise failed[0] from None
            raise
        # generation_config.json travels with the tokenizer: its end tokens stop rollouts
        tokenizer_files = [f for f in (*TOKENIZER_FILES, "generation_config.json")
                           if os.path.exists(os.path.join(hf_dir, f))]
        for f in tokenizer_files:
            shutil.copy(os.path.join(hf_dir, f), os.path.join(out, f))
        run_cfg = {"model": {**model, "value_head_init": "normal"},
                   "parallel": parallel,
                   "checkpoint": {"load": os.path.join(final, "checkpoints")}}
        if "tokenizer.json" in tokenizer_files:
            run_cfg["tokenizer"] = {"type": "hf", "path": final}
        with open(os.path.join(out, "config.yaml"), "w") as f:
            yaml.safe_dump(run_cfg, f, sort_keys=False)
        count = sum(p.numel() for p in params.values())
        return {"architecture": hf.get("architectures", [hf["model_type"]])[0],
                "role": f"{role} ({kind}{', new scalar head' if fresh_head else ''})",
                "parameters": count,
                "layout": f"TP={tp} PP={pp}" + (f" EP={ep}" if ep > 1 else ""),
                "checkpoint": os.path.join(final, os.path.relpath(path, out)),
                "files": ["config.yaml", *tokenizer_files],
                **({"not converted": f"{len(reader.skipped)} tensors of the layers after "
                    f"num_hidden_layers={model['num_layers']} (multi-token prediction)"}
                   if reader.skipped else {}),
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    finally:
        shutdown()


def main(argv: list[str] | None = None) -> int:
    from megarlhf import quiet_known_warnings, speedups
    from megarlhf.engine.streaming import return_freed_memory

    speedups.install()
    return_freed_memory()
    quiet_known_warnings()
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel size written to config.yaml (MoE models)")
    parser.add_argument("--role", choices=["actor", "critic", "reward"], default="actor")
    parser.add_argument("--in-memory", action="store_true",
                        help="build the model whole and save it as a run does (the reference "
                        "the streaming write is tested against); default: stream")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                        default="auto", help="the checkpoint's dtype (auto: config.json's, "
                        "so bf16 in is bf16 out; float32 for CPU runs)")
    args = parser.parse_args(argv)
    from megarlhf.models.hf_mapping import ConversionError
    try:
        info = convert(args.hf_dir, args.out, args.tp, args.pp, args.role, args.dtype,
                       stream=not args.in_memory, ep=args.ep)
    except (ConversionError, FileNotFoundError, FileExistsError, KeyError, ValueError) as err:
        print(f"convert_hf_to_megatron: error: {err}", file=sys.stderr)
        return 2
    for key, value in info.items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
