#!/usr/bin/env bash
# Every GPU figure of issue 32 (a few minutes on one H100/H200), each part under its own
# time limit inside a running budget, in the order that a small budget keeps the most:
# the kernels' numerics compiled on the card, the flash attention beside cuDNN (causal,
# packed documents; both backwards), the sweeps of tiles, warps and stages (head_dim 64
# and 128; the one-kernel backward's first), the 1B step beside transformers +
# torch.compile (scripts/bench_gpu.sh, the baseline in the same call), where that step's
# time goes (scripts/profile_step.py), the MoE layer, and the fused norm beside XLA. All
# of it is more than one call's 10 minutes: a second call takes PARTS (what the first did
# not reach; the step part takes whatever budget is left).
#
#   bash scripts/gpu_check.sh [OUT_DIR]              # everything
#   PARTS="numerics sweep" bash scripts/gpu_check.sh  # some parts only
#
# PARTS: any of numerics, attention, sweep, step, profile, moe, norm (default: all).
# BUDGET: seconds (default 470). Wheels the GPU image lacks (grain, array-record,
# portpicker, jax-triton) come from .whl/ (docs/kernels.md says how to fetch them); flax
# and jax are the image's.
# Each part writes OUT_DIR/<name>.txt; bench_gpu.sh's table is OUT_DIR/step/.
set -u
OUT=${1:-${OUT:-/tmp/gpu_check}}
BUDGET=${BUDGET:-470}
PARTS=${PARTS:-numerics attention sweep step profile moe norm}
mkdir -p "$OUT"
start=$(date +%s)
source "$(dirname "$0")/gpu_common.sh"
want() { [[ " $PARTS " == *" $1 "* ]]; }
versions

if want numerics; then
  run flash-numerics 90 python3 scripts/check_flash_gpu.py
  run triton-numerics 60 python3 -m pytest -q -p no:cacheprovider --override-ini=addopts= -rs \
    -s tests/test_triton.py -k "gpu or h100"
fi
if want attention; then  # each length: the split backward's row, then the fused one's
  run attention-d64 90 python3 scripts/bench_attention.py --iters 5
  run attention-packed 70 python3 scripts/bench_attention.py --seqs 2048,8192 --packed --iters 5
  run attention-d128 90 python3 scripts/bench_attention.py --iters 5 --head-dim 128 --heads 16
fi
if want sweep; then  # the one-kernel backward's first (unmeasured), then the measured ones
  for d in 64 128; do
    run "sweep-bwd-fused-d$d" 80 python3 scripts/bench_attention.py --seqs 4096 --head-dim "$d" \
      --kv-heads 8 --heads $((2048 / d)) --sweep bwd --fused --iters 5
  done
  for d in 64 128; do
    run "sweep-fwd-d$d" 60 python3 scripts/bench_attention.py --seqs 4096 --head-dim "$d" \
      --kv-heads 8 --heads $((2048 / d)) --sweep fwd --iters 5
    run "sweep-bwd-d$d" 80 python3 scripts/bench_attention.py --seqs 4096 --head-dim "$d" \
      --kv-heads 8 --heads $((2048 / d)) --sweep bwd --iters 5
  done
fi
if want step; then
  left=$((BUDGET - ($(date +%s) - start)))
  echo "== step: bench_gpu.sh with $left s"
  BUDGET=$left bash scripts/bench_gpu.sh "$OUT/step" 2>&1 | tail -12
fi
if want profile; then  # where the 1B step's time goes (selective: the fastest), per kind of op
  run profile 150 python3 scripts/profile_step.py --size 1b --steps 3 --top 30 \
    train.micro_batch_size=8 model.remat=selective
fi
if want moe; then  # the MoE layer's native ragged_dot: numerics, time, compiled memory
  run moe 120 python3 scripts/check_moe_gpu.py
fi
if want norm; then
  run bench-norm 50 python3 scripts/bench_norm.py
fi
echo "total $(($(date +%s) - start)) s"
