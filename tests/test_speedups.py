"""The speed-ups' off switch (megarlhf/speedups): the demo-shaped PPO through the real CLI
with every speed-up, with none (plain megatron-core and torch) and without each one in
turn. Metrics must be equal bit for bit except where a speed-up changes the arithmetic
(``fused_adam``: torch's fused Adam kernel), and there within float rounding."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, run_cli

pytestmark = pytest.mark.slow
SETTINGS = ["1", "0", "-lazy_jit", "-checkpoint_queue", "-fused_adam", "-linears",
            "-positions", "-shared_prefill", "-compiled_decode"]
ROUNDING = {"0", "-fused_adam", "-positions", "-compiled_decode"}  # without torch's fused
# Adam; the head's and the last MLP's matmuls over all rows (megarlhf.speedups.positions:
# not bitwise); megatron's context decoding, not the static cache (compiled_decode)


class Runs(dict):
    """setting -> (the run's stdout, its metrics rows), each run on first use."""

    def __init__(self, tiny):
        super().__init__()
        self.tiny = tiny

    def __missing__(self, setting):
        out, task, common = self.tiny
        name = f"speedups{setting}"
        proc = run_cli("ppo", "configs/demo/ppo.yaml", f"data.train_path={task['prompts']}",
                       f"data.eval_path={task['eval_prompts']}",
                       f"ppo.sft_checkpoint={out}/sft-tiny/checkpoints/step_0000006",
                       f"roles.reference.checkpoint={out}/sft-tiny/checkpoints/step_0000003",
                       f"ppo.reward_checkpoint={out}/rm-tiny/checkpoints", *common,
                       f"run.name={name}", "ppo.num_iterations=3", "ppo.eval_interval=3",
                       "ppo.num_eval_prompts=8", "ppo.ema_decay=0.9",
                       "logging.sample_table_interval=0", "checkpoint.save_interval=2",
                       "rollout.stop_at_eos=false", env={"MEGARLHF_SPEEDUPS": setting})
        rows = [json.loads(line) for line in open(out / name / "metrics.jsonl")]
        self[setting] = (proc.stdout, rows)
        return self[setting]


@pytest.fixture(scope="module")
def runs(tiny_checkpoints):
    return Runs(tiny_checkpoints)


def comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("timing/", "perf/", "memory/"))}


# all off and one off in the fast tier; each of the others in the extended
@pytest.mark.parametrize("setting", [
    pytest.param(s, marks=() if s in ("0", "-positions") else pytest.mark.extended)
    for s in SETTINGS if s != "1"])
def test_metrics_with_and_without_each_speedup(runs, setting):
    on, off = runs["1"][1], runs[setting][1]
    assert len(on) == len(off) == 4  # the evaluation before training and 3 iterations
    for a, b in zip(on, off, strict=True):
        a, b = comparable(a), comparable(b)
        assert a.keys() == b.keys()
        if setting not in ROUNDING:
            assert a == b, {k: (a[k], b[k]) for k in a if a[k] != b[k]}
            continue
        for key, value in a.items():
            assert abs(value - b[key]) <= 1e-5 + 1e-3 * abs(value), (key, value, b[key])
    if setting in ROUNDING:  # the switch did something
        assert any(comparable(a) != comparable(b) for a, b in zip(on, off, strict=True))


def test_the_cli_says_which_speedups_run(runs):
    assert "speed-ups: all (MEGARLHF_SPEEDUPS=0 turns them off)" in runs["1"][0]
    assert "speed-ups: none (plain megatron-core and torch)" in runs["0"][0]
    assert "speed-ups: all but positions" in runs["-positions"][0]


def test_importing_megarlhf_installs_nothing_and_a_bad_setting_is_named():
    code = ("import megarlhf.stages.ppo, megarlhf.engine.checkpoint, megatron.core.jit as j, "
            "torch; from megarlhf import speedups;"
            "from megatron.core.dist_checkpointing.strategies import filesystem_async as f;"
            "print(j.jit_fuser is torch.compile, f._results_queue is None,"
            " speedups.enabled('linears'))")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                         text=True, check=True, cwd=ROOT).stdout.split()
    assert out == ["True", "True", "False"]
    bad = run_cli("config", "show", "configs/sft_tiny.yaml", check=False,
                  env={"MEGARLHF_SPEEDUPS": "linears,bogus"})
    assert bad.returncode == 2
    assert "MEGARLHF_SPEEDUPS='linears,bogus': unknown speed-up(s) bogus" in bad.stderr
    mixed = run_cli("config", "show", "configs/sft_tiny.yaml", check=False,
                    env={"MEGARLHF_SPEEDUPS": "linears,-positions"})
    assert mixed.returncode == 2 and "not both" in mixed.stderr


def test_selection_and_one_install_per_process():
    from megarlhf import speedups

    everything = frozenset(speedups.NAMES)
    assert speedups.selected(None) == speedups.selected("1") == everything
    assert speedups.selected("0") == frozenset()
    assert speedups.selected("-linears") == everything - {"linears"}
    assert speedups.selected("linears, positions") == {"linears", "positions"}
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    code = ("from megarlhf import speedups; speedups.install('0');"
            "speedups.install('1')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env=env)
    assert proc.returncode != 0 and "cannot switch" in proc.stderr
    # all of them, as the CLI installs them: lazy_jit before anything imports megatron
    code = ("from megarlhf import speedups; speedups.install('1');"
            "import megatron.core.jit as j; print(j.jit_fuser.__name__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env=env, check=True)
    assert proc.stdout.split() == ["_compile_on_first_call"]
