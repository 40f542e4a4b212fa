#!/usr/bin/env bash
# Set up the environment if needed, then run megarlhf's main job on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test
exec .venv/bin/python scripts/demo.py
