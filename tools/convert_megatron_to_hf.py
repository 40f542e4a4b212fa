"""Convert a megarlhf checkpoint back into a Hugging Face directory that
``transformers`` loads with ``from_pretrained`` (no remote code).

    python tools/convert_megatron_to_hf.py --config CONFIG.yaml --out HF_DIR
        [--ckpt CHECKPOINT] [--role NAME] [--model-type llama|mistral|qwen2|gpt2]

The checkpoint (default: the config's ``checkpoint.load``) may have been saved at any
TP/PP; it is loaded into one process. Writes config.json, model.safetensors (one file per
``--shard-layers`` layers with an index when sharded) and the tokenizer files found next
to the config.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch

from convert_hf_to_megatron import TOKENIZER_FILES


def hf_config(model_type: str, m: dict, role: str) -> dict:
    from megarlhf.models.hf_mapping import LLAMA_FAMILY

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
               "attention_dropout": 0.0}
    if role == "value":
        cfg["num_labels"] = 1
    cfg["torch_dtype"] = "float32"
    return cfg


def convert(config_path: str, out: str, ckpt: str | None, role_name: str | None,
            model_type: str | None, shard_layers: int) -> dict:
    import dataclasses

    from safetensors.torch import save_file

    from megarlhf.config import load_config
    from megarlhf.engine.checkpoint import checkpoint_role, read_meta
    from megarlhf.engine.role_specs import single_role_spec
    from megarlhf.engine.roles import build_role
    from megarlhf.models.hf_mapping import ConversionError, megatron_to_hf
    from megarlhf.parallel.launch import init_distributed, shutdown

    cfg = load_config(config_path, ["parallel.tensor_model_parallel_size=1",
                                    "parallel.pipeline_model_parallel_size=1",
                                    "parallel.virtual_pipeline_model_parallel_size=null"])
    ckpt = ckpt or cfg.checkpoint.load
    if not ckpt:
        raise ValueError("no checkpoint: pass --ckpt or set checkpoint.load in the config")
    meta = read_meta(ckpt)
    role = checkpoint_role(meta, role_name, ckpt)
    kind = meta["roles"][role].get("kind", "lm")
    cfg.checkpoint.load = ckpt
    # The model is the checkpoint's own (the config's written fields must agree with it).
    spec = single_role_spec(cfg, name=role, kind=kind, world_size=1, trained=False,
                            checkpoint_role=role)
    model_cfg = spec.model
    m = dataclasses.asdict(model_cfg)
    m["num_query_groups"] = model_cfg.query_groups
    m["ffn_hidden_size"] = model_cfg.ffn_size
    m["tie_word_embeddings"] = model_cfg.tied
    model_type = model_type or meta["trainer"].get("hf_model_type") or (
        "gpt2" if model_cfg.arch == "gpt2" else
                                ("qwen2" if model_cfg.qkv_bias else "llama"))
    init_distributed(cfg)
    try:
        (chunk,) = build_role(spec, seed=cfg.run.seed).chunks
        sd = {k: v.detach().float() for k, v in chunk.state_dict().items()
              if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
        if kind == "value" and sd.get("output_layer.bias", torch.zeros(1)).abs().max() > 0:
            raise ConversionError("the value head has a non-zero bias, which HF's "
                                  "*ForSequenceClassification 'score' layer cannot hold")
        tensors = megatron_to_hf(model_type, m, sd, model_cfg.vocab_size, kind)
        os.makedirs(out, exist_ok=True)
        files = _save_sharded(tensors, out, m["num_layers"], shard_layers, save_file)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(hf_config(model_type, m, kind), f, indent=1)
        src_dir = os.path.dirname(os.path.abspath(config_path))
        copied = [f for f in TOKENIZER_FILES if os.path.exists(os.path.join(src_dir, f))]
        for f in copied:
            shutil.copy(os.path.join(src_dir, f), os.path.join(out, f))
        return {"model_type": model_type, "role": f"{role} ({kind})",
                "parameters": sum(t.numel() for t in tensors.values()),
                "files": ["config.json", *files, *copied]}
    finally:
        shutdown()


def _save_sharded(tensors: dict, out: str, num_layers: int, shard_layers: int, save_file):
    if shard_layers <= 0 or shard_layers >= num_layers:
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    groups: dict[int, dict] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        layer = int(parts[parts.index("layers") + 1]) if "layers" in parts else \
            int(parts[parts.index("h") + 1]) if ".h." in name else -1
        groups.setdefault(max(layer, 0) // shard_layers, {})[name] = t
    total = len(groups)
    weight_map, files = {}, []
    for i, (_, group) in enumerate(sorted(groups.items())):
        fname = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        save_file(group, os.path.join(out, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in group})
        files.append(fname)
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    return files + ["model.safetensors.index.json"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="megarlhf YAML config of the model")
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--role", default=None, help="checkpoint role (default: its only one)")
    parser.add_argument("--model-type", choices=["llama", "mistral", "qwen2", "gpt2"],
                        default=None)
    parser.add_argument("--shard-layers", type=int, default=0,
                        help="layers per safetensors shard (0: one file)")
    args = parser.parse_args(argv)
    from megarlhf.models.hf_mapping import ConversionError
    try:
        info = convert(args.config, args.out, args.ckpt, args.role, args.model_type,
                       args.shard_layers)
    except (ConversionError, FileNotFoundError, KeyError, ValueError) as err:
        print(f"convert_megatron_to_hf: error: {err}", file=sys.stderr)
        return 2
    for key, value in info.items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
