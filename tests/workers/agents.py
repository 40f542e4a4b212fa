"""Agents for tests/test_agents.py: programs that play the tool task's episodes through the
official ``openai`` client against the rollout's endpoint (``rollout.agent``), each in a
process of its own. ``AGENT_DUMP`` names a folder where each writes what it sent and got
(one JSON file per process), for the test to compare with what was trained. The client is
imported by the agents that use it: the others start in a fraction of its import time."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request

from megarlhf.data.tool_task import LOOKUP, question
from megarlhf.data.tools import ToolCallError, error_observation, parse_tool_calls


class Log:
    """What an agent saw, written to AGENT_DUMP/<pid>.json as it goes."""

    def __init__(self, row: dict):
        self.data = {"row": row, "requests": [], "errors": [], "reward": None,
                     "trainer_env": {k: os.environ.get(k) for k in (
                         "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}}

    def reply(self, response, kind: str) -> None:
        choice = response.choices[0]
        if kind == "chat":
            logprobs = [c.logprob for c in choice.logprobs.content]
        else:
            logprobs = choice.logprobs.token_logprobs
        self.data["requests"].append({"kind": kind, "prompt": response.prompt_token_ids,
                                      "tokens": choice.token_ids, "logprobs": logprobs,
                                      "finish": choice.finish_reason})
        self.save()

    def error(self, what: str, status: int, body) -> None:
        self.data["errors"].append({"what": what, "status": status, "body": body})
        self.save()

    def save(self, reward=None) -> None:
        self.data["reward"] = reward
        folder = os.environ.get("AGENT_DUMP")
        if folder:
            with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as f:
                json.dump(self.data, f)


def client(base_url: str, api_key: str):
    import openai

    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)


def ask(base_url: str, model: str, noun: str) -> dict:
    """One chat request with the standard library (no client to import)."""
    body = json.dumps({"model": model, "messages": [{"role": "user",
                                                     "content": question(noun)}]})
    request = urllib.request.Request(f"{base_url}/chat/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as answer:
        return json.loads(answer.read())


def lookup(row: dict, *, base_url: str, api_key: str, model: str) -> float:
    """The tool task played as megarlhf.data.tool_task.LookupEnv plays it: a lookup call is
    answered with the row's colour (or "unknown key"), a call that does not parse with the
    environment's error message, and a reply without a call is the answer (1 when it is
    the row's colour). A turn cut short, or a request the endpoint refuses (no more
    turns, no room), ends the episode at 0, as the environment's ends."""
    import openai

    log, api = Log(row), client(base_url, api_key)
    messages = [{"role": "user", "content": question(row["noun"])}]
    reward = 0.0
    while True:
        try:
            response = api.chat.completions.create(model=model, messages=messages,
                                                   tools=[LOOKUP], logprobs=True)
        except openai.BadRequestError as err:
            log.error("refused", err.status_code, err.body)
            break
        log.reply(response, "chat")
        choice = response.choices[0]
        if choice.finish_reason == "length":
            break
        message = choice.message
        if message.tool_calls:
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                name, args = call.function.name, json.loads(call.function.arguments)
                key = args.get("key") if name == "lookup" else None
                messages.append({"role": "tool", "tool_call_id": call.id, "content":
                                 row["answer"] if key == row["noun"] else "unknown key"
                                 if name == "lookup" else f"no tool named {name}"})
            continue
        text = message.content or ""
        try:
            parse_tool_calls(text, "hermes")
        except ToolCallError as err:  # the environment's answer to a call that fails
            messages += [{"role": "assistant", "content": text}, error_observation(err)]
            continue
        reward = float(text.strip() == row["answer"])
        break
    log.save(reward)
    return reward


# ------------------------------------------------------------------ misbehaving, by row

def probe(row, *, base_url, api_key, model):
    """The API's error shapes (malformed JSON, an unknown model, streaming), a retried
    request, a multi-turn chat, then its reward."""
    import urllib.error

    import openai

    log, api = Log(row), client(base_url, api_key)
    try:
        urllib.request.urlopen(urllib.request.Request(
            f"{base_url}/chat/completions", data=b"{not json",
            headers={"Content-Type": "application/json"}), timeout=300)
        log.error("malformed", 200, None)
    except urllib.error.HTTPError as err:
        log.error("malformed", err.code, json.loads(err.read()))
    for what, kw in (("unknown model", dict(model="gpt-5")),
                     ("stream", dict(model=model, stream=True))):
        try:
            api.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw)
            log.error(what, 200, None)
        except openai.APIStatusError as err:
            log.error(what, err.status_code, err.body)
    messages = [{"role": "user", "content": question(row["noun"])}]
    first = api.chat.completions.create(model=model, messages=messages, logprobs=True)
    log.reply(first, "chat")
    again = api.chat.completions.create(model=model, messages=messages, logprobs=True)
    log.reply(again, "chat")  # a retry: the same answer, recorded once
    if first.choices[0].finish_reason != "length":  # (a cut turn ends the episode)
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "sure ?"}]
        log.reply(api.chat.completions.create(model=model, messages=messages,
                                              logprobs=True), "chat")
    log.save(0.5)
    return 0.5


def complete(row, *, base_url, api_key, model):
    """/v1/completions: a text prompt, an extension of it as text, one as token ids."""
    log, api = Log(row), client(base_url, api_key)
    prompt = f"<|im_start|>user\n{question(row['noun'])}<|im_end|>\n<|im_start|>assistant\n"
    first = api.completions.create(model=model, prompt=prompt, logprobs=1, max_tokens=6)
    log.reply(first, "completion")
    more = prompt + first.choices[0].text + "<|im_end|>\n<|im_start|>user\nsure ?" \
        "<|im_end|>\n<|im_start|>assistant\n" if first.choices[0].finish_reason == "stop" \
        else None
    if more is None:
        log.save(0.0)
        return 0.0
    # the stop token the model wrote is not in the text: the episode keeps it, and this
    # prompt's own "<|im_end|>" comes after it
    second = api.completions.create(model=model, prompt=more, logprobs=1, max_tokens=6)
    log.reply(second, "completion")
    if second.choices[0].finish_reason == "stop":
        ids = second.prompt_token_ids + second.choices[0].token_ids + first.prompt_token_ids[-3:]
        log.reply(api.completions.create(model=model, prompt=ids, logprobs=1, max_tokens=4),
                  "completion")
    log.save(1.0)
    return 1.0


def rewrite(row, *, base_url, api_key, model):
    """A rewritten history: the episode fails."""
    import openai

    log, api = Log(row), client(base_url, api_key)
    messages = [{"role": "user", "content": question(row["noun"])}]
    log.reply(api.chat.completions.create(model=model, messages=messages, logprobs=True),
              "chat")
    try:
        api.chat.completions.create(model=model, messages=[
            {"role": "user", "content": "something else"},
            {"role": "assistant", "content": "blue"}, {"role": "user", "content": "ok"}])
    except openai.BadRequestError as err:
        log.error("rewrite", err.status_code, err.body)
    log.save(1.0)
    return 1.0


def silent(row, *, base_url, api_key, model):
    """One request, then nothing: killed after rollout.rewards.timeout_s."""
    ask(base_url, model, row["noun"])
    time.sleep(600)


def crash(row, *, base_url, api_key, model):
    ask(base_url, model, row["noun"])
    raise ConnectionError("the agent's sandbox is gone")


def unscored(row, *, base_url, api_key, model):
    """A reward of null: rollout.rewards.fn scores the episode."""
    ask(base_url, model, row["noun"])
    return None


BY_ROW = {"lookup": lookup, "probe": probe, "complete": complete, "rewrite": rewrite,
          "silent": silent, "crash": crash, "unscored": unscored}


def by_row(row, **endpoint):
    """The agent the row names (its "agent" column)."""
    return BY_ROW[row["agent"]](row, **endpoint)


def length_of_last_turn(prompt: str, response: str) -> float:
    """A verifier for the unscored rows: the response's length."""
    return float(len(response))


if __name__ == "__main__":  # rollout.agent.command: the same agents as a program
    row = json.loads(os.environ["MEGARLHF_AGENT_ROW"])
    value = by_row(row, base_url=os.environ["OPENAI_BASE_URL"],
                   api_key=os.environ["OPENAI_API_KEY"],
                   model=os.environ["MEGARLHF_AGENT_MODEL"])
    print("the agent's own line on stdout")
    print(json.dumps(value))
    sys.exit(0)
