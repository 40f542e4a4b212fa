"""Tool calls (``megarlhf.data.tools``): the families' templates render a ``tools`` list,
an assistant's tool calls and the tools' answers as transformers' ``apply_chat_template(...,
tools=...)`` does, and what a model writes in each family's format is read back into the
calls it rendered - a malformed call is an error meant for the model, not a crash."""

from __future__ import annotations

import pytest

from chat_model import make_chat_model
from megarlhf.config import TokenizerConfig
from megarlhf.data.chat import check_messages
from megarlhf.data.tokenizer import load_tokenizer
from megarlhf.data.tools import (ToolCall, ToolCallError, error_observation,
                                 parse_tool_calls)

TOOLS = [
    {"type": "function", "function": {
        "name": "lookup", "description": "The colour of a named thing.",
        "parameters": {"type": "object", "properties": {"thing": {"type": "string"}},
                       "required": ["thing"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "a + b",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                        "b": {"type": "number"}}}}},
]
CALL = {"type": "function", "function": {"name": "lookup", "arguments": {"thing": "sky"}}}
ROUND_TRIP = [
    {"role": "system", "content": "Answer with one word."},
    {"role": "user", "content": "What colour is the sky?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "blue"},
    {"role": "assistant", "content": "blue"},
]


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def family(request, tmp_path_factory):
    model = make_chat_model(str(tmp_path_factory.mktemp(request.param)), family=request.param)
    tok = load_tokenizer(TokenizerConfig(type="hf", path=model["hf"]))
    return request.param, model["tokenizer"], tok


@pytest.mark.parametrize("upto, gen", [(2, True), (3, False), (4, True), (5, False)])
def test_tools_render_as_transformers_does(family, upto, gen):
    """The tools listed (Llama 3.1: in the first user turn, indented JSON; Qwen3: in the
    system turn), the assistant's call (JSON / a <tool_call> block), the tool's answer
    (an ipython turn / a <tool_response> in a user turn): the text transformers renders."""
    _, hf, tok = family
    messages = check_messages(ROUND_TRIP[:upto], "test", needs_assistant=not gen)
    ours = tok.chat_template.render(messages, add_generation_prompt=gen, tools=TOOLS)
    assert ours == hf.apply_chat_template(ROUND_TRIP[:upto], tools=TOOLS, tokenize=False,
                                          add_generation_prompt=gen)
    assert '"name": "lookup"' in ours


def test_without_tools_the_render_is_unchanged(family):
    _, hf, tok = family
    messages = ROUND_TRIP[:2]
    assert tok.chat_template.render(messages, add_generation_prompt=True) == \
        hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "lookup" not in tok.chat_template.render(messages, add_generation_prompt=True)


def test_a_rendered_call_reads_back_as_the_call(family):
    """What the template writes for the assistant's call - what a model trained on it
    writes - parses back into that call, in the family's format."""
    name, _, tok = family
    before = tok.chat_template.render(ROUND_TRIP[:2], add_generation_prompt=True, tools=TOOLS)
    after = tok.chat_template.render(ROUND_TRIP[:3], add_generation_prompt=False, tools=TOOLS)
    assert after.startswith(before)
    written = after[len(before):]
    end = "<|eot_id|>" if name == "llama3" else "<|im_end|>"
    written = written[:written.index(end)]
    text, calls = parse_tool_calls(written, "llama3_json" if name == "llama3" else "hermes")
    assert calls == [ToolCall("lookup", {"thing": "sky"})]
    # Qwen3 writes the last turn's (empty) think block first: text, not a call
    assert text == ("<think>\n\n</think>" if name == "qwen3" else "")
    assert calls[0].message_entry() == CALL


def test_hermes_calls_and_text_around_them():
    text, calls = parse_tool_calls(
        'Let me check.\n<tool_call>\n{"name": "lookup", "arguments": {"thing": "sea"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}'
        '\n</tool_call>', "hermes")
    assert text == "Let me check."
    assert calls == [ToolCall("lookup", {"thing": "sea"}), ToolCall("add", {"a": 1, "b": 2})]
    assert parse_tool_calls("just words", "hermes") == ("just words", [])
    assert parse_tool_calls("blue", "llama3_json") == ("blue", [])
    assert parse_tool_calls('<|python_tag|>{"name": "add", "parameters": {"a": 1}}',
                            "llama3_json") == ("", [ToolCall("add", {"a": 1})])


@pytest.mark.parametrize("text, fmt, message", [
    ('<tool_call>\n{"name": "lookup", "arguments": {"thing": }\n</tool_call>', "hermes",
     "is not valid JSON (Expecting value at character"),
    ('<tool_call>\n{"name": "lookup"', "hermes", "a <tool_call> is not closed by </tool_call>"),
    ('<tool_call>{"arguments": {}}</tool_call>', "hermes", 'a tool call needs a "name" string'),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "hermes",
     'the "arguments" of a call to add must be a JSON object, got [1, 2]'),
    ('<tool_call>["lookup"]</tool_call>', "hermes", "a tool call must be a JSON object"),
    ('{"name": "add", "parameters": {"a": 1}', "llama3_json", "is not valid JSON"),
    ('{"name": 3, "parameters": {}}', "llama3_json", 'a tool call needs a "name" string'),
])
def test_a_malformed_call_is_an_error_for_the_model(text, fmt, message):
    with pytest.raises(ToolCallError) as err:
        parse_tool_calls(text, fmt)
    assert message in str(err.value)
    observation = error_observation(err.value)
    assert observation["role"] == "tool" and observation["content"].startswith("Error: ")


def test_tool_calls_in_data_files_are_checked():
    ok = check_messages(ROUND_TRIP, "rows.jsonl row 1", needs_assistant=True)
    assert ok[2] == {"role": "assistant", "content": "", "tool_calls": [CALL]}
    with pytest.raises(ValueError, match="message 0 \\(user\\): only an assistant turn has "
                                         "tool_calls"):
        check_messages([{"role": "user", "content": "x", "tool_calls": [CALL]}], "rows.jsonl",
                       needs_assistant=False)
    with pytest.raises(ValueError, match='tool call 0: the "arguments" of a call to lookup '
                                         "must be a JSON object"):
        check_messages([{"role": "user", "content": "x"},
                        {"role": "assistant", "content": "",
                         "tool_calls": [{"function": {"name": "lookup", "arguments": 3}}]}],
                       "rows.jsonl", needs_assistant=True)
    with pytest.raises(ValueError, match="message 1 \\(assistant\\): empty content"):
        check_messages([{"role": "user", "content": "x"},
                        {"role": "assistant", "content": " "}], "rows.jsonl",
                       needs_assistant=True)
    with pytest.raises(ValueError, match="unknown tool call format 'xml'|use one of"):
        parse_tool_calls("x", "xml")
