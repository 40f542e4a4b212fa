"""Prompt / SFT / preference datasets: field mapping, length filtering, clear errors."""

import json

import pytest

from megarlhf.config import DataConfig
from megarlhf.data.datasets import tokenize_dataset


class CharTokenizer:
    """One id per character (a stand-in that makes lengths easy to reason about)."""

    bos_id, eos_id, pad_id, vocab_size = 1, 2, 0, 256

    def encode(self, text, add_bos=False, add_eos=False):
        return ([1] if add_bos else []) + [ord(c) % 250 + 3 for c in text] + ([2] if add_eos else [])

    def decode(self, ids):
        return "".join(chr(i - 3) for i in ids if i > 2)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_sft_with_field_mapping_and_filtering(tmp_path):
    path = write_jsonl(tmp_path / "sft.jsonl", [
        {"q": "hi", "a": "hello"},
        {"q": "x" * 20, "a": "long prompt"},
        {"q": "ok", "a": "y" * 30},
        {"q": "fine", "a": "good"},
    ])
    cfg = DataConfig(prompt_key="q", response_key="a", max_prompt_len=10, max_seq_len=16)
    ds = tokenize_dataset(path, "sft", cfg, CharTokenizer())
    assert len(ds) == 2
    assert ds.prompts[0] == [1] + CharTokenizer().encode("hi")
    assert ds.responses[0][-1] == 2
    assert sum(ds.dropped.values()) == 2
    report = ds.report()
    assert "2 of 4 sft rows kept" in report
    assert "1 prompt > data.max_prompt_len=10" in report
    assert "1 prompt+response > data.max_seq_len=16" in report


def test_preference_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"prompt": ["a", "b"], "chosen": ["good", "fine"],
                      "rejected": ["bad", "poor"]})
    pq.write_table(table, tmp_path / "prefs.parquet")
    ds = tokenize_dataset(str(tmp_path / "prefs.parquet"), "preference", DataConfig(),
                          CharTokenizer())
    assert len(ds) == 2 and len(ds.chosen) == 2 and len(ds.rejected) == 2
    prompts = tokenize_dataset(str(tmp_path / "prefs.parquet"), "prompt", DataConfig(),
                               CharTokenizer())
    assert prompts.texts == ["a", "b"]


@pytest.mark.parametrize("rows, kind, message", [
    ([{"prompt": "a"}], "sft", "has no column 'response' (data.response_key); its columns are: prompt"),
    ([{"prompt": 3, "response": "b"}], "sft", "row 1: column 'prompt' must be a string, got int"),
    ([{"prompt": "a", "chosen": "b"}], "preference", "has no column 'rejected'"),
    ([{"prompt": "a" * 500}], "prompt", "no rows left after length filtering"),
])
def test_dataset_errors(tmp_path, rows, kind, message):
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(ValueError) as err:
        tokenize_dataset(path, kind, DataConfig(), CharTokenizer())
    assert message in str(err.value)


def test_file_errors(tmp_path):
    tok, cfg = CharTokenizer(), DataConfig()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tokenize_dataset(str(tmp_path / "none.jsonl"), "sft", cfg, tok)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty|could not be read"):
        tokenize_dataset(str(empty), "sft", cfg, tok)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a", "response": "b"}\n{not json\n')
    with pytest.raises(ValueError, match="could not be read as json: .*broken.jsonl line 2: "):
        tokenize_dataset(str(broken), "sft", cfg, tok)
    torn = tmp_path / "torn.jsonl"  # a copy cut short: the last record torn mid-string
    torn.write_text('{"prompt": "a", "response": "b"}\n' * 3 + '{"prompt": "a", "resp')
    with pytest.raises(ValueError, match="torn.jsonl line 4: Unterminated string.*fix or "
                                         "remove that record"):
        tokenize_dataset(str(torn), "sft", cfg, tok)
    (tmp_path / "dir").mkdir()
    with pytest.raises(ValueError, match="holds no .jsonl"):
        tokenize_dataset(str(tmp_path / "dir"), "sft", cfg, tok)
    with pytest.raises(ValueError, match="kind must be one of"):
        tokenize_dataset(str(broken), "dpo", cfg, tok)


def test_line_files_that_are_not_utf8_name_the_line(tmp_path):
    """generate's prompts and score's sequences, read line by line: a line that is not
    UTF-8 (a binary file, a latin-1 export) is an error naming the file and that line."""
    from megarlhf.stages.sample import read_prompts
    from megarlhf.stages.score import read_sequences
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "ab"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match="bad.jsonl line 2: not UTF-8 text"):
        read_sequences(str(bad), CharTokenizer())
    bad.write_bytes(b'{"prompt": "ab"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match="bad.jsonl line 2: not UTF-8 text"):
        read_prompts(str(bad), CharTokenizer())
