"""A judge model as the reward (``rollout.judge``, ``roles.judge``, issue 62): its scores
against a plain loop of greedy generation (the judge converted to transformers, its chat
template applied by transformers, one sample at a time) and parsing; verdicts that do not
parse under the reward rules; its layouts against one process."""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import run_cli, torchrun
from megarlhf.data.synthetic import COLOURS, NOUNS, write_jsonl
from megarlhf.data.tool_task import question
from megarlhf.engine.metrics import read_metrics

pytestmark = pytest.mark.slow

# The tool task's SFT policy judges the policy's answers: asked the colour of the answer,
# it answers a colour or calls the tool (a verdict whose first word is "tool_call" and
# whose last, here, is "key"). The first colour scores 0 and "key" 5; any other last word
# is a verdict that does not parse - so reading the first match instead fails calls
# that parse.
TEMPLATE = 'colour of "{response}" ?'
LABELS = {COLOURS[0]: 0.0, "key": 5.0}


@pytest.fixture(scope="module")
def judged(tool_sft):
    """A config file for GRPO on the tool task's questions, single-turn, the SFT policy both
    the policy and its judge."""
    tmp = tool_sft["tmp"]
    rows = write_jsonl(str(tmp / "judge_rows.jsonl"), [
        {"messages": [{"role": "user", "content": question(noun)}]} for noun in NOUNS])
    labels = "{" + ", ".join(f"{k}: {v}" for k, v in LABELS.items()) + "}"
    config = tmp / "judge.yaml"
    config.write_text(f"""\
run: {{name: judge, seed: 3}}
parallel: {{make_vocab_size_divisible_by: 16}}
tokenizer: {{type: hf, path: {tool_sft['files']['tokenizer']}}}
data: {{train_path: {rows}, max_prompt_len: 48, max_seq_len: 96}}
optimizer: {{lr: 1.0e-3}}
ppo: {{sft_checkpoint: {tool_sft['checkpoints']}, advantage_estimator: grpo, group_size: 2,
      rollout_batch_size: 8, mini_batch_size: 16, micro_batch_size: 8, num_iterations: 1,
      missing_stop_penalty: null, clip_reward_value: 100}}
rollout:
  max_new_tokens: 24
  judge: {{template: '{TEMPLATE}', pattern: '(\\w+)', labels: {labels}, max_new_tokens: 24,
          log_verdicts: 1000}}
roles: {{judge: {{checkpoint: {tool_sft['checkpoints']}}}}}
checkpoint: {{save_interval: 0}}
logging: {{progress_bar: false, sample_table_interval: 0}}
""")
    return {"tmp": tmp, "config": str(config), "tool_sft": tool_sft}


def verdicts(run) -> list[dict]:
    return [json.loads(line) for line in open(run / "judge_verdicts.jsonl")]


def test_the_judges_scores_equal_a_plain_loop(judged):
    """rollout.rewards.on_error=penalty: every sample's verdict equals the one a plain loop
    writes - the judge converted to transformers, the template filled here and applied as
    the user's message by transformers' chat template, the model extended greedily one
    token at a time until its end token - and its score is the loop's parse (the last
    word's label); a verdict whose last word has no label is a failed call scored
    rollout.rewards.error_score and counted in reward/failed; objective/score is the mean
    of those scores. Catches a judge prompt rendered otherwise than the template and the
    chat template, verdicts of another sample (a gathered batch out of order), the wrong
    match or group read, and failures scored or counted otherwise than the reward
    rules."""
    import transformers

    tmp = judged["tmp"]
    hf_dir = tmp / "judge_hf"
    if not hf_dir.exists():
        run_cli("export", "configs/demo/tool_sft.yaml",
                f"tokenizer.path={judged['tool_sft']['files']['tokenizer']}",
                "--ckpt", judged["tool_sft"]["checkpoints"], "--out", str(hf_dir))
    run_cli("ppo", judged["config"], f"run.output_dir={tmp / 'judge_penalty'}",
            "rollout.rewards.on_error=penalty", "rollout.rewards.error_score=-5")
    run = tmp / "judge_penalty" / "judge"
    got = verdicts(run)
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir),
                                                           dtype=torch.float32).eval()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    scores = []
    for row in got:
        text = tok.apply_chat_template(
            [{"role": "user", "content": TEMPLATE.replace("{response}", row["response"])}],
            add_generation_prompt=True, tokenize=False)
        ids = tok.encode(text, add_special_tokens=False)
        new = []
        with torch.no_grad():
            for _ in range(24):
                logits = hf(torch.tensor([ids + new])).logits[0, -1, :len(tok)]
                new.append(int(logits.argmax()))
                if new[-1] == end:
                    break
        verdict = tok.decode(new[:-1] if new[-1] == end else new)
        assert row["verdict"] == verdict, row
        words = re.findall(r"(\w+)", verdict)
        want = LABELS.get(words[-1]) if words else None
        assert row["score"] == want, row
        assert (row["error"] is None) == (want is not None), row
        scores.append(-5.0 if want is None else want)
    assert len(scores) == 16
    assert any(s == -5.0 for s in scores) and any(s >= 0 for s in scores), got
    metrics = [r for r in read_metrics(str(run)) if "objective/score" in r][0]
    assert metrics["reward/failed"] == sum(s == -5.0 for s in scores)
    assert metrics["objective/score"] == pytest.approx(sum(scores) / len(scores), abs=1e-6)
    # one epoch of one mini-batch: the update at the old policy moves nothing
    assert metrics["ppo/policy/approxkl"] == 0 and metrics["ppo/policy/clipfrac"] == 0


def test_a_verdict_that_does_not_parse_stops_the_run(judged):
    """rollout.rewards.on_error=stop (the default): the run exits 2 naming the judge, the
    sample and its verdict, with no traceback."""
    proc = run_cli("ppo", judged["config"], f"run.output_dir={judged['tmp'] / 'judge_stop'}",
                   check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "the judge (roles.judge.checkpoint=" in proc.stderr
    assert "is not one of rollout.judge.labels" in proc.stderr
    assert "rollout.rewards.on_error=penalty would score such samples" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.extended
def test_the_judge_at_tp2_and_two_replicas_writes_one_process_verdicts(judged):
    """Two processes - the judge at TP=2, and at TP=1 as two replicas each answering half
    the batch - against one process: the same verdicts and scores, sample for sample.
    Catches a gathered batch out of order and TP peers that generate apart."""
    common = ("rollout.rewards.on_error=penalty", "rollout.rewards.error_score=-5")
    tmp = judged["tmp"]
    run_cli("ppo", judged["config"], f"run.output_dir={tmp / 'judge_one'}", *common)
    want = verdicts(tmp / "judge_one" / "judge")
    for name, extra in (("tp2", ["roles.judge.parallel.tensor_model_parallel_size=2"]),
                        ("dp2", [])):
        torchrun(["ppo", judged["config"], f"run.output_dir={tmp / f'judge_{name}'}",
                  *common, *extra], 2)
        got = verdicts(tmp / f"judge_{name}" / "judge")
        assert [(g["verdict"], g["score"]) for g in got] == \
            [(w["verdict"], w["score"]) for w in want], name
