"""Chaos soak: a 2-process PPO run killed with SIGKILL at random moments and rerun with the
same command each time, against the same run left alone.

    .venv/bin/python bench/chaos.py [--kills 6] [--iterations 8] [--seed 0] [--out DIR]

Each kill takes the whole job (torchrun and both workers) at a random moment of a rerun -
start-up, rollout, resharding, training or a checkpoint save; every second kill is aimed
at a save (``MEGARLHF_FAULT_INJECT=save_before_commit``: all shards written, not yet
committed). At the end, every non-timing metric of every iteration and the actor's
log-probs on fixed sequences (``megarlhf score`` of the final checkpoints) must equal the
uninterrupted run's, bitwise. Prints N, kills survived, the iterations each kill lost
(at most one checkpoint interval) and the time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable


def cli(*argv, env=None):
    return subprocess.run([PY, "-m", "megarlhf.cli", *argv], cwd=ROOT, check=True,
                          capture_output=True, text=True, env=env)


def steps(run_dir: str) -> list[int]:
    from megarlhf.engine.metrics import read_metrics
    path = os.path.join(run_dir, "metrics.jsonl")
    return [r["step"] for r in read_metrics(run_dir)] if os.path.exists(path) else []


def latest(run_dir: str) -> int:
    path = os.path.join(run_dir, "checkpoints", "latest")
    return int(open(path).read().split("_")[1]) if os.path.exists(path) else 0


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


def kill_job(proc) -> None:
    """SIGKILL torchrun and everything it started, at once (a lost node)."""
    for pid in [proc.pid] + descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def torchrun(args, env, wait=True):
    cmd = [PY, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port",
           str(random.randint(20000, 40000)), "-m", "megarlhf.cli", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    if wait:
        proc.wait()
    return proc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=6)
    parser.add_argument("--iterations", type=int, default=8)
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
    cli("sft", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}", "train.max_steps=20",
        *common)
    cli("rm", "configs/rm_tiny.yaml", f"data.train_path={task['prefs']}", "train.max_steps=20",
        *common)
    ppo = ["ppo", "configs/demo/ppo.yaml", f"data.train_path={task['prompts']}",
           f"data.eval_path={task['eval_prompts']}", "ppo.num_eval_prompts=16",
           f"ppo.sft_checkpoint={args.out}/sft-tiny/checkpoints",
           f"ppo.reward_checkpoint={args.out}/rm-tiny/checkpoints",
           f"ppo.num_iterations={args.iterations}", "ppo.eval_interval=2", "ppo.ema_decay=0.9",
           "checkpoint.save_interval=1", "checkpoint.keep_last=2",
           "logging.sample_table_interval=0", "parallel.tensor_model_parallel_size=2",
           *common]

    start = time.time()
    torchrun(ppo + ["run.name=reference"], env)
    ref_seconds = time.time() - start
    ref_dir, run = os.path.join(args.out, "reference"), os.path.join(args.out, "chaos")
    assert steps(ref_dir)[-1] == args.iterations, "the reference run did not finish"

    kills, lost, log = 0, [], []
    start = time.time()
    for k in range(args.kills):
        if steps(run) and steps(run)[-1] == args.iterations:
            break
        before = latest(run)
        if k % 2 == 1:  # at a save: the N-th save of this rerun dies before its commit
            n = rng.randint(1, 2)
            proc = torchrun(ppo + ["run.name=chaos"],
                            {**env, "MEGARLHF_FAULT_INJECT": f"save_before_commit:{n}"},
                            wait=True)
            kill_job(proc)  # the checkpoint writer's helper processes, if any survive
            how = f"in save {n} of the rerun"
        else:
            proc = torchrun(ppo + ["run.name=chaos"], env, wait=False)
            delay = rng.uniform(3.0, 15.0)  # start-up, rollout, reshard, training, saves
            time.sleep(delay)
            if proc.poll() is None:
                kill_job(proc)
            proc.wait()
            how = f"SIGKILL after {delay:.1f} s"
        progress = max(steps(run), default=0)
        kept = latest(run)
        kills += 1
        lost.append(progress - kept)
        log.append(f"kill {kills}: {how}; checkpoint {before} -> {kept}, metrics reached "
                   f"{progress}, iterations lost {progress - kept}")
        print(log[-1], flush=True)
    torchrun(ppo + ["run.name=chaos"], env)  # run to the end
    chaos_seconds = time.time() - start

    from megarlhf.engine.metrics import read_metrics
    ref = {r["step"]: r for r in read_metrics(ref_dir)}
    got = {r["step"]: r for r in read_metrics(run)}
    assert sorted(ref) == sorted(got), (sorted(ref), sorted(got))
    diffs = [(s, key) for s in ref for key, value in ref[s].items()
             if not key.startswith(("timing/", "perf/")) and got[s].get(key) != value]
    seqs = os.path.join(args.out, "seqs.jsonl")
    with open(seqs, "w") as f:
        for tokens in ([3, 7, 9, 11, 4], [5, 6, 7, 8]):
            f.write(json.dumps({"tokens": tokens}) + "\n")
    scores = []
    for name in ("reference", "chaos"):
        for role in ("actor", "ema"):
            dest = os.path.join(args.out, f"score_{name}_{role}.jsonl")
            cli("score", "--config", "configs/sft_tiny.yaml", "--input", seqs, "--output", dest,
                "--ckpt-role", role, f"checkpoint.load={args.out}/{name}/checkpoints",
                f"tokenizer.path={task['tokenizer']}")
            scores.append(open(dest).read())
    same_weights = scores[0] == scores[2] and scores[1] == scores[3]
    print(f"\nchaos soak: {args.iterations} iterations, 2 processes (TP=2), checkpoint every "
          f"iteration; {kills} kills, {kills} survived")
    print(f"iterations lost per kill: {lost} (max {max(lost, default=0)}; bound: 1 = the "
          "checkpoint interval)")
    print(f"uninterrupted run {ref_seconds:.0f} s; killed and rerun {chaos_seconds:.0f} s")
    print(f"metrics equal to the uninterrupted run's: {not diffs} "
          f"({len(diffs)} differing values{': ' + str(diffs[:5]) if diffs else ''})")
    print(f"actor and EMA log-probs equal (final checkpoints): {same_weights}")
    ok = not diffs and same_weights and max(lost, default=0) <= 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
