"""What is read: ``tokenizer`` and ``data``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megarlhf.config.fields import require


@dataclass(kw_only=True, frozen=True)
class TokenizerConfig:
    type: Literal["sentencepiece", "hf"] = "sentencepiece"
    """sentencepiece model file, or a Hugging Face ``tokenizer.json``."""
    path: str | None = None
    """Path of the tokenizer file; None allowed only with a random model and token input."""
    add_bos: bool = True
    """Prepend BOS when encoding prompts (text rows; a chat template writes its own)."""
    chat_template: str = "auto"
    """How conversations (``messages`` rows) become text: auto (the model directory's
    template: ``chat_template`` in tokenizer_config.json or chat_template.jinja; none if it
    has none), none (conversations are refused), or the path of a jinja template file."""
    chat_template_kwargs: dict[str, bool | int | float | str] = field(default_factory=dict)
    """Extra variables every render of the chat template gets, as transformers'
    ``apply_chat_template(**kwargs)`` passes them: e.g. ``{enable_thinking: false}`` for
    Qwen3's template (an empty think block after the generation prompt)."""

    def __post_init__(self):
        taken = {"messages", "add_generation_prompt", "bos_token", "eos_token", "pad_token"}
        for key in self.chat_template_kwargs:
            require(key not in taken, "tokenizer.chat_template_kwargs", key,
                    f"names a variable the renderer sets itself ({', '.join(sorted(taken))})")


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    train_path: str | None = None
    """Training data: a .jsonl/.json or .parquet file (or a folder of them)."""
    eval_path: str | None = None
    """Held-out data; None splits ``eval_fraction`` off the training data."""
    eval_fraction: float = 0.0
    """Fraction of training rows held out for evaluation when eval_path is None."""
    prompt_key: str = "prompt"
    """Column holding the prompt."""
    response_key: str = "response"
    """Column holding the SFT response."""
    chosen_key: str = "chosen"
    """Column holding the preferred response."""
    rejected_key: str = "rejected"
    """Column holding the dispreferred response."""
    tools_key: str = "tools"
    """Column holding the tools of a conversation row (JSON schemas, OpenAI shape), which
    the chat template renders (its tools variable); rows without it, or with null, have
    none. Also the tools an environment's episode renders (rollout.environment.name)."""
    messages_key: str = "messages"
    """Column holding a conversation (a list of {role, content}): SFT trains on every
    assistant turn; PPO prompts end before the assistant's answer (the generation prompt
    is appended). Preference rows may instead hold conversations in chosen/rejected
    (sharing their first turns, HH-RLHF style) with an optional prompt (UltraFeedback
    style). Needs a chat template (tokenizer.chat_template)."""
    max_prompt_len: int = 128
    """Prompts longer than this (in tokens) are dropped and counted."""
    max_seq_len: int = 256
    """Prompt+response longer than this are dropped and counted."""
    ptx_path: str | None = None
    """PPO-ptx: pretraining/SFT data (prompt, response) whose next-token loss is mixed into
    the actor's updates (InstructGPT); used when ppo.ptx_coef > 0."""
    packing: bool = False
    """Pack several SFT samples into one sequence (attention isolated per sample)."""

    def __post_init__(self):
        require(0.0 <= self.eval_fraction < 1.0, "data.eval_fraction", self.eval_fraction,
                "must be in [0, 1)")
        require(self.max_prompt_len >= 1, "data.max_prompt_len", self.max_prompt_len,
                "must be >= 1")
