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

from megarlhf.config import Config, ConfigError, Layout, check_ppo, explicit_fields

STAGES = ("sft", "rm", "ppo", "dpo", "distill", "score")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _role_layouts(cfg: Config) -> dict[str, Layout]:
    """The training layout and that of every role block that sets its own."""
    actor = cfg.roles.actor.parallel
    base = actor.over(cfg.parallel.layout)
    out = {"parallel" if actor == type(actor)() else "roles.actor.parallel": base}
    for name in ("critic", "reference", "reward"):
        own = getattr(cfg.roles, name).parallel
        if own != type(own)():
            out[f"roles.{name}.parallel"] = own.over(base)
    return out


def check_fit(cfg: Config) -> int:
    launch = cfg.launch
    world = launch.nodes * launch.tasks_per_node
    for where, layout in _role_layouts(cfg).items():
        tp, pp, ranks = layout.tp, layout.pp, layout.model_parallel
        if world % ranks:
            raise ConfigError(
                f"the layout {where}: TP x PP = {tp} x {pp} = {ranks} processes does not fit "
                f"{launch.nodes} node(s) x {launch.tasks_per_node} task(s) = {world}: use a "
                f"multiple of {ranks} processes (launch.nodes / launch.tasks_per_node)")
        if tp > launch.tasks_per_node:
            raise ConfigError(f"{where}: TP={tp} spans nodes (launch.tasks_per_node="
                              f"{launch.tasks_per_node}); keep TP within a node")
    if world % cfg.rollout.tensor_parallel_size:
        raise ConfigError(f"rollout.tensor_parallel_size={cfg.rollout.tensor_parallel_size} "
                          f"does not divide the {world} processes of the job")
    if launch.gpus_per_node and launch.tasks_per_node > launch.gpus_per_node:
        raise ConfigError(f"launch.tasks_per_node={launch.tasks_per_node} exceeds "
                          f"launch.gpus_per_node={launch.gpus_per_node} (one task per GPU)")
    return world


def check_memory(cfg: Config, world: int) -> None:
    """With ``launch.gpu_memory_gib`` set: refuse a PPO config whose predicted per-GPU
    memory (``megarlhf plan``) does not fit, with the plan and the layouts that would."""
    if cfg.launch.gpu_memory_gib is None:
        return
    from megarlhf.memory.plan import GIB, explain, missing_checkpoints

    missing = missing_checkpoints(cfg)
    if missing and not (cfg.model.vocab_size and {"num_layers", "hidden_size"}
                        <= explicit_fields(cfg.model)):
        raise ConfigError(
            "launch.gpu_memory_gib is set but the memory check cannot size these roles: "
            f"{', '.join(missing)} not found on this machine. Write the model's shape in "
            "the config (model.num_layers, model.hidden_size, ...) or unset "
            "launch.gpu_memory_gib")
    ok, text = explain(cfg, world, cfg.launch.gpu_memory_gib * GIB,
                       cfg.launch.gpus_per_node or cfg.launch.tasks_per_node)
    if not ok:
        raise ConfigError(f"the PPO run does not fit launch.gpu_memory_gib="
                          f"{cfg.launch.gpu_memory_gib:g} per GPU (megarlhf plan):\n{text}")


def render_sbatch(cfg: Config, stage: str, config_path: str, overrides: list[str]) -> str:
    if stage not in STAGES:
        raise ConfigError(f"stage must be one of {', '.join(STAGES)}, got {stage!r}")
    world = check_fit(cfg)
    if stage == "ppo":
        check_ppo(cfg)  # a setting that would do nothing fails here, not on the cluster
        check_memory(cfg, world)
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
