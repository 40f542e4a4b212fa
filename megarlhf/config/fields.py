"""What every section's ``__post_init__`` uses to refuse a value."""

from __future__ import annotations


def _require(ok: bool, name: str, value, valid: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: {valid}")
