"""The long-sequence levers, each on and off: the bytes one training step keeps for
backward (``memory.accounting.ActivationMeter``: the peak of what autograd saved), what
``megarlhf plan`` estimates for the same shapes, and the step's wall time (forward and
backward of one micro-batch; the median of ``--repeats`` after a warm-up).

Two steps per length: one PPO policy update of one sample (512 prompt tokens, the rest
response; the PPO loss with its KL and entropy terms) and one SFT step of one sample of
that many tokens. One process: no lever, full recomputation (a layer at a time), the MLPs
recomputed; two processes: TP=2, TP=2 with sequence parallelism, and with full
recomputation too, and context parallelism at CP=2, without and with full recomputation. The LM head's log-probs go a chunk of positions at a time in every
setting (``models.logprobs.head_logprobs``; no off switch).

    .venv/bin/python bench/long_sequences.py [--size small] [--lengths 2048 8192] [--repeats 2]
        [--settings NAME ...] [--out FILE]

Prints one table per length and writes bench/results/long_sequences.json (``--out``);
``--settings`` runs only the settings named (e.g. ``"CP=2"``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, SIZES, machine  # noqa: E402

PROMPT = 512
RECOMPUTE_FULL = ["model.recompute.granularity=full", "model.recompute.num_layers=1"]
SETTINGS = {
    1: {"plain": [], "recompute full": RECOMPUTE_FULL,
        "recompute mlp": ["model.recompute.granularity=selective",
                          "model.recompute.modules=[mlp]"]},
    2: {"TP=2": ["parallel.tensor_model_parallel_size=2"],
        "TP=2 SP": ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
        "TP=2 SP + recompute full": ["parallel.tensor_model_parallel_size=2",
                                     "parallel.sequence_parallel=true", *RECOMPUTE_FULL],
        "CP=2": ["parallel.context_parallel_size=2"],
        "CP=2 + recompute full": ["parallel.context_parallel_size=2", *RECOMPUTE_FULL]},
}


def worker(size: str, lengths: list[int], repeats: int, out: str,
           only: list[str] | None = None) -> None:
    import torch
    import torch.distributed as dist

    from megarlhf import algos
    from megarlhf.config import load_config
    from megarlhf.data.batching import sft_example
    from megarlhf.engine.optimizer import forward_backward, prepare_step
    from megarlhf.engine.steps import make_lm_loss_step, make_policy_step
    from megarlhf.memory.accounting import ActivationMeter
    from megarlhf.memory.estimates import train_activation_bytes
    from megarlhf.parallel.launch import init_distributed
    from megarlhf.ppo.learner import dp_share, experience_batches
    from megarlhf.roles.build import build_from_config
    from megarlhf.stages.sft import make_microbatches

    world = int(os.environ["WORLD_SIZE"])
    s = SIZES[size]
    results = []
    for length in lengths:
        g = torch.Generator().manual_seed(0)
        T = length - PROMPT
        prompt = torch.randint(3, s["vocab"], (1, PROMPT), generator=g)
        response = torch.randint(3, s["vocab"], (1, T), generator=g)
        for name, extra in SETTINGS[world].items():
            if only and name not in only:
                continue
            cfg = load_config(None, [
                "model.arch=llama", f"model.vocab_size={s['vocab']}",
                f"model.num_layers={s['layers']}", f"model.hidden_size={s['hidden']}",
                f"model.num_attention_heads={s['heads']}",
                f"model.num_query_groups={s['kv_heads']}", f"model.ffn_hidden_size={s['ffn']}",
                f"model.max_position_embeddings={length}", "ppo.kl.loss_coef=0.1",
                "ppo.entropy_coef=0.01", "optimizer.use_distributed_optimizer=false",
                "parallel.make_vocab_size_divisible_by=16", "run.seed=1", *extra])
            if not dist.is_initialized():
                init_distributed(cfg)
            actor = build_from_config(cfg, kind="lm", trained=True, name="actor",
                                      total_steps=10, seed=1)
            mask = torch.ones(1, T)
            exp = algos.Experience(
                prompt_tokens_BP=prompt, prompt_mask_BP=torch.ones(1, PROMPT, dtype=torch.long),
                response_tokens_BT=response, response_mask_BT=mask,
                rollout_logprobs_BT=-torch.ones(1, T), old_logprobs_BT=-torch.ones(1, T),
                ref_logprobs_BT=-torch.ones(1, T), values_BT=torch.zeros(1, T),
                scores_B=torch.zeros(1), kl_BT=torch.zeros(1, T), rewards_BT=torch.zeros(1, T),
                advantages_BT=torch.randn(1, T, generator=g), returns_BT=torch.zeros(1, T))
            tp = actor.layout.tp_group
            steps = {
                "PPO update": (make_policy_step(prompt_len=PROMPT, tp_group=tp,
                                                true_vocab=s["vocab"], temperature=1.0,
                                                ppo=cfg.ppo),
                               experience_batches(dp_share(exp, actor.layout), 1, 0), T),
                "SFT step": (make_lm_loss_step(tp_group=tp, true_vocab=s["vocab"]),
                             make_microbatches([sft_example(prompt[0].tolist(),
                                                            response[0].tolist())],
                                               1, packing=False, max_len=length, pad_id=0)[0],
                             length - 1)}
            params = [p for chunk in actor.trained.model for p in chunk.parameters()]
            for task, (step, batches, kept) in steps.items():
                times, peak = [], 0
                for i in range(repeats + 1):
                    dist.barrier()
                    start = time.perf_counter()
                    with ActivationMeter(exclude=params) as meter:
                        forward_backward(actor.trained, step, batches, seq_length=length,
                                         micro_batch_size=1)
                    prepare_step(actor.trained)
                    if i:
                        times.append(time.perf_counter() - start)
                    peak = max(peak, meter.peak)
                stats = torch.tensor([float(peak), max(times) if times else 0.0])
                dist.all_reduce(stats, op=dist.ReduceOp.MAX)
                # the plan sizes PPO's micro-batches (an attention mask per sample); an SFT
                # row runs without one
                planned = train_activation_bytes(actor.spec, pp_rank=0, micro=1,
                                                 micro_batches=1, seq=length, response=kept) \
                    if task == "PPO update" else None
                times.sort()
                results.append({"length": length, "setting": name, "task": task,
                                "processes": world, "kept_MB": float(stats[0]) / 1e6,
                                "planned_MB": None if planned is None else planned / 1e6,
                                "step_s": times[len(times) // 2]})
                if dist.get_rank() == 0:
                    print(json.dumps(results[-1]), flush=True)
            del actor
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def table(results: list[dict], lengths: list[int], size: str) -> str:
    """One table per length: bytes kept for backward (measured / planned for the PPO
    update; measured for the SFT step) and the step time, per setting."""
    lines = []
    for length in lengths:
        lines += [f"\n{length} tokens ({PROMPT} prompt), size {size}: kept for backward (MB; "
                  "PPO: measured / planned), step (s)",
                  f"{'setting':28s} {'PPO update':>26s} {'SFT step':>18s}"]
        for world in (1, 2):
            for name in SETTINGS[world]:
                if not any(r["setting"] == name for r in results):
                    continue
                cells = []
                for task in ("PPO update", "SFT step"):
                    r = next(r for r in results if r["length"] == length
                             and r["setting"] == name and r["task"] == task)
                    kept = f"{r['kept_MB']:7.1f}" + (
                        f" / {r['planned_MB']:7.1f}" if r["planned_MB"] is not None else "")
                    cells.append(f"{kept} {r['step_s']:6.2f}s")
                lines.append(f"{name:28s} {cells[0]:>26s} {cells[1]:>18s}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--settings", nargs="+", default=None,
                        help="run only these settings (names as in the table)")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results",
                                                      "long_sequences.json"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.size, args.lengths, args.repeats, args.worker, args.settings)
        return
    print(f"bench/long_sequences.py --size {args.size}: {machine()}")
    results = []
    for world in (1, 2):
        if args.settings and not set(args.settings) & set(SETTINGS[world]):
            continue
        out = os.path.join(ROOT, "bench", "results", f".long_sequences_{world}.json")
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // world))}
        subprocess.run([sys.executable, "-m", "torch.distributed.run",
                        f"--nproc-per-node={world}", "--standalone", os.path.abspath(__file__),
                        "--size", args.size, "--lengths", *map(str, args.lengths),
                        "--repeats", str(args.repeats), "--worker", out,
                        *(["--settings", *args.settings] if args.settings else [])],
                       check=True, env=env, cwd=ROOT)
        with open(out) as f:
            results += json.load(f)
        os.remove(out)
    print(table(results, args.lengths, args.size))
    path = args.out
    with open(path, "w") as f:
        json.dump({"machine": machine(), "size": args.size, "results": results}, f, indent=1)
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
