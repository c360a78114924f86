#!/usr/bin/env bash
# Every GPU figure of issue 32 in one call of under 8 minutes on one H100/H200, each part
# under its own time limit inside a running budget, in the order that a short budget keeps
# the most: the flash attention's numerics compiled on the card (both backwards), the
# kernel beside cuDNN (causal, seq 2048/4096/8192, head_dim 64 and 128, both backwards; at
# head_dim 64 also the grid's order before), and the 1B step beside transformers +
# torch.compile (scripts/bench_gpu.sh: causal, selective recomputation, packed documents
# one a row, four a row, and one a row with the one-kernel backward, the run a short
# budget drops first; the baseline in the same call). More
# parts, each asked for by name (a second call): the fused norm beside XLA, the packed
# kernel alone, the sweeps of tiles, warps and stages, where the step's time goes
# (scripts/profile_step.py), XLA's GPU code-generation flags on the step, the step's
# other recomputation settings (full; offload, never run before) and its layers as one
# scan, and the MoE layer.
#
#   bash scripts/gpu_check.sh [OUT_DIR]               # issue 32's figures
#   PARTS="sweep profile" bash scripts/gpu_check.sh   # others, by name
#   PARTS=all bash scripts/gpu_check.sh               # every part (more than one call)
#
# PARTS: any of numerics, attention, step (the default), norm, packed, sweep, profile,
# flags, remat, moe.
# BUDGET: seconds (default 470). Wheels the GPU image lacks (grain, array-record,
# portpicker, jax-triton) come from .whl/ (docs/kernels.md says how to fetch them); flax
# and jax are the image's.
# Each part writes OUT_DIR/<name>.txt; bench_gpu.sh's table is OUT_DIR/step/; every table
# and verdict line, with the versions, ends in OUT_DIR/summary.md.
set -u
OUT=${1:-${OUT:-/tmp/gpu_check}}
BUDGET=${BUDGET:-470}
PARTS=${PARTS:-numerics attention step}
[ "$PARTS" = all ] && PARTS="numerics attention step norm packed sweep profile flags remat moe"
mkdir -p "$OUT"
start=$(date +%s)
source "$(dirname "$0")/gpu_common.sh"
want() { [[ " $PARTS " == *" $1 "* ]]; }
versions

if want numerics; then
  run flash-numerics 70 python3 scripts/check_flash_gpu.py  # the model's cases first
fi
if want attention; then  # each length: the split backward's row, the fused one's (head_dim
  # 64: and the split one on the grid's order before, batch and head fastest)
  run attention-d64 100 python3 scripts/bench_attention.py --iters 5 --heads-first
  run attention-d128 90 python3 scripts/bench_attention.py --iters 5 --head-dim 128 --heads 16
fi
if want step; then  # the 1B step's runs of the issue's targets; a norm part keeps 70 s
  keep=0
  want norm && keep=70
  left=$((BUDGET - ($(date +%s) - start) - keep))
  echo "== step: bench_gpu.sh with $left s"
  RUNS=${RUNS:-ultrajax-causal hf-compiled ultrajax-selective ultrajax-packed \
    ultrajax-packed-docs4 ultrajax-packed-fused} \
    BUDGET=$left bash scripts/bench_gpu.sh "$OUT/step" 2>&1 | tail -14
fi
if want norm; then  # the Triton norm compiled and held to XLA's, then its time beside XLA's
  run triton-numerics 40 python3 -m pytest -q -p no:cacheprovider --override-ini=addopts= -rs \
    -s tests/test_triton.py -k "gpu or h100"
  run bench-norm 30 python3 scripts/bench_norm.py
fi
if want packed; then
  run attention-packed 70 python3 scripts/bench_attention.py --seqs 2048,8192 --packed --iters 5
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
if want profile; then  # where the 1B step's time goes (selective: the fastest), per kind of op
  run profile 150 python3 scripts/profile_step.py --size 1b --steps 3 --top 30 \
    train.micro_batch_size=8 model.remat=selective
fi
if want flags; then  # XLA's GPU code generation on the 1B step (selective): each flag alone
  i=0
  for flags in "" --xla_gpu_enable_triton_gemm=false --xla_gpu_enable_command_buffer= \
    --xla_gpu_enable_cublaslt=true; do
    echo "== XLA_FLAGS=$flags"
    XLA_FLAGS="${XLA_FLAGS:-} $flags" run "flags-$i" 90 python3 scripts/bench_step.py \
      --sizes 1b --steps 10 --warmup 2 train.micro_batch_size=8 model.remat=selective
    echo "XLA_FLAGS=$flags" >>"$OUT/flags-$i.txt"
    i=$((i + 1))
  done
fi
if want remat; then  # the 1B step's recomputation settings beside selective (the config's),
  # and selective with the layers as one scan instead of the size's Python loop
  left=$((BUDGET - ($(date +%s) - start)))
  echo "== remat: bench_gpu.sh with $left s"
  RUNS="ultrajax-selective ultrajax-scanned ultrajax-full ultrajax-offload" BUDGET=$left \
    bash scripts/bench_gpu.sh "$OUT/remat" 2>&1 | tail -8
fi
if want moe; then  # the MoE layer's native ragged_dot: numerics, time, compiled memory
  run moe 120 python3 scripts/check_moe_gpu.py
fi
echo "total $(($(date +%s) - start)) s"
{  # every part's tables and verdict lines in one file, in RESULTS.md's form, for the record
  echo "gpu_check.sh, PARTS=\"$PARTS\", $(($(date +%s) - start)) s of a $BUDGET s budget"
  sed 's/^/    /' "$OUT/versions.txt"
  for f in "$OUT"/*.txt "$OUT"/step/step_table.txt "$OUT"/remat/step_table.txt; do
    [ -f "$f" ] || continue
    case $(basename "$f") in versions.txt) continue ;; esac
    echo
    echo "**${f#"$OUT"/}**"
    echo
    grep -E '^(\||ok |FAIL|XLA_FLAGS|== .*skipped|packed.*causal tokens/s)' "$f" || echo "(no table: see the file)"
  done
} >"$OUT/summary.md"
echo "summary: $OUT/summary.md"
