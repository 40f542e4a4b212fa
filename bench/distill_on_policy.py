"""On-policy against offline distillation of the demo's SFT policy into a smaller student,
at the same budget: the same student start, the same number of optimizer steps and of
trained sequences; the gold score (the synthetic task's known reward) of each student's
answers to the evaluation prompts.

- teacher: configs/sft_tiny.yaml (2 layers x 64) trained as the demo trains it;
- student start: 1 layer x 32, a short SFT (``--student-steps``);
- offline: ``megarlhf distill`` from the teacher's cached top-k on the SFT rows,
  ``4 x --iterations`` steps of 16 rows;
- on-policy: ``megarlhf ppo`` with the teacher as ``roles.teacher`` and no task reward
  (``ppo.teacher.task_reward=false``, the reverse KL per token, REINFORCE++),
  ``--iterations`` iterations of 32 samples x 2 epochs in mini-batches of 16 (4 steps each).

Each student's gold score is the PPO evaluation before any update (its step 0) of a run
started from it; the teacher's too. Results: bench/results/distill_on_policy.txt.

    .venv/bin/python bench/distill_on_policy.py [--iterations 25] [--student-steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megarlhf.data.synthetic import write_task  # noqa: E402
from megarlhf.engine.metrics import read_metrics  # noqa: E402
from common import run_megarlhf  # noqa: E402

STUDENT = ("model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2",
           "model.num_query_groups=1")


def gold(out: str, name: str, step: int) -> float:
    rows = [r for r in read_metrics(os.path.join(out, name))
            if r.get("step") == step and "eval/gold_score" in r]
    return float(rows[-1]["eval/gold_score"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=25)
    parser.add_argument("--student-steps", type=int, default=30)
    parser.add_argument("--gamma", type=float, default=0.0,
                        help="the on-policy run's discount: 0 gives each token its own "
                             "reverse KL as its return (no length penalty from the KL "
                             "still to come)")
    parser.add_argument("--lr", type=float, default=3e-3,
                        help="both students' learning rate (configs/sft_tiny.yaml's)")
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "bench-distill"))
    args = parser.parse_args()
    out = args.out
    task = write_task(os.path.join(out, "task"), seed=0)
    common = [f"tokenizer.path={task['tokenizer']}", f"run.output_dir={out}",
              "checkpoint.resume=false", "logging.progress_bar=false",
              "logging.tensorboard=false"]
    times = {}
    times["teacher"] = run_megarlhf(["sft", "configs/sft_tiny.yaml",
                                     f"data.train_path={task['sft']}", "train.num_epochs=4",
                                     "run.name=teacher", *common])
    times["student start"] = run_megarlhf([
        "sft", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}", *STUDENT,
        f"train.max_steps={args.student_steps}", "checkpoint.save_interval=0",
        "run.name=student-start", *common])
    steps = 4 * args.iterations
    times["offline"] = run_megarlhf([
        "distill", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}", *STUDENT,
        f"checkpoint.load={out}/student-start/checkpoints",
        f"distill.teacher_checkpoint={out}/teacher/checkpoints", f"train.max_steps={steps}",
        f"optimizer.lr={args.lr}", f"optimizer.min_lr={args.lr / 10}",
        "train.num_epochs=100", "checkpoint.save_interval=0", "run.name=offline", *common])
    teacher = ["ppo.teacher.coef=1.0", "ppo.teacher.task_reward=false",
               f"roles.teacher.checkpoint={out}/teacher/checkpoints",
               "ppo.reward_checkpoint=null", "ppo.advantage_estimator=reinforce_pp",
               "ppo.kl.init_coef=0.0", "ppo.kl.controller=fixed", "ppo.missing_stop_penalty=null",
               f"ppo.gamma={args.gamma}", f"optimizer.lr={args.lr}",
               f"optimizer.min_lr={args.lr / 10}",
               f"data.train_path={task['prompts']}", f"data.eval_path={task['eval_prompts']}"]

    def ppo(name: str, start: str, iterations: int) -> float:
        return run_megarlhf(["ppo", "configs/demo/ppo.yaml", f"ppo.sft_checkpoint={start}",
                         *teacher, f"ppo.num_iterations={iterations}",
                         f"ppo.eval_interval={iterations}", f"run.name={name}", *common])

    times["on-policy"] = ppo("on-policy", f"{out}/student-start/checkpoints", args.iterations)
    times["offline's evaluation"] = ppo("offline-eval", f"{out}/offline/checkpoints", 1)
    times["teacher's evaluation"] = ppo("teacher-eval", f"{out}/teacher/checkpoints", 1)
    result = {"teacher": gold(out, "teacher-eval", 0),
              "student start": gold(out, "on-policy", 0),
              f"offline, {steps} steps": gold(out, "offline-eval", 0),
              f"on-policy, {args.iterations} iterations ({steps} steps)":
                  gold(out, "on-policy", args.iterations)}
    lines = [f"# bench/distill_on_policy.py --iterations {args.iterations} --student-steps "
             f"{args.student_steps} --gamma {args.gamma} --lr {args.lr}, "
             f"{time.strftime('%Y-%m-%d')}",
             "# gold score on the evaluation prompts (the PPO evaluation before any update "
             "of a run from each checkpoint)"]
    lines += [f"{name}: {value:.3f}" for name, value in result.items()]
    lines += [f"wall time, {name}: {seconds:.0f} s" for name, seconds in times.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "distill_on_policy.txt"), "w") as f:
        f.write(text)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
