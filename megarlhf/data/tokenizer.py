"""Tokenizers behind one small interface: sentencepiece models and Hugging Face
``tokenizer.json`` files."""

from __future__ import annotations

import json
import os
from typing import Protocol

from megarlhf.config import TokenizerConfig


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int
    # Tokens besides EOS that end a response as the model ships (Llama 3's
    # generation_config.json lists <|eot_id|> and <|eom_id|>); rollouts stop at them and
    # the missing-stop rule counts them, beside rollout.stop_token_ids.
    end_ids: tuple[int, ...]

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def pieces(self) -> list[str]: ...


class SentencePieceTokenizer:
    """A sentencepiece model; pad falls back to EOS when the model defines none."""

    def __init__(self, path: str):
        import sentencepiece as spm

        self.path = path
        try:
            self.sp = spm.SentencePieceProcessor(model_file=path)
        except Exception as err:  # sentencepiece raises OSError/RuntimeError variants
            raise ValueError(f"{path} is not a readable sentencepiece model: {err}") from None
        self.vocab_size = self.sp.get_piece_size()
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        if self.sp.eos_id() < 0:
            raise ValueError(f"sentencepiece model {path} has no EOS piece (train it with "
                             "eos_id set; tools/train_tokenizer.py does)")
        self.eos_id = self.sp.eos_id()
        self.pad_id = self.sp.pad_id() if self.sp.pad_id() >= 0 else self.eos_id
        self.end_ids = ()

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = self.sp.encode(text)
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids + [self.eos_id] if add_eos else ids

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode([i for i in ids if i < self.vocab_size])

    def pieces(self) -> list[str]:
        return [self.sp.id_to_piece(i) for i in range(self.vocab_size)]

    def special_tokens(self) -> dict[str, str]:
        out = {"eos_token": self.sp.id_to_piece(self.eos_id)}
        if self.bos_id is not None:
            out["bos_token"] = self.sp.id_to_piece(self.bos_id)
        out["pad_token"] = self.sp.id_to_piece(self.pad_id)
        return out

    def default_chat_template(self) -> tuple[str, str] | None:
        return None


class HFTokenizer:
    """A Hugging Face ``tokenizers`` JSON file (``tokenizer.json``), with the special
    tokens read from ``tokenizer_config.json`` / ``special_tokens_map.json`` beside it
    when present, else guessed from common names."""

    _EOS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|im_end|>")
    _BOS = ("<s>", "<|begin_of_text|>", "<bos>")
    _PAD = ("<pad>", "<|pad|>", "[PAD]")

    def __init__(self, path: str):
        from tokenizers import Tokenizer as HFTok

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        try:
            self.tok = HFTok.from_file(file)
        except Exception as err:
            raise ValueError(f"{file} is not a readable tokenizers JSON file: {err}") from None
        self.path = file
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.folder = os.path.dirname(file)
        named = self._special_tokens(self.folder)
        self.eos_id = self._find(named.get("eos_token"), self._EOS)
        if self.eos_id is None:
            raise ValueError(f"{file}: no EOS token found (looked for {named.get('eos_token')} "
                             f"and {', '.join(self._EOS)})")
        self.bos_id = self._find(named.get("bos_token"), self._BOS)
        pad = self._find(named.get("pad_token"), self._PAD)
        self.pad_id = self.eos_id if pad is None else pad
        self.end_ids = self._generation_end_ids(self.folder)

    def _generation_end_ids(self, folder: str) -> tuple[int, ...]:
        """The end tokens ``generation_config.json`` beside the tokenizer lists
        (``eos_token_id``: one id or a list), other than EOS; checked against the
        vocabulary."""
        path = os.path.join(folder, "generation_config.json")
        if not os.path.exists(path):
            return ()
        ids = _json_object(path).get("eos_token_id")
        ids = [ids] if isinstance(ids, int) else (ids or [])
        for token in ids:
            if not isinstance(token, int) or isinstance(token, bool) \
                    or not 0 <= token < self.vocab_size:
                raise ValueError(f"{path}: eos_token_id {token!r} is not a token id of this "
                                 f"tokenizer (0 .. {self.vocab_size - 1})")
        return tuple(dict.fromkeys(t for t in ids if t != self.eos_id))

    def special_tokens(self) -> dict[str, str]:
        """The special tokens' texts, as a chat template reads them (``bos_token``...)."""
        out = {"eos_token": self.tok.id_to_token(self.eos_id),
               "pad_token": self.tok.id_to_token(self.pad_id)}
        if self.bos_id is not None:
            out["bos_token"] = self.tok.id_to_token(self.bos_id)
        return out

    def default_chat_template(self) -> tuple[str, str] | None:
        """(template, where it came from) of this model directory, if it has one:
        ``chat_template.jinja``, else ``chat_template`` in tokenizer_config.json (a
        string, or a list of named templates: the one named 'default')."""
        jinja = os.path.join(self.folder, "chat_template.jinja")
        if os.path.exists(jinja):
            return _text(jinja), jinja
        config = os.path.join(self.folder, "tokenizer_config.json")
        if not os.path.exists(config):
            return None
        template = _json_object(config).get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return (template, config) if isinstance(template, str) and template else None

    @staticmethod
    def _special_tokens(folder: str) -> dict:
        found: dict = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            path = os.path.join(folder, name)
            if os.path.exists(path):
                data = _json_object(path)
                for key in ("eos_token", "bos_token", "pad_token"):
                    value = data.get(key)
                    if isinstance(value, dict):
                        value = value.get("content")
                    if isinstance(value, str):
                        found.setdefault(key, value)
        return found

    def _find(self, preferred: str | None, candidates: tuple) -> int | None:
        for token in ((preferred,) if preferred else ()) + candidates:
            token_id = self.tok.token_to_id(token)
            if token_id is not None:
                return token_id
        return None

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids + [self.eos_id] if add_eos else ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode([i for i in ids if i < self.vocab_size],
                               skip_special_tokens=False)

    def pieces(self) -> list[str]:
        vocab = self.tok.get_vocab(with_added_tokens=True)
        return [piece for piece, _ in sorted(vocab.items(), key=lambda kv: kv[1])]


def _text(path: str) -> str:
    """A chat template file's text, or an error naming it when it is not UTF-8."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}): "
                         "is this the chat template?") from None


def _json_object(path: str) -> dict:
    """A tokenizer folder's JSON file (tokenizer_config.json, special_tokens_map.json,
    generation_config.json), or an error naming it and what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is damaged or unreadable ({err}): restore it from the model's "
                         "original files, or delete it if the tokenizer does not need it"
                         ) from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object (it holds a {type(data).__name__})")
    return data


def fingerprint(tokenizer) -> dict:
    """What a checkpoint records of the tokenizer it was trained with: the vocabulary size
    and a hash of the pieces in id order (two tokenizers of equal size still differ)."""
    import hashlib

    digest = hashlib.sha256("\x00".join(tokenizer.pieces()).encode()).hexdigest()[:16]
    return {"vocab_size": tokenizer.vocab_size, "sha256": digest}


def load_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    if cfg.path is None:
        raise ValueError("tokenizer.path is unset: point it at a sentencepiece .model file "
                         "or a tokenizer.json (tools/train_tokenizer.py makes one)")
    if not os.path.exists(cfg.path):
        raise FileNotFoundError(f"tokenizer.path={cfg.path!r} does not exist")
    tokenizer = SentencePieceTokenizer(cfg.path) if cfg.type == "sentencepiece" \
        else HFTokenizer(cfg.path)
    tokenizer.add_bos = cfg.add_bos  # prompts and scored texts start with BOS when set
    tokenizer.chat_template = _chat_template(cfg, tokenizer)
    return tokenizer


def _chat_template(cfg: TokenizerConfig, tokenizer):
    """``tokenizer.chat_template`` resolved: auto, none or a jinja file."""
    from megarlhf.data.chat import ChatTemplate

    choice = cfg.chat_template
    if choice == "none":
        return None
    if choice == "auto":
        found = tokenizer.default_chat_template()
        return ChatTemplate(found[0], tokenizer.special_tokens(), found[1],
                            cfg.chat_template_kwargs) if found else None
    if not os.path.isfile(choice):
        raise FileNotFoundError(f"tokenizer.chat_template={choice!r}: not 'auto', 'none' or "
                                "an existing jinja file")
    return ChatTemplate(_text(choice), tokenizer.special_tokens(), choice,
                        cfg.chat_template_kwargs)


def train_sentencepiece(text_files: list[str], model_prefix: str, vocab_size: int,
                        model_type: str = "bpe") -> str:
    """Train a sentencepiece model with pad=0, unk=1, bos=2, eos=3; returns its path."""
    import sentencepiece as spm

    for path in text_files:
        if not os.path.exists(path):
            raise FileNotFoundError(f"training text {path!r} does not exist")
    spm.SentencePieceTrainer.train(
        input=",".join(text_files), model_prefix=model_prefix, vocab_size=vocab_size,
        model_type=model_type, pad_id=0, unk_id=1, bos_id=2, eos_id=3,
        character_coverage=1.0, num_threads=2, minloglevel=2,
        hard_vocab_limit=False, bos_piece="<s>", eos_piece="</s>", pad_piece="<pad>")
    return model_prefix + ".model"
