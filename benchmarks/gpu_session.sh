#!/usr/bin/env bash
# One GPU session's checks in one command: the CUDA tests and the engine's decode/prefill
# step on SmolLM2's shapes, on a machine whose python3 already has torch with CUDA and
# Triton but none of pdserve's other dependencies and no network.
#
#   bash benchmarks/gpu_session.sh OUT_DIR [WHEEL_DIR] [PYTEST_ARGS...]
#
# WHEEL_DIR (default .whl) holds cp312 wheels of the dependencies the machine lacks; they
# install into a scratch site directory, never over the machine's own packages. The C
# helpers are compiled for that python; the CPU int4 kernel is not built (no CUDA test
# uses it). Logs, junit XML and the benchmark's table land in OUT_DIR; the last lines
# printed are the summary.
set -u -o pipefail
out=${1:?usage: gpu_session.sh OUT_DIR [WHEEL_DIR] [PYTEST_ARGS...]}
wheels=${2:-.whl}
shift $(( $# >= 2 ? 2 : 1 ))
mkdir -p "$out"
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start )) s] $*"; }

site=/tmp/pdserve-site
if compgen -G "$wheels/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$wheels"/*.whl >"$out/pip.log" 2>&1 || { cat "$out/pip.log"; exit 1; }
fi
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1
stamp "wheels installed"

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c 'import sys, torch, triton, transformers; print(sys.version.split()[0], torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
    lscpu | grep -E "Model name|^CPU\(s\)"
    uptime
} 2>&1 | tee "$out/machine.txt"

read -r inc suffix < <(python3 -c 'import sysconfig as s; print(s.get_paths()["include"], s.get_config_var("EXT_SUFFIX"))')
for src in transport/_atomics.c frontend/http/_acceptor.c; do
    gcc -O2 -shared -fPIC -I"$inc" "$src" -o "${src%.c}$suffix" || exit 1
done
stamp "C helpers built"

tests=(
    tests/engine/kernels tests/engine/test_cuda_graphs.py tests/engine/test_mistral_and_cuda.py
    tests/engine/test_gpu_memory.py tests/engine/test_kv_tiers_cuda.py tests/transport/test_kv.py
    tests/launcher/test_gpus.py tests/e2e/test_cuda_launch.py tests/speculative/test_cuda_speculative.py
)
if (( $# )); then tests=("$@"); fi
timeout 330 python3 -m pytest -q -p no:cacheprovider --timeout 120 --junitxml "$out/cuda_tests.xml" \
    "${tests[@]}" 2>&1 | tee "$out/cuda_tests.log" | tail -40
stamp "tests done"

timeout 150 python3 -m benchmarks.engine.engine_bench --device cuda --dtype bfloat16 --models smollm2 \
    2>&1 | tee "$out/engine_bench.log" | tail -15
stamp "engine_bench done"
grep -E "passed|failed|error" "$out/cuda_tests.log" | tail -3
