"""An agent's process (``rollout.agent.entry``): imports ``package.module:function``
(argv[1]), reads the episode's data row as JSON from stdin, calls ``function(row,
base_url=..., api_key=..., model=...)`` with the episode's endpoint (from
``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and ``MEGARLHF_AGENT_MODEL``) and prints what it
returns as the last line of stdout: a JSON number, or null. The agent's own prints go to
stderr; an exception ends the process with its traceback on stderr and exit code 1."""

from __future__ import annotations

import importlib
import json
import os
import sys


def main() -> int:
    out = sys.stdout
    sys.stdout = sys.stderr  # stdout carries only the result
    module, name = sys.argv[1].split(":", 1)
    fn = getattr(importlib.import_module(module), name)
    row = json.loads(sys.stdin.read())
    value = fn(row, base_url=os.environ["OPENAI_BASE_URL"],
               api_key=os.environ["OPENAI_API_KEY"], model=os.environ["MEGARLHF_AGENT_MODEL"])
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = json.dumps(repr(value))  # the caller says why it is not a reward
    out.write(text + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
