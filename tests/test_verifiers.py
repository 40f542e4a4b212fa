"""Programmatic rewards that cannot take the trainer down (``rewards.verifiers``): a reward
function in worker processes - a call that hangs, raises, kills its process or returns
NaN or a string - and a reward server on loopback that is down, slow, flaky, or answers
malformed JSON or the wrong number of rewards. End to end: the same reward through
worker processes, in the trainer's process and from a server gives the same run, and a
run whose reward calls start failing stops naming them, loses nothing, and resumes."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import ROOT, WORKERS, torchrun
from megarlhf.rewards.verifiers import (InProcess, RewardError, RewardServer, Verifier,
                                        WorkerPool)


@pytest.fixture(autouse=True)
def _fns_on_path(monkeypatch):
    monkeypatch.syspath_prepend(WORKERS)  # verifier_fns, here and in the worker processes


def score(prompt: str, response: str) -> float:
    """verifier_fns.judge's score of a well-behaved call (computed here, not called)."""
    return float(len(response)) + 0.5 * len(prompt)


PAIRS = [("ab", "ok"), ("ab", "hang"), ("c", "fine"), ("ab", "boom"), ("ab", "nan"),
         ("ab", "text"), ("ab", "die"), ("abcd", "the last one")]


def test_worker_pool_outlives_every_misbehaving_call():
    """Batches of 3 over 2 processes, 1 s per call: each failure is reported for its own
    call - the hang as a timeout after 1 s (its process killed, not waited for 5 s), the
    exception with its type and text, NaN and a string as not finite numbers, a process
    that exits as dead with its exit code - and the other calls of the same batches are
    scored, in order. The replaced processes answer the next batch."""
    pool = WorkerPool("verifier_fns:judge", workers=2, timeout_s=1.0, batch=3)
    try:
        start = time.monotonic()
        out = pool.map(PAIRS)
        took = time.monotonic() - start
        for i in (0, 2, 7):
            assert out[i] == score(*PAIRS[i]), (i, out[i])
        assert getattr(out[1], "kind", None) == "timeout", out[1]  # not waited for
        assert "rollout.rewards.timeout_s=1" in out[1].message
        assert out[3].kind == "error" and out[3].message == \
            "raised ZeroDivisionError: planted"
        assert out[4].message == "returned nan, not a finite number"
        assert out[5].message == "returned str 'great answer', not a number"
        assert "worker process died (exit code 3)" in out[6].message
        assert took < 15, took
        assert pool.map([("x", "again"), ("y", "and again")]) == [score("x", "again"),
                                                                   score("y", "and again")]
    finally:
        pool.close()


def test_a_worker_gone_between_batches_is_replaced_and_preemption_signals_are_not_theirs():
    """A preemption signal (SIGUSR1, SIGTERM: Slurm sends them to every process of the job
    step; seen to kill a worker in a two-node preemption) and Ctrl-C's SIGINT leave the
    worker processes alone; one killed while idle is replaced when the next batch comes,
    which is scored in full."""
    import signal
    pool = WorkerPool("verifier_fns:judge", workers=2, timeout_s=5.0, batch=2)
    try:
        pairs = [(f"p{i}", "y" * i) for i in range(6)]
        assert pool.map(pairs) == [score(*p) for p in pairs]
        first, second = (w.proc for w in pool.workers)
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            os.kill(first.pid, sig)
        second.kill()
        second.wait()
        time.sleep(0.2)
        assert first.poll() is None  # the signals were ignored
        assert pool.map(pairs) == [score(*p) for p in pairs]
        assert all(w.proc.poll() is None for w in pool.workers)
    finally:
        pool.close()


def test_workers_give_the_in_process_scores():
    from verifier_fns import judge
    pairs = [(f"p{i}", "x" * i) for i in range(23)]
    pool = WorkerPool("verifier_fns:judge", workers=2, timeout_s=10.0, batch=4)
    try:
        assert pool.map(pairs) == InProcess(judge).map(pairs) == [score(*p) for p in pairs]
    finally:
        pool.close()


def test_penalty_scores_and_counts_failures_and_stop_names_function_and_sample():
    from verifier_fns import judge
    pairs = [("a", "ok"), ("a", "boom"), ("a", "nan")]
    name = "rollout.rewards.fn=verifier_fns:judge"
    scores, counts = Verifier(name, InProcess(judge), "penalty", -3.0)(pairs)
    assert scores == [score("a", "ok"), -3.0, -3.0]
    assert counts == {"reward/failed": 2.0, "reward/timeouts": 0.0}
    with pytest.raises(RewardError) as err:
        Verifier(name, InProcess(judge), "stop", -1.0)(pairs)
    assert str(err.value) == (
        "rollout.rewards.fn=verifier_fns:judge: sample 1 (response 'boom'): raised "
        "ZeroDivisionError: planted (1 more of the batch's 3 failed too); the run stops "
        "(rollout.rewards.on_error=penalty would score such samples "
        "rollout.rewards.error_score=-1 instead)")
    # a function that fails every call, under penalty: counted, not stopped
    scores, counts = Verifier("f", InProcess(lambda p, r: 1 / 0), "penalty", -2.0)(pairs)
    assert scores == [-2.0] * 3 and counts["reward/failed"] == 3.0


# ------------------------------------------------------------------ a reward server

class _Handler(BaseHTTPRequestHandler):
    calls: collections.Counter = collections.Counter()

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Handler.calls[self.path] += 1
        responses = body["responses"]
        rewards = [score(p, r) for p, r in zip(body["prompts"], responses, strict=True)]
        if self.path == "/flaky" and _Handler.calls[self.path] <= 2:
            return self._reply(500, b'{"error": "busy"}')
        if self.path == "/slow":
            time.sleep(1.0)
        if self.path == "/malformed":
            return self._reply(200, b"<html>not json</html>")
        if self.path == "/short":
            rewards = rewards[:-1]
        if self.path == "/nan":
            rewards[0] = float("nan")
        self._reply(200, json.dumps({"rewards": rewards}).encode())

    def _reply(self, code: int, data: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # a client that gave up on /slow: the reply finds the socket closed


@pytest.fixture(scope="module")
def server():
    httpd = _QuietServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _server(url, timeout_s=2.0, retries=2, batch=2):
    return RewardServer(url, timeout_s, retries, batch, backoff_s=0.01)


PAIRS_OK = [("ab", "one"), ("c", "two two"), ("", "three"), ("dd", "four"), ("e", "five")]


def test_reward_server_scores_in_batches_and_retries_a_flaky_one(server):
    _Handler.calls.clear()
    assert _server(f"{server}/ok").map(PAIRS_OK) == [score(*p) for p in PAIRS_OK]
    assert _Handler.calls["/ok"] == 3  # 5 samples, 2 per request
    # two 500s, then an answer: the retries reach it
    assert _server(f"{server}/flaky", batch=8).map(PAIRS_OK) == [score(*p) for p in PAIRS_OK]
    assert _Handler.calls["/flaky"] == 3


@pytest.mark.parametrize("path, kind, message", [
    ("/slow", "timeout", "timed out"),
    ("/malformed", "error", "JSONDecodeError"),
    ("/short", "error", 'the answer is not {"rewards": [2 numbers]}'),
])
def test_reward_server_failures_are_named_and_counted(server, path, kind, message):
    url = f"{server}{path}"
    out = _server(url, timeout_s=0.3, retries=1).map(PAIRS_OK[:2])
    assert len(out) == 2, out
    assert all(f.kind == kind and message in f.message and "failed 2 times" in f.message
               for f in out), out
    # penalty: a server that fails every request of a batch is down - the run stops,
    # naming the URL
    with pytest.raises(RewardError) as err:
        Verifier(f"rollout.rewards.url={url}", _server(url, timeout_s=0.3, retries=1),
                 "penalty", -1.0, down_when_all_fail=True)(PAIRS_OK[:2])
    assert f"rollout.rewards.url={url}: sample 0" in str(err.value)
    assert "the server is down" in str(err.value)


def test_reward_server_nan_and_down(server):
    out = _server(f"{server}/nan").map(PAIRS_OK[:2])
    assert out[0].message == "returned nan, not a finite number"
    assert out[1] == score(*PAIRS_OK[1])
    with ThreadingHTTPServer(("127.0.0.1", 0), _Handler) as closed:
        port = closed.server_address[1]  # bound, then closed: nothing listens there
    url = f"http://127.0.0.1:{port}/ok"
    with pytest.raises(RewardError) as err:
        Verifier(f"rollout.rewards.url={url}", _server(url), "stop", -1.0,
                 down_when_all_fail=True)(PAIRS_OK[:1])
    assert f"rollout.rewards.url={url}: sample 0" in str(err.value)
    assert "Connection refused" in str(err.value) and "failed 3 times" in str(err.value)


# ------------------------------------------------------------------ end to end

def _ppo(tiny, name, *extra, env=None, check=True):
    from test_reliability_runs import ppo_args
    proc = subprocess.run([sys.executable, "-m", "megarlhf.cli",
                           *ppo_args(tiny, name, "ppo.reward_checkpoint=null",
                                     "ppo.critic_init=sft", "ppo.num_iterations=3",
                                     "checkpoint.save_interval=1", "ppo.eval_interval=3",
                                     *extra)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
                               "PYTHONPATH": WORKERS, **(env or {})})
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _metrics(out, name):
    from megarlhf.engine.metrics import read_metrics
    return {r["step"]: {k: v for k, v in r.items()
                        if not k.startswith(("timing/", "perf/", "memory/"))}
            for r in read_metrics(os.path.join(out, name))}


class _GoldHandler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802
        from megarlhf.data.synthetic import gold_reward_pair
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        data = json.dumps({"rewards": [gold_reward_pair(p, r) for p, r in
                                       zip(body["prompts"], body["responses"])]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.mark.slow
@pytest.mark.extended
def test_the_same_reward_from_workers_the_trainer_and_a_server_gives_the_same_run(
        tiny_checkpoints):
    """The synthetic task's gold reward as rollout.rewards.fn in 2 worker processes, in the
    trainer's process, and from a reward server on loopback: every metric equal, and
    reward/failed 0 throughout."""
    import shutil
    out = tiny_checkpoints[0]
    gold = "rollout.rewards.fn=megarlhf.data.synthetic:gold_reward_pair"
    runs = {}
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _GoldHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        for name, extra in (("verify_workers", [gold]),
                            ("verify_inproc", [gold, "rollout.rewards.workers=0"]),
                            ("verify_url", [f"rollout.rewards.url=http://127.0.0.1:"
                                            f"{httpd.server_address[1]}/score"])):
            shutil.rmtree(out / name, ignore_errors=True)
            _ppo(tiny_checkpoints, name, *extra)
            runs[name] = _metrics(out, name)
    finally:
        httpd.shutdown()
    assert sorted(runs["verify_workers"]) == [0, 1, 2, 3]
    assert runs["verify_workers"] == runs["verify_inproc"] == runs["verify_url"]
    assert all(runs["verify_url"][s]["reward/failed"] == 0.0 for s in (1, 2, 3))


@pytest.mark.slow
@pytest.mark.extended
def test_failing_reward_calls_stop_the_run_naming_them_and_it_resumes(tiny_checkpoints,
                                                                       tmp_path):
    """The reward calls start failing in iteration 3 (verifier_fns.gold_until): the run
    exits 2 naming the function, the sample and the error - no traceback - with iterations
    1-2 saved; once the cause is gone the same command resumes, and iteration 3 equals
    that of a run that never failed."""
    import shutil
    out = tiny_checkpoints[0]
    fn = ["rollout.rewards.fn=verifier_fns:gold_until", "rollout.rewards.workers=1"]
    marker = tmp_path / "marker"
    calls = tmp_path / "calls"
    per_iteration = 32  # configs/demo/ppo.yaml: 32 prompts, one sample each
    env = {"VERIFIER_MARKER": str(marker), "VERIFIER_FAIL_AFTER": str(2 * per_iteration)}
    for name in ("verify_clean", "verify_failing"):
        shutil.rmtree(out / name, ignore_errors=True)
    _ppo(tiny_checkpoints, "verify_clean", *fn, env=env)
    calls.unlink()
    marker.write_text("")
    failed = _ppo(tiny_checkpoints, "verify_failing", *fn, env=env, check=False)
    assert failed.returncode == 2, failed.stderr[-3000:]
    assert "rollout.rewards.fn=verifier_fns:gold_until: sample 0 (response " in failed.stderr
    assert "raised ConnectionError: the sandbox is gone" in failed.stderr
    assert "Traceback" not in failed.stderr
    assert (out / "verify_failing" / "checkpoints" / "latest").read_text() == "iter_000002"
    marker.unlink()
    _ppo(tiny_checkpoints, "verify_failing", *fn, env=env)
    clean, resumed = _metrics(out, "verify_clean"), _metrics(out, "verify_failing")
    assert clean[3] == resumed[3]


@pytest.mark.slow
def test_a_gold_function_failing_in_evaluation_stops_every_rank_at_once(tiny_checkpoints):
    """ppo.gold_reward_fn raises in the first evaluation, at rollout TP=2: only TP rank 0
    calls it, yet both ranks stop with its message (exit 2), well before the watchdog
    would name the rank left waiting in the next collective."""
    import shutil
    import time
    from test_reliability_runs import ppo_args
    out = tiny_checkpoints[0]
    shutil.rmtree(out / "verify_gold_tp2", ignore_errors=True)
    start = time.monotonic()
    proc = torchrun(ppo_args(tiny_checkpoints, "verify_gold_tp2", "ppo.num_iterations=1",
                             "ppo.gold_reward_fn=verifier_fns:never",
                             "rollout.tensor_parallel_size=2", "rollout.rewards.workers=0"),
                    2, env={"PYTHONPATH": WORKERS}, check=False)
    assert proc.returncode != 0
    # both ranks name it: the one that called it and the one that did not
    assert proc.stderr.count("megarlhf: error: ppo.gold_reward_fn=verifier_fns:never: "
                             "sample 0") == 2, proc.stderr[-3000:]
    assert "raised ValueError: always" in proc.stderr and "watchdog" not in proc.stderr
    assert time.monotonic() - start < 120
