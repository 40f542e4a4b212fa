"""Episodes played by agent programs through the rollout's OpenAI-compatible endpoint
(``rollout.agent``, issue 62): the official ``openai`` client over real HTTP on loopback,
episodes recorded as tokens and trained as an environment's, the API's error shapes, and
agents that fail."""

from __future__ import annotations

import glob
import json
import os
import re

import pytest
import torch

from conftest import WORKERS, run_cli, torchrun
from megarlhf.data.synthetic import COLOURS, NOUNS, write_jsonl

ENV = {"PYTHONPATH": os.pathsep.join([WORKERS, os.environ.get("PYTHONPATH", "")])}
AGENT = ["rollout.agent.entry=agents:by_row"]  # over configs/demo/tool_agent.yaml


def answer_of(noun: str) -> str:
    return COLOURS[(NOUNS.index(noun) + 1) % len(COLOURS)]


@pytest.fixture(scope="module")
def task(tool_sft):
    """The tool task's tokenizer and tiny SFT policy (conftest.tool_sft), and the
    arguments every run here shares."""
    common = [f"tokenizer.path={tool_sft['files']['tokenizer']}", "data.eval_path=null",
              f"ppo.sft_checkpoint={tool_sft['checkpoints']}", "checkpoint.resume=false",
              "logging.progress_bar=false", "logging.sample_table_interval=0",
              "ppo.group_size=2", "optimizer.lr=1e-3"]
    return {"tmp": tool_sft["tmp"], "files": tool_sft["files"], "common": common}


def rows_file(task, name: str, agents: list[str]) -> str:
    rows = [{"noun": NOUNS[i % len(NOUNS)], "answer": answer_of(NOUNS[i % len(NOUNS)]),
             "agent": agent} for i, agent in enumerate(agents)]
    return write_jsonl(str(task["tmp"] / f"{name}.jsonl"), rows)


def ppo(task, name: str, rows: str, *extra: str, check: bool = True, env=None,
        config: str = "tool_agent"):
    """``megarlhf ppo`` on configs/demo/<config>.yaml: (the process, the run's folder, the
    folder the agents wrote what they saw to)."""
    out = task["tmp"] / name
    dump = task["tmp"] / f"{name}_dump"
    dump.mkdir(exist_ok=True)
    proc = run_cli("ppo", f"configs/demo/{config}.yaml", *task["common"],
                   f"data.train_path={rows}", f"run.output_dir={out}", *extra, check=check,
                   env={**ENV, "AGENT_DUMP": str(dump), **(env or {})})
    return proc, out / config.replace("_", "-"), dump


def metrics(run) -> list[dict]:
    return [json.loads(line) for line in open(run / "metrics.jsonl")]


def queued(run, iteration: int) -> dict:
    return torch.load(run / "checkpoints" / f"iter_{iteration:06d}" / "rollout_queue.pt",
                      weights_only=True)["batches"][str(iteration)]["gen"]


def dumps(folder) -> list[dict]:
    return [json.load(open(path)) for path in sorted(glob.glob(str(folder / "*.json")))]


STALE = ["ppo.num_iterations=2", "ppo.max_staleness=1", "checkpoint.save_interval=1",
         "checkpoint.keep_last=2", "ppo.rollout_batch_size=8", "ppo.mini_batch_size=16",
         "ppo.micro_batch_size=8"]


def test_an_agent_plays_the_episodes_an_environment_plays(task):
    """The tool task played by the demo's agent program through the endpoint
    (configs/demo/tool_agent.yaml: megarlhf.data.tool_task:lookup_agent, which answers
    the tool as LookupEnv does) and by the environment itself (configs/demo/
    tool_grpo.yaml), from the same policy and seed: the batch waiting in the checkpoint
    is the same - prompts, every token, the masks of the model's and the environment's
    tokens, the rewards at each token - and so is the training on it (losses within
    1e-6). Catches re-tokenized turns or observations, a reply echoed back that is
    rendered otherwise than the environment's turn, seeds that differ from the
    environment path's, and a reward at the wrong token."""
    rows = rows_file(task, "lookup_rows", ["lookup"] * 8)
    _, env_run, _ = ppo(task, "as_env", rows, *STALE, config="tool_grpo")
    _, agent_run, _ = ppo(task, "as_agent", rows, *STALE)
    a, b = queued(env_run, 1), queued(agent_run, 1)
    for key in ("prompt_tokens_BP", "prompt_mask_BP", "response_tokens_BT", "fed_mask_BT",
                "observation_BT", "env_rewards_BT", "finished_B"):
        assert torch.equal(a[key], b[key]), key
    assert (a["logprobs_BT"] - b["logprobs_BT"]).abs().max() < 1e-5
    assert float(b["observation_BT"].sum()) > 0  # tool answers among them
    env_rows, agent_rows = metrics(env_run)[1:], metrics(agent_run)[1:]
    for key in ("objective/score", "ppo/policy/loss", "objective/kl", "ppo/policy/approxkl",
                "ppo/policy/clipfrac", "rollout/turns_mean", "rollout/tool_call_errors"):
        for x, y in zip(env_rows, agent_rows, strict=True):
            assert x[key] == pytest.approx(y[key], abs=1e-6), key


def _batch_rows(gen: dict) -> list[tuple[list[int], list[int], list[float], list[int], list]]:
    """(prompt, response, sampler log-probs, observation mask, rewards) of each row."""
    out = []
    for i in range(gen["fed_mask_BT"].shape[0]):
        n = int(gen["fed_mask_BT"][i].sum())
        out.append((gen["prompt_tokens_BP"][i][gen["prompt_mask_BP"][i].bool()].tolist(),
                    gen["response_tokens_BT"][i, :n].tolist(),
                    gen["logprobs_BT"][i, :n].tolist(),
                    gen["observation_BT"][i, :n].tolist(),
                    gen["env_rewards_BT"][i, :n].tolist()))
    return out


def _covers(record: dict, kind: str, prompt: list[int], response: list[int],
            lps: list[float]) -> list[int] | None:
    """The observation mask an agent's record implies for a batch row (1 where none of its
    requests' sampled tokens are), or None when a request's prompt is not the episode so
    far or its tokens and log-probs are not the row's."""
    requests = record["requests"][1:] if kind == "probe" else record["requests"]  # the
    # probe's second request is a retry of its first: it replaced it
    seq = prompt + response
    covered = [0] * len(response)
    for req in requests:
        start, n = len(req["prompt"]) - len(prompt), len(req["tokens"])
        if seq[:len(req["prompt"])] != req["prompt"] or response[start:start + n] != \
                req["tokens"] or lps[start:start + n] != req["logprobs"]:
            return None
        covered[start:start + n] = [1] * n
    if len(prompt) + len(covered) != len(requests[-1]["prompt"]) + len(requests[-1]["tokens"]):
        return None
    return [1 - c for c in covered]


def test_openai_clients_agents_that_misbehave_and_what_is_trained(task):
    """Agents on the official openai client, one behaviour per row (tests/workers/
    agents.py), rollout.rewards.on_error=penalty, a verifier for the agents that return
    null. Checks, on the batch waiting in the checkpoint and what each agent wrote down:

    - the API's error shapes: malformed JSON 400 (invalid_json), an unknown model 404
      (model_not_found), stream=true 400, a rewritten history 400 (not_an_extension) -
      each {"error": {"message", "type", "param", "code"}};
    - a retried request gets the same tokens and the episode records it once;
    - /v1/completions with a text prompt, a text extension and a token-id extension;
    - chat with tools: the model's calls come back as the API's tool_calls, and the
      agent's tool messages continue the episode;
    - every token and log-prob an agent received is the one the batch trains, each
      request's prompt is the episode so far, and what the agent added is masked as
      observation;
    - rewards: the agent's at its last model token, the verifier's (the last turn's
      length) for null, rollout.rewards.error_score for an agent that raised or rewrote
      its history, counted in reward/failed.

    Catches replies whose tokens or log-probs are not the trained ones, retries recorded
    twice, extensions appended wrong, errors in another shape, and failures scored or
    counted otherwise than the reward rules say."""
    import transformers

    kinds = ["probe", "complete", "rewrite", "crash", "unscored", "lookup", "lookup", "lookup"]
    rows = rows_file(task, "mixed_rows", kinds)
    # one episode per row (REINFORCE++: no groups), each agent a process of its own
    _, run, dump = ppo(task, "mixed", rows, *AGENT, "ppo.num_iterations=2",
                       "ppo.max_staleness=1", "checkpoint.save_interval=1",
                       "checkpoint.keep_last=2", "ppo.rollout_batch_size=8",
                       "ppo.advantage_estimator=reinforce_pp", "ppo.group_size=1",
                       "ppo.mini_batch_size=8", "ppo.micro_batch_size=8",
                       "rollout.rewards.on_error=penalty",
                       "rollout.rewards.fn=agents:length_of_last_turn",
                       "rollout.rewards.workers=1")
    r = metrics(run)[1]
    assert r["reward/failed"] == 2 and r["reward/timeouts"] == 0, r  # rewrite, crash
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(task["files"]["tokenizer"], "tokenizer.json"))
    batch = _batch_rows(queued(run, 1))
    assert len(batch) == 8
    by_kind: dict[str, list] = {}
    for row in batch:  # the row's noun says its agent (rows_file)
        noun = re.search(r'colour of "(\w+)"', tok.decode(row[0])).group(1)
        by_kind.setdefault(kinds[NOUNS.index(noun)], []).append(row)
    assert sorted(len(v) for v in by_kind.values()) == [1] * 5 + [3]
    records = {}
    for record in dumps(dump):
        records.setdefault(record["row"]["agent"], []).append(record)
    for kind in ("probe", "complete", "rewrite"):
        assert len(records[kind]) == 2, kind  # the two rollouts' episodes
    # tool calls through the client: parsed into tool_calls, answered, continued
    assert any(req["finish"] == "tool_calls" and len(rec["requests"]) > 1
               for rec in records["lookup"] for req in rec["requests"]), records["lookup"]
    # the API's errors
    for record in records["probe"]:
        errors = {e["what"]: e for e in record["errors"]}
        want = {"malformed": (400, "invalid_json"), "unknown model": (404, "model_not_found"),
                "stream": (400, None)}
        for what, (status, code) in want.items():
            body = errors[what]["body"]
            body = body.get("error", body)  # the client hands over the inner object
            assert errors[what]["status"] == status, (what, errors[what])
            assert set(body) == {"message", "type", "param", "code"}, (what, body)
            assert body["code"] == code and body["message"], (what, body)
        first, retry = record["requests"][:2]  # a retry: the same answer (sampled again
        # with the same seed in another batch: the log-probs to float noise)
        assert (retry["prompt"], retry["tokens"]) == (first["prompt"], first["tokens"])
        assert retry["logprobs"] == pytest.approx(first["logprobs"], abs=1e-5)
    for record in records["rewrite"]:
        assert record["errors"][0]["status"] == 400
        body = record["errors"][0]["body"]
        assert body.get("error", body)["code"] == "not_an_extension"
    # what the agents received is what is trained (the second rollout's records)
    assert any(len(rec["requests"]) == 3 for rec in records["probe"])
    for kind in ("probe", "complete", "rewrite", "lookup"):
        for prompt, response, lps, obs, rewards in by_kind[kind]:
            # the record of this episode: its requests cover the model's tokens exactly
            # (two episodes of a group may be the same tokens, their log-probs from other
            # batches: the one whose log-probs are these)
            found = [rec for rec in records[kind]
                     if _covers(rec, kind, prompt, response, lps) == obs]
            assert found, (kind, tok.decode(prompt + response))
            want_reward = -1.0 if kind == "rewrite" else found[0]["reward"]
            last = max(t for t in range(len(obs)) if obs[t] == 0)
            assert rewards[last] == want_reward and sum(rewards) == want_reward, kind
            requests = found[0]["requests"]
            if kind == "complete" and len(requests) == 3:
                one, two, three = requests
                assert two["prompt"][:len(one["prompt"]) + len(one["tokens"])] == \
                    one["prompt"] + one["tokens"]  # the stop token kept
                assert three["prompt"] == two["prompt"] + two["tokens"] + one["prompt"][-3:]
    assert any(len(rec["requests"]) == 3 for rec in records["complete"])
    for _, response, _, obs, rewards in by_kind["crash"]:
        assert sum(rewards) == -1.0 and response and not any(obs)
    for prompt, response, _, obs, rewards in by_kind["unscored"]:
        text = tok.decode(response[:-1] if response[-1] == tok.convert_tokens_to_ids(
            "<|im_end|>") else response)
        assert sum(rewards) == float(len(text)) and rewards[-1] == float(len(text))


def test_silent_and_unscored_agents_and_a_stop_with_a_command_agent(task):
    """The agents as a command (rollout.agent.command: tests/workers/agents.py run as a
    program, its own print before its reward line), on the standard library's client so
    they start at once. rollout.rewards.on_error=penalty: an agent silent past
    rollout.rewards.timeout_s is killed and counted in reward/timeouts, one that returns
    null with no verifier fails (reward/failed), and both score error_score. on_error=stop:
    the run exits 2 naming the agent, the sample and why, with no traceback of megarlhf's
    own. Catches a hung agent that holds the rollout, a null reward taken as 0, and
    failures that stop or score otherwise than the rules say."""
    import sys

    command = f"{sys.executable} {os.path.join(WORKERS, 'agents.py')}"
    small = [f"rollout.agent.command={command}", "rollout.agent.entry=null",
             "ppo.num_iterations=1", "ppo.rollout_batch_size=2", "ppo.mini_batch_size=4",
             "ppo.micro_batch_size=4"]
    rows = rows_file(task, "silent_rows", ["silent", "unscored"])
    _, run, _ = ppo(task, "silent", rows, *small, "rollout.rewards.on_error=penalty",
                    "rollout.rewards.timeout_s=3", "rollout.rewards.error_score=-2")
    r = metrics(run)[1]
    assert (r["reward/timeouts"], r["reward/failed"]) == (2, 2), r
    assert r["objective/score"] == -2.0
    rows = rows_file(task, "stop_rows", ["unscored"])
    proc, run, _ = ppo(task, "stop", rows, *small, "ppo.rollout_batch_size=1",
                       "ppo.mini_batch_size=2", "ppo.micro_batch_size=2", check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"rollout.agent.command={command}: sample 0: the agent returned no reward " \
           "(null)" in proc.stderr, proc.stderr[-3000:]
    assert "rollout.rewards.on_error=stop" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (run / "metrics.jsonl").exists() or len(metrics(run)) <= 1


@pytest.mark.extended
def test_rollout_tp2_two_replicas_and_split_placement_play_the_same_agent_episodes(task):
    """Two processes - the rollout at TP=2 (the leader serves the endpoint and hands each
    batch of requests to its peer), two TP=1 replicas (an endpoint each, their own rows)
    and split placement (the rollout rank serves, the other trains) - against one
    process: the same episodes (score, turns, observation and response tokens exactly)
    and the same update (losses to float noise). Catches TP peers fed other requests,
    replicas that play other rows or seeds, an agent rollout that only works colocated,
    and agents that inherit torchrun's process-group settings (the openai client's
    agents, tests/workers/agents.py:lookup, write down what they saw)."""
    rows = rows_file(task, "layout_rows", ["lookup"] * 8)
    args = ["configs/demo/tool_agent.yaml", *task["common"], f"data.train_path={rows}",
            "ppo.num_iterations=1", *AGENT]
    one = task["tmp"] / "agent_layout1"
    run_cli("ppo", *args, f"run.output_dir={one}", env=ENV)
    ref = metrics(one / "tool-agent")[1]
    assert ref["rollout/turns_mean"] > 1
    for name, extra in (("tp2", ["rollout.tensor_parallel_size=2",
                                 "parallel.tensor_model_parallel_size=2"]),
                        ("dp2", ["ppo.micro_batch_size=4"]),
                        ("split", ["rollout.placement.mode=split",
                                   "rollout.placement.ranks=1"])):
        out = task["tmp"] / f"agent_layout_{name}"
        dump = task["tmp"] / f"agent_layout_{name}_dump"
        dump.mkdir(exist_ok=True)
        torchrun(["ppo", *args, f"run.output_dir={out}", *extra], 2,
                 env={**ENV, "AGENT_DUMP": str(dump)})
        got = metrics(out / "tool-agent")[1]
        for key in ("objective/score", "rollout/turns_mean",
                    "rollout/observation_tokens_mean", "rollout/response_len_mean"):
            assert got[key] == ref[key], (name, key)
        for key in ("ppo/policy/loss", "objective/kl", "objective/entropy"):
            assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (name, key)
        # the agents did not inherit the trainer's process group (torchrun's settings)
        records = dumps(dump)
        assert len(records) == 16 and all(not any(r["trainer_env"].values())
                                           for r in records), name
