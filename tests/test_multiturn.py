"""Multi-turn rollouts with an environment (``rollout.environment.name``, issue 42): episodes
kept as tokens, the loss on the model's tokens only, per-turn rewards in the targets, the
no-op update, resume, layouts, and environments that fail."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from conftest import ROOT, WORKERS, run_cli, torchrun
from megarlhf import algos
from megarlhf.data.synthetic import COLOURS, NOUNS, write_jsonl
from megarlhf.data.tool_task import LOOKUP, TEMPLATE, write_tool_task

ENV = {"PYTHONPATH": os.pathsep.join([WORKERS, os.environ.get("PYTHONPATH", "")])}


def answer_of(noun: str) -> str:
    """The test rows' colour of a noun: known from the prompt, so the test can say what
    the environment answers without asking it."""
    return COLOURS[(NOUNS.index(noun) + 1) % len(COLOURS)]


@pytest.fixture(scope="module")
def task(tool_sft):
    """The tool task, its rows with a colour the test can compute, and a tiny SFT policy
    that calls the tool some of the time (conftest.tool_sft)."""
    tmp, files = tool_sft["tmp"], dict(tool_sft["files"])
    rows = [{"noun": n, "answer": answer_of(n)} for n in NOUNS]
    files["rows"] = write_jsonl(str(tmp / "task" / "known_rows.jsonl"), rows)
    common = ["configs/demo/tool_grpo.yaml", f"tokenizer.path={files['tokenizer']}",
              f"data.train_path={files['rows']}", "data.eval_path=null",
              f"ppo.sft_checkpoint={tmp}/tool-sft/checkpoints", "checkpoint.resume=false",
              "logging.progress_bar=false", "logging.sample_table_interval=0",
              "ppo.rollout_batch_size=4", "ppo.group_size=2", "ppo.mini_batch_size=8",
              "ppo.micro_batch_size=8", "optimizer.lr=1e-3"]
    return {"tmp": tmp, "files": files, "common": common}


def metrics(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def ppo(task, name: str, *extra: str, check: bool = True):
    out = task["tmp"] / name
    return run_cli("ppo", *task["common"], f"run.output_dir={out}", *extra, check=check,
                   env=ENV), out / "tool-grpo"


def test_episode_tokens_are_the_turns_as_sampled_and_as_the_template_renders(task):
    """A batch waiting in a checkpoint (ppo.max_staleness=1): each episode's text is the
    conversation transformers renders from its turns - the model's turns as it wrote
    them, the tool's answers the environment gives (computed here from the noun) - the
    observations are encoded as text in one piece, every model turn but a cut last one
    ends with <|im_end|>; the sampler's log-probs equal the trainer's over the model's
    tokens (so the mask skips the observations, whose sampler log-prob is 0); the trained
    tokens per sample are the model's. Catches re-tokenized turns, an observation
    rendered otherwise than the template, observations in the loss, and misplaced
    tokens."""
    import transformers

    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(task["files"]["tokenizer"], "tokenizer.json"),
        chat_template=TEMPLATE, eos_token="<|im_end|>", pad_token="<pad>")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    _, out = ppo(task, "tokens", "ppo.num_iterations=3", "ppo.max_staleness=1",
                 "checkpoint.save_interval=1", "checkpoint.keep_last=3",
                 "ppo.rollout_batch_size=8", "ppo.mini_batch_size=16")
    rows = metrics(out / "metrics.jsonl")
    assert rows[1]["rollout/logprob_diff_max"] < 1e-4, rows[1]  # (the next: one update old)
    gens = [torch.load(out / "checkpoints" / f"iter_00000{i}" / "rollout_queue.pt",
                       weights_only=True)["batches"][str(i)]["gen"] for i in (1, 2)]
    multi = 0
    for i, gen in enumerate(gens, 1):
        obs_mask, mask = gen["observation_BT"], gen["fed_mask_BT"]
        model_tokens = float((mask - obs_mask).sum()) / mask.shape[0]
        assert rows[i + 1]["rollout/response_len_mean"] == pytest.approx(model_tokens,
                                                                         abs=1e-9)
        multi += _check_episodes(gen, tok, end)
    assert multi >= 2  # episodes with a tool call and its answer


def test_kv_kept_across_turns_plays_the_episodes_that_re_prefilling_does(task):
    """The same run with the episodes' keys and values kept across their turns
    (speedups.turn_kv, the default) and with every turn prefilling its whole conversation
    again (MEGARLHF_SPEEDUPS=-turn_kv): the batches sampled are the same episodes - tokens,
    fed and observation masks exactly - with the sampler's log-probs within 1e-5, and
    both runs' sampler log-probs agree with the trainer's. Catches a turn fed the wrong
    tokens (a stop token or an observation missing from the cache or fed twice), columns
    of another row or turn in a row's attention, and rotary positions counted by column
    rather than by the row's own tokens."""
    runs = {}
    for name, env in (("kept", {}), ("again", {"MEGARLHF_SPEEDUPS": "-turn_kv"})):
        out = task["tmp"] / f"turn_kv_{name}"
        run_cli("ppo", *task["common"], f"run.output_dir={out}", "ppo.num_iterations=3",
                "ppo.max_staleness=1", "checkpoint.save_interval=1", "checkpoint.keep_last=3",
                "ppo.rollout_batch_size=8", "ppo.mini_batch_size=16",
                env={**ENV, **env})
        run = out / "tool-grpo"
        runs[name] = (metrics(run / "metrics.jsonl"), [
            torch.load(run / "checkpoints" / f"iter_00000{i}" / "rollout_queue.pt",
                       weights_only=True)["batches"][str(i)]["gen"] for i in (1, 2)])
    (rows, kept), (rows_again, again) = runs["kept"], runs["again"]
    # the planner counts the kept cache: the replica's 16 episodes x its columns
    from megarlhf.config import load_config
    from megarlhf.memory.plan import plan_ppo
    cfg = load_config(os.path.join(ROOT, "configs/demo/tool_grpo.yaml"), [*task["common"][1:],
                                                      "ppo.rollout_batch_size=8"])
    planned = plan_ppo(cfg, 1).phase_max()["rollout"][("inference", "kv_cache")]
    assert rows[1]["memory/rollout/inference/kv_cache"] == pytest.approx(planned / 2**20,
                                                                          rel=1e-9)
    for a, b in zip(kept, again, strict=True):
        for key in ("response_tokens_BT", "fed_mask_BT", "observation_BT", "prompt_tokens_BP"):
            assert torch.equal(a[key], b[key]), key
        assert (a["logprobs_BT"] - b["logprobs_BT"]).abs().max() < 1e-5
    assert max(r.get("rollout/turns_mean", 0) for r in rows) > 1.0
    assert rows[1]["rollout/logprob_diff_max"] < 1e-4
    assert rows_again[1]["rollout/logprob_diff_max"] < 1e-4


def test_dynamic_sampling_refills_with_episodes(task):
    """DAPO's dynamic sampling on the tool task: groups whose episodes all scored alike are
    dropped and refilled by further rounds of episodes (data rows played, not single-turn
    prompts: a refill round happens), and the merged batch keeps its size and the
    episodes' observation masks and turn rewards. (Which groups are kept is tested on
    single-turn batches: tests/test_ppo_modes.py.) Catches refills sampled as plain
    prompts and merged batches that lose the episodes' observations or rewards."""
    _, out = ppo(task, "dynamic", "ppo.num_iterations=2", "ppo.dynamic_sampling=true",
                 "ppo.max_sampling_rounds=3", "ppo.max_staleness=1",
                 "checkpoint.save_interval=1", "checkpoint.keep_last=2")
    rows = metrics(out / "metrics.jsonl")[1:]
    assert all(r["rollout/dynamic_sampling_rounds"] >= 1 for r in rows)
    assert any(r["rollout/dynamic_sampling_rounds"] > 1 for r in rows), rows
    gen = torch.load(out / "checkpoints" / "iter_000001" / "rollout_queue.pt",
                     weights_only=True)["batches"]["1"]["gen"]
    assert gen["observation_BT"] is not None and gen["env_rewards_BT"] is not None
    assert gen["response_tokens_BT"].shape[0] == 4 * 2  # rollout_batch_size x group_size
    assert float(gen["observation_BT"].sum()) > 0  # tool answers kept in the merged batch


def _check_episodes(gen: dict, tok, end: int) -> int:
    """The checks of the test above on one batch; returns its episodes of several turns."""
    obs_mask, mask = gen["observation_BT"], gen["fed_mask_BT"]
    multi = 0
    for b in range(mask.shape[0]):
        prompt = gen["prompt_tokens_BP"][b][gen["prompt_mask_BP"][b].bool()].tolist()
        n = int(mask[b].sum())
        response = gen["response_tokens_BT"][b, :n].tolist()
        kinds = obs_mask[b, :n].tolist()
        assert (mask[b, n:] == 0).all() and (obs_mask[b, n:] == 0).all()
        noun = re.search(r'colour of "(\w+)"', tok.decode(prompt)).group(1)
        segments = []  # (is the environment's, tokens)
        for token, kind in zip(response, kinds):
            if not segments or segments[-1][0] != kind:
                segments.append((kind, []))
            segments[-1][1].append(token)
        assert segments[0][0] == 0 and segments[-1][0] == 0  # model first and last
        conv = [{"role": "user", "content": f'colour of "{noun}" ?'}]
        assert prompt == tok.encode(tok.apply_chat_template(
            conv, tools=[LOOKUP], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False)
        for k, (kind, seg) in enumerate(segments):
            if kind == 1:
                text = tok.decode(seg)
                assert seg == tok.encode(text, add_special_tokens=False)
                continue
            last = k == len(segments) - 1
            assert seg[-1] == end or last, (b, tok.decode(seg))
            text = tok.decode(seg[:-1] if seg[-1] == end else seg)
            conv.append({"role": "assistant", "content": text})
            if not last:
                call = re.fullmatch(r'<tool_call>(.*)</tool_call>', text)
                key = json.loads(call.group(1))["arguments"].get("key") if call else None
                conv.append({"role": "tool", "content": answer_of(noun) if key == noun
                             else "unknown key"})
        multi += len(segments) > 1
        if response[-1] != end:
            continue  # a cut last turn: no end-of-turn to render
        rendered = tok.apply_chat_template(conv, tools=[LOOKUP], tokenize=False)
        assert tok.decode(prompt + response) + "\n" == rendered, (b, conv)
    return multi


@pytest.mark.parametrize("loss", ["ppo", "lora",
                                  pytest.param("decoupled", marks=pytest.mark.extended),
                                  pytest.param("truncated_is", marks=pytest.mark.extended)])
def test_the_update_at_the_old_policy_is_a_no_op_and_a_moved_one_clips(task, loss):
    """One mini-batch, one epoch: the update's ratio is exactly 1 on every model token
    (approxkl and clipfrac exactly 0) - with the clipped loss, with LoRA adapters on the
    actor (its reference the actor with them off), the decoupled loss (its behaviour
    log-probs the sampler's, its weights 1 to float noise: the sampler's log-probs are the
    trainer's) and truncated importance weights. Three epochs at a tight clip: the policy
    moved and clips. Catches old or behaviour log-probs taken from other tokens or
    positions than the update reads (the environment's tokens shifting them); with LoRA,
    episodes sampled without the adapters (the sampler's log-probs then differ from the
    actor's) and a reference that scores with them (no KL once they moved)."""
    extra = {"ppo": [], "decoupled": ["ppo.policy_loss=decoupled", "ppo.correction.behavior_weight_cap=5"],
             "truncated_is": ["ppo.correction.is_cap=2.0"],
             "lora": ["model.lora.rank=4", "model.lora.alpha=8"]}[loss]
    proc, out = ppo(task, f"noop_{loss}", "ppo.num_iterations=2", "ppo.ppo_epochs=1",
                    "ppo.rollout_batch_size=8", "ppo.mini_batch_size=16", *extra)
    rows = metrics(out / "metrics.jsonl")[1:]
    for r in rows:
        assert r["ppo/policy/approxkl"] == 0.0 and r["ppo/policy/clipfrac"] == 0.0, r
        if loss == "decoupled":
            assert r["ppo/policy/behavior_weight"] == pytest.approx(1.0, abs=1e-5), r
    assert max(r["rollout/turns_mean"] for r in rows) > 1.0
    if loss == "lora":
        assert "reference the actor's model with its LoRA adapters off" in proc.stdout
        assert all(r["rollout/logprob_diff_max"] < 1e-5 for r in rows)
        assert rows[0]["objective/kl"] == 0.0 < rows[-1]["objective/kl"]
    if loss != "ppo":
        return
    _, out = ppo(task, "moved", "ppo.num_iterations=1", "ppo.ppo_epochs=3",
                 "ppo.clip_eps=0.02", "optimizer.lr=3e-3")
    r = metrics(out / "metrics.jsonl")[1]
    assert r["ppo/policy/approxkl"] > 0 and r["ppo/policy/clipfrac"] > 0, r


@pytest.mark.extended
def test_resume_in_the_middle_equals_the_uninterrupted_run(task):
    """GAE with a critic and a reward per tool call (workers.envs.Reward2ndTurn): three
    iterations in one go against two, then a resume for the third - every metric of the
    third equal. Catches episode state or seeds that depend on the process's history."""
    gae = ["ppo.advantage_estimator=gae", "ppo.critic_init=sft", "ppo.group_size=1",
           "ppo.rollout_batch_size=8", "rollout.environment.name=envs:Reward2ndTurn",
           "checkpoint.save_interval=1"]
    _, whole = ppo(task, "whole", *gae, "ppo.num_iterations=3")
    _, cut = ppo(task, "cut", *gae, "ppo.num_iterations=2")
    run_cli("ppo", *task["common"], f"run.output_dir={task['tmp'] / 'cut'}", *gae,
            "ppo.num_iterations=3", "checkpoint.resume=true", env=ENV)
    a, b = metrics(whole / "metrics.jsonl")[-1], metrics(cut / "metrics.jsonl")[-1]
    assert a["step"] == b["step"] == 3
    keep = [k for k in a if not k.startswith(("timing/", "perf/", "memory/"))]
    assert {k: a[k] for k in keep} == {k: b[k] for k in keep}
    assert max(r.get("rollout/turns_mean", 0) for r in metrics(whole / "metrics.jsonl")) > 1


@pytest.mark.extended
def test_rollout_tp2_and_two_replicas_play_the_same_episodes(task):
    """Two processes - the rollout at TP=2 (the leader runs the episodes and hands each
    step to its peer), two TP=1 replicas, split placement (one process samples the
    episodes, one trains) and the actor at PP=2 - and one process packing its
    micro-batches, against one padded process: the same episodes
    (score, turns, observation tokens exactly) and the same update (losses to float
    noise). Catches TP peers that disagree on an observation, and replicas that play
    other rows or seeds."""
    one = task["tmp"] / "layout1"
    run_cli("ppo", *task["common"], f"run.output_dir={one}", "ppo.num_iterations=1", env=ENV)
    ref = metrics(one / "tool-grpo" / "metrics.jsonl")[1]
    for name, extra in (("tp2", ["rollout.tensor_parallel_size=2",
                                 "parallel.tensor_model_parallel_size=2"]),
                        ("dp2", ["ppo.micro_batch_size=4"]),
                        ("split", ["rollout.placement.mode=split", "rollout.placement.ranks=1"]),
                        ("pp2", ["parallel.pipeline_model_parallel_size=2"])):
        out = task["tmp"] / f"layout_{name}"
        torchrun(["ppo", *task["common"], f"run.output_dir={out}", "ppo.num_iterations=1",
                  *extra], 2, env=ENV)
        got = metrics(out / "tool-grpo" / "metrics.jsonl")[1]
        for key in ("objective/score", "rollout/turns_mean", "rollout/observation_tokens_mean",
                    "rollout/response_len_mean"):
            assert got[key] == ref[key], (name, key)
        for key in ("ppo/policy/loss", "objective/kl", "objective/entropy"):
            assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (name, key)
    packed = task["tmp"] / "layout_packed"
    run_cli("ppo", *task["common"], f"run.output_dir={packed}", "ppo.num_iterations=1",
            "ppo.max_tokens_per_micro_batch=512", env=ENV)
    got = metrics(packed / "tool-grpo" / "metrics.jsonl")[1]
    assert got["rollout/turns_mean"] == ref["rollout/turns_mean"]
    assert got["objective/score"] == ref["objective/score"]
    for key in ("ppo/policy/loss", "objective/kl", "objective/entropy"):
        assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), ("packed", key)


@pytest.mark.parametrize("fail,mode,expect", [
    ("raise", "stop", "raised ConnectionError: the sandbox is gone"),
    ("nonsense", "stop", "step() must return (observation, reward, done)"),
    ("raise", "penalty", "failed"),
    ("hang", "penalty", "timeouts"),
    ("exit", "penalty", "failed"),
    ("reset", "penalty", "raised KeyError: 'no such task' - and no episode of the batch "
                         "reached its first turn"),
])
def test_an_environment_that_fails(task, fail, mode, expect):
    """workers.envs.Failing on every row: stop exits 2 naming the environment, the sample
    and the error, after no iteration was logged; penalty scores the episodes
    rollout.rewards.error_score, counts them, and the run completes (a hang costs
    rollout.rewards.timeout_s, a process that exits is replaced) - unless no episode of
    the batch started (every reset failed): nothing to learn from, it stops either way."""
    rows = write_jsonl(str(task["tmp"] / f"fail_{fail}.jsonl"),
                       [{"noun": n, "answer": answer_of(n), "fail": fail} for n in NOUNS])
    extra = [f"data.train_path={rows}", "rollout.environment.name=envs:Failing",
             "ppo.num_iterations=1", f"rollout.rewards.on_error={mode}",
             "rollout.rewards.timeout_s=2"]
    if mode == "penalty":
        extra.append("rollout.rewards.error_score=-2")
    proc, out = ppo(task, f"fail_{fail}_{mode}", *extra,
                    check=mode == "penalty" and fail != "reset")
    if mode == "stop" or fail == "reset":  # (no episode started: a stop in either mode)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "rollout.environment.name=envs:Failing: sample" in proc.stderr
        assert expect in proc.stderr and "Traceback" not in proc.stderr
        return
    r = metrics(out / "metrics.jsonl")[1]
    assert r[f"reward/{expect}"] >= 1, r
    assert r["objective/score"] < 0  # the penalties (every row fails once it is stepped)


# ------------------------------------------------------------------ the arithmetic

def _compressed(x, mask):
    return [[v for v, m in zip(row, mrow) if m] for row, mrow in zip(x.tolist(), mask.tolist())]


def test_gae_and_returns_skip_the_environments_tokens():
    """GAE and the discounted returns over a mask with gaps equal a plain loop over the
    model's tokens alone (the gaps removed). Catches an observation token that decays
    the advantage or bootstraps a value."""
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0, 0], [1, 0, 1, 1, 0, 1, 0, 0, 0.]])
    rewards, values = torch.randn(2, 9), torch.randn(2, 9)
    adv, ret = algos.gae(rewards, values, mask, 0.9, 0.8)
    disc = algos.discounted_returns(rewards, mask, 0.9)
    for b, (r, v) in enumerate(zip(_compressed(rewards, mask), _compressed(values, mask))):
        a, g, last, run = [0.0] * len(r), [0.0] * len(r), 0.0, 0.0
        for t in reversed(range(len(r))):
            nxt = v[t + 1] if t + 1 < len(r) else 0.0
            last = r[t] + 0.9 * nxt - v[t] + 0.9 * 0.8 * last
            a[t] = last
            run = r[t] + 0.9 * run
            g[t] = run
        assert _compressed(adv, mask)[b] == pytest.approx(a, abs=1e-6)
        assert _compressed(ret, mask)[b] == pytest.approx([x + y for x, y in zip(a, v)],
                                                          abs=1e-6)
        assert _compressed(disc, mask)[b] == pytest.approx(g, abs=1e-6)
    assert (adv[mask == 0] == 0).all() and (disc[mask == 0] == 0).all()


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp", "gae"])
def test_turn_rewards_reach_every_estimator(estimator):
    """A reward on an earlier turn: GRPO and RLOO see it in the sequence reward (its
    sum), REINFORCE++ and GAE where it fell - the same as a batch whose score already
    holds it (sequence estimators), or whose per-token rewards do (token estimators).
    Catches turn rewards dropped from any estimator."""
    mask = torch.tensor([[1, 1, 0, 1, 1.], [1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 1, 1, 1]])
    turns = torch.zeros(4, 5)
    turns[0, 1], turns[2, 0] = 0.5, -0.25
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0])
    zeros = torch.zeros(4, 5)
    common = dict(logprobs_BT=zeros, ref_logprobs_BT=zeros, values_BT=torch.rand(4, 5),
                  mask_BT=mask, kl_estimator="k1", kl_coef=0.0, clip_reward_value=None,
                  whiten_rewards=False, whiten_unbiased=True, estimator=estimator, gamma=1.0,
                  lam=0.95, group_size=4, whiten_advantages=False, group_norm="sequence")
    got = algos.learning_targets(scores_B=scores, turn_rewards_BT=turns, **common)
    if estimator in ("grpo", "rloo"):
        want = algos.learning_targets(scores_B=scores + turns.sum(1), **common)
        assert torch.allclose(got["advantages_BT"], want["advantages_BT"])
    else:
        assert torch.allclose(got["rewards_BT"],
                              algos.learning_targets(scores_B=scores, **common)["rewards_BT"]
                              + turns)
    without = algos.learning_targets(scores_B=scores, **common)
    assert not torch.allclose(got["advantages_BT"], without["advantages_BT"])


def test_worker_environments_keep_episodes_and_fail_one_call_at_a_time(monkeypatch):
    """Episodes stay in their process (e mod N); a call that hangs is cut at the timeout
    and fails, the other episodes of that process fail as lost, the other process's go
    on; the next reset gets a fresh process."""
    from megarlhf.rewards.environments import WorkerEnvs
    from megarlhf.rewards.verifiers import Failure

    monkeypatch.syspath_prepend(WORKERS)
    host = WorkerEnvs("envs:Failing", workers=2, timeout_s=1.0)
    try:
        rows = [{"noun": "cat", "answer": "red", "fail": f} for f in ("hang", None, None, None)]
        got = host.call([(e, "reset", row) for e, row in enumerate(rows)])
        assert [g["messages"][0]["content"] for g in got] == ['colour of "cat" ?'] * 4
        assert got[0]["tools"][0]["function"]["name"] == "lookup"
        turn = {"text": "red", "tool_calls": [], "index": 0}
        got = host.call([(e, "step", turn) for e in range(4)])
        assert got[1] == [[], 1.0, True] and got[3] == [[], 1.0, True]
        assert isinstance(got[0], Failure) and got[0].kind == "timeout"
        assert isinstance(got[2], Failure) and "replaced" in got[2].message  # lost with it
        # episode 2 again, in a fresh process
        assert host.call([(2, "reset", rows[2])])[0]["messages"]
        assert host.call([(2, "step", turn)]) == [[[], 1.0, True]]
    finally:
        host.close()


def test_a_tools_column_renders_as_transformers_does(tmp_path):
    """A ``tools`` column (JSON text, or a list) in SFT, prompt and preference rows reaches
    the chat template's tools variable: the texts equal transformers' apply_chat_template(...,
    tools=...), the trained tokens are the assistant's; a malformed tools value names its
    row and column. Catches a tools column read but not rendered, or rendered only for
    some kinds of row."""
    import transformers

    from megarlhf.config import DataConfig, TokenizerConfig
    from megarlhf.data.datasets import episode_rows, tokenize_dataset
    from megarlhf.data.tokenizer import load_tokenizer

    files = write_tool_task(str(tmp_path / "t"), num_sft=12)
    tok = load_tokenizer(TokenizerConfig(type="hf", path=files["tokenizer"]))
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(files["tokenizer"], "tokenizer.json"),
        chat_template=TEMPLATE, eos_token="<|im_end|>", pad_token="<pad>")
    data = DataConfig(max_prompt_len=64, max_seq_len=128)
    rows = [json.loads(line) for line in open(files["sft"])]
    ds = tokenize_dataset(files["sft"], "sft", data, tok)
    examples = list(ds.examples())
    assert len(rows) == len(examples) == 12, (len(rows), len(examples))
    for row, (tokens, weights) in zip(rows, examples, strict=True):
        want = hf.apply_chat_template(row["messages"], tools=json.loads(row["tools"]),
                                      tokenize=False)
        assert tok.decode(tokens) == want and "tools: lookup" in want
        trained = tok.decode([t for t, w in zip(tokens[1:], weights) if w])
        assert trained.replace("<|im_end|>\n", "") == "".join(
            m["content"] + "".join(f'<tool_call>{{"name": "lookup", "arguments": '
                                   f'{json.dumps(c["function"]["arguments"])}}}</tool_call>'
                                   for c in m.get("tool_calls", []))
            for m in row["messages"] if m["role"] == "assistant")
    prompts = tmp_path / "prompts.jsonl"
    write_jsonl(str(prompts), [{"messages": row["messages"][:1], "tools": [LOOKUP]}
                               for row in rows[:3]] + [{"messages": rows[3]["messages"][:1]}])
    got = tokenize_dataset(str(prompts), "prompt", data, tok).prompts
    for row, prompt, tools in zip(rows, got, [[LOOKUP]] * 3 + [None]):
        assert prompt == hf.encode(hf.apply_chat_template(
            row["messages"][:1], tools=tools, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False)
    assert "tools:" not in tok.decode(got[3])
    pairs = tmp_path / "pairs.jsonl"
    user = rows[0]["messages"][:1]
    write_jsonl(str(pairs), [{"chosen": user + [{"role": "assistant", "content": "red"}],
                              "rejected": user + [{"role": "assistant", "content": "blue"}],
                              "tools": [LOOKUP]}])
    pref = tokenize_dataset(str(pairs), "preference", data, tok)
    assert pref.prompts[0] == hf.encode(hf.apply_chat_template(
        user, tools=[LOOKUP], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False)
    assert tok.decode(pref.chosen[0]) == "red<|im_end|>\n"
    for bad, match in (("not json", "tools is not valid JSON"),
                       ([{"type": "function"}], "tool 0 must be a JSON schema with a 'name'"),
                       ({"name": "x"}, "tools must be a list")):
        write_jsonl(str(prompts), [{"messages": rows[0]["messages"][:1], "tools": bad}])
        with pytest.raises(ValueError, match=f"row 1 column 'tools': {re.escape(match)}"):
            tokenize_dataset(str(prompts), "prompt", data, tok)
        with pytest.raises(ValueError, match=f"row 1 column 'tools': {re.escape(match)}"):
            episode_rows(str(prompts), data)


# each estimator's settings on the tool task (configs/demo/tool_grpo.yaml, the task
# fixture's settings, a reward of 0.25 per tool call on top of the final one, and these)
TRACED = {
    "grpo": {},
    "rloo": {"ppo.advantage_estimator": "rloo"},
    "reinforce_pp": {"ppo.advantage_estimator": "reinforce_pp", "ppo.group_size": "1",
                     "ppo.rollout_batch_size": "8", "ppo.gamma": "0.9"},
    "gae": {"ppo.advantage_estimator": "gae", "ppo.group_size": "1",
            "ppo.rollout_batch_size": "8", "ppo.critic_init": "sft", "ppo.gamma": "0.9",
            "ppo.lam": "0.8", "ppo.whiten_rewards": "true"},
}


def traced_overrides(task, folder, name) -> list[str]:
    settings = dict(o.split("=", 1) for o in task["common"][1:])
    settings.update({"run.output_dir": str(folder),
                     "rollout.environment.name": "envs:Reward2ndTurn", **TRACED[name]})
    return [f"{k}={v}" for k, v in settings.items()]


@pytest.fixture(scope="module")
def traced_episodes(task):
    """One traced iteration (tests/workers/ppo_trace.py) per estimator: {estimator:
    (its trace, its config)}."""
    from megarlhf.config import load_config

    folder = task["tmp"] / "traced"
    folder.mkdir(exist_ok=True)
    cases = {name: {"config": task["common"][0],
                    "overrides": traced_overrides(task, folder, name)} for name in TRACED}
    (folder / "cases.json").write_text(json.dumps(cases))
    torchrun(os.path.join(WORKERS, "ppo_trace.py"), 1, str(folder / "cases.json"),
             str(folder), env={**ENV, "MEGARLHF_TRACE_CASES": ""})  # (the PPO reference's)
    return {name: (torch.load(folder / f"{name}.pt", weights_only=False)["iterations"][0],
                   load_config(case["config"], case["overrides"]))
            for name, case in cases.items()}


@pytest.mark.parametrize("estimator", list(TRACED))
def test_multi_turn_experience_against_plain_loops(traced_episodes, estimator):
    """A real multi-turn iteration's experience recomputed from the episode itself: the
    trained mask is the model's tokens (the environment's out), the score is the last
    turn's reward at the episode's last model token and every earlier turn's reward sits
    at its turn's last token; KL, rewards, advantages and returns equal the plain loops
    run over each episode's model tokens alone (the observations between turns removed),
    for every estimator. Catches an observation token trained, a turn reward dropped or
    misplaced, an estimator that decays or bootstraps across an observation."""
    import reference_loops as loops

    run, cfg = traced_episodes[estimator]
    gen, exp = run["gen"], run["experience"]
    ppo = cfg.ppo
    assert ppo.advantage_estimator == estimator
    model = gen["fed_mask_BT"].float() * (1 - gen["observation_BT"].float())
    assert torch.equal(exp["response_mask_BT"], model)
    assert torch.equal(exp["fed_mask_BT"], gen["fed_mask_BT"])
    gaps = [row for row in loops.rows(model) if "10" in "".join(str(int(x)) for x in row)
            .rstrip("0")]
    assert gaps, "no episode with an observation between two model turns"
    # the score: the last model token's reward; the earlier turns' rewards where they fell
    env = loops.rows(gen["env_rewards_BT"])
    scores, turns = [], []
    for r, m in zip(env, loops.rows(model), strict=True):
        last = max((t for t, k in enumerate(m) if k), default=0)
        scores.append(r[last])
        turns.append([x if t != last else 0.0 for t, x in enumerate(r)])
    assert exp["scores_B"].tolist() == pytest.approx(scores, abs=1e-7)
    assert any(any(row) for row in turns), "no turn reward before an episode's last turn"
    # the learning targets over the model's tokens alone
    squeeze = lambda t: torch.tensor(loops.compress(t, model))  # noqa: E731
    want = loops.experience(
        old=squeeze(exp["old_logprobs_BT"]), ref=squeeze(exp["ref_logprobs_BT"]),
        values=squeeze(exp["values_BT"]), scores=scores,
        mask=squeeze(model), estimator=estimator, kl_estimator=ppo.kl.estimator,
        beta=run["kl_coef"] if ppo.kl_reward_on else 0.0,
        clip_reward=ppo.clip_reward_value, whiten_rewards=ppo.whiten_rewards,
        whiten_advantages=ppo.whiten_advantages, unbiased=ppo.whiten_unbiased,
        gamma=ppo.gamma, lam=ppo.lam, group_size=ppo.group_size,
        group_norm=ppo.grpo_normalization, turn_rewards=squeeze(torch.tensor(turns)))
    for key in ("kl", "rewards", "advantages", "returns"):
        got = exp[f"{key}_BT"].double()
        expect = torch.tensor(loops.expand(want[key], model), dtype=torch.float64)
        assert (got - expect).abs().max() <= 1e-5 * max(1.0, expect.abs().max()), key
    assert any(any(row) for row in want["advantages"])
