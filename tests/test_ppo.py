"""PPO end to end through the CLI: SFT -> reward model -> PPO on the synthetic task with a
known gold reward (a shortened demo). Other layouts against one process: test_ppo_roles.py
(TP/PP/VPP per role) and test_ppo_modes.py (DP=2)."""

import json
import os

import pytest

from conftest import run_cli
from megarlhf.data.synthetic import write_task
from megarlhf.engine.metrics import read_metrics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    out = tmp_path_factory.mktemp("ppo")
    task = write_task(str(out / "task"), seed=0)
    common = [f"tokenizer.path={task['tokenizer']}", f"run.output_dir={out}",
              "logging.progress_bar=false"]
    run_cli("sft", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}",
            "train.num_epochs=4", *common)
    run_cli("rm", "configs/rm_tiny.yaml", f"data.train_path={task['prefs']}", *common)
    ppo = ["ppo", "configs/demo/ppo.yaml", f"data.train_path={task['prompts']}",
           f"data.eval_path={task['eval_prompts']}",
           f"ppo.sft_checkpoint={out}/sft-tiny/checkpoints",
           f"ppo.reward_checkpoint={out}/rm-tiny/checkpoints", "ppo.num_iterations=12",
           "ppo.eval_interval=6", "logging.sample_table_interval=0", *common]
    return out, ppo


def curve(out, name, key):
    return {r["step"]: r[key] for r in read_metrics(os.path.join(out, name)) if key in r}


@pytest.mark.extended
def test_dpo_improves_gold_reward(pipeline):
    """DPO from the SFT policy on the synthetic task's preference pairs (one epoch, the
    reference's log-probs from the cache) raises the gold reward of greedy samples."""
    out, ppo = pipeline
    task = str(out / "task")
    run_cli("dpo", "configs/dpo_tiny.yaml", f"data.train_path={task}/prefs.jsonl",
            f"checkpoint.load={out}/sft-tiny/checkpoints", f"tokenizer.path={task}/tok.model",
            f"run.output_dir={out}", "logging.progress_bar=false", "train.eval_interval=0",
            f"dpo.gold_eval_path={task}/eval_prompts.jsonl", "rollout.max_new_tokens=10",
            "dpo.gold_reward_fn=megarlhf.data.synthetic:gold_reward_pair")
    gold = curve(out, "dpo-tiny", "eval/gold_score")
    first, last = gold[min(gold)], gold[max(gold)]
    assert last > first + 0.3, gold


def test_ppo_improves_gold_reward(pipeline):
    out, ppo = pipeline
    proc = run_cli(*ppo, "run.name=ppo1")
    gold = curve(out, "ppo1", "eval/gold_score")
    assert gold[12] > gold[0] + 1.0, gold  # SFT policy -> after 12 PPO iterations
    records = read_metrics(os.path.join(out, "ppo1"))
    last = records[-1]
    for key in ("objective/score", "objective/kl", "objective/kl_coef", "objective/entropy",
                "ppo/policy/loss", "ppo/policy/approxkl", "ppo/policy/clipfrac",
                "ppo/val/loss", "ppo/val/clipfrac", "ppo/val/explained_var",
                "rollout/response_len_mean", "rollout/eos_fraction",
                "rollout/logprob_diff_mean", "timing/rollout", "timing/reshard",
                "timing/experience", "timing/train", "timing/iteration",
                "perf/tokens_per_s", "perf/samples_per_s"):
        assert key in last, key
    assert last["rollout/logprob_diff_mean"] < 1e-4
    assert "[ppo] done" in proc.stdout
    plot = run_cli("plot", str(out / "ppo1"))
    assert os.path.getsize(out / "ppo1" / "curves.png") > 10_000 and "curves.png" in plot.stdout
    json.dumps(last)
