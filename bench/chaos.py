"""Chaos soak for every training stage: 2-process SFT, reward-model, DPO and PPO (with an
EMA actor) runs, each hit by faults at random moments and rerun with the same command after
each, against the same run left alone. ``ppo-split``: PPO with split placement (1 training
+ 1 rollout process, k = 1), ``ppo-partial``: the same with partial rollouts,
``ppo-workers``: PPO scored by a reward function in 2 worker processes, ``ppo-env``:
GRPO on the tool task's multi-turn episodes, the environment in 2 worker processes, and
``cluster``: PPO across a two-node Slurm cluster, hit by every way Slurm restarts a job
(``bench/chaos_cluster.py`` says which; root and Slurm needed).

    .venv/bin/python bench/chaos.py [--stages sft rm dpo ppo ppo-split ppo-partial
                                     ppo-workers ppo-env cluster] [--faults 8] [--steps 60]
                                    [--iterations 8] [--seed 0] [--out DIR]

The faults cycle through four kinds:
- ``kill``: SIGKILL of the whole job (torchrun and both workers) at a random moment -
  start-up, rollout, resharding, training or a checkpoint save (a lost node);
- ``save``: the N-th save of the rerun dies after writing every shard, before its commit
  (``MEGARLHF_FAULT_INJECT=save_before_commit:N``), then the job is killed;
- ``term``: SIGTERM to the workers (a preemption): they checkpoint at the next safe point
  and exit 0;
- ``stop``: SIGSTOP of rank 1 (a wedged process): rank 0's watchdog notices within
  ``parallel.timeout_minutes`` (0.1 here), exits naming the phase and leaves ``STALLED``;
  the stopped rank is then killed.
In the split stages the process stopped alternates between the two sides (rank 1 samples,
rank 0 trains; the other side's watchdog ends the job), and a fifth kind, ``rank``,
SIGKILLs one side's process alone, alternating too (the other side loses its connection,
names it and exits). In ``ppo-workers`` the fifth kind SIGKILLs one reward worker process
mid-run (the run replaces it and scores its calls again), then the job; in ``ppo-env`` it
SIGKILLs one environment worker process mid-episode (its episodes' state is gone: the
failed call stops the run under rollout.rewards.on_error=stop, naming it, and the rerun
resumes).
Nothing is cleared by hand between faults: the next run takes over the run lock, skips a
torn checkpoint and resumes. At the end, every non-timing metric of every step and the
final weights (``megarlhf score`` log-probs of fixed sequences; the reward model: its eval
metrics) must equal the uninterrupted run's, bitwise, and no fault may lose more than one
checkpoint interval. ``ppo-partial`` samples with whatever weights have arrived, which
depends on timing: there the invariants must hold instead - every step logged once with
finite metrics, the share of tokens sampled after an update within [0, 1], the last
checkpoint the last iteration's, at most one interval lost per fault. Prints, per stage,
the faults, the steps each lost and the time.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import time

from chaos_check import PY, ROOT, TIMING_DEPENDENT, cli, compare, latest, steps

KINDS = ("kill", "save", "term", "stop")
MORE_KINDS = {"ppo-split": ("rank",), "ppo-partial": ("rank",), "ppo-workers": ("worker",),
              "ppo-env": ("worker",)}
STAGES = ("sft", "rm", "dpo", "ppo", "ppo-split", "ppo-partial", "ppo-workers", "ppo-env",
          "cluster")


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun's agent starts its workers in their own
    sessions, so killing torchrun's process group does not reach them)."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = subprocess.run(["ps", "-o", "pid=", "--ppid", str(parent)],
                              capture_output=True, text=True).stdout.split()
        for kid in map(int, kids):
            out.append(kid)
            todo.append(kid)
    return out


def workers(proc) -> dict[int, int]:
    """rank -> pid of torchrun's workers."""
    out = {}
    for pid in descendants(proc.pid):
        try:
            environ = open(f"/proc/{pid}/environ").read().split("\0")
        except OSError:
            continue
        rank = [e[5:] for e in environ if e.startswith("RANK=")]
        if rank and "megarlhf.cli" in open(f"/proc/{pid}/cmdline").read():
            out.setdefault(int(rank[0]), pid)
    return out


def kill_job(proc) -> None:
    """SIGKILL torchrun and everything it started, at once."""
    for pid in [proc.pid] + descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def torchrun(args, env, wait=True):
    # --standalone: the rendezvous port is the OS's pick when torchrun binds it (a port
    # chosen here could be taken by a concurrent job before torchrun binds it)
    cmd = [PY, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
           "-m", "megarlhf.cli", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    if wait:
        proc.wait()
    return proc


def fault(kind: str, args: list, env: dict, rng: random.Random, victim: int = 1) -> str:
    """Run ``args`` once more and hit it with ``kind``; returns what happened. ``victim``:
    the rank a ``stop`` or ``rank`` fault hits (the other one is watched)."""
    if kind == "save":
        n = rng.randint(1, 2)
        proc = torchrun(args, {**env, "MEGARLHF_FAULT_INJECT": f"save_before_commit:{n}"})
        kill_job(proc)  # the checkpoint writer's helper processes, if any survive
        return f"save {n} of the rerun died before its commit"
    proc = torchrun(args, env, wait=False)
    delay = rng.uniform(3.0, 15.0)
    time.sleep(delay)
    if proc.poll() is not None:
        return f"{kind} after {delay:.1f} s: the rerun had finished"
    if kind == "kill":
        kill_job(proc)
        return f"SIGKILL after {delay:.1f} s"
    ranks = workers(proc)
    if kind == "term":
        for pid in ranks.values():
            os.kill(pid, signal.SIGTERM)
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            kill_job(proc)
            return f"SIGTERM after {delay:.1f} s: NOT honoured in 300 s"
        return f"SIGTERM after {delay:.1f} s: exit {proc.returncode}"
    if kind == "worker":  # a reward or environment worker process: a child of a rank (started
        kids, until = [], time.time() + 20  # at the first scoring)
        while not kids and time.time() < until and proc.poll() is None:
            kids = [pid for rank_pid in workers(proc).values() for pid in descendants(rank_pid)
                    if _is_reward_worker(pid)]
            time.sleep(0.2)
        if not kids:
            finished = proc.poll() is not None
            kill_job(proc)
            return (f"worker after {delay:.1f} s: " + ("the rerun had finished" if finished
                    else "no worker process in 20 s, the job killed instead"))
        os.kill(kids[0], signal.SIGKILL)
        try:  # reward: replaced, the run goes on; environment: the run stops, naming it
            proc.wait(timeout=rng.uniform(3.0, 8.0))
            return (f"SIGKILL of worker process {kids[0]} after {delay:.1f} s: the rerun "
                    f"ended, exit {proc.returncode}")
        except subprocess.TimeoutExpired:
            kill_job(proc)
            return (f"SIGKILL of worker process {kids[0]} after {delay:.1f} s, the run went "
                    "on; then SIGKILL of the job")
    # stop: the victim wedged, the other rank's watchdog ends the job; rank: the victim
    # killed alone, the other rank loses its connection and leaves
    other = 1 - victim
    if victim not in ranks or other not in ranks:
        finished = proc.poll() is not None
        kill_job(proc)
        return (f"{kind} after {delay:.1f} s: the rerun had finished" if finished else
                f"{kind} after {delay:.1f} s: no rank {victim} yet, killed instead")
    os.kill(ranks[victim], signal.SIGSTOP if kind == "stop" else signal.SIGKILL)
    stopped = time.time()
    while _alive(ranks[other]) and time.time() - stopped < 120:
        time.sleep(0.2)
    took = time.time() - stopped
    kill_job(proc)
    return (f"{'SIGSTOP' if kind == 'stop' else 'SIGKILL'} of rank {victim} after "
            f"{delay:.1f} s: rank {other} left after {took:.1f} s")


def _is_reward_worker(pid: int) -> bool:
    try:
        return b"megarlhf" in open(f"/proc/{pid}/cmdline", "rb").read() and \
            b"megarlhf.cli" not in open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def stage_args(stage: str, out: str, task: dict, common: list, n: int) -> tuple[list, str]:
    """The 2-process command of ``stage`` and the role its checkpoints hold for ``score``."""
    every = ["checkpoint.save_interval=1", "checkpoint.keep_last=2",
             "parallel.timeout_minutes=0.1", *common]
    if stage != "ppo":  # train.max_steps decides, not the epochs
        every.append("train.num_epochs=1000")
    if stage == "sft":
        return ["sft", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}",
                f"train.max_steps={n}", "train.eval_interval=4", *every], "policy"
    if stage == "rm":
        return ["rm", "configs/rm_tiny.yaml", f"data.train_path={task['prefs']}",
                f"train.max_steps={n}", "train.eval_interval=4", *every], ""
    if stage == "dpo":
        return ["dpo", "configs/dpo_tiny.yaml", f"data.train_path={task['prefs']}",
                f"checkpoint.load={out}/sft-tiny/checkpoints", f"train.max_steps={n}",
                "train.global_batch_size=8", "train.micro_batch_size=2",
                "train.eval_interval=4", f"cache.path={out}/dpo-cache",
                "dpo.gold_reward_fn=null", "dpo.gold_eval_path=null", *every], "policy"
    ppo = ["ppo", "configs/demo/ppo.yaml", f"data.train_path={task['prompts']}",
           f"data.eval_path={task['eval_prompts']}", "ppo.num_eval_prompts=16",
           f"ppo.sft_checkpoint={out}/sft-tiny/checkpoints",
           f"ppo.reward_checkpoint={out}/rm-tiny/checkpoints", f"ppo.num_iterations={n}",
           "ppo.eval_interval=2", "ppo.ema_decay=0.9", "logging.sample_table_interval=0",
           *every]
    if stage == "ppo":
        return ppo + ["parallel.tensor_model_parallel_size=2"], "actor"
    if stage == "cluster":  # 2 nodes x 1 process (bench/chaos_cluster.py)
        return ppo, "actor"
    if stage == "ppo-workers":  # the synthetic task's reward, in 2 worker processes
        return ppo + ["parallel.tensor_model_parallel_size=2", "ppo.reward_checkpoint=null",
                      "rollout.rewards.fn=megarlhf.data.synthetic:gold_reward_pair",
                      "rollout.rewards.workers=2", "ppo.critic_init=sft"], "actor"
    if stage == "ppo-env":  # the tool task's episodes, the environment in 2 processes
        tool = task["tool"]
        return ["ppo", "configs/demo/tool_grpo.yaml", f"data.train_path={tool['rows']}",
                f"data.eval_path={tool['eval_rows']}", "ppo.num_eval_prompts=8",
                f"ppo.sft_checkpoint={out}/tool-sft/checkpoints", f"ppo.num_iterations={n}",
                "ppo.eval_interval=2", "ppo.ema_decay=0.9", "ppo.rollout_batch_size=4",
                "ppo.mini_batch_size=8", "logging.sample_table_interval=0",
                "parallel.tensor_model_parallel_size=2", "rollout.rewards.workers=2",
                *every, f"tokenizer.path={tool['tokenizer']}"], "actor"
    split = ["rollout.placement.mode=split", "rollout.placement.ranks=1",
             "ppo.max_staleness=1"]
    if stage == "ppo-partial":
        split.append("rollout.placement.partial=true")
    return ppo + split, "actor"


def soak(stage: str, args, out: str, task: dict, common: list, env: dict,
         rng: random.Random) -> dict:
    n = args.iterations if stage.startswith(("ppo", "cluster")) else args.steps
    kinds = KINDS + MORE_KINDS.get(stage, ())
    base, role = stage_args(stage, out, task, common, n)
    if stage == "cluster":
        import chaos_cluster
        return chaos_cluster.soak(args, out, task, base, rng)
    ref_dir, run = os.path.join(out, f"{stage}-reference"), os.path.join(out, f"{stage}-chaos")
    start = time.time()
    torchrun(base + [f"run.name={stage}-reference"], env)
    ref_seconds = time.time() - start
    assert steps(ref_dir) and steps(ref_dir)[-1] == n, f"{stage}: the reference did not finish"
    chaos = base + [f"run.name={stage}-chaos"]
    lost, log = [], []
    start = time.time()
    hits: dict[str, int] = {}
    for k in range(args.faults):
        if steps(run) and steps(run)[-1] == n and latest(run) == n:
            break
        before = latest(run)
        kind = kinds[k % len(kinds)]
        hits[kind] = hits.get(kind, 0) + 1
        # split placement: the stopped or killed side alternates (rank 1 samples, rank 0
        # trains); elsewhere rank 1, as before
        victim = (hits[kind] % 2) if stage in ("ppo-split", "ppo-partial") else 1
        how = fault(kind, chaos, env, rng, victim)
        progress, kept = max(steps(run), default=0), latest(run)
        lost.append(max(0, progress - kept))
        log.append(f"{stage} fault {k + 1} ({kind}): {how}; checkpoint "
                   f"{before} -> {kept}, metrics reached {progress}, lost {lost[-1]}")
        print(log[-1], flush=True)
    if not (steps(run) and steps(run)[-1] == n and latest(run) == n):
        torchrun(chaos, env)  # run to the end
    chaos_seconds = time.time() - start
    return compare(stage, out, task, role, n, lost, log, kinds, hits, ref_seconds,
                   chaos_seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    parser.add_argument("--faults", "--kills", type=int, default=8, help="faults per stage")
    parser.add_argument("--steps", type=int, default=60, help="SFT / RM / DPO steps")
    parser.add_argument("--iterations", type=int, default=8, help="PPO iterations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="/tmp/megarlhf_chaos")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    random.seed(args.seed)
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    from megarlhf.data.synthetic import write_task
    task = write_task(os.path.join(args.out, "task"), seed=0)
    common = [f"tokenizer.path={task['tokenizer']}", f"run.output_dir={args.out}",
              "logging.progress_bar=false", "logging.tensorboard=false"]
    if any(stage in ("dpo", "cluster") or stage.startswith("ppo") for stage in args.stages):
        cli("sft", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}",
            "train.max_steps=20", *common)
    if "ppo-env" in args.stages:
        from megarlhf.data.tool_task import write_tool_task
        task["tool"] = write_tool_task(os.path.join(args.out, "tool-task"), seed=0)
        cli("sft", "configs/demo/tool_sft.yaml", f"data.train_path={task['tool']['sft']}",
            "train.max_steps=60", *common, f"tokenizer.path={task['tool']['tokenizer']}")
    if any(stage.startswith(("ppo", "cluster")) for stage in args.stages):
        cli("rm", "configs/rm_tiny.yaml", f"data.train_path={task['prefs']}",
            "train.max_steps=20", *common)
    results = [soak(stage, args, args.out, task, common, env, rng) for stage in args.stages]
    print()
    for r in results:
        print(f"chaos soak, {r['stage']}: {r['steps']} steps, 2 processes, checkpoint every "
              f"step; {r['faults']} faults ({', '.join(r['kinds'])} in turn: {r['hits']}), "
              f"all recovered without a hand: {r['ok']}")
        print(f"  steps lost per fault: {r['lost']} (max {max(r['lost'], default=0)}; bound "
              "1 = the checkpoint interval)")
        what = ("every step once, finite, partial share in [0, 1]"
                if r["stage"] in TIMING_DEPENDENT else "metrics equal to the uninterrupted run's")
        print(f"  {what}: {r['same_steps'] and not r['diffs']}"
              f" ({r['n_diffs']} differing values{': ' + str(r['diffs']) if r['diffs'] else ''})"
              + (f"; final weights equal: {r['same_weights']}"
                 if r["stage"] not in TIMING_DEPENDENT else ""))
        print(f"  uninterrupted {r['ref_seconds']:.0f} s; with faults and reruns "
              f"{r['chaos_seconds']:.0f} s")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
