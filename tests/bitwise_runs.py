"""The PPO runs a refactor must leave bitwise unchanged, recorded and compared.

    .venv/bin/python tests/bitwise_runs.py OUT                  record this tree's runs
    .venv/bin/python tests/bitwise_runs.py OUT --against BEFORE  ... and compare them
    [--setup DIR]  build (or reuse, when complete) the tiny models in DIR

A move (a file or a function to another room) must not change a number. This script
runs four short, demo-shaped PPO jobs from the tree it lives in and writes every metric
they log (``OUT/<run>.json``, timings, memory and throughput left out: they vary between
runs of the same code):

- ``colocated``: configs/demo/ppo.yaml, GAE with a critic, 2 iterations, one process;
- ``split_k1``: 1 training + 1 rollout process, ``ppo.max_staleness=1``, 3 iterations;
- ``multiturn``: the tool task's GRPO with a reward per tool call (tests/workers/envs.py),
  2 iterations;
- ``moe_ep2``: a 4-expert actor at EP=2 on two processes, 2 iterations.

``--against BEFORE`` then compares metric for metric with ``==`` (not a tolerance) and
exits 1 naming every difference. Run it on the tree before the refactor (say into
/tmp/before), then on the tree after; ``--setup`` lets both read the same tiny models
(the moves do not touch SFT or RM training). Leave OMP_NUM_THREADS unset: the recorded runs
used torch's default threads in their single-process jobs, and one thread there rounds
differently.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)

from conftest import ROOT, WORKERS, build_tiny, run_cli, torchrun  # noqa: E402

VARYING = ("timing/", "perf/", "memory/")
MOE = ["model.num_layers=2", "model.moe.num_experts=4", "model.moe.top_k=2",
       "model.moe.ffn_hidden_size=32", "model.moe.aux_loss_coeff=0.01"]
ENV = {"PYTHONPATH": os.pathsep.join([WORKERS, os.environ.get("PYTHONPATH", "")])}
QUIET = ["logging.progress_bar=false", "logging.tensorboard=false",
         "logging.sample_table_interval=0", "checkpoint.resume=false"]


def build(setup: str) -> dict:
    """The tiny task, SFT policy and reward model (conftest.build_tiny), a tiny MoE SFT
    policy, and the tool task with a policy that calls the tool: each made once into
    ``setup`` (a COMPLETE file marks each part)."""
    from megarlhf.data.tool_task import write_tool_task

    os.makedirs(setup, exist_ok=True)
    task = build_tiny(os.path.join(setup, "tiny"))
    common = [f"tokenizer.path={task['tokenizer']}", *QUIET]
    moe_dir = os.path.join(setup, "moe")
    if not os.path.exists(os.path.join(moe_dir, "COMPLETE")):
        run_cli("sft", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}", *MOE,
                "train.max_steps=6", "checkpoint.save_interval=0", "run.name=moe-sft",
                f"run.output_dir={moe_dir}", *common)
        open(os.path.join(moe_dir, "COMPLETE"), "w").close()
    tool_dir = os.path.join(setup, "tool")
    tool_done = os.path.join(tool_dir, "COMPLETE")
    if not os.path.exists(tool_done):
        files = write_tool_task(os.path.join(tool_dir, "task"), seed=0, num_sft=512)
        run_cli("sft", "configs/demo/tool_sft.yaml", f"tokenizer.path={files['tokenizer']}",
                f"data.train_path={files['sft']}", f"run.output_dir={tool_dir}",
                "train.max_steps=120", *QUIET)
        with open(tool_done, "w") as f:
            json.dump(files, f)
    tool = json.load(open(tool_done))
    return {"task": task, "moe": moe_dir, "tool_dir": tool_dir, "tool": tool}


def runs(setup: str, out: str) -> dict[str, tuple[int, list[str], dict | None, str]]:
    """name -> (processes, the CLI's argv, extra environment, the run's folder name)."""
    s = build(setup)
    tiny, task = os.path.join(setup, "tiny"), s["task"]
    ppo = ["ppo", "configs/demo/ppo.yaml", f"data.train_path={task['prompts']}",
           f"data.eval_path={task['eval_prompts']}", "ppo.num_eval_prompts=16",
           f"ppo.reward_checkpoint={tiny}/rm-tiny/checkpoints", "ppo.eval_interval=2",
           "checkpoint.save_interval=0", f"tokenizer.path={task['tokenizer']}", *QUIET]
    actor = f"ppo.sft_checkpoint={tiny}/sft-tiny/checkpoints"
    tool = s["tool"]
    return {
        "colocated": (1, [*ppo, actor, "ppo.num_iterations=2",
                          f"run.output_dir={out}/colocated"], None, "ppo-tiny"),
        "split_k1": (2, [*ppo, actor, "ppo.num_iterations=3", "ppo.max_staleness=1",
                         "rollout.placement.mode=split", "rollout.placement.ranks=1",
                         f"run.output_dir={out}/split_k1"], None, "ppo-tiny"),
        "multiturn": (1, ["ppo", "configs/demo/tool_grpo.yaml",
                          f"tokenizer.path={tool['tokenizer']}", f"data.train_path={tool['rows']}",
                          "data.eval_path=null",
                          f"ppo.sft_checkpoint={s['tool_dir']}/tool-sft/checkpoints",
                          "rollout.environment.name=envs:Reward2ndTurn", "ppo.rollout_batch_size=4",
                          "ppo.group_size=2", "ppo.mini_batch_size=8", "ppo.micro_batch_size=8",
                          "ppo.num_iterations=2", "checkpoint.save_interval=0",
                          f"run.output_dir={out}/multiturn", *QUIET], ENV, "tool-grpo"),
        "moe_ep2": (2, [*ppo, f"ppo.sft_checkpoint={s['moe']}/moe-sft/checkpoints",
                        "parallel.expert_model_parallel_size=2", "ppo.num_iterations=2",
                        "run.name=moe", f"run.output_dir={out}/moe_ep2"], None, "moe"),
    }


def record(name: str, nprocs: int, argv: list[str], env: dict | None, folder: str) -> dict:
    if nprocs == 1:
        run_cli(*argv, env=env)
    else:
        torchrun(argv, nprocs, env=env)
    path = os.path.join(folder, "metrics.jsonl")
    rows = [json.loads(line) for line in open(path)]
    kept = [{k: v for k, v in r.items() if not k.startswith(VARYING)} for r in rows]
    if not any("ppo/policy/loss" in r for r in kept):
        raise SystemExit(f"bitwise_runs: {name} logged no update ({path})")
    return {"rows": kept}


def compare(out: str, before: str, names) -> list[str]:
    diffs = []
    for name in names:
        a = json.load(open(os.path.join(before, f"{name}.json")))["rows"]
        b = json.load(open(os.path.join(out, f"{name}.json")))["rows"]
        if len(a) != len(b):
            diffs.append(f"{name}: {len(a)} records before, {len(b)} now")
            continue
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            for key in sorted(set(x) | set(y)):
                if x.get(key, "<absent>") != y.get(key, "<absent>"):
                    diffs.append(f"{name} record {i} {key}: {x.get(key, '<absent>')!r} "
                                 f"before, {y.get(key, '<absent>')!r} now")
    return diffs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="folder for this tree's runs and their metrics")
    parser.add_argument("--against", help="a folder this script wrote before the change")
    parser.add_argument("--setup", help="build the tiny models here, or reuse them "
                        "(default OUT/setup)")
    parser.add_argument("--only", nargs="*", help="these runs only")
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    os.chdir(ROOT)
    table = runs(os.path.abspath(args.setup or os.path.join(out, "setup")), out)
    names = args.only or list(table)
    for name in names:
        nprocs, argv, env, run_name = table[name]
        result = record(name, nprocs, argv, env, os.path.join(out, name, run_name))
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(result, f, indent=1)
        print(f"bitwise_runs: {name}: {len(result['rows'])} records", flush=True)
    if args.against:
        diffs = compare(out, os.path.abspath(args.against), names)
        for line in diffs:
            print(line)
        if diffs:
            raise SystemExit(f"bitwise_runs: {len(diffs)} metrics differ from {args.against}")
        print(f"bitwise_runs: every metric of {', '.join(names)} equals {args.against}'s")


if __name__ == "__main__":
    main()
