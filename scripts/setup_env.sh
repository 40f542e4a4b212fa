#!/usr/bin/env bash
# Create ./.venv (if absent) with the CPU build of torch and megarlhf installed editable.
# Re-running is cheap: it reinstalls only when setup.py changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
EXTRAS="${1:-test}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=".venv/.megarlhf-installed-$(sha1sum setup.py | cut -c1-12)-${EXTRAS}"
if [ ! -f "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
    # Pinned CPU torch: an unpinned torch pulls a multi-GB CUDA build. GPU users install
    # their own torch (e.g. an NGC container) and skip this script.
    .venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
    # PYTHONWARNINGS: setuptools' notes on editable installs are not for the user.
    PYTHONWARNINGS=ignore .venv/bin/python -m pip install -q -e ".[${EXTRAS}]" 2>&1 \
        | grep -v "^WARNING: Location" || true
    if [[ "$EXTRAS" == *test* ]]; then
        # trl 0.11.4's AdaptiveKLController is a test oracle; it cannot be installed beside
        # trl 1.12.0, so its wheel is kept for the test to read.
        mkdir -p .venv/oracles
        .venv/bin/python -m pip download -q --no-deps "trl==0.11.4" -d .venv/oracles 2>&1 \
            | grep -v "^WARNING: Location" || true
    fi
    # -W ignore: megatron-core's Apex/TransformerEngine fallback notes are expected on CPU.
    .venv/bin/python -W ignore -c "import megarlhf, megatron.core, torch; print('megarlhf env ready:', 'torch', torch.__version__, 'megatron-core', megatron.core.__version__)"
    rm -f .venv/.megarlhf-installed-*
    touch "$stamp"
fi
