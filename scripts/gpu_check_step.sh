#!/usr/bin/env bash
# One GPU call that checks the train step on a real card: the 1B Llama shape (issue 10's
# table: tied, vocabulary 128256, seq 2048, micro-batch 8, bf16, cuDNN attention, no
# remat) in both collective modes, beside a previous commit of the step on the same card,
# and the GPU overlap flags (collective pipelining on) on the 125m shape.
#
#   git archive <commit> ultrajax scripts | tar -x -C .old   # the baseline, once, here
#   bash scripts/gpu_check_step.sh [OUT_DIR]                  # on the GPU machine
#
# Wheels the GPU image lacks (grain, array-record, portpicker) are installed from .whl/ if
# present; flax and jax are the image's own. Each run has its own time limit, inside a
# running budget (BUDGET seconds, default 480), and writes OUT_DIR/<name>.txt.
set -u
OUT=${1:-${OUT:-/tmp/gpu_check}}
BUDGET=${BUDGET:-480}
mkdir -p "$OUT"
start=$(date +%s)
source "$(dirname "$0")/gpu_common.sh"
versions

ONEB=(--sizes 1b --steps 10 --warmup 2 model.attention=cudnn train.micro_batch_size=8
  model.remat=none)
run step-1b-explicit 170 python3 scripts/bench_step.py "${ONEB[@]}"
run step-1b-gspmd 150 python3 scripts/bench_step.py "${ONEB[@]}" parallel.collectives=gspmd
if [ -f .old/scripts/bench_step.py ]; then
  run step-1b-before 150 env PYTHONPATH=/tmp/site:$PWD/.old \
    python3 .old/scripts/bench_step.py "${ONEB[@]}"
fi
run step-125m-pipelined-flags 100 python3 scripts/bench_step.py --sizes 125m --steps 5 \
  model.attention=cudnn parallel.pipeline_collectives=true
echo "total $(($(date +%s) - start)) s"
