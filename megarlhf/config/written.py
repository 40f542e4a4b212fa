"""Provenance: which settings a config file and the overrides wrote.

A few things depend on it, not on the values alone: a role's model is its checkpoint's
with only the written fields on top (``roles.reward.model.params_dtype=float32`` over a
bfloat16 checkpoint means float32, though float32 is the default); a setting that would
do nothing is refused only when someone wrote it; a ``roles.<name>`` block a stage does not
read is refused when anything under it was written. The loader returns it beside the
config (:func:`megarlhf.config.loader.read_config`); a config built in code has none, and
:meth:`Written.differing` stands in for it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Written:
    """The dotted keys written (``ppo.clip_eps``, ``roles.actor.model.params_dtype``), each
    section on the way counted too (``roles``, ``roles.actor``, ``roles.actor.model``).
    ``spelled`` maps a key written through an alias to the alias the user wrote
    (``roles.actor.checkpoint`` -> ``ppo.sft_checkpoint``), for messages."""

    keys: frozenset[str] = frozenset()
    spelled: dict[str, str] = field(default_factory=dict)

    def __contains__(self, key: str) -> bool:
        return key in self.keys

    def fields(self, section: str) -> frozenset[str]:
        """The names written directly under ``section`` (a dotted path)."""
        prefix = f"{section}."
        return frozenset(key[len(prefix):] for key in self.keys
                         if key.startswith(prefix) and "." not in key[len(prefix):])

    def spelling(self, key: str) -> str:
        """``key`` as the user wrote it (its alias, when it came through one)."""
        return self.spelled.get(key, key)

    @classmethod
    def differing(cls, cfg) -> Written:
        """For a config built in code: every field whose value differs from its default
        counts as written, and a section set where its default is none."""
        keys: set[str] = set()
        _differing(cfg, type(cfg)(), "", keys)
        return cls(frozenset(keys))


def _differing(section, defaults, prefix: str, keys: set[str]) -> bool:
    found = False
    for f in dataclasses.fields(section):
        key = f"{prefix}{f.name}"
        value, default = getattr(section, f.name), getattr(defaults, f.name)
        if dataclasses.is_dataclass(value):
            inner = default if dataclasses.is_dataclass(default) else type(value)()
            if _differing(value, inner, f"{key}.", keys) or default is None:
                keys.add(key)
                found = True
        elif value != default:
            keys.add(key)
            found = True
    return found

