"""Launching through a real single-node Slurm (Debian's slurmctld/slurmd/munge, started by
slurm/local_slurm.sh and stopped by the PIDs it started): the shortened PPO demo with 2
tasks through `megarlhf launch --slurm`, preempted, requeued and resumed to the end."""

import json
import os
import shutil
import subprocess
import time

import pytest

from conftest import ROOT, run_cli

pytestmark = pytest.mark.slow
MISSING = "needs root and Debian's slurmctld/slurmd/slurm-client/munge (scripts/test.sh " \
    "installs them when it runs as root)"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running single-node Slurm. Without one the test is skipped - or fails, where
    scripts/test.sh (as root, in CI) set MEGARLHF_REQUIRE_SLURM=1."""
    if shutil.which("slurmctld") is None or os.geteuid() != 0:
        if os.environ.get("MEGARLHF_REQUIRE_SLURM") == "1":
            pytest.fail(f"Slurm is required here (MEGARLHF_REQUIRE_SLURM=1) but absent: {MISSING}")
        pytest.skip(MISSING)
    state = tmp_path_factory.mktemp("slurm")
    script = os.path.join(ROOT, "slurm", "local_slurm.sh")
    subprocess.run(["bash", script, "start", str(state)], check=True, timeout=120)
    yield state
    subprocess.run(["bash", script, "stop", str(state)], check=False, timeout=60)


@pytest.fixture(scope="module")
def pipeline(tiny_checkpoints):
    out, task, common = tiny_checkpoints
    args = ["configs/demo/ppo.yaml", f"data.train_path={task['prompts']}",
            f"data.eval_path={task['eval_prompts']}",
            f"ppo.sft_checkpoint={out}/sft-tiny/checkpoints",
            f"ppo.reward_checkpoint={out}/rm-tiny/checkpoints", *common,
            f"launch.log_dir={out}/logs", "launch.nodes=1", "launch.tasks_per_node=2",
            "launch.gpus_per_node=0", "launch.cpus_per_task=1",
            f"launch.python={os.path.join(ROOT, '.venv', 'bin', 'python')}",
            "parallel.tensor_model_parallel_size=2", "logging.sample_table_interval=0"]
    return out, args


def submit(args):
    proc = run_cli("launch", "ppo", *args, "--slurm")
    return proc.stdout.split("submitted job ")[1].split(";")[0]


def wait_done(job, timeout):
    """Wait for ``job`` to leave the queue. Slurm holds a requeued job until its old
    credential expires (reason BeginTime; 10 s with slurm/local_slurm.sh's cred_expire):
    released earlier, the restart is killed with "Job credential revoked"."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], capture_output=True,
                             text=True).stdout.strip()
        if not out:
            return
        # A job that can never start fails the test now rather than at the timeout.
        assert not any(r in out for r in ("PartitionConfig", "ReqNodeNotAvail", "BadConstraints")), \
            f"job {job} cannot run: {out}"
        time.sleep(2)
    raise AssertionError(f"job {job} did not finish in {timeout} s")


def steps(run_dir):
    return [json.loads(line)["step"] for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def test_dry_run_renders_and_checks_fit(pipeline):
    out, args = pipeline
    script = run_cli("launch", "ppo", *args, "--slurm", "--dry-run").stdout
    assert "#SBATCH --ntasks-per-node=2" in script and "#SBATCH --signal=B:USR1@120" in script
    assert "#SBATCH --requeue" in script and "slurm/launch.sh" in script
    bad = run_cli("launch", "ppo", *args, "launch.tasks_per_node=3", "--slurm", "--dry-run",
                  check=False)
    assert bad.returncode == 2 and "does not fit 1 node(s) x 3 task(s)" in bad.stderr


def test_preemption_checkpoints_requeues_and_resumes(slurm, pipeline):
    out, args = pipeline
    job = submit(args + ["run.name=preempt", "ppo.num_iterations=12"])
    metrics = out / "preempt" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not metrics.exists() or len(steps(out / "preempt")) < 4):
        time.sleep(1)
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    log_path = out / "logs" / f"megarlhf-ppo-preempt-{job}.out"
    deadline = time.time() + 900
    # squeue can show nothing for a moment between the requeue and the held job: wait
    # until the job has left the queue after its resumed run wrote its last line
    while True:
        wait_done(job, max(deadline - time.time(), 1))
        log = open(log_path).read()
        if "[ppo] done" in log or time.time() > deadline:
            break
        time.sleep(2)
    # srun's rendezvous of the 2 tasks, the signal, the requeue, the resumed job
    assert "rendezvous" in log and "requeueing job" in log and "restart 1" in log \
        and "[ppo] resumed iter_" in log, log[-3000:]
    assert "[ppo] done" in log
    assert steps(out / "preempt") == list(range(0, 13))  # no iteration lost or repeated
    assert open(out / "preempt" / "checkpoints" / "latest").read() == "iter_000012"
