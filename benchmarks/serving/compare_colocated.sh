#!/bin/bash
# Disaggregated (launch --prefill 1 --decode 1) vs co-located (launch --colocated 2: the same
# engine, no KV transfer), the same load one after the other, on the tiny test checkpoint.
# Run from anywhere in a clone; results (JSON, plots, logs) go to $OUT:
#   benchmarks/serving/compare_colocated.sh
set -u
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-${TMPDIR:-/tmp}/pdserve-bench}
MODEL=$("$PY" -c "from bundled_models.tiny import tiny_model_dir; print(tiny_model_dir())")
TOK=$("$PY" -c "from bundled_models.tiny import tokenizer_dir; print(tokenizer_dir())")
NAME=tiny
mkdir -p "$OUT"

bench() {  # name port dataset
  "$PY" -m benchmarks.serving --base-url "http://127.0.0.1:$2" --model "$NAME" \
    --tokenizer "$TOK" --dataset "$3" --num-prompts 32 --random-input-len 256 --random-output-len 64 \
    --sweep request-rate=2,4,8 --seed 0 --metric-percentiles 50,99 --goodput ttft:500 tpot:100 \
    --result-file "$OUT/$1_$3.json" --plot "$OUT/$1_$3.png" --disable-tqdm > "$OUT/$1_$3.log" 2>&1
  echo "$1 $3 rc=$?"
}

wait_up() {  # port
  for _ in $(seq 1 90); do
    sleep 1
    curl -sf "http://127.0.0.1:$1/health" > /dev/null && return 0
  done
  return 1
}

serve() {  # name port launch-args...
  local name=$1 port=$2
  shift 2
  OMP_NUM_THREADS=1 setsid "$PY" -m launcher.cli --model "$MODEL" --served-model-name "$NAME" \
    --device cpu --port "$port" --log-level warning "$@" > "$OUT/${name}_server.log" 2>&1 &
  local pid=$!
  wait_up "$port" && { bench "$name" "$port" random; bench "$name" "$port" mixed; }
  kill -TERM -- "-$pid"
  wait "$pid"
}

serve pd 18441 --prefill 1 --decode 1
serve co 18442 --colocated 2
echo "done: $OUT"
