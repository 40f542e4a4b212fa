"""The demo's tool task trained with its episodes played by an agent program through the
rollout's OpenAI-compatible endpoint (configs/demo/tool_agent.yaml) against the same
episodes played by the environment in the trainer (configs/demo/tool_grpo.yaml): the
held-out success rate (eval/gold_score, greedy episodes) of each run, and what the agent
path costs per iteration (timing/generate: every agent a process of its own, every turn
an HTTP request).

Both runs start from one SFT policy with one seed; the environment path keeps the
episodes' keys and values across turns (speedups.turn_kv, the default) and the agent path
prefills each request's conversation again. Results: bench/results/agent_episodes.txt.

    .venv/bin/python bench/agent_episodes.py [--iterations 16] [--sft-steps 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megarlhf.data.tool_task import write_tool_task  # noqa: E402
from megarlhf.engine.metrics import read_metrics  # noqa: E402
from common import run_megarlhf  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=16)
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_agent_episodes"))
    args = parser.parse_args()
    tool = write_tool_task(os.path.join(args.out, "tool-task"), seed=0)
    common = [f"tokenizer.path={tool['tokenizer']}", f"run.output_dir={args.out}",
              "checkpoint.resume=false", "logging.progress_bar=false"]
    run_megarlhf(["sft", "configs/demo/tool_sft.yaml", f"data.train_path={tool['sft']}", *common,
              f"train.max_steps={args.sft_steps}"])
    lines = [f"# bench/agent_episodes.py --iterations {args.iterations} --sft-steps "
             f"{args.sft_steps} ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs)"]
    for config, name in (("tool_grpo", "environment in the trainer"),
                         ("tool_agent", "agent program via the endpoint")):
        seconds = run_megarlhf(["ppo", f"configs/demo/{config}.yaml",
                            f"data.train_path={tool['rows']}",
                            f"data.eval_path={tool['eval_rows']}",
                            f"ppo.sft_checkpoint={args.out}/tool-sft/checkpoints",
                            f"ppo.num_iterations={args.iterations}", *common])
        rows = read_metrics(os.path.join(args.out, config.replace("_", "-")))
        gold = [(r["step"], r["eval/gold_score"]) for r in rows if "eval/gold_score" in r]
        generate = [r["timing/generate"] for r in rows if "timing/generate" in r][1:]
        iteration = [r["timing/iteration"] for r in rows if "timing/iteration" in r][1:]
        lines.append(f"{config} ({name}): held-out success {gold[0][1]:.3f} at step "
                     f"{gold[0][0]} -> {gold[-1][1]:.3f} at step {gold[-1][0]}; "
                     f"timing/generate median {statistics.median(generate):.2f} s, "
                     f"timing/iteration median {statistics.median(iteration):.2f} s; "
                     f"whole run {seconds:.0f} s")
        lines.append("  eval/gold_score by step: " + ", ".join(f"{s}: {g:.3f}"
                                                                 for s, g in gold))
    text = "\n".join(lines) + "\n"
    print(text, end="")
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "agent_episodes.txt"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
