#!/bin/bash
# Disaggregated (launch 1P+1D) vs co-located (one in-process engine), same load, same session.
cd /work/main
TOK=$(.venv/bin/python -c "from pdserve import tiny_models; print(tiny_models.tokenizer_dir())")
MODEL=$(.venv/bin/python -c "from pdserve import tiny_models; print(tiny_models.tiny_model_dir())")
OUT=${OUT:-/tmp/bench}
mkdir -p $OUT
bench() {  # name port dataset
  .venv/bin/python -m benchmarks.serving --base-url http://127.0.0.1:$2 --model tiny-qwen2-v1 \
    --tokenizer $TOK --dataset $3 --num-prompts 32 --random-input-len 256 --random-output-len 64 \
    --sweep request-rate=2,4,8 --seed 0 --metric-percentiles 50,99 --goodput ttft:500 tpot:100 \
    --result-file $OUT/$1_$3.json --plot $OUT/$1_$3.png --disable-tqdm > $OUT/$1_$3.log 2>&1
  echo "$1 $3 rc=$?"
}
wait_up() { for i in $(seq 1 90); do sleep 1; curl -sf http://127.0.0.1:$1/health >/dev/null && return 0; done; return 1; }
OMP_NUM_THREADS=1 setsid .venv/bin/launch --model $MODEL --prefill 1 --decode 1 --port 18441 --log-level warning > $OUT/pd_server.log 2>&1 &
PD=$!
wait_up 18441 && { bench pd 18441 random; bench pd 18441 mixed; }
kill -TERM -- -$PD; wait $PD
OMP_NUM_THREADS=1 setsid .venv/bin/python -m frontend.local_server --model $MODEL --served-model-name tiny-qwen2-v1 --port 18442 --log-level warning > $OUT/co_server.log 2>&1 &
CO=$!
wait_up 18442 && { bench co 18442 random; bench co 18442 mixed; }
kill -TERM -- -$CO; wait $CO
echo done
