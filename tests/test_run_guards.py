"""Guards around a run (issue 38; the watchdog's runs: test_watchdog.py). One run per run
directory. A resume with changed settings says what changed; with another model shape it
is refused. A short run that went wrong does not end "done"; a metric out of its band
stops the run. A full disk, a damaged cache, forked writers, and the short chaos soak."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow
DEADLINE_S = 9.0  # parallel.timeout_minutes=0.15


def ppo(tiny, name, iterations):
    out, task, common = tiny
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
            "--standalone", "-m", "megarlhf.cli", "ppo",
            "configs/demo/ppo.yaml", f"data.train_path={task['prompts']}",
            f"data.eval_path={task['eval_prompts']}", f"run.name={name}",
            f"ppo.sft_checkpoint={out}/sft-tiny/checkpoints",
            f"ppo.reward_checkpoint={out}/rm-tiny/checkpoints", "ppo.num_eval_prompts=8",
            "logging.sample_table_interval=0", "checkpoint.save_interval=1",
            f"ppo.num_iterations={iterations}", "parallel.tensor_model_parallel_size=2",
            f"parallel.timeout_minutes={DEADLINE_S / 60}", *common]


def ranks(launcher: subprocess.Popen) -> dict[int, int]:
    """rank -> pid of torchrun's workers."""
    kids = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True,
                          text=True).stdout.split()
    out = {}
    for pid in kids:
        try:
            environ = open(f"/proc/{pid}/environ").read().split("\0")
        except OSError:
            continue
        for item in environ:
            if item.startswith("RANK="):
                out[int(item[5:])] = int(pid)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0] != "Z"
    except OSError:
        return False


def test_one_run_per_directory(tiny_checkpoints):
    """A second run in a run directory is refused naming the first (exit 2, before any
    work); once the first is killed (SIGKILL: no chance to release), a new run takes the
    lock over, says so, and resumes."""
    out = tiny_checkpoints[0]
    name = "locked"
    shutil.rmtree(out / name, ignore_errors=True)  # one an earlier session left (shared
    # MEGARLHF_TINY_DIR) would be resumed, not locked
    single = ppo(tiny_checkpoints, name, 40)
    single = single[:1] + single[single.index("-m", 2):]  # one process, no torchrun
    single = [a for a in single if not a.startswith("parallel.")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    log = open(out / f"{name}.log", "w+")
    first = subprocess.Popen(single, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    run = out / name
    deadline = time.time() + 300
    while not (run / "checkpoints" / "latest").exists() and time.time() < deadline:
        assert first.poll() is None, (out / f"{name}.log").read_text()[-3000:]
        time.sleep(0.2)
    second = subprocess.run(single, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert second.returncode == 2, second.stderr[-2000:]
    assert f"is in use by another run (host {os.uname().nodename}, pid {first.pid}" \
        in second.stderr, second.stderr[-2000:]
    first.kill()
    first.wait()
    latest = (run / "checkpoints" / "latest").read_text().strip()
    third = subprocess.run(single[:-len(tiny_checkpoints[2])] + ["ppo.num_iterations=4"]
                           + list(tiny_checkpoints[2]), cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"pid {first.pid}" in third.stdout and "its process no longer exists" \
        in third.stdout, third.stdout[-2000:]
    assert f"[ppo] resumed {latest}" in third.stdout
    assert not (run / "LOCK").exists()  # released at the end


def test_a_lock_from_another_host_is_waited_on_then_taken_over_or_refused(tmp_path,
                                                                          monkeypatch):
    """Across hosts the owner's pid cannot be checked, and its host may have died with it
    (a Slurm requeue after a node failure lands elsewhere): a fresh lock is waited on, not
    refused at once, until it goes stale - taken over, saying so - or is refreshed - the
    owner lives: refused. A stale or damaged lock is taken over at once."""
    import json
    import threading

    from megarlhf.stages import runlock
    monkeypatch.setattr(runlock, "STALE_S", 2.0)
    lock = tmp_path / runlock.LOCK_FILE
    owner = json.dumps({"host": "elsewhere", "pid": 1, "started": "then"})
    lock.write_text(owner)
    stop = threading.Event()

    def refresh():  # the owner, alive on its host
        while not stop.wait(0.3):
            os.utime(lock)

    refresher = threading.Thread(target=refresh)
    refresher.start()
    said, start = [], time.time()
    try:
        with pytest.raises(runlock.RunLocked, match="in use by another run \\(host elsewhere"):
            runlock.acquire(str(tmp_path), log=said.append)
    finally:
        stop.set()
        refresher.join()
    assert "which this host cannot check" in said[0] and time.time() - start < 2.5, said
    os.utime(lock)  # refreshed a moment ago, then silent: its host died
    said, start = [], time.time()
    runlock.acquire(str(tmp_path), log=said.append)
    took = time.time() - start
    assert "waiting up to 3 s for the lock to go stale or be refreshed" in said[0], said
    assert 1.5 < took < 5 and "last refreshed" in said[1], (said, took)
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    runlock.release()
    assert not lock.exists()
    lock.write_text(owner)  # stale already: taken over at once
    old = time.time() - 10
    os.utime(lock, (old, old))
    said, start = [], time.time()
    runlock.acquire(str(tmp_path), log=said.append)
    assert len(said) == 1 and "last refreshed" in said[0] and time.time() - start < 1
    runlock.release()
    lock.write_text("{")  # torn
    said.clear()
    runlock.acquire(str(tmp_path), log=said.append)
    assert "damaged" in said[0]
    runlock.release()


def test_a_resume_with_changed_settings_says_what_changed(tiny_checkpoints, tmp_path):
    """Each changed setting printed and recorded in resumes.jsonl; a changed model shape
    refused before anything is loaded (exit 2, no traceback); a torn latest checkpoint
    passed over for the newest complete one, with a message; none complete: an error."""
    import json

    from conftest import run_cli
    out, task, common = tiny_checkpoints
    args = ["sft", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}",
            "checkpoint.save_interval=2", "run.name=changed",
            *[c for c in common if not c.startswith("run.output_dir")],
            f"run.output_dir={tmp_path}"]
    run_cli(*args, "train.max_steps=2")
    proc = run_cli(*args, "train.max_steps=4", "train.micro_batch_size=2")
    assert "[resume] resuming step_0000002 with 2 setting(s) changed" in proc.stdout
    assert "[resume]   train.micro_batch_size: 4 -> 2" in proc.stdout
    assert json.loads((tmp_path / "changed" / "resumes.jsonl").read_text()) == {
        "checkpoint": "step_0000002",
        "changes": {"train.max_steps": [2, 4], "train.micro_batch_size": [4, 2]}}
    proc = run_cli(*args, "train.max_steps=6", "model.num_layers=3", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "with another model shape: model.num_layers was 2, now 3" in proc.stderr
    # the checkpoint `latest` names is torn: the newest complete one is taken, said so
    ckpts = tmp_path / "changed" / "checkpoints"
    (ckpts / "step_0000004" / "megarlhf_meta.json").write_text('{"roles": ')
    proc = run_cli(*args, "train.max_steps=4", "train.micro_batch_size=2")
    assert f"{ckpts / 'latest'} names 'step_0000004', which is not a complete checkpoint; " \
           "taking step_0000002" in proc.stdout, proc.stdout[-2000:]
    assert (ckpts / "latest").read_text() == "step_0000004"  # saved again, whole
    # nothing complete to fall back on: an error naming the pointer
    for tag in ("step_0000002", "step_0000004"):
        (ckpts / tag / "megarlhf_meta.json").unlink()
    proc = run_cli(*args, "train.max_steps=6", check=False)
    assert proc.returncode == 2 and "holds no complete checkpoint" in proc.stderr, \
        proc.stderr[-2000:]


def _flip_byte(path, offset: int) -> None:
    """One byte changed in place: the file keeps its size."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_checkpoint_changed_after_its_save_is_named_and_passed_over(tiny_checkpoints,
                                                                      tmp_path):
    """checkpoint.checksums (issue 60): a save records every file's size and SHA-256 - at
    DP=2 the ranks hash their turns of the files, and the record lists them all. One byte
    changed in place in the latest checkpoint's shard (the same size: the metadata and the
    format read it as it is): a resume names the file and takes the checkpoint before,
    then trains on; that checkpoint named directly is an error naming the file (exit 2, no
    traceback). A truncated or missing file is named too; with checksums off the changed
    file is taken as it is."""
    import json

    from conftest import run_cli, torchrun
    from megarlhf.engine import checkpoint as ck

    out, task, common = tiny_checkpoints
    args = ["sft", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}",
            "checkpoint.save_interval=1", "run.name=integrity",
            *[c for c in common if not c.startswith("run.output_dir")],
            f"run.output_dir={tmp_path}"]
    torchrun(args, 2, "train.max_steps=2")
    ckpts = tmp_path / "integrity" / "checkpoints"
    second = ckpts / "step_0000002"
    meta = json.loads((second / ck.META_FILE).read_text())
    on_disk = sorted(str(p.relative_to(second)) for p in second.rglob("*")
                     if p.is_file() and p.name != ck.META_FILE)
    assert sorted(meta["files"]) == on_disk and len(on_disk) >= 4, (meta["files"], on_disk)
    shard = second / next(n for n in on_disk if n.endswith(".distcp"))
    _flip_byte(shard, shard.stat().st_size // 2)
    proc = run_cli(*args, "train.max_steps=3")
    assert f"{ckpts / 'latest'} names 'step_0000002', which does not hold what its save " \
           f"wrote: {shard} was changed since the save" in proc.stdout, proc.stdout[-2000:]
    assert "taking step_0000001, the newest complete checkpoint there" in proc.stdout
    assert (ckpts / "latest").read_text() == "step_0000003"
    _flip_byte(shard, shard.stat().st_size // 2)  # step 2 was saved again, whole
    proc = run_cli("sft", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}",
                   f"checkpoint.load={second}", "run.name=from-damaged", "train.max_steps=1",
                   *common, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"checkpoint {second} does not hold what its save wrote: {shard} was changed" \
        in proc.stderr
    # in this process: a truncated file, a missing one, and checksums off
    third = ckpts / "step_0000003"
    files = json.loads((third / ck.META_FILE).read_text())["files"]
    cut = third / sorted(files)[0]
    size = cut.stat().st_size
    with open(cut, "r+b") as f:
        f.truncate(size - 1)
    with pytest.raises(ValueError, match=f"{cut} has {size - 1} bytes, the save wrote {size}"):
        ck.resolve_checkpoint(str(third))
    cut.unlink()
    with pytest.raises(ValueError, match=f"{cut} is missing"):
        ck.resolve_checkpoint(str(third))
    try:
        ck.use_checksums(False)
        assert ck.resolve_checkpoint(str(second)) == str(second)
    finally:
        ck.use_checksums(True)


def test_a_metrics_file_changed_after_a_save_stops_the_resume(tiny_checkpoints, tmp_path):
    """The run's own records (issue 60): a save records the size and SHA-256 of
    metrics.jsonl as it is then. A row changed in place (same size) stops the resume
    with exit 2 naming the file, before any step (latest and the file untouched); one cut
    short likewise; rows appended after the save (what a crash leaves) are not checked;
    the file moved aside is said and started afresh. Old behaviour: the resume appended to
    the changed rows in silence."""
    import json

    from conftest import run_cli
    from megarlhf.engine import checkpoint as ck

    out, task, common = tiny_checkpoints
    args = ["sft", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}",
            "checkpoint.save_interval=1", "run.name=records",
            *[c for c in common if not c.startswith("run.output_dir")],
            f"run.output_dir={tmp_path}"]
    run_cli(*args, "train.max_steps=2")
    run = tmp_path / "records"
    metrics, ckpts = run / "metrics.jsonl", run / "checkpoints"
    record = json.loads((ckpts / "step_0000002" / ck.META_FILE).read_text())["records"]
    assert record["metrics.jsonl"]["bytes"] == metrics.stat().st_size, record
    text = metrics.read_text()
    assert text.startswith('{"step": 0,'), text[:40]
    metrics.write_text('{"step": 7,' + text[len('{"step": 0,'):] + '{"step": 9, "torn')
    proc = run_cli(*args, "train.max_steps=3", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"{metrics} was changed after step_0000002 recorded it" in proc.stderr, \
        proc.stderr[-2000:]
    assert (ckpts / "latest").read_text() == "step_0000002"
    assert metrics.read_text().startswith('{"step": 7,')
    metrics.write_text(text[:-5])
    proc = run_cli(*args, "train.max_steps=3", check=False)
    assert proc.returncode == 2 and f"{metrics} has {len(text) - 5} bytes, fewer than the " \
        f"{len(text)} step_0000002 recorded" in proc.stderr, proc.stderr[-2000:]
    metrics.write_text(text + '{"step": 3, "torn')  # a crash's torn row after the save: kept
    run_cli(*args, "train.max_steps=3")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3], rows
    metrics.rename(run / "metrics.jsonl.aside")
    proc = run_cli(*args, "train.max_steps=4")
    assert f"{metrics}, recorded by step_0000003, is gone: the resumed run starts it " \
        "afresh" in proc.stdout, proc.stdout[-2000:]
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()
            if "train/loss" in line] == [4]


def test_a_short_run_that_went_wrong_does_not_end_done(tiny_checkpoints):
    """Two iterations of NaN rewards. As they are, the first iteration's non-finite score
    stops the run (exit 2) naming the metric, before iteration 1 is saved. With the
    rollout's metrics allowed to be NaN (run.allow_nonfinite) and the in-a-row guard off,
    every optimizer step is skipped: more than optimizer.max_skipped_fraction of the run's
    steps, so it exits 2 naming that setting, however short. Catches a non-finite metric
    logged and the run going on (the old behaviour: exit 0 after an evaluation's NaN), and
    skipped updates' losses judged here instead of by the skipped-step guards."""
    from conftest import WORKERS
    from test_reliability_runs import ppo_args
    out = tiny_checkpoints[0]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": WORKERS}
    nan = ["ppo.reward_checkpoint=null", "rollout.rewards.fn=rewards:nan_reward",
           # a NaN is a failed call: scored NaN here, so that it reaches the trainer's guards
           "rollout.rewards.on_error=penalty", "rollout.rewards.error_score=.nan",
           "ppo.critic_init=sft", "ppo.num_iterations=2", "checkpoint.save_interval=1",
           "optimizer.max_consecutive_skipped_steps=0"]
    proc = subprocess.run([sys.executable, "-m", "megarlhf.cli",
                           *ppo_args(tiny_checkpoints, "short-nan-metric", *nan)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "iteration 1: " in proc.stderr and "objective/score=nan is not finite" \
        in proc.stderr and "run.allow_nonfinite" in proc.stderr, proc.stderr[-2000:]
    assert "[ppo] done" not in proc.stdout
    assert not (out / "short-nan-metric" / "checkpoints" / "iter_000001").exists()
    allowed = "run.allow_nonfinite=[objective/*, rollout/*, rollout_corr/*]"
    proc = subprocess.run([sys.executable, "-m", "megarlhf.cli",
                           *ppo_args(tiny_checkpoints, "short-nan", *nan, allowed)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "optimizer steps were skipped for non-finite gradients " \
           "(optimizer.max_skipped_fraction=0.25)" in proc.stderr, proc.stderr[-2000:]
    assert "[ppo] done" not in proc.stdout


@pytest.mark.parametrize("lr", [pytest.param("5e-4", marks=pytest.mark.extended), "1e6"])
def test_a_metric_out_of_its_band_stops_the_run(tiny_checkpoints, lr):
    """PPO at optimizer.lr=1e6 for 2 iterations (the issue's run: the policy is wrecked in
    the first update, its KL from the reference jumps): with a KL band, exit 2 naming the
    metric, its band and the setting, and iteration 2 is not saved. The same band at the
    demo's learning rate lets the run finish (so the band is not what stops it)."""
    from test_reliability_runs import ppo_args
    out = tiny_checkpoints[0]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    name = f"band-lr{lr}"
    proc = subprocess.run([sys.executable, "-m", "megarlhf.cli",
                           *ppo_args(tiny_checkpoints, name, "ppo.num_iterations=2",
                                     "checkpoint.save_interval=1", f"optimizer.lr={lr}",
                                     "run.metric_bands={objective/kl: [null, 0.5], "
                                     "objective/entyropy: [0.1, null]}")],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    latest = (out / name / "checkpoints" / "latest").read_text()
    if lr == "5e-4":
        assert proc.returncode == 0 and "[ppo] done" in proc.stdout, proc.stderr[-2000:]
        assert latest == "iter_000002"
        # a misspelt band checked nothing, and says so
        assert "run.metric_bands names 'objective/entyropy', which this run never logged" \
            in proc.stdout, proc.stdout[-2000:]
        return
    assert proc.returncode == 2, proc.stderr[-2000:]
    # iteration 1 samples from the reference itself (KL 0); iteration 2 trips
    assert "iteration 2: objective/kl=" in proc.stderr and \
        "is outside its band [null, 0.5] (run.metric_bands)" in proc.stderr, proc.stderr[-2000:]
    assert "[ppo] done" not in proc.stdout
    assert latest == "iter_000001"
    assert not (out / name / "checkpoints" / "iter_000002").exists()


def test_a_supervised_run_stops_at_its_loss_band(tiny_checkpoints):
    """SFT (the supervised loop every stage but PPO runs): a train/loss band the first
    step's loss is above (a tiny model starts near log(vocab)) stops it at step 1, exit 2,
    nothing saved."""
    from conftest import run_cli
    out, task, common = tiny_checkpoints
    proc = run_cli("sft", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}",
                   "run.name=band-sft", "train.max_steps=4", "checkpoint.save_interval=1",
                   "run.metric_bands={train/loss: [null, 1.0]}", *common, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "step 1: train/loss=" in proc.stderr and "[null, 1] (run.metric_bands)" \
        in proc.stderr, proc.stderr[-2000:]
    assert not (out / "band-sft" / "checkpoints" / "latest").exists()


@pytest.mark.extended
def test_metric_bands_stop_every_rank():
    """Two ranks, a metric only rank 0 holds: both stop together (tests/workers)."""
    from conftest import WORKERS, torchrun
    proc = torchrun(os.path.join(WORKERS, "metric_bands.py"), 2, timeout=120)
    for rank in (0, 1):
        assert f"rank {rank} stopped: step 2:" in proc.stdout, proc.stdout
    assert "eval/gold_score=-2 is outside its band [-1, null]" in proc.stdout


@pytest.mark.parametrize("mode", ["on", "off"])
def test_forked_writers_die_with_a_killed_run(mode):
    """A process killed while its forked children (megatron's checkpoint writers) run: with
    signals.die_with_parent (every training CLI run installs it) they die with it instead
    of waiting forever as orphans; without, the child outlives it (so the test can fail)."""
    from conftest import WORKERS
    parent = subprocess.Popen([sys.executable, os.path.join(WORKERS, "fork_and_wait.py"),
                               mode], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.time() + 5
    while alive(child) and time.time() < deadline:
        time.sleep(0.05)
    gone = not alive(child)
    if not gone:
        os.kill(child, signal.SIGKILL)
    assert gone == (mode == "on")


def test_a_full_disk_keeps_latest_and_the_next_run_resumes(tiny_checkpoints, tmp_path):
    """A real full disk: the run directory on a 3 MiB tmpfs (a checkpoint of the tiny
    policy is about 1.8 MiB). The second save runs out of space: the run stops naming the
    device and the checkpoint `latest` still points at, leaving no partial folder; with
    room (the tmpfs grown), the same command resumes from it."""
    from conftest import run_cli
    out, task, common = tiny_checkpoints
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        why = f"cannot mount a tmpfs here ({mounted.stderr.strip()})"
        if os.environ.get("CI") and os.geteuid() == 0:  # CI runs as root: it must run here
            pytest.fail(f"{why}: in CI, as root, the full-disk test must run")
        pytest.skip(why)
    try:
        args = ["sft", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}",
                "checkpoint.save_interval=2", "checkpoint.keep_last=2", "run.name=full",
                *[c for c in common if not c.startswith("run.output_dir")],
                f"run.output_dir={disk}", "train.max_steps=4"]
        proc = run_cli(*args, check=False)
        assert proc.returncode != 0, proc.stdout[-2000:]
        assert "no space left on device at" in proc.stderr and \
            "latest is still step_0000002" in proc.stderr, proc.stderr[-2000:]
        ckpts = disk / "full" / "checkpoints"
        assert (ckpts / "latest").read_text() == "step_0000002"
        assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_0000002"]
        subprocess.run(["mount", "-o", "remount,size=32m", str(disk)], check=True)
        proc = run_cli(*args)
        assert "resumed step_0000002" in proc.stdout
        assert (ckpts / "latest").read_text() == "step_0000004"
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_a_damaged_reference_cache_starts_empty(tiny_checkpoints):
    """The reference log-prob cache saved with a PPO checkpoint, one byte changed in place
    (its checksum tells): the resume says so and starts the cache empty (it only saves
    work) instead of failing."""
    from conftest import run_cli
    from test_reliability_runs import ppo_args
    out = tiny_checkpoints[0]
    args = ppo_args(tiny_checkpoints, "torn-cache", "checkpoint.save_interval=1")
    shutil.rmtree(out / "torn-cache", ignore_errors=True)  # an earlier session's is resumed
    run_cli(*args, "ppo.num_iterations=1")
    cache = out / "torn-cache" / "checkpoints" / "iter_000001" / "ref_cache.pt"
    assert cache.exists()
    _flip_byte(cache, cache.stat().st_size // 2)  # in place: the checksum tells
    proc = run_cli(*args, "ppo.num_iterations=2")
    assert f"{cache} is damaged and cannot be read ({cache} was changed since the save" \
        in proc.stdout and \
        "the reference log-prob cache starts empty" in proc.stdout, proc.stdout[-2000:]
    assert "resumed iter_000001" in proc.stdout


@pytest.mark.extended
def test_chaos_soak_short(tmp_path):
    """bench/chaos.py's short version: a 2-process SFT hit by each kind of fault in turn
    (SIGKILL of the job, a save killed before its commit, SIGTERM, SIGSTOP of one rank),
    rerun with the same command after each, nothing cleared by hand: its metrics and final
    weights equal the uninterrupted run's bitwise, at most one step lost per fault. (The
    long soak, every stage with 20 faults: BENCHMARKS.md.)"""
    import re
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "chaos.py"),
                           "--stages", "sft", "--faults", "4", "--steps", "48",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # (a rerun may finish the 48 steps before the last fault is due)
    faults = re.search(r"(\d) faults \(kill, save, term, stop in turn\), all recovered "
                       r"without a hand: True", proc.stdout)
    assert faults and int(faults.group(1)) >= 3, proc.stdout[-3000:]
