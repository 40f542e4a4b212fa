"""Prompt, SFT and preference datasets from local JSONL / Parquet through HF ``datasets``.

Columns are mapped by the ``data.*_key`` fields; rows too long for the model are dropped
and counted by reason; malformed files, missing columns, wrong types and empty results
are errors that name the file and the column.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

from megarlhf.config import DataConfig

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
    dropped: Counter = field(default_factory=Counter)
    source: str = ""

    def __len__(self) -> int:
        return len(self.prompts)

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
        files = sorted(os.path.join(path, f) for f in os.listdir(path)
                       if f.endswith((".jsonl", ".json", ".parquet")))
        if not files:
            raise ValueError(f"dataset folder {path!r} holds no .jsonl, .json or .parquet files")
    exts = {os.path.splitext(f)[1] for f in files}
    if exts <= {".jsonl", ".json"}:
        return "json", files
    if exts == {".parquet"}:
        return "parquet", files
    raise ValueError(f"dataset {path!r}: use .jsonl/.json or .parquet files, not a mix "
                     f"({', '.join(sorted(exts))})")


def load_rows(path: str):
    """The raw table as an HF ``datasets.Dataset``."""
    import datasets

    builder, files = _data_files(path)
    empty = [f for f in files if os.path.getsize(f) == 0 or (
        builder == "json" and not open(f, "rb").read(65536).strip())]
    if len(empty) == len(files):
        raise ValueError(f"dataset {path!r} is empty" + (
            f" ({len(files)} empty files)" if len(files) > 1 else ""))
    datasets.disable_progress_bars()
    try:
        table = datasets.load_dataset(builder, data_files=files, split="train")
    except Exception as err:  # datasets wraps parse errors in several exception types
        raise ValueError(f"dataset {path!r} could not be read as {builder}: "
                         f"{str(err).splitlines()[0] if str(err) else type(err).__name__}"
                         ) from None
    if len(table) == 0:
        raise ValueError(f"dataset {path!r} is empty")
    return table


def tokenize_dataset(path: str, kind: str, data_cfg: DataConfig, tokenizer,
                     ) -> TokenizedDataset:
    """Read ``path`` as a ``kind`` dataset ('prompt', 'sft' or 'preference')."""
    if kind not in KINDS:
        raise ValueError(f"dataset kind must be one of {', '.join(KINDS)}, got {kind!r}")
    table = load_rows(path)
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
        if not prompt:
            out.dropped["empty prompt"] += 1
            continue
        if len(prompt) > data_cfg.max_prompt_len:
            out.dropped[f"prompt > data.max_prompt_len={data_cfg.max_prompt_len}"] += 1
            continue
        answers = []
        for key in KINDS[kind][1:]:
            answers.append(tokenizer.encode(values[key], add_eos=True))
        if any(len(prompt) + len(a) > data_cfg.max_seq_len for a in answers):
            out.dropped[f"prompt+response > data.max_seq_len={data_cfg.max_seq_len}"] += 1
            continue
        out.prompts.append(prompt)
        out.texts.append(values["prompt_key"])
        if kind == "sft":
            out.responses.append(answers[0])
        elif kind == "preference":
            out.chosen.append(answers[0])
            out.rejected.append(answers[1])
    if len(out) == 0:
        raise ValueError(f"dataset {path!r}: no rows left after length filtering "
                         f"({out.report()})")
    return out
