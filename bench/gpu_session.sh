#!/usr/bin/env bash
# One session's GPU checks (issue 63), in three stages, one per device call on the same
# warm machine: TransformerEngine's 177 MB core wheel travels in three pieces (a call
# carries at most 64 MiB), and each call also runs what needs no TE. Every step has its
# own time limit and writes its output to $OUT as it goes, so a cut session still leaves
# numbers; each stage prints how long its steps took. GPU_STEPS (comma-separated; default
# all) picks the steps that run: a later session skips what an earlier one measured.
#
#   bash bench/gpu_session.sh 1   carry [.whl, .te1]: install the wheels; build
#        transformer-engine-torch from its sdist in the background (its own process
#        session: it outlives the call); `memory`: the planner against GPU memory at 2k and
#        8k tokens, without and with full recomputation (bench/gpu_memory.py); `convert`:
#        the 0.9 B Llama for stages 2 and 3
#   bash bench/gpu_session.sh 2   carry [.te2]: `generate`: tokens/s, eager and CUDA graphs,
#        against transformers' generate (bench/gpu.py generate); `cuda_tests`: the CUDA
#        tests of tests/test_gpu.py that need no TE (CUDA against the CPU: log-probs,
#        generation through the captured step, a mixture of experts, LoRA; bf16's gap;
#        recomputation under megatron's CUDA RNG tracker)
#   bash bench/gpu_session.sh 3   carry [.te3]: join and check the core wheel, install TE;
#        `te`: TE's layers and fp8 log-probs (bench/gpu.py te); `train`: training steps in
#        bf16 (local, TE) and fp8 (delayed, current scaling) with MFU; `te_tests`: the TE
#        tests of tests/test_gpu.py (fp8 forward, packed THD attention)
#
# Made here (git ignores .whl and .te*, through .git/info/exclude):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     -d .whl megatron-core==0.16.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
#     pydantic==2.14.4 pydantic_core==2.50.5 typing-inspection==0.4.5 annotated-types \
#     importlib-metadata typing_extensions==4.16.0
#   (and transformer_engine_torch-2.10.0.tar.gz, the sdist, from PyPI's files into .whl)
#   W=transformer_engine_cu13-2.10.0-py3-none-manylinux_2_28_x86_64.whl   # pip download,
#   head -c 55000000 $W > .te1/te.part1                                   # outside .whl
#   tail -c +55000001 $W | head -c 61000000 > .te2/te.part2
#   tail -c +116000001 $W > .te3/te.part3; cp transformer_engine-2.10.0-py3-none-any.whl .te3/
# TE 2.10 is the newest release megatron-core 0.16.1 checks for (is_te_min_version).
set -u
STAGE=${1:?stage 1, 2 or 3}
OUT=${OUT:-/tmp/gpu_session}
SITE=/tmp/site WORK=/tmp/gpu_work TE=/tmp/te
WHEEL=transformer_engine_cu13-2.10.0-py3-none-manylinux_2_28_x86_64.whl
SHA=b8ee7bd6cef455e07bad61d645af290940aa58856d70fda05e1f973353a85349
mkdir -p "$OUT" "$TE" "$WORK"
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 MEGARLHF_TINY_DIR=/tmp/tiny
STEPS=,${GPU_STEPS:-all},install,te_install,  # the installs always run
step() {  # step NAME SECONDS COMMAND...: timed, its output kept in $OUT/NAME.txt
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    if [[ $STEPS != *,all,* && $STEPS != *,$name,* ]]; then
        echo "== $name: not in GPU_STEPS"
        return
    fi
    echo "== $name (limit ${limit} s): $*"
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    grep -v "warn" "$OUT/$name.txt" | tail -n 30
    echo "== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$OUT/$name.txt"
}
case $STAGE in
1)
    {
        date -u
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
        nproc
    } | tee "$OUT/machine.txt"
    cp .te1/te.part1 "$TE/"
    step install 120 python3 -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, \
'megatron-core', m.__version__)" | tee -a "$OUT/machine.txt"
    # transformer-engine-torch: C++ against this torch, the core's headers in the sdist,
    # CUDA's from the toolkit and the nvidia-* wheels (cuDNN, NCCL)
    rm -rf /tmp/te_build && mkdir -p /tmp/te_build /tmp/te_wheel
    tar xzf .whl/transformer_engine_torch-2.10.0.tar.gz -C /tmp/te_build
    NV=$(python3 -c "import nvidia; print(list(nvidia.__path__)[0])")
    export CPATH=$(find "$NV" -maxdepth 3 -type d -name include | paste -sd:)
    setsid nohup nice -n 10 bash -c "cd /tmp/te_build/transformer_engine_torch-2.10.0 && \
s=\$(date +%s) && NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS=14 python3 -m pip wheel \
--no-build-isolation --no-deps --no-cache-dir -w /tmp/te_wheel . > /tmp/te_build.log 2>&1; \
echo \"te build: exit \$? after \$((\$(date +%s) - s)) s\" >> /tmp/te_build.log; \
touch /tmp/te_build.done" > /dev/null 2>&1 < /dev/null &
    step memory 270 python3 bench/gpu_memory.py --tokens 2048 8192 --recompute none full \
        --out /tmp/gpu_memory
    step convert 120 python3 bench/gpu.py --parts convert --work "$WORK"
    tail -n 3 /tmp/te_build.log | tee "$OUT/te_build.txt"
    ;;
2)
    cp .te2/te.part2 "$TE/"
    { tail -n 3 /tmp/te_build.log; ls -la /tmp/te_wheel; } | tee "$OUT/te_build.txt"
    step generate 240 python3 bench/gpu.py --parts roofline,generate --work "$WORK"
    # generation on CUDA through the captured decode step (the worker installs the
    # speed-ups): fp32 tokens equal full recompute's and the CPU's, log-probs the trainer's;
    # a mixture of experts and LoRA against the CPU; recomputation's gradients
    step cuda_tests 180 python3 -m pytest -q -rA -p no:cacheprovider -m gpu \
        tests/test_gpu.py -k "logprobs_equal_cpu or kv_cached_generation or bf16_gap or \
moe_and_lora or recomputation"
    ;;
3)
    cp .te3/* "$TE/"
    start=$SECONDS
    while [ ! -e /tmp/te_build.done ] && [ $((SECONDS - start)) -lt 200 ]; do sleep 5; done
    echo "waited $((SECONDS - start)) s for the TE build" | tee "$OUT/te_install.txt"
    grep -v "^ *[0-9]*/" /tmp/te_build.log | tail -n 20 >> "$OUT/te_install.txt"
    start=$SECONDS
    cat "$TE/te.part1" "$TE/te.part2" "$TE/te.part3" > "$TE/$WHEEL"
    echo "$SHA  $TE/$WHEEL" | sha256sum -c | tee -a "$OUT/te_install.txt"
    step te_install 180 python3 -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target "$SITE" "$TE/$WHEEL" \
        "$TE"/transformer_engine-2.10.0-py3-none-any.whl /tmp/te_wheel/*.whl
    python3 -c "import transformer_engine.pytorch as te, transformer_engine as t; \
print('transformer_engine', t.__version__)" 2>&1 | tail -n 3 | tee -a "$OUT/te_install.txt"
    echo "install: $((SECONDS - start)) s" | tee -a "$OUT/te_install.txt"
    step te 240 python3 bench/gpu.py --parts te --work "$WORK"
    step train 240 python3 bench/gpu.py --parts roofline,train \
        --train-variants local,te,fp8-delayed,fp8-current
    step te_tests 150 python3 -m pytest -q -rA -p no:cacheprovider -m gpu tests/test_gpu.py \
        -k "te_spec or packed_scores"
    ;;
*)
    echo "stage 1, 2 or 3" >&2
    exit 2
    ;;
esac
