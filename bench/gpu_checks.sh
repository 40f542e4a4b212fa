#!/usr/bin/env bash
# The checks a session with one CUDA GPU runs on the device machine, in one go, most
# important first (each step has its own time limit, so a slow one leaves the rest):
#
#   1. split placement (issue 41) on one GPU: a 1 training + 1 rollout process job against
#      the colocated run, k = 0 and 1 (tests/test_async.py, which asserts equal metrics and
#      equal final actors); continuous batching end to end; a stopped rollout process named;
#   2. the CUDA tests (tests/test_gpu.py -m "gpu and not slow").
#
# The machine has torch, transformers, tokenizers, sentencepiece, safetensors, jinja2, pyyaml
# and tqdm, but not megatron-core or datasets: their wheels (Python 3.12, x86-64) travel in
# .whl (ignored by git), made here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 -d .whl \
#     megatron-core==0.16.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
# and the run is: device run, carry [.whl], command "bash bench/gpu_checks.sh" (ASYNC=
# a pytest -k expression chooses other tests of tests/test_async.py).
# Only one GPU: every process group of more than one rank would need NCCL across two
# processes on one device, which NCCL refuses, so only 1-process layouts (and split
# placement, whose two worlds are 1 process each, joined by a gloo bridge) run here.
set -u
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
# the repository on the path too: test workers run as scripts (locally the package is installed)
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MEGARLHF_TINY_DIR=/tmp/tiny
step() {  # step NAME SECONDS COMMAND...: timed, its output kept in $OUT/NAME.txt
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "== $name (limit ${limit} s): $*"
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.txt"
    echo "== $name: exit $rc after $((SECONDS - start)) s"
}
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)"
} | tee "$OUT/machine.txt"
ASYNC=${ASYNC:-split_placement_equals_colocated or continuous_batching or stopped_rollout}
step async 330 python3 -m pytest -q -rA -p no:cacheprovider tests/test_async.py -k "$ASYNC"
step gpu 240 python3 -m pytest -q -rA -p no:cacheprovider -m "gpu and not slow" tests/test_gpu.py
