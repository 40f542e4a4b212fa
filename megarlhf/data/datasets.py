"""Prompt, SFT and preference datasets from local JSONL / Parquet / Arrow (or a
``save_to_disk`` folder) through HF ``datasets``.

Columns are mapped by the ``data.*_key`` fields; rows too long for the model are dropped
and counted by reason; malformed files, missing columns, wrong types and empty results
are errors that name the file and the column.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

from megarlhf.config import DataConfig
from megarlhf.data.batching import sft_example

KINDS = {
    "prompt": ("prompt_key",),
    "sft": ("prompt_key", "response_key"),
    "preference": ("prompt_key", "chosen_key", "rejected_key"),
}


@dataclass
class TokenizedDataset:
    """Token ids per row; ``dropped`` counts filtered rows by reason."""

    kind: str
    prompts: list[list[int]]
    responses: list[list[int]] = field(default_factory=list)  # sft
    chosen: list[list[int]] = field(default_factory=list)  # preference
    rejected: list[list[int]] = field(default_factory=list)  # preference
    texts: list[str] = field(default_factory=list)  # the prompt text, for sample tables
    # sft rows from conversations: per-position next-token loss weights over
    # prompt + response (every assistant turn); None for a prompt/response row
    weights: list[list[int] | None] = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)
    source: str = ""

    def __len__(self) -> int:
        return len(self.prompts)

    def examples(self) -> list[tuple[list[int], list[int]]]:
        """sft rows as (tokens, next-token loss weights)."""
        out = []
        for i, (prompt, response) in enumerate(zip(self.prompts, self.responses)):
            weights = self.weights[i] if i < len(self.weights) else None
            out.append(sft_example(prompt, response) if weights is None
                       else (prompt + response, weights))
        return out

    def report(self) -> str:
        kept = len(self)
        total = kept + sum(self.dropped.values())
        reasons = ", ".join(f"{n} {why}" for why, n in sorted(self.dropped.items()))
        return (f"{self.source}: {kept} of {total} {self.kind} rows kept"
                + (f" (dropped: {reasons})" if reasons else ""))


def _data_files(path: str) -> tuple[str, list[str]]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"dataset {path!r} does not exist")
    files = [path]
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "state.json")):
            return "saved", [path]  # Dataset.save_to_disk
        files = sorted(os.path.join(path, f) for f in os.listdir(path)
                       if f.endswith((".jsonl", ".json", ".parquet", ".arrow")))
        if not files:
            raise ValueError(f"dataset folder {path!r} holds no .jsonl, .json, .parquet or "
                             ".arrow files")
    exts = {os.path.splitext(f)[1] for f in files}
    if exts <= {".jsonl", ".json"}:
        return "json", files
    if exts == {".parquet"}:
        return "parquet", files
    if exts == {".arrow"}:
        return "arrow", files
    raise ValueError(f"dataset {path!r}: use .jsonl/.json, .parquet or .arrow files (or a "
                     f"save_to_disk folder), not a mix ({', '.join(sorted(exts))})")


def load_rows(path: str):
    """The raw table as an HF ``datasets.Dataset``."""
    import datasets

    datasets.disable_progress_bars()
    builder, files = _data_files(path)
    if builder == "saved":
        table = datasets.load_from_disk(path)
        if isinstance(table, datasets.DatasetDict):
            if "train" not in table:
                raise ValueError(f"dataset {path!r} is a DatasetDict without a 'train' split "
                                 f"(it has {', '.join(table)}): point at one split's folder")
            table = table["train"]
        if len(table) == 0:
            raise ValueError(f"dataset {path!r} is empty")
        return table
    empty = [f for f in files if os.path.getsize(f) == 0 or (
        builder == "json" and not open(f, "rb").read(65536).strip())]
    if len(empty) == len(files):
        raise ValueError(f"dataset {path!r} is empty" + (
            f" ({len(files)} empty files)" if len(files) > 1 else ""))
    datasets.disable_progress_bars()
    try:
        table = datasets.load_dataset(builder, data_files=files, split="train")
    except Exception as err:  # datasets wraps parse errors in several exception types
        where = _first_bad_json_line(files) if builder == "json" else None
        raise ValueError(f"dataset {path!r} could not be read as {builder}: " + (
            where or (str(err).splitlines()[0] if str(err) else type(err).__name__)) +
            " - fix or remove that record (a run that was killed while writing the file "
            "leaves a torn last line)") from None
    if len(table) == 0:
        raise ValueError(f"dataset {path!r} is empty")
    return table


def _first_bad_json_line(files: list[str]) -> str | None:
    """Where a JSON Lines file stops parsing ("FILE line N: what"), for the error message
    (the ``datasets`` error names neither); None for a whole-file .json or when every line
    parses (the problem is elsewhere, e.g. a column's type changing between rows)."""
    import json

    for name in files:
        if not name.endswith(".jsonl"):
            continue
        with open(name, "rb") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    json.loads(line)
                except (UnicodeDecodeError, json.JSONDecodeError) as err:
                    return f"{name} line {number}: {err}"
    return None


def _conversational(table, kind: str, data_cfg: DataConfig) -> bool:
    """Whether ``table`` holds conversations: a messages column (sft, prompt), or
    message lists in chosen/rejected (preference)."""
    columns = table.column_names
    if kind == "preference":
        return data_cfg.chosen_key in columns and isinstance(table[0][data_cfg.chosen_key], list)
    if data_cfg.messages_key in columns and data_cfg.prompt_key not in columns:
        return True
    return data_cfg.prompt_key in columns and isinstance(table[0][data_cfg.prompt_key], list)


def tokenize_dataset(path: str, kind: str, data_cfg: DataConfig, tokenizer,
                     ) -> TokenizedDataset:
    """Read ``path`` as a ``kind`` dataset ('prompt', 'sft' or 'preference'): text
    columns (``data.prompt_key``...) or conversations (``data.messages_key``, or message
    lists in chosen/rejected) rendered by the tokenizer's chat template."""
    if kind not in KINDS:
        raise ValueError(f"dataset kind must be one of {', '.join(KINDS)}, got {kind!r}")
    table = load_rows(path)
    if _conversational(table, kind, data_cfg):
        return _tokenize_chats(path, table, kind, data_cfg, tokenizer)
    return _tokenize_texts(path, table, kind, data_cfg, tokenizer)


def _keep(out: TokenizedDataset, data_cfg: DataConfig, prompt: list[int],
          answers: list[list[int]]) -> bool:
    """Length filtering, counted by reason."""
    if not prompt:
        out.dropped["empty prompt"] += 1
        return False
    if len(prompt) > data_cfg.max_prompt_len:
        out.dropped[f"prompt > data.max_prompt_len={data_cfg.max_prompt_len}"] += 1
        return False
    if any(len(prompt) + len(a) > data_cfg.max_seq_len for a in answers):
        out.dropped[f"prompt+response > data.max_seq_len={data_cfg.max_seq_len}"] += 1
        return False
    return True


def _add(out: TokenizedDataset, kind: str, prompt: list[int], answers: list[list[int]],
         text: str, weights: list[int] | None = None) -> None:
    out.prompts.append(prompt)
    out.texts.append(text)
    if kind == "sft":
        out.responses.append(answers[0])
        out.weights.append(weights)
    elif kind == "preference":
        out.chosen.append(answers[0])
        out.rejected.append(answers[1])


def _finish(path: str, out: TokenizedDataset) -> TokenizedDataset:
    if len(out) == 0:
        raise ValueError(f"dataset {path!r}: no rows left after length filtering "
                         f"({out.report()})")
    return out


def _tokenize_texts(path, table, kind, data_cfg: DataConfig, tokenizer) -> TokenizedDataset:
    columns = {key: getattr(data_cfg, key) for key in KINDS[kind]}
    for key, column in columns.items():
        if column not in table.column_names:
            raise ValueError(f"dataset {path!r} has no column '{column}' (data.{key}); "
                             f"its columns are: {', '.join(table.column_names)}")
    out = TokenizedDataset(kind=kind, prompts=[], source=path)
    for row_no, row in enumerate(table, 1):
        values = {}
        for key, column in columns.items():
            value = row[column]
            if not isinstance(value, str):
                raise ValueError(f"dataset {path!r} row {row_no}: column '{column}' must be a "
                                 f"string, got {type(value).__name__}")
            values[key] = value
        prompt = tokenizer.encode(values["prompt_key"], add_bos=getattr(tokenizer, "add_bos", True))
        answers = [tokenizer.encode(values[key], add_eos=True) for key in KINDS[kind][1:]]
        if _keep(out, data_cfg, prompt, answers):
            _add(out, kind, prompt, answers, values["prompt_key"])
    return _finish(path, out)


def _tokenize_chats(path, table, kind, data_cfg: DataConfig, tokenizer) -> TokenizedDataset:
    from megarlhf.data.chat import assistant_rows, check_messages, tokenize_pieces
    from megarlhf.data.tools import check_tools

    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        raise ValueError(f"dataset {path!r} holds conversations, but the tokenizer has no chat "
                         "template (tokenizer.chat_template=auto found none beside "
                         "tokenizer.path): set tokenizer.chat_template to a jinja file")
    encode = tokenizer.encode
    out = TokenizedDataset(kind=kind, prompts=[], source=path)
    for row_no, row in enumerate(table, 1):
        where = f"dataset {path!r} row {row_no}"
        tools = check_tools(row.get(data_cfg.tools_key), f"{where} column "
                            f"'{data_cfg.tools_key}'")
        if kind == "preference":
            prompt_msgs, chosen, rejected = _preference_turns(row, data_cfg, where)
            prompt_text = template.render(prompt_msgs, add_generation_prompt=True, tools=tools)
            answers = []
            for name, turns in (("chosen", chosen), ("rejected", rejected)):
                full = template.render(prompt_msgs + turns, add_generation_prompt=False,
                                       tools=tools)
                if not full.startswith(prompt_text):
                    raise ValueError(f"{where}: the chat template {template.origin} does not "
                                     f"render the {name} answer as an extension of the prompt")
                answers.append(encode(full[len(prompt_text):]))
            prompt = encode(prompt_text)
            if _keep(out, data_cfg, prompt, answers):
                _add(out, kind, prompt, answers, prompt_text)
            continue
        column = data_cfg.messages_key if data_cfg.messages_key in table.column_names \
            else data_cfg.prompt_key
        messages = check_messages(row[column], f"{where} column '{column}'",
                                  needs_assistant=kind == "sft")
        if kind == "prompt":
            text = template.render(messages, add_generation_prompt=True, tools=tools)
            prompt = encode(text)
            if _keep(out, data_cfg, prompt, []):
                _add(out, kind, prompt, [], text)
            continue
        for text, spans in assistant_rows(template, messages, f"{where} column '{column}'",
                                          tools):
            tokens, trained = tokenize_pieces(text, spans, encode)
            first = trained.index(1)
            weights = trained[1:] + [0]  # weight t: the loss of predicting token t + 1
            prompt, response = tokens[:first], tokens[first:]
            if _keep(out, data_cfg, prompt, [response]):
                _add(out, kind, prompt, [response], text[:spans[0][0]], weights)
    return _finish(path, out)


def _preference_turns(row, data_cfg: DataConfig, where: str
                      ) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt turns, chosen answer turns, rejected answer turns) of a conversational
    preference row: an explicit prompt column (a string is one user turn; chosen/rejected
    may repeat it, UltraFeedback-binarized style), else the turns chosen and rejected
    share (HH-RLHF style)."""
    from megarlhf.data.chat import check_messages

    c_key, r_key = data_cfg.chosen_key, data_cfg.rejected_key
    chosen = check_messages(row[c_key], f"{where} column '{c_key}'", needs_assistant=True,
                            ends_with_assistant=True)
    rejected = check_messages(row[r_key], f"{where} column '{r_key}'", needs_assistant=True,
                              ends_with_assistant=True)
    explicit = row.get(data_cfg.prompt_key)
    if explicit is not None:
        if isinstance(explicit, str):
            prompt = check_messages([{"role": "user", "content": explicit}],
                                    f"{where} column '{data_cfg.prompt_key}'",
                                    needs_assistant=False)
        else:
            prompt = check_messages(explicit, f"{where} column '{data_cfg.prompt_key}'",
                                    needs_assistant=False)
        n = len(prompt)
        chosen = chosen[n:] if chosen[:n] == prompt else chosen
        rejected = rejected[n:] if rejected[:n] == prompt else rejected
    else:
        n = 0
        while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
            n += 1
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        if not prompt:
            raise ValueError(f"{where}: '{c_key}' and '{r_key}' share no first turns and there "
                             f"is no '{data_cfg.prompt_key}' column: the prompt is unknown")
    for name, turns in (("chosen", chosen), ("rejected", rejected)):
        if not turns or turns[0]["role"] != "assistant":
            raise ValueError(f"{where}: the {name} answer must start with an assistant turn "
                             "after the prompt")
    if prompt[-1]["role"] == "assistant":
        raise ValueError(f"{where}: the prompt (the turns chosen and rejected share) ends with "
                         "an assistant turn")
    return prompt, chosen, rejected


@dataclass
class EpisodeRows:
    """The rows of an environment's episodes (``rollout.environment.name``): each row as a dict
    of its columns, handed to the environment's ``reset``."""

    prompts: list[dict]
    source: str = ""
    kind: str = "episode"

    def __len__(self) -> int:
        return len(self.prompts)

    def report(self) -> str:
        return f"{self.source}: {len(self)} episode rows"


def episode_rows(path: str, data_cfg: DataConfig) -> EpisodeRows:
    """``path``'s rows for an environment; a ``data.tools_key`` column and a conversation
    column (``data.messages_key``), where present, are checked now."""
    from megarlhf.data.chat import check_messages
    from megarlhf.data.tools import check_tools

    rows = load_rows(path).to_list()
    for row_no, row in enumerate(rows, 1):
        where = f"dataset {path!r} row {row_no}"
        row[data_cfg.tools_key] = check_tools(row.get(data_cfg.tools_key),
                                              f"{where} column '{data_cfg.tools_key}'")
        if row.get(data_cfg.messages_key) is not None:
            check_messages(row[data_cfg.messages_key],
                           f"{where} column '{data_cfg.messages_key}'", needs_assistant=False)
    return EpisodeRows(prompts=rows, source=path)


def text_lines(path: str):
    """(line number, line) of a text file the CLI reads line by line (generate's prompts,
    score's sequences; ``-``: stdin); a line that is not UTF-8 is an error naming the file
    and the line."""
    import sys

    name = "stdin" if path == "-" else path
    stream = sys.stdin.buffer if path == "-" else open(path, "rb")
    try:
        for number, raw in enumerate(stream, 1):
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{name} line {number}: not UTF-8 text ({err.reason} at "
                                 f"column {err.start + 1}): is this the right file?") from None
    finally:
        if path != "-":
            stream.close()
