"""Chat templates and conversational datasets, against transformers' ``apply_chat_template``
on a model directory saved by transformers (tokenizer.json, tokenizer_config.json with a
ChatML template)."""

from __future__ import annotations

import json

import pytest

from chat_model import make_chat_model
from megarlhf.config import DataConfig, TokenizerConfig
from megarlhf.data.datasets import tokenize_dataset
from megarlhf.data.synthetic import write_jsonl
from megarlhf.data.tokenizer import load_tokenizer

CONVERSATION = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "words: red cat"},
                {"role": "assistant", "content": "cat red"},
                {"role": "user", "content": "words: blue sky"},
                {"role": "assistant", "content": "sky blue"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_chat_model(str(tmp_path_factory.mktemp("chat")))


@pytest.fixture(scope="module")
def tok(model):
    return load_tokenizer(TokenizerConfig(type="hf", path=model["hf"]))


DATA = DataConfig(max_prompt_len=64, max_seq_len=128)


def hf_ids(hf, messages, add_generation_prompt):
    """transformers' token ids of a conversation (a list, or a dict in transformers 5)."""
    out = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_special_tokens_and_template_from_the_model_directory(model, tok):
    hf = model["tokenizer"]
    assert (tok.eos_id, tok.bos_id, tok.pad_id) == (hf.eos_token_id, hf.bos_token_id,
                                                    hf.pad_token_id)
    assert tok.chat_template is not None
    for messages, gen in ((CONVERSATION, False), (CONVERSATION[:4], True),
                          (CONVERSATION[1:2], True)):
        assert tok.chat_template.render(messages, add_generation_prompt=gen) == \
            hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    none = load_tokenizer(TokenizerConfig(type="hf", path=model["hf"], chat_template="none"))
    assert none.chat_template is None


def test_template_from_a_file_and_errors(model, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    tok = load_tokenizer(TokenizerConfig(type="hf", path=model["hf"], chat_template=str(path)))
    assert tok.chat_template.render(CONVERSATION[1:3], False) == "[user] words: red cat\n" \
        "[assistant] cat red\n"
    with pytest.raises(FileNotFoundError, match="tokenizer.chat_template"):
        load_tokenizer(TokenizerConfig(type="hf", path=model["hf"], chat_template="missing"))
    latin1 = tmp_path / "latin1.jinja"  # not UTF-8: named, not a bare codec error
    latin1.write_bytes(b"{{ 'caf\xe9' }}")
    with pytest.raises(ValueError, match="latin1.jinja is not UTF-8 text"):
        load_tokenizer(TokenizerConfig(type="hf", path=model["hf"], chat_template=str(latin1)))


def test_sft_messages_train_every_assistant_turn_only(model, tok, tmp_path):
    path = write_jsonl(str(tmp_path / "sft.jsonl"), [{"messages": CONVERSATION}])
    ds = tokenize_dataset(path, "sft", DATA, tok)
    (tokens, weights), = ds.examples()
    hf = model["tokenizer"]
    text = hf.apply_chat_template(CONVERSATION, tokenize=False)
    assert tok.decode(tokens) == text
    trained = [tokens[t + 1] for t, w in enumerate(weights) if w]
    assert tok.decode(trained) == "cat red<|im_end|>\nsky blue<|im_end|>\n"
    # the prompt part is what generation would be given before the first answer
    assert ds.prompts[0] == hf_ids(hf, CONVERSATION[:2], True)


def test_prompt_messages_end_with_the_generation_prompt(model, tok, tmp_path):
    rows = [{"messages": CONVERSATION[:2]}, {"messages": CONVERSATION[1:4]}]
    ds = tokenize_dataset(write_jsonl(str(tmp_path / "p.jsonl"), rows), "prompt", DATA, tok)
    hf = model["tokenizer"]
    for row, ids in zip(rows, ds.prompts, strict=True):
        assert ids == hf_ids(hf, row["messages"], True)
        assert tok.decode(ids).endswith("<|im_start|>assistant\n")


def test_preference_pairs_in_both_conversational_shapes_and_as_strings(model, tok, tmp_path):
    user = {"role": "user", "content": "words: red cat"}
    good, bad = {"role": "assistant", "content": "red red"}, {"role": "assistant",
                                                              "content": "cat"}
    rows = [{"chosen": [user, good], "rejected": [user, bad]},  # HH-RLHF
            {"prompt": "words: red cat", "chosen": [user, good], "rejected": [user, bad]},
            {"prompt": [user], "chosen": [good], "rejected": [bad]}]  # explicit prompt
    ds = tokenize_dataset(write_jsonl(str(tmp_path / "pr.jsonl"), rows), "preference", DATA,
                          tok)
    hf = model["tokenizer"]
    want_prompt = hf_ids(hf, [user], True)
    for i in range(3):
        assert ds.prompts[i] == want_prompt
        assert tok.decode(ds.prompts[i] + ds.chosen[i]) == hf.apply_chat_template(
            [user, good], tokenize=False)
        assert tok.decode(ds.rejected[i]) == "cat<|im_end|>\n"
    strings = tokenize_dataset(write_jsonl(str(tmp_path / "s.jsonl"), [
        {"prompt": "words: red cat", "chosen": "red red", "rejected": "cat"}]), "preference",
        DATA, tok)
    assert strings.chosen[0][-1] == tok.eos_id  # text rows: no template, EOS appended


@pytest.mark.parametrize("row,kind,match", [
    ({"messages": [{"role": "robot", "content": "hi"}]}, "sft", "row 1 .* unknown role 'robot'"),
    ({"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "a"}]},
     "sft", "row 1 .*message 0 \\(user\\): empty content"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "sft", "no assistant turn"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}]},
     "prompt", "must not end with an assistant turn"),
    ({"messages": "hello"}, "sft", "must be a non-empty list"),
    ({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
      "rejected": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]},
     "preference", "share no first turns"),
])
def test_malformed_conversations_name_row_and_field(tok, tmp_path, row, kind, match):
    path = write_jsonl(str(tmp_path / "bad.jsonl"), [row])
    with pytest.raises(ValueError, match=match):
        tokenize_dataset(path, kind, DATA, tok)


def test_conversations_need_a_template(model, tmp_path):
    tok = load_tokenizer(TokenizerConfig(type="hf", path=model["hf"], chat_template="none"))
    path = write_jsonl(str(tmp_path / "c.jsonl"), [{"messages": CONVERSATION}])
    with pytest.raises(ValueError, match="no chat template"):
        tokenize_dataset(path, "sft", DATA, tok)


def test_the_chat_task_files_read(model, tok):
    for kind, key in (("sft", "sft"), ("preference", "prefs"), ("prompt", "prompts")):
        ds = tokenize_dataset(model[key], kind, DATA, tok)
        assert len(ds) == sum(1 for _ in open(model[key]))
    multi = [json.loads(line) for line in open(model["sft"])][0]
    assert sum(m["role"] == "assistant" for m in multi["messages"]) == 2


FIXTURES = "tests/fixtures/chat"


SHAPES = (("sft_messages", "sft"), ("prompts_messages", "prompt"), ("prefs_hh", "preference"),
          ("prefs_ultrafeedback", "preference"), ("prefs_strings", "preference"))


def _read_fixture(tok, path: str, kind: str) -> tuple:
    ds = tokenize_dataset(path, kind, DATA, tok)
    return ds.prompts, ds.responses, ds.chosen, ds.rejected, ds.weights


def _converted(src: str, fmt: str, out) -> str:
    """``src`` (JSONL) written by ``datasets`` as Parquet, a folder of .arrow files, or a
    save_to_disk folder."""
    import datasets

    table = datasets.load_dataset("json", data_files=src, split="train")
    if fmt == "parquet":
        table.to_parquet(str(out) + ".parquet")
        return str(out) + ".parquet"
    table.save_to_disk(str(out))
    if fmt == "save_to_disk":
        return str(out)
    arrows = out.parent / f"{out.name}_arrow"
    arrows.mkdir()
    for f in out.glob("*.arrow"):
        (arrows / f.name).write_bytes(f.read_bytes())
    return str(arrows)


def test_hand_written_fixtures_of_each_shape(tok):
    got = {name: _read_fixture(tok, f"{FIXTURES}/{name}.jsonl", kind) for name, kind in SHAPES}
    hh, uf = got["prefs_hh"], got["prefs_ultrafeedback"]
    assert hh[0] == uf[0] and hh[2] == uf[2] and hh[3] == uf[3]  # one pair, two shapes
    prompts, _, _, _, weights = got["sft_messages"]
    assert len(prompts) == 2 and sum(weights[1]) > sum(weights[0])  # two answered turns
    assert got["prompts_messages"][0][1] != got["prompts_messages"][0][0]


@pytest.mark.parametrize("fmt", ["parquet", "arrow", "save_to_disk"])
def test_fixtures_read_the_same_from_every_file_format(tok, tmp_path, fmt):
    for name, kind in SHAPES:
        src = f"{FIXTURES}/{name}.jsonl"
        assert _read_fixture(tok, _converted(src, fmt, tmp_path / name), kind) == \
            _read_fixture(tok, src, kind), name


# ------------------------------------------------------------------ the families' own shapes

LONG = DataConfig(max_prompt_len=256, max_seq_len=512)  # Llama 3's dated system header

@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def family(request, tmp_path_factory):
    return request.param, make_chat_model(str(tmp_path_factory.mktemp(request.param)),
                                          family=request.param)


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_family_templates_render_as_transformers_does(family, kwargs):
    """Llama 3's header template (dated system turn) and Qwen3's (think blocks, the
    enable_thinking switch through tokenizer.chat_template_kwargs) render like
    ``apply_chat_template(**kwargs)``; the tokens they ship as end tokens are read."""
    name, model = family
    hf = model["tokenizer"]
    tok = load_tokenizer(TokenizerConfig(type="hf", path=model["hf"],
                                         chat_template_kwargs=kwargs))
    assert tok.eos_id == hf.eos_token_id and set(tok.end_ids) | {tok.eos_id} == set(model["ends"])
    thinking = [*CONVERSATION[:2], {"role": "assistant",
                                    "content": "<think>\nsort them\n</think>\n\ncat red"}]
    for messages, gen in ((CONVERSATION, False), (CONVERSATION[:4], True),
                          (CONVERSATION[1:2], True), (thinking, False)):
        ours = tok.chat_template.render(messages, add_generation_prompt=gen)
        assert ours == hf.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=gen, **kwargs)
    prompt = tok.chat_template.render(CONVERSATION[1:2], add_generation_prompt=True)
    if name == "qwen3":
        assert prompt.endswith("<think>\n\n</think>\n\n") == (kwargs == {"enable_thinking": False})
    else:
        assert "Today Date: " in prompt and prompt.startswith("<|begin_of_text|>")


def test_prompts_and_single_turn_sft_in_the_families_templates(family, tmp_path):
    """RL prompts end with the family's generation prompt; single-turn SFT trains exactly
    the assistant's text; Qwen3's template drops earlier turns' think blocks, so a multi-turn
    conversation becomes one row per assistant turn, each rendered as the model sees it
    when it writes that turn (Llama 3's: one row, every turn trained)."""
    name, model = family
    hf = model["tokenizer"]
    tok = load_tokenizer(TokenizerConfig(type="hf", path=model["hf"]))
    rows = tmp_path / "rows.jsonl"
    write_jsonl(str(rows), [{"messages": CONVERSATION[1:3]}])
    ds = tokenize_dataset(str(rows), "sft", LONG, tok)
    tokens, weights = ds.examples()[0]
    trained = [t for t, w in zip(tokens, weights, strict=True) if w]
    assert tok.decode(tokens) == hf.apply_chat_template(CONVERSATION[1:3], tokenize=False)
    assert "cat red" in tok.decode(trained) and "words" not in tok.decode(trained)
    write_jsonl(str(rows), [{"messages": CONVERSATION[1:2]}])
    prompts = tokenize_dataset(str(rows), "prompt", LONG, tok).prompts
    assert tok.decode(prompts[0]) == hf.apply_chat_template(CONVERSATION[1:2], tokenize=False,
                                                            add_generation_prompt=True)
    thinking = [*CONVERSATION[1:3], CONVERSATION[3],
                {"role": "assistant", "content": "<think>\nswap\n</think>\n\nsky blue"}]
    thinking[1] = {"role": "assistant", "content": "<think>\nsort\n</think>\n\ncat red"}
    write_jsonl(str(rows), [{"messages": thinking}])
    examples = tokenize_dataset(str(rows), "sft", LONG, tok).examples()
    if name == "qwen3":
        assert len(examples) == 2
        for turn, (tokens, weights) in zip((2, 4), examples, strict=True):
            text = hf.apply_chat_template(thinking[:turn], tokenize=False)
            assert tok.decode(tokens) == text  # the conversation up to the turn, as rendered
            # weight t is the loss of predicting token t + 1
            trained = tok.decode([tokens[t + 1] for t, w in enumerate(weights) if w])
            assert trained.startswith("<think>\nswap" if turn == 4 else "<think>\nsort")
            assert "words" not in trained
    else:
        assert len(examples) == 1
