"""What converting a Hugging Face checkpoint costs, both ways: peak resident memory and time
of ``tools/convert_hf_to_megatron.py`` (HF -> megatron) and of
``tools/convert_megatron_to_hf.py`` on its output (megatron -> HF, the export) against the
safetensors' size, at several depths of one Llama-3 shape (random weights saved by
transformers in bf16, llama3 RoPE scaling, GQA).

By default both stream: the converter writes each tensor as it makes it (a meta-device
model, megatron's format), the export reads, converts and writes a layer at a time;
``--in-memory`` builds the model whole first in both (the references they are tested
against).
Each conversion runs in its own process (its peak is that process's ``ru_maxrss``), and
so does each model's creation: a child forked from a large parent would count the parent's
pages in its peak.

    .venv/bin/python bench/convert.py [--hidden 1024] [--layers 6,12] [--dtype auto]
        [--in-memory]

The export direction reads the checkpoint in its own dtype (bf16 when --dtype auto).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_model(folder: str, hidden: int, layers: int) -> int:
    """A random Llama-3-shaped model saved in bf16: (its safetensors bytes, the bytes of one
    transformer layer)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256), max_position_embeddings=131072,
        rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 8192})
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    largest_layer = sum(p.numel() * p.element_size()
                        for p in model.model.layers[0].parameters())
    del model
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
               if f.endswith(".safetensors"))
    return size, largest_layer


def run_tool(args: list[str], out: str) -> tuple[float, float, int]:
    """(seconds, peak resident bytes, bytes written under ``out``) of one tool run: the
    child's own ``ru_maxrss`` (``os.wait4``)."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{args[0]} failed:\n{proc.stderr.read().decode()[-3000:]}")
    written = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(out)
                  for f in files if f.endswith((".distcp", ".safetensors")))
    return seconds, usage.ru_maxrss * 1024.0, written


def convert(hf: str, out: str, dtype: str, in_memory: bool) -> tuple[float, float, int]:
    """HF -> megatron (tools/convert_hf_to_megatron.py)."""
    return run_tool([os.path.join(ROOT, "tools", "convert_hf_to_megatron.py"), "--hf-dir", hf,
                     "--out", out, "--dtype", dtype, *(["--in-memory"] if in_memory else [])],
                    out)


def export(converted: str, out: str, in_memory: bool) -> tuple[float, float, int]:
    """megatron -> HF (tools/convert_megatron_to_hf.py) of a conversion's output."""
    return run_tool([os.path.join(ROOT, "tools", "convert_megatron_to_hf.py"), "--config",
                     os.path.join(converted, "config.yaml"), "--out", out,
                     *(["--in-memory"] if in_memory else [])], out)


def make_model_apart(folder: str, hidden: int, layers: int) -> tuple[int, int]:
    """:func:`make_model` in a child process (this one stays small)."""
    import json

    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--make", folder,
                          str(hidden), str(layers)], check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--make":
        import json
        print(json.dumps(make_model(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
        return
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", default="6,12", help="depths, shallowest first")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--in-memory", action="store_true")
    args = parser.parse_args()
    way = "in memory" if args.in_memory else "streamed"
    depths = [int(x) for x in args.layers.split(",")]
    print("| direction | layers | safetensors | one layer | peak resident | peak / files | "
          "time | written |")
    print("|---|---|---|---|---|---|---|---|")
    mib = 2.0 ** 20
    with tempfile.TemporaryDirectory() as tmp:
        for layers in depths:
            hf = os.path.join(tmp, f"hf{layers}")
            size, layer = make_model_apart(hf, args.hidden, layers)
            out = os.path.join(tmp, f"out{layers}")
            runs = {"HF -> megatron": lambda: convert(hf, out, args.dtype, args.in_memory),
                    "megatron -> HF": lambda: export(out, os.path.join(tmp, f"back{layers}"),
                                                     args.in_memory)}
            for direction, run in runs.items():
                seconds, peak, written = run()
                print(f"| {direction} | {layers} | {size / mib:.0f} MiB | {layer / mib:.1f} MiB "
                      f"| {peak / mib:.0f} MiB | {peak / size:.2f}x | {seconds:.1f} s | "
                      f"{written / mib:.0f} MiB ({args.dtype}, {way}) |", flush=True)


if __name__ == "__main__":
    main()
