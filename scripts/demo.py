"""megarlhf's main job on CPU: a complete RLHF pipeline on a synthetic task with a known
gold reward - tokenizer, SFT, reward model (trained on gold-labelled pairs with label
noise), PPO against the learned reward model, DPO on the same pairs - then curves (runs/demo/ppo-tiny/curves.png)
and a check that the SFT checkpoint scores the same at TP=1, TP=2 and PP=2."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

from megarlhf.data.synthetic import write_task
from megarlhf.data.tool_task import write_tool_task

OUT = os.path.join("runs", "demo")
# MEGARLHF_DEMO_QUICK=1: the same pipeline, a few steps of each stage (tests/test_commands.py
# needs its outputs, not its results)
QUICK = os.environ.get("MEGARLHF_DEMO_QUICK") == "1"


def quick(*overrides: str) -> list[str]:
    return list(overrides) if QUICK else []


def megarlhf(args: list[str], nprocs: int = 1) -> None:
    launcher = [sys.executable, "-m", "megarlhf.cli"]
    if nprocs > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}",
                    f"--master-port={port}", "-m", "megarlhf.cli"]
    start = time.time()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if subprocess.run(launcher + args, env=env).returncode != 0:
        sys.exit(f"failed: megarlhf {' '.join(args)}")
    print(f"    ({time.time() - start:.0f} s)\n", flush=True)


def main() -> None:
    start = time.time()
    print("1. synthetic task: corpus, sentencepiece tokenizer, SFT and preference data")
    task = write_task(os.path.join(OUT, "task"), seed=0)
    common = [f"tokenizer.path={task['tokenizer']}", f"run.output_dir={OUT}",
              "checkpoint.resume=false"]
    print("2. SFT (configs/sft_tiny.yaml)")
    megarlhf(["sft", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}", *common,
              "train.num_epochs=4", *quick("train.max_steps=8")])
    print("3. reward model on gold-labelled preferences with 10% label noise")
    megarlhf(["rm", "configs/rm_tiny.yaml", f"data.train_path={task['prefs']}", *common,
              *quick("train.max_steps=8")])
    print("4. PPO against the learned reward model (configs/demo/ppo.yaml)")
    megarlhf(["ppo", "configs/demo/ppo.yaml", f"data.train_path={task['prompts']}",
              f"data.eval_path={task['eval_prompts']}",
              f"ppo.sft_checkpoint={OUT}/sft-tiny/checkpoints",
              f"ppo.reward_checkpoint={OUT}/rm-tiny/checkpoints", *common,
              *quick("ppo.num_iterations=2", "ppo.eval_interval=2", "ppo.num_eval_prompts=8")])
    megarlhf(["plot", os.path.join(OUT, "ppo-tiny")])
    print("5. DPO from the same SFT policy on the preference pairs, no reward model "
          "(configs/dpo_tiny.yaml; the reference's log-probs are cached once)")
    megarlhf(["dpo", "configs/dpo_tiny.yaml", f"data.train_path={task['prefs']}",
              f"checkpoint.load={OUT}/sft-tiny/checkpoints",
              f"dpo.gold_eval_path={task['eval_prompts']}", *common,
              *quick("train.max_steps=4")])
    print("6. multi-turn tool use: SFT on conversations that call a lookup tool 40% of the "
          "time, then GRPO on episodes of the tool environment (configs/demo/tool_grpo.yaml)")
    tool = write_tool_task(os.path.join(OUT, "tool-task"), seed=0)
    tool_common = [f"tokenizer.path={tool['tokenizer']}", f"run.output_dir={OUT}",
                   "checkpoint.resume=false"]
    megarlhf(["sft", "configs/demo/tool_sft.yaml", f"data.train_path={tool['sft']}",
              *tool_common, *quick("train.max_steps=8")])
    megarlhf(["ppo", "configs/demo/tool_grpo.yaml", f"data.train_path={tool['rows']}",
              f"data.eval_path={tool['eval_rows']}",
              f"ppo.sft_checkpoint={OUT}/tool-sft/checkpoints", *tool_common,
              *quick("ppo.num_iterations=2", "ppo.num_eval_prompts=8")])
    megarlhf(["plot", os.path.join(OUT, "tool-grpo")])
    print("7. score held-out texts with the SFT checkpoint at three layouts")
    texts = os.path.join(OUT, "texts.jsonl")
    with open(texts, "w") as f:
        for line in open(task["prompts"]).readlines()[:16]:
            prompt = json.loads(line)["prompt"]
            f.write(json.dumps({"text": prompt + " " + " ".join(reversed(prompt.split()[1:]))})
                    + "\n")
    ckpt = os.path.join(OUT, "sft-tiny", "checkpoints")
    score = ["score", "--config", "configs/sft_tiny.yaml", "--input", texts,
             f"tokenizer.path={task['tokenizer']}", f"checkpoint.load={ckpt}"]
    results = {}
    for name, nprocs, extra in [("TP=1 PP=1", 1, []),
                                ("TP=2", 2, ["parallel.tensor_model_parallel_size=2"]),
                                ("PP=2", 2, ["parallel.pipeline_model_parallel_size=2"])]:
        path = os.path.join(OUT, f"scores_{name.replace(' ', '_').replace('=', '')}.jsonl")
        megarlhf(score + ["--output", path, *extra], nprocs)
        results[name] = [json.loads(line) for line in open(path)]
    ref = results["TP=1 PP=1"]
    print("max |log-prob difference| against TP=1 PP=1 (fp32):")
    for name in ("TP=2", "PP=2"):
        diff = max(abs(a - b) for r, s in zip(ref, results[name])
                   for a, b in zip(r["logprobs"], s["logprobs"]))
        print(f"  {name}: {diff:.2e}  ({'OK' if diff < 1e-5 else 'MISMATCH'})")
    for stage in ("sft-tiny", "rm-tiny"):
        records = [json.loads(line) for line in open(os.path.join(OUT, stage, "metrics.jsonl"))]
        evals = [r for r in records if any(k.startswith("eval/") for k in r)]
        first, last = evals[0], evals[-1]
        keys = [k for k in first if k.startswith("eval/")]
        print(f"{stage}: " + ", ".join(f"{k} {first[k]:.3f} -> {last[k]:.3f}" for k in keys))
    records = [json.loads(line) for line in open(os.path.join(OUT, "ppo-tiny", "metrics.jsonl"))]
    print("\nPPO on held-out prompts (greedy), gold reward (best achievable 3.0; proxy = RM score "
          "of samples):")
    print(f"  {'iter':>4} {'gold':>7} {'proxy':>7} {'KL':>6} {'beta':>6} {'length':>6}")
    for r in records:
        if "eval/gold_score" in r:
            print(f"  {r['step']:>4} {r['eval/gold_score']:>7.3f} "
                  f"{r.get('objective/score', float('nan')):>7.3f} "
                  f"{r.get('objective/kl', float('nan')):>6.2f} "
                  f"{r.get('objective/kl_coef', float('nan')):>6.3f} "
                  f"{r.get('eval/response_len', float('nan')):>6.2f}")
    gold = [r["eval/gold_score"] for r in records if "eval/gold_score" in r]
    print(f"  gap to the best gold score closed: {(gold[-1] - gold[0]) / (3.0 - gold[0]):.0%}")
    dpo = [json.loads(line) for line in open(os.path.join(OUT, "dpo-tiny", "metrics.jsonl"))]
    dpo_gold = [r["eval/gold_score"] for r in dpo if "eval/gold_score" in r]
    print(f"DPO: gold score {dpo_gold[0]:.3f} -> {dpo_gold[-1]:.3f} (greedy, held-out prompts); "
          f"gap closed {(dpo_gold[-1] - dpo_gold[0]) / (3.0 - dpo_gold[0]):.0%}")
    tool_rows = [json.loads(line)
                 for line in open(os.path.join(OUT, "tool-grpo", "metrics.jsonl"))]
    print("\nGRPO with the tool environment, held-out success rate of greedy episodes "
          "(1 = every answer the hidden colour):")
    print(f"  {'iter':>4} {'success':>8} {'turns':>6} {'sampled':>8}")
    for r in tool_rows:
        if "eval/gold_score" in r:
            print(f"  {r['step']:>4} {r['eval/gold_score']:>8.3f} {r['eval/turns']:>6.2f} "
                  f"{r.get('objective/score', float('nan')):>8.3f}")
    print(f"curves: {OUT}/ppo-tiny/curves.png, {OUT}/tool-grpo/curves.png; metrics (JSONL, "
          f"TensorBoard) and checkpoints "
          f"under {OUT}/")
    print(f"demo finished in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
