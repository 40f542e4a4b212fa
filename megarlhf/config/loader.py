"""YAML + ``key.sub=value`` overrides -> a validated :class:`Config`.

Every value is checked against the dataclass field's type; an unknown key names the
nearest valid key. Nothing here touches torch or process groups.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
import types
import typing
from typing import Any, Literal, NamedTuple

import yaml

from megarlhf.config.fields import ConfigError
from megarlhf.config.rules import check_section
from megarlhf.config.tree import Config
from megarlhf.config.written import Written

__all__ = ["ALIASES", "SHORTHANDS", "ConfigError", "Loaded", "config_from_dict", "dump_config",
           "load_config",
           "overlay", "parse_overrides", "read_config", "section_from_dict"]


# One name per setting. These older names are read once, here, into the field that now
# holds the setting (a config written before they moved still loads): the shorter
# spellings of a role's checkpoint, and the settings that left the mixed ``ppo`` and
# ``rollout`` sections for sections of their own.
_MOVED = {"ppo.kl_": ("ppo.kl.", ["estimator", "in_reward", "loss_coef", "loss_estimator",
                                  "controller", "target", "horizon"]),
          "rollout.reward_": ("rollout.rewards.", ["fn", "url", "workers", "timeout_s", "batch",
                                                   "retries", "on_error", "error_score"]),
          "rollout.": ("rollout.environment.", ["max_turns", "max_observation_tokens",
                                                "tool_format"])}
ALIASES = {"ppo.sft_checkpoint": "roles.actor.checkpoint",
           "ppo.reward_checkpoint": "roles.reward.checkpoint",
           "dpo.reference_checkpoint": "roles.reference.checkpoint",
           "distill.teacher_checkpoint": "roles.teacher.checkpoint",
           "ppo.init_kl_coef": "ppo.kl.init_coef",
           "ppo.behavior_weight_cap": "ppo.correction.behavior_weight_cap",
           "ppo.rollout_is_cap": "ppo.correction.is_cap",
           "ppo.rollout_mask_low": "ppo.correction.mask_low",
           "ppo.rollout_mask_high": "ppo.correction.mask_high",
           "rollout.ranks": "rollout.placement.ranks",
           "rollout.weight_checksum": "rollout.placement.weight_checksum",
           "rollout.partial": "rollout.placement.partial",
           "rollout.partial_kv": "rollout.placement.partial_kv",
           **{old + name: new + name
              for old, (new, names) in _MOVED.items() for name in names}}
# A section that takes one value as short for its main field: ``rollout.placement: split``
# is ``rollout.placement.mode: split`` (how it was written before it became a section).
SHORTHANDS = {"rollout.placement": "mode", "rollout.environment": "name"}


class Loaded(NamedTuple):
    """A loaded config and what its file and overrides wrote."""

    config: Config
    written: Written


def overlay(base, override, written: Written, where: str, only: tuple[str, ...] | None = None):
    """``base`` with the fields written at ``where`` (the dotted path of ``override``, a
    section of the same type; None changes nothing) on top, nested sections overlaid field
    by field; ``only`` limits the fields taken. The result is checked again."""
    if override is None:
        return base
    changes = {}
    for name in written.fields(where):
        if only is not None and name not in only:
            continue
        value = getattr(override, name)
        current = getattr(base, name)
        if dataclasses.is_dataclass(value) and dataclasses.is_dataclass(current):
            value = overlay(current, value, written, f"{where}.{name}")
        changes[name] = value
    try:
        merged = dataclasses.replace(base, **changes)
        check_section(merged)
    except ValueError as err:
        raise ConfigError(f"{where}: {err}") from None
    return merged


_FLOAT_LITERAL = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _field_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, hint: Any, key: str, keys: set[str]) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key, keys)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else
                          f"{key}={value!r} matches none of {hint}")
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is invalid: choose one of "
                              f"{', '.join(map(repr, allowed))}")
        return value
    if origin is dict:
        key_hint, item = typing.get_args(hint)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} has the wrong type: expected a mapping")
        return {_coerce(k, key_hint, f"{key} key", keys): _coerce(v, item, f"{key}.{k}", keys)
                for k, v in value.items()}
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{key}={value!r} has the wrong type: expected a list")
        return [_coerce(v, item, f"{key}[{i}]", keys) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key, keys)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} has the wrong type: expected true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r} has the wrong type: expected an integer")
        return value
    if hint is float:
        if isinstance(value, str) and _FLOAT_LITERAL.fullmatch(value.strip()):
            # PyYAML (YAML 1.1) reads '1e-5' - no dot in the mantissa - as a string.
            return float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r} has the wrong type: expected a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r} has the wrong type: expected a string")
        return value
    raise AssertionError(f"unsupported config type {hint} at {key}")


def _unknown_key(cls, name: str, prefix: str) -> ConfigError:
    valid = [f.name for f in dataclasses.fields(cls)]
    valid += [alias[len(prefix):] for alias in ALIASES
              if alias.startswith(prefix) and "." not in alias[len(prefix):]]
    near = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    hint = f"; did you mean '{prefix}{near[0]}'?" if near else ""
    section = prefix.rstrip(".") or "<root>"
    return ConfigError(f"unknown config key '{prefix}{name}'{hint} "
                       f"(valid keys under '{section}': {', '.join(valid)})")


def _build(cls, data: Any, key: str, keys: set[str]):
    """``cls`` from ``data``, each value checked against its field's type and the section
    against its rules; the dotted key of every value written goes into ``keys``."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{key or 'config'} must be a mapping, got {type(data).__name__}")
    prefix = f"{key}." if key else ""
    hints = _field_types(cls)
    kwargs = {}
    for name, value in data.items():
        if name not in hints:
            raise _unknown_key(cls, str(name), prefix)
        kwargs[name] = _coerce(value, hints[name], prefix + name, keys)
        keys.add(prefix + name)
    for name, hint in hints.items():  # unwritten sections: built here, with nothing written
        if name not in kwargs and dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, {}, prefix + name, set())
    try:
        built = cls(**kwargs)
        check_section(built)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return built


def _set_path(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    cls = Config
    node = tree
    for depth, part in enumerate(parts):
        hints = _field_types(cls)
        if part not in hints:
            raise _unknown_key(cls, part, ".".join(parts[:depth]) + ("." if depth else ""))
        hint = hints[part]
        if depth == len(parts) - 1:
            node[part] = value
            return
        hint = _section_type(hint)
        if hint is None:
            raise ConfigError(f"'{'.'.join(parts[:depth + 1])}' is a value, not a section")
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise ConfigError(f"'{'.'.join(parts[:depth + 1])}' must be a mapping")
        cls = hint


def _section_type(hint):
    """The dataclass behind ``Section`` or ``Section | None``; None for plain values."""
    if dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = [h for h in typing.get_args(hint) if h is not type(None)]
        if len(options) == 1 and dataclasses.is_dataclass(options[0]):
            return options[0]
    return None


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """``["ppo.clip_eps=0.1", "rollout.stop_token_ids=[2,3]"]`` -> (key, value) pairs (a
    section's shorthand, ``rollout.placement=split``, keyed by its main field), each
    value read as its field's type: a text field takes the text as written (``run.name=on``
    is "on", not YAML 1.1's True; quotes are taken off; null or ~ unsets an optional one),
    any other field reads it as YAML, whose booleans are true and false only (as in
    config files)."""
    pairs = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like key.sub=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        if key in SHORTHANDS:
            key = f"{key}.{SHORTHANDS[key]}"
        pairs.append((key, _override_value(_field_hint(ALIASES.get(key, key)), raw)))
    return pairs


def _override_value(hint: Any, raw: str) -> Any:
    text = raw.strip()
    if not text:
        return None
    quoted = len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""
    if _is_text(hint) and not quoted:
        optional = typing.get_origin(hint) in (typing.Union, types.UnionType) \
            and type(None) in typing.get_args(hint)
        return None if optional and text in ("null", "Null", "NULL", "~") else raw
    try:
        return yaml.load(raw, Loader=_StrictLoader)
    except yaml.YAMLError as err:
        raise ConfigError(f"override value {raw!r} is not valid YAML: {err}") from None


def _field_hint(dotted: str) -> Any:
    """The type of the config field at ``dotted``; None where no field is (the override
    then fails where it is applied, naming the key)."""
    cls = Config
    parts = dotted.split(".")
    for depth, part in enumerate(parts):
        hint = _field_types(cls).get(part)
        if hint is None or depth == len(parts) - 1:
            return hint
        cls = _section_type(hint)
        if cls is None:
            return None
    return None


def _is_text(hint: Any) -> bool:
    """A field that holds text: ``str``, ``str | None``, or a choice of strings."""
    if hint is str:
        return True
    origin = typing.get_origin(hint)
    if origin is Literal:
        return all(isinstance(a, str) for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        return bool(options) and all(_is_text(a) for a in options)
    return False


class _RepeatedKey(ValueError):
    pass


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the
    last, silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _RepeatedKey(f"key '{key}' is given twice, on lines {seen[key]} and "
                                   f"{line}: keep one")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                              _StrictLoader.construct_mapping)
# Booleans as YAML 1.2 has them, true and false only: PyYAML (YAML 1.1) also reads yes, no,
# on, off, y and n as booleans, so "name: on" would be True.
_BOOL = "tag:yaml.org,2002:bool"
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _BOOL]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_StrictLoader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                    list("tTfF"))


def read_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> Loaded:
    """Read ``path`` (YAML; None means all defaults), apply overrides, validate; with the
    config, what the file and the overrides wrote."""
    tree: dict = {}
    if path is not None:
        if not os.path.exists(path):
            raise ConfigError(f"config file not found: {path}")
        with open(path, encoding="utf-8") as f:
            try:
                tree = yaml.load(f, Loader=_StrictLoader) or {}
            except UnicodeDecodeError as err:
                raise ConfigError(f"{path} is not UTF-8 text ({err.reason} at byte "
                                  f"{err.start}): is this the config file?") from None
            except _RepeatedKey as err:
                raise ConfigError(f"{path}: {err}") from None
            except yaml.YAMLError as err:
                raise ConfigError(f"{path} is not valid YAML: {err}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path} must hold a mapping at the top level")
    spelled = _resolve_aliases(tree)
    through_alias: dict[str, tuple[str, Any]] = {}
    direct: dict[str, Any] = {}
    for key, value in parse_overrides(list(overrides)):
        if key in ALIASES:
            through_alias[ALIASES[key]] = (key, value)
        else:
            _set_path(tree, key, value)
            direct[key] = value
            spelled.pop(key, None)
    for canonical, (alias, value) in through_alias.items():
        _set_alias(tree, canonical, direct.get(canonical), alias, value, spelled)
    return _load(tree, spelled)


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    """:func:`read_config` without the provenance."""
    return read_config(path, overrides).config


def config_from_dict(tree: dict) -> Config:
    """A validated :class:`Config` from a nested dict (same rules as YAML files)."""
    tree = copy.deepcopy(tree)
    return _load(tree, _resolve_aliases(tree)).config


def _load(tree: dict, spelled: dict[str, str]) -> Loaded:
    keys: set[str] = set()
    config = _build(Config, tree, "", keys)
    return Loaded(config, Written(frozenset(keys), spelled))


def _resolve_aliases(tree: dict) -> dict[str, str]:
    """Move each alias a config file wrote into its field, and each section's shorthand
    into its main field (in place). Returns, for the fields written through an alias, the
    alias (for messages)."""
    for dotted, main in SHORTHANDS.items():
        section_name, name = dotted.split(".")
        section = tree.get(section_name)
        if isinstance(section, dict) and name in section \
                and not isinstance(section[name], dict) and section[name] is not None:
            section[name] = {main: section[name]}
    spelled: dict[str, str] = {}
    for alias, canonical in ALIASES.items():
        section_name, name = alias.split(".")
        section = tree.get(section_name)
        if not isinstance(section, dict) or name not in section:
            continue
        short = section.pop(name)
        node, leaf = _leaf(tree, canonical, alias)
        _set_alias(tree, canonical, node.get(leaf), alias, short, spelled)
    return spelled


def _set_alias(tree: dict, canonical: str, own: Any, alias: str, value: Any,
               spelled: dict[str, str]) -> None:
    """``alias=value`` written as ``canonical``, whose own value is ``own`` (None: unset);
    null unsets it (nothing written). Two different values are an error."""
    if own is not None:
        if value is not None and own != value:
            raise ConfigError(f"{canonical}={own!r} and {alias}={value!r} disagree: "
                              "set one of them")
        return
    node, leaf = _leaf(tree, canonical, alias)
    if value is None:
        node.pop(leaf, None)
        spelled.pop(canonical, None)
    else:
        node[leaf] = value
        spelled[canonical] = alias


def _leaf(tree: dict, dotted: str, alias: str) -> tuple[dict, str]:
    """The mapping that holds ``dotted``'s last part, created on the way."""
    *path, leaf = dotted.split(".")
    node = tree
    for part in path:
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise ConfigError(f"'{part}' must be a mapping (it holds {alias})")
    return node, leaf


def section_from_dict(cls, tree: dict, key: str):
    """One validated section (e.g. a checkpoint's saved ``ModelConfig``) from a dict; keys
    are named ``key.field`` in errors."""
    return _build(cls, tree, key, set())


def config_to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def dump_config(cfg: Config, docs: bool = False) -> str:
    """The config as YAML; ``docs`` puts each field's docstring above it as comments."""
    if not docs:
        return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
    return "".join(_documented(cfg, 0))


def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a config dataclass (read from its source)."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                and isinstance(after.value.value, str):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _documented(section, indent: int):
    import textwrap

    pad = "  " * indent
    docs = field_docs(type(section))
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        for line in textwrap.wrap(docs.get(f.name, ""), 88 - len(pad)):
            yield f"{pad}# {line}\n"
        if dataclasses.is_dataclass(value):
            yield f"{pad}{f.name}:\n"
            yield from _documented(value, indent + 1)
        else:
            text = yaml.safe_dump({f.name: value}, sort_keys=False, width=1000).rstrip("\n")
            yield "".join(f"{pad}{line}\n" for line in text.splitlines())
