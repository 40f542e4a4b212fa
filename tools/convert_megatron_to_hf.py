"""Convert a megarlhf checkpoint back into a Hugging Face directory that
``transformers`` loads with ``from_pretrained`` (no remote code).

    python tools/convert_megatron_to_hf.py --config CONFIG.yaml --out HF_DIR
        [--ckpt CHECKPOINT] [--role NAME] [--model-type llama|mistral|qwen2|qwen3|qwen3_moe|mixtral|gpt2]

The checkpoint (default: the config's ``checkpoint.load``) may have been saved at any
TP/PP; it is read in one process a layer at a time, each layer converted and written to its
place in the safetensors files before the next is read, so peak memory does not grow with
the depth (bench/convert.py --export); --in-memory loads the model whole first (the
reference the streamed files are tested against: the same bytes). Writes config.json, model.safetensors (one file per
``--shard-layers`` layers with an index when sharded) and the tokenizer files of the
config's tokenizer (or found next to the config). ``megarlhf export`` does the same from
a run's config and adds generation_config.json.
"""

from __future__ import annotations

import argparse
import os
import sys


def convert(config_path: str, out: str, ckpt: str | None, role_name: str | None,
            model_type: str | None, shard_layers: int, stream: bool = True) -> dict:
    from megarlhf.config import load_config
    from megarlhf.stages.export import export_checkpoint

    cfg = load_config(config_path)
    ckpt = ckpt or cfg.checkpoint.load
    if not ckpt:
        raise ValueError("no checkpoint: pass --ckpt or set checkpoint.load in the config")
    return export_checkpoint(cfg, out, ckpt, role_name, model_type, shard_layers,
                             tokenizer_dir=os.path.dirname(os.path.abspath(config_path)),
                             stream=stream)


def main(argv: list[str] | None = None) -> int:
    from megarlhf import quiet_known_warnings, speedups
    from megarlhf.engine.streaming import return_freed_memory

    speedups.install()
    return_freed_memory()
    quiet_known_warnings()
    from megarlhf.models.hf_mapping import SUPPORTED

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="megarlhf YAML config of the model")
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--role", default=None, help="checkpoint role (default: its only one)")
    parser.add_argument("--model-type", choices=SUPPORTED,
                        default=None)
    parser.add_argument("--shard-layers", type=int, default=0,
                        help="layers per safetensors shard (0: one file)")
    parser.add_argument("--in-memory", action="store_true",
                        help="load the model whole first (the reference the streamed write "
                        "is tested against); default: a layer at a time")
    args = parser.parse_args(argv)
    from megarlhf.models.hf_mapping import ConversionError
    try:
        info = convert(args.config, args.out, args.ckpt, args.role, args.model_type,
                       args.shard_layers, stream=not args.in_memory)
    except (ConversionError, FileNotFoundError, KeyError, ValueError) as err:
        print(f"convert_megatron_to_hf: error: {err}", file=sys.stderr)
        return 2
    for key, value in info.items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
