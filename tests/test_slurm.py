"""Launching through a real Slurm cluster of two nodes (Debian's slurmctld/slurmd/munge;
each node a network namespace with its own hostname and address: scripts/local_cluster.sh,
started once for the file and torn down after it). `megarlhf launch STAGE --slurm` with
launch.nodes=2: PPO, SFT and RM across the two nodes equal the same layout on one node;
a preemption signal to the batch script reaches the tasks on both nodes, and the requeued
job resumes to the same metrics; a node whose network is cut is named by the surviving
rank within the deadline, Slurm requeues the job, and once the node is back it resumes.
Every other way Slurm restarts a run resumes it too, with nothing done by hand: an
operator's `scontrol requeue`, a fresh `sbatch` after the job crashed or was cancelled
(which must stay ended), and a requeue after the host that held the run's lock died with
it (issue 60)."""

import json
import math
import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import ROOT, run_cli

pytestmark = pytest.mark.slow
MISSING = "needs root, network namespaces and Debian's slurmctld/slurmd/slurm-client/munge " \
    "(scripts/test.sh installs them when it runs as root)"
CLUSTER = os.path.join(ROOT, "scripts", "local_cluster.sh")
DEADLINE_S = 9.0  # parallel.timeout_minutes=0.15


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A running two-node Slurm. Without one the tests are skipped - or fail, where
    scripts/test.sh (as root, in CI) set MEGARLHF_REQUIRE_SLURM=1."""
    required = os.environ.get("MEGARLHF_REQUIRE_SLURM") == "1"
    if shutil.which("slurmctld") is None or os.geteuid() != 0:
        if required:
            pytest.fail(f"Slurm is required here (MEGARLHF_REQUIRE_SLURM=1) but absent: {MISSING}")
        pytest.skip(MISSING)
    state = tmp_path_factory.mktemp("cluster")
    up = subprocess.run(["bash", CLUSTER, "up", str(state), "2"], capture_output=True,
                        text=True, timeout=120)
    if up.returncode != 0:
        subprocess.run(["bash", CLUSTER, "down", str(state)], timeout=60)
        if required:
            pytest.fail(f"the local cluster did not start:\n{up.stdout}\n{up.stderr}")
        pytest.skip(f"the local cluster did not start ({up.stderr.strip()[-300:]})")
    yield state
    subprocess.run(["bash", CLUSTER, "down", str(state)], check=False, timeout=60)
    left = [pid for pid in subprocess.run(["pgrep", "-x", "slurmctld|slurmd"],
                                          capture_output=True, text=True).stdout.split()
            if running(pid)]
    assert not left, f"the cluster left daemons running: {left}"
    assert "mrl-node" not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                            text=True).stdout


def running(pid: str) -> bool:
    """Alive and not a zombie (a daemon's parent here may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def common(tiny_checkpoints):
    out, task, shared = tiny_checkpoints
    launch = [f"launch.log_dir={out}/logs", "launch.gpus_per_node=0", "launch.cpus_per_task=1",
              f"launch.python={os.path.join(ROOT, '.venv', 'bin', 'python')}"]
    ppo = ["ppo", "configs/demo/ppo.yaml", f"data.train_path={task['prompts']}",
           f"data.eval_path={task['eval_prompts']}",
           f"ppo.sft_checkpoint={out}/sft-tiny/checkpoints",
           f"ppo.reward_checkpoint={out}/rm-tiny/checkpoints", "ppo.num_eval_prompts=8",
           "logging.sample_table_interval=0", "ppo.num_iterations=6", "ppo.eval_interval=3",
           "checkpoint.save_interval=1", *shared]
    sft = ["sft", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}",
           "train.max_steps=6", "train.eval_interval=3", *shared]
    rm = ["rm", "configs/rm_tiny.yaml", f"data.train_path={task['prefs']}",
          "train.max_steps=6", "train.eval_interval=3", *shared]
    return out, {"ppo": ppo, "sft": sft, "rm": rm}, launch


def submit(stage_args, launch, *extra, nodes=2, tasks=1):
    stage, config, *rest = stage_args
    proc = run_cli("launch", stage, config, *rest, *launch, f"launch.nodes={nodes}",
                   f"launch.tasks_per_node={tasks}", *extra, "--slurm")
    return proc.stdout.split("submitted job ")[1].split(";")[0]


def wait_done(job, timeout):
    """Wait for ``job`` to leave the queue. Slurm holds a requeued job until its old
    credential expires (reason BeginTime; 10 s with local_cluster.sh's cred_expire):
    released earlier, the restart is killed with "Job credential revoked"."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], capture_output=True,
                             text=True).stdout.strip()
        if not out:
            return
        # A job that can never start fails the test now rather than at the timeout.
        assert not any(r in out for r in ("PartitionConfig", "BadConstraints")), \
            f"job {job} cannot run: {out}"
        time.sleep(1)
    raise AssertionError(f"job {job} did not finish in {timeout} s")


def wait_finished(job, log_path, done_line, timeout):
    """Until the job has left the queue after writing ``done_line`` (squeue can show
    nothing for a moment between a requeue and the held job), or has stayed out of it for
    15 s without (a job that failed: the test fails now, not at the timeout)."""
    deadline = time.time() + timeout
    out_since = None
    while True:
        wait_done(job, max(deadline - time.time(), 1))
        log = open(log_path).read() if os.path.exists(log_path) else ""
        if done_line in log or time.time() > deadline:
            return log
        queued = subprocess.run(["squeue", "-h", "-j", job], capture_output=True,
                                text=True).stdout.strip()
        out_since = None if queued else (out_since or time.time())
        if out_since is not None and time.time() - out_since > 15:
            return log
        time.sleep(1)


def rows(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def assert_same_metrics(got_dir, want_dir, tol=1e-6):
    got, want = rows(got_dir), rows(want_dir)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want):
        for key, value in b.items():
            if key.startswith(("timing/", "perf/")) or not isinstance(value, (int, float)):
                continue
            assert math.isclose(a[key], value, rel_tol=tol, abs_tol=tol), \
                (got_dir, a["step"], key, a[key], value)


def one_node(stage_args, name):
    """The same layout on one node: 2 processes under torchrun here."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
         "--standalone", "-m", "megarlhf.cli", *stage_args, f"run.name={name}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def two_node_runs(cluster, common):
    """PPO, SFT and RM, each 2 nodes x 1 task (every role data-parallel across the nodes),
    submitted together; {stage: (job, run dir)}."""
    out, stages, launch = common
    jobs = {stage: submit(args, launch, f"run.name=two-{stage}")
            for stage, args in stages.items()}
    for stage, job in jobs.items():
        log = wait_finished(job, out / "logs" / f"megarlhf-{stage}-two-{stage}-{job}.out",
                            f"[{stage}] done", 600)
        assert f"[{stage}] done" in log, log[-3000:]
        assert "2 node(s) x 1 task(s), rendezvous node1:" in log, log[-3000:]
    return {stage: (job, out / f"two-{stage}") for stage, job in jobs.items()}


def test_dry_run_renders_and_checks_fit(common):
    out, stages, launch = common
    script = run_cli("launch", *stages["ppo"], *launch, "launch.nodes=2",
                     "launch.tasks_per_node=1", "--slurm", "--dry-run").stdout
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=1" in script
    assert "#SBATCH --signal=B:USR1@120" in script and "#SBATCH --requeue" in script
    assert "slurm/launch.sh" in script
    bad = run_cli("launch", *stages["ppo"], *launch, "launch.tasks_per_node=3",
                  "parallel.tensor_model_parallel_size=2", "--slurm", "--dry-run", check=False)
    assert bad.returncode == 2 and "does not fit 1 node(s) x 3 task(s)" in bad.stderr
    spans = run_cli("launch", *stages["ppo"], *launch, "launch.nodes=2",
                    "launch.tasks_per_node=1", "parallel.tensor_model_parallel_size=2",
                    "--slurm", "--dry-run", check=False)
    assert spans.returncode == 2 and "TP=2 spans nodes" in spans.stderr


@pytest.mark.extended
@pytest.mark.parametrize("stage", ["ppo", "sft", "rm"])
def test_two_nodes_equal_one_node(common, two_node_runs, stage):
    """Each rank on its own host (the rendezvous, every role's process groups and the
    checkpoints across hosts): the metrics equal the same layout's on one node (fp32)."""
    out, stages, _ = common
    one_node(stages[stage], f"one-{stage}")
    assert_same_metrics(two_node_runs[stage][1], out / f"one-{stage}")


@pytest.mark.extended
def test_preemption_across_nodes_resumes_to_the_same_metrics(common, two_node_runs):
    """SIGUSR1 to the batch script alone (as Slurm's --signal=B: sends it): slurm/launch.sh
    forwards it through srun to the tasks on both nodes, which checkpoint together; the job
    requeues and resumes; its metrics equal the uninterrupted two-node run's."""
    out, stages, launch = common
    job = submit(stages["ppo"], launch, "run.name=preempt")
    run = out / "preempt"
    deadline = time.time() + 300
    while time.time() < deadline and (not (run / "metrics.jsonl").exists()
                                      or len(rows(run)) < 3):
        time.sleep(0.5)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)
    log = wait_finished(job, out / "logs" / f"megarlhf-ppo-preempt-{job}.out", "[ppo] done",
                        600)
    assert "the signal reached 2 of 2 ranks: 0, 1" in log, log[-3000:]
    assert "requeueing job" in log and "restart 1" in log and "[ppo] resumed iter_" in log, \
        log[-3000:]
    assert_same_metrics(run, two_node_runs["ppo"][1], tol=0)  # bitwise


def wait_rows(run, n: int, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and (not (run / "metrics.jsonl").exists()
                                      or len(rows(run)) < n):
        time.sleep(0.5)
    assert (run / "metrics.jsonl").exists() and len(rows(run)) >= n


@pytest.mark.extended
def test_an_operators_requeue_resumes_to_the_same_metrics(common, two_node_runs):
    """`scontrol requeue` of the running job: Slurm signals the batch script, which has the
    tasks checkpoint; the job starts again and resumes; its metrics equal the uninterrupted
    two-node run's, bitwise."""
    out, stages, launch = common
    job = submit(stages["ppo"], launch, "run.name=operator-requeue")
    run = out / "operator-requeue"
    wait_rows(run, 3)
    subprocess.run(["scontrol", "requeue", job], check=True)
    log = wait_finished(job, out / "logs" / f"megarlhf-ppo-operator-requeue-{job}.out",
                        "[ppo] done", 600)
    assert "restart 1" in log and "[ppo] resumed iter_" in log, log[-3000:]
    assert_same_metrics(run, two_node_runs["ppo"][1], tol=0)


@pytest.mark.extended
def test_a_fresh_job_after_a_crash_resumes_to_the_same_metrics(common, two_node_runs):
    """Both tasks of the job killed at once (SIGKILL: no checkpoint, no marker, the lock
    left behind): the job ends without a requeue; a fresh `sbatch` of the same run -
    another job id - takes the dead run's lock over, resumes from `latest` and ends with
    the uninterrupted run's metrics, bitwise."""
    out, stages, launch = common
    first = submit(stages["ppo"], launch, "run.name=crashed")
    run = out / "crashed"
    wait_rows(run, 3)
    tasks = node_tasks(1) + node_tasks(2)  # the tasks, and srun on the first node
    assert len(tasks) >= 2, tasks
    for pid in tasks:  # all at once: no task lives to leave a marker
        os.kill(pid, 9)
    wait_done(first, 120)
    log = open(out / "logs" / f"megarlhf-ppo-crashed-{first}.out").read()
    assert "restart 1" not in log and (run / "LOCK").exists(), log[-3000:]
    second = submit(stages["ppo"], launch, "run.name=crashed")
    assert second != first
    log = wait_finished(second, out / "logs" / f"megarlhf-ppo-crashed-{second}.out",
                        "[ppo] done", 600)
    assert f"taking over {run / 'LOCK'}" in log and "[ppo] resumed iter_" in log, log[-3000:]
    assert_same_metrics(run, two_node_runs["ppo"][1], tol=0)


@pytest.mark.extended
def test_a_users_scancel_ends_the_job_and_a_fresh_one_resumes(common, two_node_runs):
    """`scancel` of the running job (found by bench/chaos.py's cluster stage: the batch
    script took the SIGTERM for a preemption and requeued the job, so a cancelled run came
    back by itself): the tasks checkpoint, the job stays ended - no restart - and a fresh
    `sbatch` of the same command resumes to the uninterrupted run's metrics, bitwise."""
    out, stages, launch = common
    first = submit(stages["ppo"], launch, "run.name=cancelled")
    run = out / "cancelled"
    wait_rows(run, 3)
    subprocess.run(["scancel", first], check=True)
    wait_done(first, 120)
    time.sleep(15)  # a requeue would have the job back in the queue by now
    assert not subprocess.run(["squeue", "-h", "-j", first], capture_output=True,
                              text=True).stdout.strip()
    log = open(out / "logs" / f"megarlhf-ppo-cancelled-{first}.out").read()
    assert f"Slurm is ending job {first} (JobState=COMPLETING" in log and \
        "restart 1" not in log, \
        log[-3000:]
    assert rows(run)[-1]["step"] < 6
    second = submit(stages["ppo"], launch, "run.name=cancelled")
    log = wait_finished(second, out / "logs" / f"megarlhf-ppo-cancelled-{second}.out",
                        "[ppo] done", 600)
    assert "[ppo] resumed iter_" in log, log[-3000:]
    assert_same_metrics(run, two_node_runs["ppo"][1], tol=0)


@pytest.mark.extended
def test_the_lock_holders_host_dies_and_the_requeued_job_takes_over(cluster, common,
                                                                    two_node_runs):
    """A one-node job (2 tasks) whose node dies with everything on it - its rank 0 held the
    run's lock: Slurm requeues the job onto the other node, whose rank 0 finds a fresh lock
    from a host it cannot check; it waits for the lock to go stale (runlock.STALE_S)
    instead of exiting, takes it over, resumes from `latest` and finishes with the
    two-node run's metrics (one node or two: equal to 1e-6)."""
    import json
    out, stages, launch = common
    job = submit(stages["ppo"], launch, "run.name=holder-dies", nodes=1, tasks=2)
    run = out / "holder-dies"
    wait_rows(run, 3)
    host = json.loads((run / "LOCK").read_text())["host"]
    node = int(host.removeprefix("node"))
    subprocess.run(["bash", CLUSTER, "die", str(cluster), str(node)], check=True)
    try:
        ctld_log, deadline = cluster / "log" / "slurmctld.log", time.time() + 120
        while time.time() < deadline and f"requeue job JobId={job} due to failure of node " \
                f"node{node}" not in ctld_log.read_text():
            time.sleep(1)
        log = wait_finished(job, out / "logs" / f"megarlhf-ppo-holder-dies-{job}.out",
                            "[ppo] done", 600)
    finally:
        subprocess.run(["bash", CLUSTER, "mend", str(cluster), str(node)], check=True)
    assert f"is held by a run on another host (host {host}" in log and \
        "which this host cannot check" in log, log[-3000:]
    assert f"taking over {run / 'LOCK'}" in log and "last refreshed" in log, log[-3000:]
    assert "restart 1" in log and "[ppo] resumed iter_" in log and "[ppo] done" in log
    assert_same_metrics(run, two_node_runs["ppo"][1], tol=1e-6)


def node_tasks(node: int) -> list[int]:
    """PIDs of megarlhf processes running on node ``node`` (in its namespace)."""
    pids = subprocess.run(["ip", "netns", "pids", f"mrl-node{node}"], capture_output=True,
                          text=True).stdout.split()
    out = []
    for pid in pids:
        try:
            if b"megarlhf.cli" in open(f"/proc/{pid}/cmdline", "rb").read():
                out.append(int(pid))
        except OSError:
            pass
    return out


@pytest.mark.extended
def test_a_lost_node_is_named_and_the_job_resumes(cluster, common):
    """node2's network cut mid-run: the rank on node1 exits within the deadline plus 30 s
    naming the phase, node2 and its rank; the rank on node2, cut off, exits too; Slurm
    marks node2 down and requeues the job; once node2 is back the job resumes from the
    last checkpoint and finishes."""
    out, stages, launch = common
    job = submit(stages["ppo"], launch, "run.name=lost", "ppo.num_iterations=10",
                 f"parallel.timeout_minutes={DEADLINE_S / 60}")
    run = out / "lost"
    log_path = out / "logs" / f"megarlhf-ppo-lost-{job}.out"
    deadline = time.time() + 300
    while time.time() < deadline and (not (run / "metrics.jsonl").exists()
                                      or len(rows(run)) < 3):
        time.sleep(0.2)
    assert node_tasks(1) and node_tasks(2), open(log_path).read()[-3000:]
    subprocess.run(["bash", CLUSTER, "cut", str(cluster), "2"], check=True)
    cut = time.time()
    try:
        while (node_tasks(1) or node_tasks(2)) and time.time() - cut < DEADLINE_S + 60:
            time.sleep(0.2)
        took = time.time() - cut
        assert took < DEADLINE_S + 30, (took, node_tasks(1), node_tasks(2))
        log = open(log_path).read()
        assert "rank 0 (host node1) waited 0.15 minute(s) (parallel.timeout_minutes) during " \
               "phase '" in log and "rank(s) 1 (host node2) stopped sending heartbeats" in log, \
            log[-3000:]
        last = (run / "checkpoints" / "latest").read_text()
        # Slurm notices the node (SlurmdTimeout=20 s) and requeues the job, which waits for it
        ctld_log, deadline = cluster / "log" / "slurmctld.log", time.time() + 120
        while time.time() < deadline and f"requeue job JobId={job} due to failure of node " \
                "node2" not in ctld_log.read_text():
            time.sleep(1)
        assert f"requeue job JobId={job} due to failure of node node2" in ctld_log.read_text()
    finally:
        subprocess.run(["bash", CLUSTER, "mend", str(cluster), "2"], check=True)
    log = wait_finished(job, log_path, "[ppo] done", 600)
    assert "restart 1" in log and f"[ppo] resumed {last}" in log and "[ppo] done" in log, \
        log[-3000:]
    assert [r["step"] for r in rows(run)][-1] == 10
