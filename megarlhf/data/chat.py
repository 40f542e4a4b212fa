"""Chat templates and conversations.

A Hugging Face model directory's chat template (``chat_template`` in
``tokenizer_config.json``, or ``chat_template.jinja``) is rendered by jinja2 in the
sandboxed environment and with the globals ``transformers``' ``apply_chat_template`` uses,
so a conversation becomes the same text it would there.

Which tokens are trained: each assistant turn is the text a render of the conversation up
to that turn adds after a render of the turns before it with the generation prompt - so
what the model learns to write is exactly what follows the prompt it will be given at
generation time. The pieces are tokenized one by one (prompt pieces, then assistant
pieces), as a rollout tokenizes its prompt alone and appends what it samples.
"""

from __future__ import annotations

import json
from datetime import datetime

ROLES = ("system", "user", "assistant", "tool")


class ChatTemplate:
    """A compiled jinja chat template with the tokenizer's special tokens as variables."""

    def __init__(self, source: str, special_tokens: dict[str, str], origin: str,
                 kwargs: dict | None = None):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.origin = origin
        try:
            self.template = env.from_string(source)
        except TemplateError as err:
            raise ValueError(f"chat template {origin}: {err}") from None
        self.special_tokens = special_tokens
        self.kwargs = dict(kwargs or {})  # tokenizer.chat_template_kwargs, every render

    def render(self, messages: list[dict], add_generation_prompt: bool,
               tools: list[dict] | None = None) -> str:
        """The conversation's text; ``tools`` (JSON schemas, ``megarlhf.data.tools``) is
        the template's ``tools`` variable, None when there are none - as transformers'
        ``apply_chat_template(..., tools=...)`` passes it."""
        from jinja2.exceptions import TemplateError

        try:
            return self.template.render(messages=messages, tools=tools,
                                        add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens, **self.kwargs)
        except TemplateError as err:
            raise ValueError(f"chat template {self.origin}: {err}") from None


def check_messages(messages, where: str, *, needs_assistant: bool,
                   ends_with_assistant: bool = False, empty_assistant: bool = False
                   ) -> list[dict]:
    """A conversation as a list of {role, content} with known roles and non-empty text
    (an assistant's may be empty with ``empty_assistant``: a model's turn as it was
    sampled); errors name ``where`` (file, row, column) and the turn."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: a conversation must be a non-empty list of "
                         f"{{'role', 'content'}} messages, got {type(messages).__name__}")
    out = []
    for i, msg in enumerate(messages):
        turn = f"{where} message {i}"
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise ValueError(f"{turn}: must be a mapping with 'role' and 'content'")
        role, content = msg["role"], msg["content"]
        if role not in ROLES:
            raise ValueError(f"{turn}: unknown role {role!r} (use one of {', '.join(ROLES)})")
        calls = msg.get("tool_calls")
        if calls is not None:  # an assistant's tool calls: its text may be empty
            if role != "assistant":
                raise ValueError(f"{turn} ({role}): only an assistant turn has tool_calls")
            from megarlhf.data.tools import check_tool_calls
            calls = check_tool_calls(calls, turn)
        if not isinstance(content, str) or (not content.strip() and not calls and not (
                empty_assistant and role == "assistant")):
            raise ValueError(f"{turn} ({role}): empty content")
        out.append({"role": role, "content": content, **({"tool_calls": calls} if calls
                                                         else {})})
    if needs_assistant and not any(m["role"] == "assistant" for m in out):
        raise ValueError(f"{where}: no assistant turn to train on")
    if ends_with_assistant and out[-1]["role"] != "assistant":
        raise ValueError(f"{where}: the conversation must end with the assistant's turn")
    if not needs_assistant and out[-1]["role"] == "assistant":
        raise ValueError(f"{where}: a prompt must not end with an assistant turn (the model "
                         "answers it)")
    return out


def _assistant_turns(template: ChatTemplate, messages: list[dict], where: str,
                     tools: list[dict] | None = None):
    """For each assistant turn i: (i, the render of the turns before it with the generation
    prompt, the render of the conversation up to it); the second must extend the first."""
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = template.render(messages[:i], add_generation_prompt=True, tools=tools) if i else ""
        upto = template.render(messages[:i + 1], add_generation_prompt=False, tools=tools)
        if not upto.startswith(before):
            raise _not_an_extension(template, i, where)
        yield i, before, upto


def _not_an_extension(template: ChatTemplate, turn: int, where: str) -> ValueError:
    return ValueError(f"{where}: the chat template {template.origin} does not render turn "
                      f"{turn} as an extension of the turns before it, so the assistant's "
                      "tokens cannot be told apart")


def assistant_spans(template: ChatTemplate, messages: list[dict], where: str,
                    tools: list[dict] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """(the whole conversation's text, the character spans of its assistant turns)."""
    full = template.render(messages, add_generation_prompt=False, tools=tools)
    spans = []
    for i, before, upto in _assistant_turns(template, messages, where, tools):
        if not full.startswith(upto):
            raise _not_an_extension(template, i, where)
        if len(upto) > len(before):
            spans.append((len(before), len(upto)))
    return full, spans


def assistant_rows(template: ChatTemplate, messages: list[dict], where: str,
                   tools: list[dict] | None = None) -> list[tuple[str, list[tuple[int, int]]]]:
    """The training rows of a conversation: one (text, assistant spans) row when the template
    renders each turn as an extension of the turns before it; otherwise (Qwen3's template
    drops the think blocks of earlier assistant turns) one row per assistant turn - the
    conversation up to that turn, rendered as the model sees it when it writes that turn,
    with that turn trained (``tools``: the template's tools variable). A turn that does not even extend its own prompt is refused."""
    try:
        return [assistant_spans(template, messages, where, tools)]
    except ValueError:
        pass
    return [(upto, [(len(before), len(upto))])
            for _, before, upto in _assistant_turns(template, messages, where, tools)
            if len(upto) > len(before)]


def tokenize_pieces(text: str, spans: list[tuple[int, int]], encode
                    ) -> tuple[list[int], list[int]]:
    """(token ids, 1 on tokens inside ``spans``) with each piece encoded on its own."""
    tokens: list[int] = []
    trained: list[int] = []
    start = 0
    for lo, hi in spans + [(len(text), len(text))]:
        for piece, flag in ((text[start:lo], 0), (text[lo:hi], 1)):
            if piece:
                ids = encode(piece)
                tokens += ids
                trained += [flag] * len(ids)
        start = hi
    return tokens, trained
