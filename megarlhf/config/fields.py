"""What every section's ``__post_init__`` uses to refuse a value, and the error a config
that cannot be loaded raises."""

from __future__ import annotations


def require(ok: bool, name: str, value, valid: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: {valid}")


class ConfigError(ValueError):
    """A config file or override that cannot become a valid config."""
