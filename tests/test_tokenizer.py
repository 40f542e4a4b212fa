"""Tokenizers: sentencepiece trained locally and an HF tokenizers JSON, one interface."""

import json
import random
import subprocess
import sys

import pytest

from megarlhf.config import TokenizerConfig
from megarlhf.data.tokenizer import load_tokenizer

WORDS = ("the cat dog sat on a mat red blue green fast slow tree house river stone "
         "bright quiet small large one two three four five").split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
                              for _ in range(2000)) + "\n")
    return path


@pytest.fixture(scope="module")
def spm_path(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("spm") / "tok"
    proc = subprocess.run([sys.executable, "tools/train_tokenizer.py", "--input", str(corpus),
                           "--vocab-size", "120", "--out", str(out)],
                          capture_output=True, text=True, check=True)
    assert "round trip" in proc.stdout
    return str(out) + ".model"


def test_sentencepiece_round_trip(spm_path):
    tok = load_tokenizer(TokenizerConfig(type="sentencepiece", path=spm_path))
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
    assert tok.vocab_size == 120
    text = "the red cat sat on a blue mat"
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids[1:-1]) == text
    assert tok.decode(tok.encode("five quiet trees")) == "five quiet trees"


def test_hf_tokenizer_round_trip(corpus, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

    hf = Tokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train([str(corpus)], trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<pad>", "<unk>", "<s>", "</s>"]))
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(TokenizerConfig(type="hf", path=str(tmp_path)))
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
    text = "the red cat sat on a blue mat"
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == 2 and ids[-1] == 3 and tok.decode(ids[1:-1]) == text
    # special tokens named in tokenizer_config.json win over the guessed names
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<s>"}))
    assert load_tokenizer(TokenizerConfig(type="hf", path=str(tmp_path))).eos_id == 2
    assert load_tokenizer(TokenizerConfig(type="hf", path=str(tmp_path))).end_ids == ()
    # Llama 3's generation_config.json lists several end tokens: all end a response
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9, 7]}))
    assert load_tokenizer(TokenizerConfig(type="hf", path=str(tmp_path))).end_ids == (7, 9)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert load_tokenizer(TokenizerConfig(type="hf", path=str(tmp_path))).end_ids == (5,)
    for bad in ({"eos_token_id": [2, 100000]}, {"eos_token_id": "x"}):
        (tmp_path / "generation_config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="generation_config.json: eos_token_id .* is not a "
                                             "token id"):
            load_tokenizer(TokenizerConfig(type="hf", path=str(tmp_path)))
    # every JSON file of the folder, torn (a copy cut short), binary or not an object: an
    # error naming the file and what is wrong
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    for name in ("generation_config.json", "tokenizer_config.json", "special_tokens_map.json"):
        good = (tmp_path / name).read_bytes() if (tmp_path / name).exists() else None
        for content, message in ((b'{"eos_token": "<s', "is damaged or unreadable"),
                                 (b"\xff\xfe\x00{", "is damaged or unreadable"),
                                 (b"[1, 2]", "is not a JSON object \\(it holds a list\\)")):
            (tmp_path / name).write_bytes(content)
            with pytest.raises(ValueError, match=f"{name} {message}"):
                load_tokenizer(TokenizerConfig(type="hf", path=str(tmp_path)))
        if good is None:
            (tmp_path / name).unlink()
        else:
            (tmp_path / name).write_bytes(good)


def test_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.path is unset"):
        load_tokenizer(TokenizerConfig(path=None))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(TokenizerConfig(path=str(tmp_path / "nope.model")))
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a readable sentencepiece model"):
        load_tokenizer(TokenizerConfig(path=str(junk)))
    with pytest.raises(ValueError, match="not a readable tokenizers JSON"):
        load_tokenizer(TokenizerConfig(type="hf", path=str(junk)))
    proc = subprocess.run([sys.executable, "tools/train_tokenizer.py", "--input",
                           str(tmp_path / "missing.txt"), "--out", str(tmp_path / "t")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_vocab_mismatch_is_rejected(spm_path, tmp_path):
    from conftest import run_cli
    seqs = tmp_path / "s.jsonl"
    seqs.write_text('{"text": "the cat"}\n')
    proc = run_cli("score", "--input", str(seqs), "--output", str(tmp_path / "o.jsonl"),
                   f"tokenizer.path={spm_path}", "model.vocab_size=50", check=False)
    assert proc.returncode == 2
    assert "model.vocab_size=50 is smaller than the tokenizer's vocabulary (120" in proc.stderr
