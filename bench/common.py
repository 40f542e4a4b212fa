"""Shared helpers for the benchmark scripts (which print figures and assert nothing)."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Benchmarks measure megarlhf as the CLI runs it: the speed-ups MEGARLHF_SPEEDUPS selects,
# installed before megatron is imported.
from megarlhf import quiet_known_warnings, speedups  # noqa: E402

speedups.install()
quiet_known_warnings()

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = {  # the tiny and small sizes
    "tiny": dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=176, vocab=1000),
    "small": dict(layers=4, hidden=256, heads=8, kv_heads=4, ffn=688, vocab=4000),
    # issue 19's ~30M-parameter model for the scaling table
    "medium": dict(layers=8, hidden=512, heads=8, kv_heads=4, ffn=1376, vocab=8000),
    # issue 37's mixture of experts: small's trunk, each MLP 8 experts of 256 (top 2) in a
    # Qwen3-MoE policy (q/k norms); its reward model and critic stay dense (small)
    "moe": dict(layers=4, hidden=256, heads=8, kv_heads=4, ffn=688, vocab=4000, experts=8,
                top_k=2, expert_ffn=256),
}


def machine() -> str:
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads{gpu}")


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def timed(fn, repeats: int = 3) -> float:
    """Median wall time of ``repeats`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def qwen3_moe_config(size: str, **extra):
    """transformers' Qwen3MoeConfig for a benchmark size with experts (no router aux loss:
    transformers computes none unless asked, so neither side pays for it)."""
    import transformers
    s = SIZES[size]
    return transformers.Qwen3MoeConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
        moe_intermediate_size=s["expert_ffn"], num_experts=s["experts"],
        num_experts_per_tok=s["top_k"], norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], router_aux_loss_coef=0.0, num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
        head_dim=s["hidden"] // s["heads"], max_position_embeddings=512, **extra)


def llama_config(size: str, **extra):
    """transformers' LlamaConfig for one of the benchmark sizes."""
    import transformers
    s = SIZES[size]
    return transformers.LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], max_position_embeddings=512, **extra)


def hf_llama(size: str, path: str):
    import transformers
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config(size, bos_token_id=1, eos_token_id=2))
    model.save_pretrained(path)
    return model.eval()


def child_env() -> dict:
    """This process's environment without its process-group address: a child started after
    ``init_distributed`` must pick its own port, not bind the parent's."""
    drop = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    return {k: v for k, v in os.environ.items() if k not in drop}


def convert(hf_dir: str, out: str, *extra: str) -> None:
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_hf_to_megatron.py"),
                           "--hf-dir", hf_dir, "--out", out, *extra], capture_output=True,
                          text=True, env=child_env())
    if proc.returncode:
        raise SystemExit(f"conversion failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def run_megarlhf(args: list[str]) -> float:
    """``megarlhf ARGS`` in a process of its own from the repository (one thread unless
    OMP_NUM_THREADS says otherwise); its seconds, or the end of the bench with its output
    when it fails."""
    start = time.time()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run([sys.executable, "-m", "megarlhf.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed: megarlhf {' '.join(args)}\n{proc.stdout[-2000:]}\n"
                 f"{proc.stderr[-4000:]}")
    return time.time() - start
