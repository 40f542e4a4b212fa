"""The built-in tool task (multi-turn rollouts, ``rollout.environment.name``), on the demo's
synthetic words.

Each row hides a colour for one noun. The user asks ``colour of <noun> ?``; the answer is
random per row, so only the ``lookup`` tool knows it. The model may call the tool (a Hermes
``<tool_call>`` block), read the tool's answer and then answer, or answer at once. The SFT
data teaches both: a share of the conversations call the tool, the rest answer at once with
the noun's usual colour (a fixed guess, right one time in six). :class:`LookupEnv` plays an
episode and is its own verifier: reward 1 when the final answer is the row's colour, else 0.
RL then learns to call the tool: the held-out success rate of greedy answers rises from
about one in six towards the rate at which the model copies the tool's answer.

Nothing is downloaded: :func:`write_tool_task` writes a byte-level BPE tokenizer (the
``tokenizers`` library) with a ChatML template that renders the tools and tool calls, the
SFT conversations and the episode rows.
"""

from __future__ import annotations

import json
import os
import random

from megarlhf.data.synthetic import COLOURS, NOUNS, write_jsonl
from megarlhf.data.tools import ToolCallError, error_observation, parse_tool_calls

LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "the colour of a noun",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                   "required": ["key"]}}}

# ChatML with Hermes tool calls (as Qwen's templates write them, in fewer characters)
TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\ntools:' }}{%- for tool in tools %}"
    "{{ ' ' + (tool.function.name if tool.function is defined else tool.name) }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content }}"
    "{%- for call in message.tool_calls | default([]) %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{{ '<tool_call>{\"name\": \"' + fn.name + '\", \"arguments\": ' + (fn.arguments | tojson)"
    " + '}</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
SPECIAL = ["<pad>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]


def usual_colour(noun: str) -> str:
    """The fixed guess for a noun (what the SFT data answers without the tool)."""
    return COLOURS[sum(map(ord, noun)) % len(COLOURS)]


def question(noun: str) -> str:
    return f"colour of \"{noun}\" ?"


def call_text(noun: str) -> str:
    return '<tool_call>{"name": "lookup", "arguments": {"key": "' + noun + '"}}</tool_call>'


class LookupEnv:
    """One episode of the tool task: ``reset`` asks the row's question; a turn with a
    ``lookup`` call gets the colour (or ``unknown key``) as a tool message; a turn without
    one is the answer, rewarded 1 when it is the row's colour."""

    tools = [LOOKUP]

    def reset(self, row: dict) -> list[dict]:
        self.noun, self.answer = row["noun"], row["answer"]
        return [{"role": "user", "content": question(self.noun)}]

    def step(self, turn: dict) -> tuple[list[dict], float, bool]:
        if turn["tool_calls"]:
            out = []
            for call in turn["tool_calls"]:
                key = call["arguments"].get("key") if call["name"] == "lookup" else None
                out.append({"role": "tool", "content": self.answer if key == self.noun
                            else "unknown key" if call["name"] == "lookup"
                            else f"no tool named {call['name']}"})
            return out, 0.0, False
        return [], float(turn["text"].strip() == self.answer), True


def lookup_agent(row: dict, *, base_url: str, api_key: str, model: str) -> float:
    """The tool task as an agent program plays it (``rollout.agent.entry``,
    configs/demo/tool_agent.yaml): the OpenAI chat API over HTTP (the standard library's
    client here; any client will do), the lookup tool answered as :class:`LookupEnv`
    answers it, the reply without a call scored as its answer. A request the endpoint
    refuses (the episode's turns or room are spent) ends the episode at 0."""
    import urllib.error
    import urllib.request

    env = LookupEnv()
    messages = env.reset(row)

    def ask() -> dict | None:
        body = json.dumps({"model": model, "messages": messages, "tools": env.tools})
        request = urllib.request.Request(f"{base_url}/chat/completions", data=body.encode(),
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {api_key}"})
        try:
            with urllib.request.urlopen(request, timeout=600) as answer:
                return json.loads(answer.read())["choices"][0]
        except urllib.error.HTTPError as err:
            if err.code == 400:  # no more turns in this episode
                return None
            raise

    while (choice := ask()) is not None and choice["finish_reason"] != "length":
        message = choice["message"]
        calls = [{"name": c["function"]["name"],
                  "arguments": json.loads(c["function"]["arguments"])}
                 for c in message.get("tool_calls") or []]
        try:  # a call the endpoint could not parse comes back as text
            parse_tool_calls(message["content"] or "", "hermes")
        except ToolCallError as err:  # answered as the environment path answers it
            messages += [message, error_observation(err)]
            continue
        observation, reward, done = env.step({"text": message["content"] or "",
                                              "tool_calls": calls})
        if done:
            return reward
        messages += [message] + observation
    return 0.0


def sft_conversation(rng: random.Random, tool_share: float) -> dict:
    noun, answer = rng.choice(NOUNS), rng.choice(COLOURS)
    user = {"role": "user", "content": question(noun)}
    if rng.random() < tool_share:
        turns = [user, {"role": "assistant", "content": "", "tool_calls": [
                     {"type": "function", "function": {"name": "lookup",
                                                       "arguments": {"key": noun}}}]},
                 {"role": "tool", "content": answer},
                 {"role": "assistant", "content": answer}]
    else:
        turns = [user, {"role": "assistant", "content": usual_colour(noun)}]
    return {"messages": turns, "tools": json.dumps([LOOKUP])}


def write_tool_task(folder: str, seed: int = 0, num_sft: int = 1024, tool_share: float = 0.4,
                    num_rows: int = 256, num_eval: int = 64) -> dict:
    """Tokenizer (``folder``/tok: tokenizer.json, tokenizer_config.json with the template),
    SFT conversations (``tool_share`` of them call the tool), training and held-out rows."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    os.makedirs(os.path.join(folder, "tok"), exist_ok=True)
    sft = [sft_conversation(rng, tool_share) for _ in range(num_sft)]
    corpus = []
    for noun in NOUNS:
        for colour in COLOURS:
            corpus += [question(noun), call_text(noun), colour, "unknown key",
                       "tools: lookup", "user", "assistant", "tool", "system"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus * 4, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(os.path.join(folder, "tok", "tokenizer.json"))
    with open(os.path.join(folder, "tok", "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "pad_token": "<pad>", "bos_token": None,
                   "chat_template": TEMPLATE}, f, indent=1)

    def rows(n: int) -> list[dict]:
        return [{"noun": rng.choice(NOUNS), "answer": rng.choice(COLOURS)} for _ in range(n)]

    return {"tokenizer": os.path.join(folder, "tok"),
            "sft": write_jsonl(os.path.join(folder, "sft.jsonl"), sft),
            "rows": write_jsonl(os.path.join(folder, "rows.jsonl"), rows(num_rows)),
            "eval_rows": write_jsonl(os.path.join(folder, "eval_rows.jsonl"), rows(num_eval))}
