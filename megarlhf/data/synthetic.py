"""A small synthetic language task with a programmatic gold reward, for tests and the
built-in demo (nothing is downloaded).

Prompts list a few words. The SFT target repeats the prompt's words in reverse order.
The gold reward prefers responses that name colours and are four words long; preference
pairs are labelled by it, optionally with label noise.
"""

from __future__ import annotations

import json
import os
import random

NOUNS = ("cat dog bird fish tree house river stone cloud hill road door lamp book cup "
         "apple bread chair field garden").split()
COLOURS = ("red blue green yellow black white").split()
OTHERS = ("fast slow small large quiet bright old new one two three four").split()
WORDS = NOUNS + COLOURS + OTHERS


def gold_reward(response: str) -> float:
    """+1 per colour word (at most 3), -0.5 per word away from a length of four."""
    words = response.split()
    colours = sum(w in COLOURS for w in words)
    return min(colours, 3) - 0.5 * abs(len(words) - 4)


def make_prompt(rng: random.Random) -> str:
    return "words: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5)))


def sft_response(prompt: str) -> str:
    return " ".join(reversed(prompt.split()[1:]))


def random_response(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 7)))


def corpus_lines(rng: random.Random, n: int) -> list[str]:
    lines = []
    for _ in range(n):
        prompt = make_prompt(rng)
        lines.append(prompt + " " + sft_response(prompt))
        lines.append(random_response(rng))
    return lines


def preference_rows(rng: random.Random, n: int, label_noise: float = 0.0,
                    min_margin: float = 0.0) -> list[dict]:
    """Pairs of random responses ranked by the gold reward (ties and pairs closer than
    ``min_margin`` are re-drawn); a ``label_noise`` fraction is flipped."""
    rows = []
    while len(rows) < n:
        prompt = make_prompt(rng)
        a, b = random_response(rng), random_response(rng)
        ga, gb = gold_reward(a), gold_reward(b)
        if abs(ga - gb) <= max(min_margin, 1e-9):
            continue
        chosen, rejected = (a, b) if ga > gb else (b, a)
        if rng.random() < label_noise:
            chosen, rejected = rejected, chosen
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def write_jsonl(path: str, rows: list[dict]) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def write_task(folder: str, seed: int = 0, num_sft: int = 512, num_pairs: int = 512,
               label_noise: float = 0.1, vocab_size: int = 128) -> dict:
    """Corpus, sentencepiece tokenizer, SFT and preference data under ``folder``."""
    from megarlhf.data.tokenizer import train_sentencepiece

    rng = random.Random(seed)
    os.makedirs(folder, exist_ok=True)
    corpus = os.path.join(folder, "corpus.txt")
    with open(corpus, "w") as f:
        f.write("\n".join(corpus_lines(rng, 2000)) + "\n")
    tokenizer = train_sentencepiece([corpus], os.path.join(folder, "tok"), vocab_size,
                                    model_type="word")
    sft = [{"prompt": p, "response": sft_response(p)}
           for p in (make_prompt(rng) for _ in range(num_sft))]
    return {
        "tokenizer": tokenizer,
        "sft": write_jsonl(os.path.join(folder, "sft.jsonl"), sft),
        "prefs": write_jsonl(os.path.join(folder, "prefs.jsonl"),
                             preference_rows(rng, num_pairs, label_noise)),
        "prefs_clean": write_jsonl(os.path.join(folder, "prefs_clean.jsonl"),
                                   preference_rows(rng, num_pairs, 0.0, min_margin=0.9)),
        "prompts": write_jsonl(os.path.join(folder, "prompts.jsonl"),
                               [{"prompt": make_prompt(rng)} for _ in range(256)]),
        "eval_prompts": write_jsonl(os.path.join(folder, "eval_prompts.jsonl"),
                                    [{"prompt": make_prompt(rng)} for _ in range(64)]),
    }


def gold_reward_pair(prompt: str, response: str) -> float:
    """The gold reward in the (prompt, response) form PPO's evaluation calls."""
    return gold_reward(response)


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def write_chat_task(folder: str, seed: int = 0, num_sft: int = 512, num_pairs: int = 512
                    ) -> dict:
    """The same task as conversations, in the shapes the field uses: SFT ``messages``
    (every third row two turns, both answered), prompt-only ``messages`` for RL, and
    preference pairs half HH-RLHF style (chosen/rejected conversations sharing the user
    turn) and half UltraFeedback-binarized style (a ``prompt`` string and conversations
    that repeat it)."""
    rng = random.Random(seed)

    def user(text):
        return {"role": "user", "content": text}

    def assistant(text):
        return {"role": "assistant", "content": text}

    sft = []
    for i in range(num_sft):
        p = make_prompt(rng)
        turns = [user(p), assistant(sft_response(p))]
        if i % 3 == 0:
            q = make_prompt(rng)
            turns += [user(q), assistant(sft_response(q))]
        sft.append({"messages": turns})
    prefs = []
    for i, row in enumerate(preference_rows(rng, num_pairs)):
        u = user(row["prompt"])
        pair = {"chosen": [u, assistant(row["chosen"])],
                "rejected": [u, assistant(row["rejected"])]}
        prefs.append(pair if i % 2 == 0 else {"prompt": row["prompt"], **pair})
    return {
        "sft": write_jsonl(os.path.join(folder, "chat_sft.jsonl"), sft),
        "prefs": write_jsonl(os.path.join(folder, "chat_prefs.jsonl"), prefs),
        "prompts": write_jsonl(os.path.join(folder, "chat_prompts.jsonl"),
                               [{"messages": [user(make_prompt(rng))]} for _ in range(256)]),
        "eval_prompts": write_jsonl(os.path.join(folder, "chat_eval_prompts.jsonl"),
                                    [{"messages": [user(make_prompt(rng))]} for _ in range(64)]),
        "corpus": corpus_lines(rng, 2000),
    }
