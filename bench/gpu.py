"""GPU figures for BENCHMARKS.md, on one CUDA GPU (printed; nothing asserted).

    python bench/gpu.py [--parts roofline,train,generate,reshard,ppo] [--quick]

- roofline: this GPU's bf16 dense matmul rate (8192^3, median of 20) and device-to-device
  copy bandwidth (bytes read + written), the ceilings the other rows are read against;
- train: training-step MFU of a ~1B Llama-shaped model in bf16 (fp32 master weights and
  Adam state in megatron's distributed optimizer, DP=1), sequence 2048, 4 micro-batches of
  4; FLOPs per token by PaLM's formula 6N + 12*L*h*s (N: non-embedding weights plus the
  output layer), against the measured rate and the datasheet's 989 TFLOP/s;
- generate: greedy KV-cached generation tokens/s against transformers' ``generate`` on the
  same weights (a random HF Llama converted with tools/convert_hf_to_megatron.py), bf16,
  prompt 128, 128 new tokens, batch 1 and 64;
- reshard: training layout -> inference model (TP=1 -> TP=1, megatron's NCCL copy service),
  seconds per GB;
- ppo: the CLI's PPO on the synthetic task with a ~0.9B actor, critic, reference and
  reward model (one GPU, bf16), two iterations, the phase split of the second.
``--quick`` shrinks every model (a smoke run of this script).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, child_env, convert  # noqa: E402

BIG = dict(layers=16, hidden=2048, heads=16, kv_heads=8, ffn=5632, vocab=32000)
QUICK = dict(layers=2, hidden=256, heads=8, kv_heads=4, ffn=688, vocab=4000)
DATASHEET_BF16 = 989.4e12  # H100 SXM dense bf16 (H200: the same compute)


def cuda_time(fn, repeats: int = 5) -> float:
    """Median seconds of ``repeats`` calls after one warm-up, synchronised."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def roofline() -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(20):
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    rate = 2 * n ** 3 / sorted(times)[10]
    x = torch.randn(2 ** 30 // 2, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    y = torch.empty_like(x)
    copy = cuda_time(lambda: y.copy_(x), repeats=10)
    print(f"roofline: bf16 matmul 8192^3 {rate / 1e12:.0f} TFLOP/s (median of 20); "
          f"device copy {2 * x.numel() * 2 / copy / 1e12:.2f} TB/s (read + write)")
    return rate


def model_overrides(s: dict, dtype: str = "bfloat16") -> list[str]:
    return [f"model.num_layers={s['layers']}", f"model.hidden_size={s['hidden']}",
            f"model.num_attention_heads={s['heads']}", f"model.num_query_groups={s['kv_heads']}",
            f"model.ffn_hidden_size={s['ffn']}", f"model.params_dtype={dtype}"]


def start(cfg) -> None:
    import torch.distributed as dist

    from megarlhf.parallel.launch import init_distributed
    if not dist.is_initialized():
        init_distributed(cfg)


def train(s: dict, peak: float, quick: bool) -> None:
    from megarlhf.config import load_config
    from megarlhf.engine.optimizer import train_step
    from megarlhf.roles.build import build_from_config
    from megarlhf.engine.steps import make_lm_loss_step

    seq, micro, num_micro = (2048, 4, 4) if not quick else (256, 2, 2)
    cfg = load_config(None, model_overrides(s) + [
        f"model.vocab_size={s['vocab']}", f"model.max_position_embeddings={seq}",
        "optimizer.lr=1e-5"])
    start(cfg)
    role = build_from_config(cfg, kind="lm", trained=True, total_steps=100)
    gen = torch.Generator().manual_seed(0)
    batches = [{"tokens": torch.randint(0, s["vocab"], (micro, seq), generator=gen),
                "position_ids": torch.arange(seq).expand(micro, -1).contiguous(),
                "loss_mask": torch.ones(micro, seq)} for _ in range(num_micro)]
    step = make_lm_loss_step(tp_group=role.layout.tp_group, true_vocab=s["vocab"])
    seconds = cuda_time(lambda: train_step(role.trained, step, batches, seq_length=seq,
                                           micro_batch_size=micro), repeats=5)
    embedding = role.chunks[0].embedding.word_embeddings.weight.numel()
    n_params = sum(p.numel() for p in role.parameters)
    n_flops = n_params - embedding  # the output layer is untied: it stays in N
    tokens = seq * micro * num_micro
    flops = tokens * (6 * n_flops + 12 * s["layers"] * s["hidden"] * seq)
    print(f"train: {n_params / 1e9:.2f} B params, bf16, DP=1 distributed optimizer, "
          f"{tokens} tokens/step (seq {seq}, {num_micro} x {micro}): {seconds * 1e3:.0f} ms/step, "
          f"{tokens / seconds:.0f} tokens/s, {flops / seconds / 1e12:.0f} TFLOP/s = "
          f"MFU {flops / seconds / DATASHEET_BF16:.1%} of the datasheet, "
          f"{flops / seconds / peak:.1%} of the measured matmul rate; "
          f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    del role
    torch.cuda.empty_cache()


def generate_vs_hf(s: dict, quick: bool) -> None:
    import transformers

    from megarlhf.config import load_config
    from megarlhf.roles.build import build_from_config
    from megarlhf.inference.generate import SamplingParams, generate

    prompt, new = (128, 128) if not quick else (16, 16)
    tmp = tempfile.mkdtemp()
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], max_position_embeddings=512, bos_token_id=1,
        eos_token_id=2, torch_dtype=torch.bfloat16)
    hf = transformers.LlamaForCausalLM(hf_cfg).to(torch.bfloat16)
    hf.save_pretrained(os.path.join(tmp, "hf"))
    start_t = time.perf_counter()
    convert(os.path.join(tmp, "hf"), os.path.join(tmp, "mrl"))
    print(f"generate: converted {sum(p.numel() for p in hf.parameters()) / 1e9:.2f} B params "
          f"HF -> megarlhf in {time.perf_counter() - start_t:.0f} s")
    hf = hf.cuda().eval()
    cfg = load_config(os.path.join(tmp, "mrl", "config.yaml"), ["model.params_dtype=bfloat16"])
    start(cfg)
    (model,) = build_from_config(cfg, kind="lm").chunks
    params = SamplingParams(max_new_tokens=new, greedy=True)
    for batch in (1, 64):
        prompts = torch.randint(3, s["vocab"], (batch, prompt),
                                generator=torch.Generator().manual_seed(batch)).tolist()

        def ours():
            return generate(model, prompts, params, eos_id=-1, pad_id=0,
                            true_vocab=cfg.model.vocab_size)

        def theirs():
            with torch.no_grad():
                return hf.generate(torch.tensor(prompts, device="cuda"), max_new_tokens=new,
                                   min_new_tokens=new, do_sample=False, pad_token_id=0)

        t_ours, t_hf = cuda_time(ours, repeats=3), cuda_time(theirs, repeats=3)
        a, b = ours().response_tokens_BT, theirs()[:, prompt:].cpu()
        same_first = float((a[:, :8] == b[:, :8]).all(dim=1).float().mean())
        tokens = batch * new
        print(f"generate: batch {batch:>2}, prompt {prompt}, {new} new: megarlhf "
              f"{tokens / t_ours:.0f} tok/s, HF generate {tokens / t_hf:.0f} tok/s, "
              f"ratio {t_hf / t_ours:.2f}x; rows whose first 8 greedy tokens agree "
              f"{same_first:.0%} (bf16)")
    del model, hf
    torch.cuda.empty_cache()
    shutil.rmtree(tmp, ignore_errors=True)


def reshard(s: dict) -> None:
    from megarlhf.config import load_config
    from megarlhf.roles.build import build_from_config
    from megarlhf.inference.reshard import Resharder, build_inference_model, inference_layout

    cfg = load_config(None, model_overrides(s) + [f"model.vocab_size={s['vocab']}"])
    start(cfg)
    actor = build_from_config(cfg, kind="lm", trained=True)
    inference = build_inference_model(actor.spec, inference_layout(1))
    resharder = Resharder(actor.chunks, inference)
    first = resharder()
    steady = sorted(resharder().seconds for _ in range(5))[2]
    gb = first.bytes_received / 1e9
    print(f"reshard: TP=1 -> TP=1 over {resharder.service}, {gb:.2f} GB: first call "
          f"(plans) {first.seconds:.2f} s, then {steady * 1e3:.1f} ms = "
          f"{gb / steady:.0f} GB/s ({steady / gb * 1e3:.1f} ms per GB)")
    del actor, inference
    torch.cuda.empty_cache()


def ppo(s: dict, quick: bool) -> None:
    """Through the CLI, in subprocesses: SFT and RM for one step each (checkpoints of the
    right shape), then two PPO iterations."""
    from megarlhf.data.synthetic import write_task

    out = tempfile.mkdtemp()
    try:
        _ppo(s, quick, out, write_task)
    finally:  # three ~1B checkpoints with optimizer state: ~50 GB of a 64 GB disk
        shutil.rmtree(out, ignore_errors=True)


def _ppo(s: dict, quick: bool, out: str, write_task) -> None:
    task = write_task(os.path.join(out, "task"), seed=0)
    new = 128 if not quick else 16
    sizes = model_overrides(s) + [f"model.max_position_embeddings={new + 32}"]
    common = [f"tokenizer.path={task['tokenizer']}", f"run.output_dir={out}",
              "logging.progress_bar=false", "logging.tensorboard=false",
              f"data.max_seq_len={new + 16}"]

    def cli(*argv, check=True):
        proc = subprocess.run([sys.executable, "-m", "megarlhf.cli", *argv], cwd=ROOT,
                              capture_output=True, text=True, env=child_env())
        if proc.returncode:
            print(proc.stdout[-3000:], proc.stderr[-6000:])
            if check:
                raise SystemExit(f"ppo benchmark: {argv[0]} failed")
        return proc

    cli("sft", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}", "train.max_steps=1",
        "checkpoint.save_interval=1", *sizes, *common)
    cli("rm", "configs/rm_tiny.yaml", f"data.train_path={task['prefs']}", "train.max_steps=1",
        "checkpoint.save_interval=1", *sizes, *common)
    start_t = time.perf_counter()
    # The final checkpoint's failure (a full disk) must not hide the iterations' figures.
    cli("ppo", "configs/demo/ppo.yaml", f"data.train_path={task['prompts']}",
        f"data.eval_path={task['eval_prompts']}", f"ppo.sft_checkpoint={out}/sft-tiny/checkpoints",
        f"ppo.reward_checkpoint={out}/rm-tiny/checkpoints", "ppo.num_iterations=2",
        "ppo.rollout_batch_size=64", "ppo.mini_batch_size=32", "ppo.micro_batch_size=8",
        "ppo.ppo_epochs=1", "ppo.eval_interval=100", "logging.sample_table_interval=0",
        f"rollout.max_new_tokens={new}", "rollout.stop_at_eos=false",
        "checkpoint.save_interval=0", *common, check=False)
    wall = time.perf_counter() - start_t
    rows = [json.loads(line) for line in open(os.path.join(out, "ppo-tiny", "metrics.jsonl"))]
    last = [r for r in rows if r.get("step") == 2][-1]
    split = {k: v for k, v in last.items() if k.startswith("timing/")}
    print(f"ppo: ~{s['layers']}x{s['hidden']} actor, critic, reference, reward on one GPU, "
          f"bf16, 64 prompts x {new} new tokens, 1 epoch of 2 mini-batches; CLI wall "
          f"{wall:.0f} s for 2 iterations; iteration 2: " + ", ".join(
              f"{k[7:]} {v:.2f} s" for k, v in sorted(split.items()))
          + f"; tokens/s {last.get('perf/tokens_per_s', 0):.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="roofline,train,generate,reshard,ppo")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs a CUDA GPU")
    parts = args.parts.split(",")
    s = QUICK if args.quick else BIG
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}")
    peak = roofline() if "roofline" in parts else DATASHEET_BF16
    for part, fn in (("train", lambda: train(s, peak, args.quick)),
                     ("generate", lambda: generate_vs_hf(s, args.quick)),
                     ("reshard", lambda: reshard(s)),
                     ("ppo", lambda: ppo(s, args.quick))):
        if part in parts:
            t0 = time.perf_counter()
            fn()
            torch.cuda.reset_peak_memory_stats()
            print(f"  ({part}: {time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
