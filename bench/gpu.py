"""GPU figures for BENCHMARKS.md, on one CUDA GPU (printed; nothing asserted).

    python bench/gpu.py [--parts roofline,convert,train,generate,te,reshard,ppo] [--quick]
                        [--train-variants local,te,fp8-delayed,fp8-current] [--work DIR]

- roofline: this GPU's bf16 dense matmul rate (8192^3, median of 20), its fp8 (e4m3,
  ``torch._scaled_mm``) rate, and device-to-device copy bandwidth (bytes read + written),
  the ceilings the other rows are read against;
- train: training-step MFU of a ~1B Llama-shaped model (fp32 master weights and Adam
  state in megatron's distributed optimizer, DP=1), sequence 2048, 4 micro-batches of 4;
  FLOPs per token by PaLM's formula 6N + 12*L*h*s (N: non-embedding weights plus the
  output layer), against the measured rate and the datasheet's 989 TFLOP/s (bf16) and
  1979 TFLOP/s (fp8). ``--train-variants``: megatron's local layers in bf16,
  TransformerEngine's layers in bf16, and TE in fp8 with delayed scaling and with current
  (per-tensor) scaling (``model.fp8.recipe=delayed`` / ``tensorwise``);
- generate: greedy KV-cached generation tokens/s against transformers' ``generate`` on the
  same weights (a random HF Llama converted with tools/convert_hf_to_megatron.py), bf16,
  prompt 128, 128 new tokens, batch 1 and 64: megatron's inference context (eager), and
  the fixed-shape cache with its step captured as a CUDA graph (``speedups.decode_graphs``),
  whose tokens are compared with the eager ones;
- te: on the same converted weights, the log-probs of 4 sequences of 1024 tokens from
  TransformerEngine's layers (bf16) against the local layers' and transformers', and the
  fp8 forward's (delayed and current scaling) against bf16 - the gap between an fp8
  training forward and a bf16 rollout's log-probs;
- reshard: training layout -> inference model (TP=1 -> TP=1, megatron's NCCL copy service),
  seconds per GB;
- ppo: the CLI's PPO on the synthetic task with a ~0.9B actor, critic, reference and
  reward model (one GPU, bf16), two iterations, the phase split of the second.
- convert: only the HF Llama and its conversion the generate and te parts read.
``--quick`` shrinks every model (a smoke run of this script). ``--work DIR`` keeps the
converted checkpoint there for a later call (the generate and te parts share it).
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
DATASHEET_FP8 = 1978.9e12  # and dense fp8


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
    fp8 = ""
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
        one = torch.ones((), device="cuda")
        seconds = cuda_time(lambda: torch._scaled_mm(a8, b8, one, one,
                                                     out_dtype=torch.bfloat16), 20)
        fp8 = f"; fp8 (e4m3, torch._scaled_mm) {2 * n ** 3 / seconds / 1e12:.0f} TFLOP/s"
    except Exception as err:  # an older torch or a GPU without fp8
        fp8 = f"; fp8 matmul not measured ({type(err).__name__}: {err})"
    x = torch.randn(2 ** 30 // 2, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    y = torch.empty_like(x)
    copy = cuda_time(lambda: y.copy_(x), repeats=10)
    print(f"roofline: bf16 matmul 8192^3 {rate / 1e12:.0f} TFLOP/s (median of 20); "
          f"device copy {2 * x.numel() * 2 / copy / 1e12:.2f} TB/s (read + write){fp8}")
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


TRAIN_VARIANTS = {  # name -> (overrides, label, the datasheet rate MFU is read against)
    "local": (["model.transformer_impl=local"], "bf16, local layers", DATASHEET_BF16),
    "te": (["model.transformer_impl=transformer_engine"], "bf16, TransformerEngine layers",
           DATASHEET_BF16),
    "fp8-delayed": (["model.transformer_impl=transformer_engine", "model.fp8.enabled=true",
                     "model.fp8.recipe=delayed"], "fp8 (TE, delayed scaling, hybrid)",
                    DATASHEET_FP8),
    "fp8-current": (["model.transformer_impl=transformer_engine", "model.fp8.enabled=true",
                     "model.fp8.recipe=tensorwise"], "fp8 (TE, current scaling, hybrid)",
                    DATASHEET_FP8),
}


def train(s: dict, peak: float, quick: bool, variant: str = "local") -> None:
    from megarlhf.config import load_config
    from megarlhf.engine.optimizer import train_step
    from megarlhf.roles.build import build_from_config
    from megarlhf.engine.steps import make_lm_loss_step

    overrides, label, datasheet = TRAIN_VARIANTS[variant]
    seq, micro, num_micro = (2048, 4, 4) if not quick else (256, 2, 2)
    cfg = load_config(None, model_overrides(s) + [
        f"model.vocab_size={s['vocab']}", f"model.max_position_embeddings={seq}",
        "optimizer.lr=1e-5", *overrides])
    start(cfg)
    torch.cuda.reset_peak_memory_stats()
    role = build_from_config(cfg, kind="lm", trained=True, total_steps=100)
    gen = torch.Generator().manual_seed(0)
    batches = [{"tokens": torch.randint(0, s["vocab"], (micro, seq), generator=gen),
                "position_ids": torch.arange(seq).expand(micro, -1).contiguous(),
                "loss_mask": torch.ones(micro, seq)} for _ in range(num_micro)]
    step = make_lm_loss_step(tp_group=role.layout.tp_group, true_vocab=s["vocab"])
    losses = []

    def one_step():
        out = train_step(role.trained, step, batches, seq_length=seq, micro_batch_size=micro)
        losses.append(out)

    seconds = cuda_time(one_step, repeats=5)
    embedding = role.chunks[0].embedding.word_embeddings.weight.numel()
    n_params = sum(p.numel() for p in role.parameters)
    n_flops = n_params - embedding  # the output layer is untied: it stays in N
    tokens = seq * micro * num_micro
    flops = tokens * (6 * n_flops + 12 * s["layers"] * s["hidden"] * seq)
    first, last = _loss(losses[0]), _loss(losses[-1])
    print(f"train [{variant}]: {n_params / 1e9:.2f} B params, {label}, DP=1 distributed "
          f"optimizer, {tokens} tokens/step (seq {seq}, {num_micro} x {micro}): "
          f"{seconds * 1e3:.0f} ms/step, {tokens / seconds:.0f} tokens/s, "
          f"{flops / seconds / 1e12:.0f} TFLOP/s = MFU {flops / seconds / datasheet:.1%} of "
          f"the {datasheet / 1e12:.0f} TFLOP/s datasheet, {flops / seconds / peak:.1%} of the "
          f"measured bf16 matmul rate; loss {first} -> {last} over {len(losses)} steps; "
          f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
    role = None  # the next variant's model and optimizer in its place
    torch.cuda.empty_cache()


def _loss(out) -> str:
    """A train_step result (logs, applied, gradient norm) as 'loss (grad norm)': the mean
    token loss over its micro-batches."""
    logs, applied, norm = out
    total = sum(float(log["loss_sum"]) for log in logs)
    tokens = sum(float(log["tokens"]) for log in logs)
    return f"{total / tokens:.4f} (grad norm {norm:.3g}{'' if applied else ', skipped'})"


def converted(s: dict, work: str) -> tuple[str, str]:
    """A random HF Llama of size ``s`` saved under ``work``/hf and converted to megarlhf
    under ``work``/mrl, once (a later call finds them)."""
    import transformers

    hf_dir, mrl = os.path.join(work, "hf"), os.path.join(work, "mrl")
    if os.path.exists(os.path.join(mrl, "config.yaml")):
        return hf_dir, mrl
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], max_position_embeddings=2048, bos_token_id=1,
        eos_token_id=2, torch_dtype=torch.bfloat16)
    hf = transformers.LlamaForCausalLM(hf_cfg).to(torch.bfloat16)
    hf.save_pretrained(hf_dir)
    start_t = time.perf_counter()
    convert(hf_dir, mrl)
    print(f"converted {sum(p.numel() for p in hf.parameters()) / 1e9:.2f} B params "
          f"HF -> megarlhf in {time.perf_counter() - start_t:.0f} s", flush=True)
    return hf_dir, mrl


def load_ours(mrl: str, *overrides: str):
    """(model, config) of the converted checkpoint, bf16, with ``overrides``."""
    from megarlhf.config import load_config
    from megarlhf.roles.build import build_from_config

    cfg = load_config(os.path.join(mrl, "config.yaml"), ["model.params_dtype=bfloat16",
                                                         *overrides])
    start(cfg)
    role = build_from_config(cfg, kind="lm")
    return role, cfg


def generate_vs_hf(s: dict, quick: bool, work: str) -> None:
    import transformers

    from megarlhf.inference.generate import SamplingParams, generate

    prompt, new = (128, 128) if not quick else (16, 16)
    hf_dir, mrl = converted(s, work)
    hf = transformers.LlamaForCausalLM.from_pretrained(
        hf_dir, torch_dtype=torch.bfloat16).cuda().eval()
    role, cfg = load_ours(mrl, "model.transformer_impl=local")
    (model,) = role.chunks
    params = SamplingParams(max_new_tokens=new, greedy=True)
    for batch in (1, 64):
        prompts = torch.randint(3, s["vocab"], (batch, prompt),
                                generator=torch.Generator().manual_seed(batch)).tolist()

        def ours(static_cache):
            return generate(model, prompts, params, eos_id=-1, pad_id=0,
                            true_vocab=cfg.model.vocab_size, static_cache=static_cache)

        def theirs():
            with torch.no_grad():
                return hf.generate(torch.tensor(prompts, device="cuda"), max_new_tokens=new,
                                   min_new_tokens=new, do_sample=False, pad_token_id=0)

        t_eager = cuda_time(lambda: ours(False), repeats=3)
        t_graph = cuda_time(lambda: ours(None), repeats=3)
        t_hf = cuda_time(theirs, repeats=3)
        eager, graphed = ours(False), ours(None)
        b = theirs()[:, prompt:].cpu()
        same = float((eager.response_tokens_BT == graphed.response_tokens_BT).all(dim=1)
                     .float().mean())
        lp_gap = float((eager.logprobs_BT - graphed.logprobs_BT).abs().max())
        same_hf = float((graphed.response_tokens_BT[:, :8] == b[:, :8]).all(dim=1)
                        .float().mean())
        tokens = batch * new
        print(f"generate: batch {batch:>2}, prompt {prompt}, {new} new: megarlhf eager "
              f"{tokens / t_eager:.0f} tok/s, CUDA graphs {tokens / t_graph:.0f} tok/s, "
              f"HF generate {tokens / t_hf:.0f} tok/s; graphs / HF {t_hf / t_graph:.2f}x, "
              f"eager / HF {t_hf / t_eager:.2f}x, graphs / eager {t_eager / t_graph:.2f}x; "
              f"rows whose {new} greedy tokens equal eager's {same:.0%} (log-probs max "
              f"|diff| {lp_gap:.2e}); rows whose first 8 agree with HF's {same_hf:.0%} (bf16)",
              flush=True)
    model = role = hf = None
    torch.cuda.empty_cache()


def te_logprobs(s: dict, quick: bool, work: str) -> None:
    """TE's layers against the local layers and transformers, and fp8 against bf16, on
    the converted weights."""
    import transformers

    from megarlhf.models.logprobs import vocab_parallel_logprobs
    from megarlhf.models.spec import transformer_engine_available

    if not transformer_engine_available():
        print("te: TransformerEngine does not import here; skipped")
        return
    hf_dir, mrl = converted(s, work)
    rows, seq = (4, 1024) if not quick else (2, 64)
    tokens = torch.randint(3, s["vocab"], (rows, seq),
                           generator=torch.Generator().manual_seed(7)).cuda()
    hf = transformers.LlamaForCausalLM.from_pretrained(
        hf_dir, torch_dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        logits = hf(tokens).logits.float()
    ref = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
    del hf, logits
    torch.cuda.empty_cache()
    pos = torch.arange(seq, device="cuda").expand(rows, -1)

    def ours(*overrides, warm: int = 0):
        role, cfg = load_ours(mrl, *overrides)
        (model,) = role.chunks
        with torch.no_grad():
            for _ in range(warm + 1):  # delayed scaling: amax histories first
                out = model(tokens, pos, None)
            lp, _ = vocab_parallel_logprobs(out[:, :-1].float(), tokens[:, 1:],
                                            tp_group=role.layout.tp_group,
                                            true_vocab=cfg.model.vocab_size)
        del role, model, out
        torch.cuda.empty_cache()
        return lp

    def gap(a, b) -> str:
        d = (a - b).abs()
        ratio = (a - b).exp()
        return (f"mean |diff| {d.mean():.2e}, max {d.max():.2e}, "
                f"ratio exp(diff) in [{ratio.min():.3f}, {ratio.max():.3f}]")

    te = "model.transformer_impl=transformer_engine"
    local = ours("model.transformer_impl=local")
    bf16 = ours(te)
    print(f"te: {rows} x {seq} tokens, bf16: local layers vs transformers: {gap(local, ref)}",
          flush=True)
    print(f"te: TE layers vs local layers: {gap(bf16, local)}; vs transformers: "
          f"{gap(bf16, ref)}", flush=True)
    for recipe, label in (("delayed", "delayed scaling"), ("tensorwise", "current scaling")):
        try:
            fp8 = ours(te, "model.fp8.enabled=true", f"model.fp8.recipe={recipe}", warm=3)
        except Exception as err:
            print(f"te: fp8 {label}: failed ({type(err).__name__}: {err})", flush=True)
            continue
        print(f"te: fp8 ({label}, hybrid) forward vs the bf16 (TE) forward on the same "
              f"weights - an fp8 training pass against a bf16 rollout's log-probs: "
              f"{gap(fp8, bf16)}", flush=True)


def reshard(s: dict) -> None:
    from megarlhf.config import load_config
    from megarlhf.roles.build import build_from_config
    from megarlhf.inference.reshard import Resharder, build_inference_model, inference_layout

    cfg = load_config(None, model_overrides(s) + [f"model.vocab_size={s['vocab']}"])
    start(cfg)
    actor = build_from_config(cfg, kind="lm", trained=True)
    inference = build_inference_model(actor.spec, inference_layout(1, actor.spec.model))
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
    parser.add_argument("--parts", default="roofline,train,generate,te,reshard,ppo")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--train-variants", default="local",
                        help=f"comma-separated, of {', '.join(TRAIN_VARIANTS)}")
    parser.add_argument("--work", default=None,
                        help="keep the converted checkpoint here (default: a temporary folder)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs a CUDA GPU")
    parts = args.parts.split(",")
    s = QUICK if args.quick else BIG
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}")
    peak = roofline() if "roofline" in parts else DATASHEET_BF16
    work = args.work or tempfile.mkdtemp()
    os.makedirs(work, exist_ok=True)

    def trains():
        for variant in args.train_variants.split(","):
            try:
                train(s, peak, args.quick, variant)
            except Exception as err:  # the next variant still runs
                print(f"train [{variant}]: failed ({type(err).__name__}: {err})", flush=True)
                torch.cuda.empty_cache()

    for part, fn in (("convert", lambda: converted(s, work)),
                     ("train", trains),
                     ("generate", lambda: generate_vs_hf(s, args.quick, work)),
                     ("te", lambda: te_logprobs(s, args.quick, work)),
                     ("reshard", lambda: reshard(s)),
                     ("ppo", lambda: ppo(s, args.quick))):
        if part in parts:
            t0 = time.perf_counter()
            fn()
            torch.cuda.reset_peak_memory_stats()
            print(f"  ({part}: {time.perf_counter() - t0:.0f} s)", flush=True)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
