"""``megarlhf launch STAGE CONFIG [overrides] --slurm [--dry-run]``: render an sbatch script
from the config and submit it.

Task counts follow from ``launch.nodes x launch.tasks_per_node``, which must hold whole
copies of the training layout (TP x PP) and of the rollout layout; the script runs
``slurm/launch.sh`` (srun, one task per GPU, preemption forwarding and requeue).
"""

from __future__ import annotations

import os
import shlex
import subprocess

from megarlhf.config import Config, ConfigError, Written, check_launch, check_ppo

STAGES = ("sft", "rm", "ppo", "dpo", "distill", "score")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def check_memory(cfg: Config, world: int, written: Written) -> None:
    """With ``launch.gpu_memory_gib`` set: refuse a PPO config whose predicted per-GPU
    memory (``megarlhf plan``) does not fit, with the plan and the layouts that would."""
    if cfg.launch.gpu_memory_gib is None:
        return
    from megarlhf.memory.estimates import GIB
    from megarlhf.memory.report import explain, missing_checkpoints

    missing = missing_checkpoints(cfg)
    if missing and not (cfg.model.vocab_size and {"num_layers", "hidden_size"}
                        <= written.fields("model")):
        raise ConfigError(
            "launch.gpu_memory_gib is set but the memory check cannot size these roles: "
            f"{', '.join(missing)} not found on this machine. Write the model's shape in "
            "the config (model.num_layers, model.hidden_size, ...) or unset "
            "launch.gpu_memory_gib")
    ok, text = explain(cfg, world, cfg.launch.gpu_memory_gib * GIB,
                       cfg.launch.gpus_per_node or cfg.launch.tasks_per_node,
                       written=written)
    if not ok:
        raise ConfigError(f"the PPO run does not fit launch.gpu_memory_gib="
                          f"{cfg.launch.gpu_memory_gib:g} per GPU (megarlhf plan):\n{text}")


def render_sbatch(cfg: Config, stage: str, config_path: str, overrides: list[str],
                  written: Written | None = None) -> str:
    """The sbatch script of ``stage``; ``written`` as in ``roles.spec.ppo_role_specs``."""
    if stage not in STAGES:
        raise ConfigError(f"stage must be one of {', '.join(STAGES)}, got {stage!r}")
    world = check_launch(cfg)
    if stage == "ppo":
        written = written or Written.differing(cfg)
        # a setting that would do nothing fails here, not on the cluster; the checkpoints
        # may live only there
        check_ppo(cfg, written, planning=True)
        check_memory(cfg, world, written)
    launch = cfg.launch
    run_dir = os.path.join(cfg.run.output_dir, cfg.run.name)
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name=megarlhf-{stage}-{cfg.run.name}",
             f"#SBATCH --nodes={launch.nodes}",
             f"#SBATCH --ntasks-per-node={launch.tasks_per_node}",
             f"#SBATCH --cpus-per-task={launch.cpus_per_task}",
             f"#SBATCH --time={launch.time}",
             f"#SBATCH --output={launch.log_dir}/%x-%j.out",
             f"#SBATCH --signal=B:USR1@{launch.preempt_signal_seconds}",
             "#SBATCH --requeue",
             "#SBATCH --open-mode=append"]
    if launch.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={launch.gpus_per_node}")
    if launch.partition:
        lines.append(f"#SBATCH --partition={launch.partition}")
    if launch.account:
        lines.append(f"#SBATCH --account={launch.account}")
    args = [stage, config_path, *overrides] if stage != "score" else [stage, *overrides]
    train = cfg.parallel.layout
    lines += [f"# {world} processes: training layout {train.tp} (TP) x {train.pp} (PP) x "
              f"{train.dp(world)} (DP); rollout TP {cfg.rollout.tensor_parallel_size}",
              f"cd {shlex.quote(REPO)}",
              f"mkdir -p {shlex.quote(launch.log_dir)} {shlex.quote(run_dir)}",
              f"exec bash slurm/launch.sh {shlex.quote(run_dir)} {shlex.quote(launch.python)} "
              + " ".join(shlex.quote(a) for a in args)]
    return "\n".join(lines) + "\n"


def submit(script: str, cfg: Config, stage: str) -> str:
    os.makedirs(cfg.launch.log_dir, exist_ok=True)
    path = os.path.join(cfg.launch.log_dir, f"megarlhf-{stage}-{cfg.run.name}.sbatch")
    with open(path, "w") as f:
        f.write(script)
    proc = subprocess.run(["sbatch", "--parsable", path], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"sbatch failed: {proc.stderr.strip()}")
    return proc.stdout.strip().split(";")[0]
