#!/usr/bin/env bash
# Issue 10's GPU benchmark, whole in one call (a few minutes on one H100/H200): ultrajax's
# train step for the Llama 3.2 1B shape, causal-only and with packed documents, beside the
# Hugging Face baseline (scripts/torch_step.py: transformers' LlamaForCausalLM at the same
# shape and batch, SDPA, bf16 autocast, fused AdamW, eager and under torch.compile) on the
# same GPU; prints tokens/s, MFU and peak memory with the ratios.
#
#   bash scripts/bench_gpu.sh [OUT_DIR]
#
# Environment: HF (the baseline script; default scripts/torch_step.py), ULTRA (bench_step.py
# arguments; default the 1B shape, micro-batch 8 x 2048, no remat), HF_ARGS (baseline
# arguments; default the same shape and batch), HF_COMPILE (the baseline's switch to
# torch.compile), BUDGET (seconds, default 420), RUNS (which of the runs below, by the
# names of their output files; default all but full, offload and scanned).
# Wheels the GPU image lacks (grain, array-record, portpicker) are installed from .whl/.
set -u
OUT=${1:-${OUT:-/tmp/bench_gpu}}
HF=${HF:-scripts/torch_step.py}
ULTRA=${ULTRA:---sizes 1b --steps 10 --warmup 2 train.micro_batch_size=8 model.remat=none}
HF_ARGS=${HF_ARGS:---size 1b --steps 10 --warmup 2 train.micro_batch_size=8}
HF_COMPILE=${HF_COMPILE:---compile}  # ../shared/bench/hf_llama_step.py: "--compile 1"
BUDGET=${BUDGET:-420}
RUNS=${RUNS:-ultrajax-causal hf-compiled ultrajax-selective ultrajax-packed \
ultrajax-packed-docs4 ultrajax-packed-fused ultrajax-whole-logits hf-eager}
mkdir -p "$OUT"
start=$(date +%s)
source "$(dirname "$0")/gpu_common.sh"
versions

# In the order a short budget keeps the most: the default step (the LM head and loss in
# chunks: model.loss_chunk auto), the baseline, selective recomputation (the memory
# target), packed documents (the Pallas kernel; one document a row, the kernel's worst case
# as it skips nothing, then four documents a row of uneven lengths, then one a row with
# the one-kernel backward, which the attention part also times alone), then the same step with whole logits (loss_chunk=0: what chunking
# costs or saves), and transformers eager last.
want() { [[ " $RUNS " == *" $1 "* ]]; }
step() {  # step NAME OVERRIDES...: bench_step.py's 1B step, if RUNS names it
  local name=$1
  shift
  # shellcheck disable=SC2086  # ULTRA and HF_ARGS are argument lists
  if want "$name"; then
    run "$name" 100 python3 scripts/bench_step.py $ULTRA model.attention=auto "$@"
  fi
}
step ultrajax-causal data.cross_doc_mask=false
# shellcheck disable=SC2086
if want hf-compiled; then run hf-compiled 140 python3 "$HF" --label compiled $HF_COMPILE $HF_ARGS; fi
step ultrajax-selective data.cross_doc_mask=false model.remat=selective
step ultrajax-packed data.cross_doc_mask=true
step ultrajax-packed-docs4 data.cross_doc_mask=true --docs 4
step ultrajax-packed-fused data.cross_doc_mask=true model.attention_backward=fused
step ultrajax-whole-logits data.cross_doc_mask=false model.loss_chunk=0
# by name only (gpu_check.sh's remat part): whole-layer recomputation, selective with the
# matmul outputs kept in pinned host memory instead (model.remat=offload: never run; under
# the scan, as validation refuses it with the 1B size's layer loop)
step ultrajax-full data.cross_doc_mask=false model.remat=full
step ultrajax-offload data.cross_doc_mask=false model.remat=offload model.scan_layers=true
# and selective with the layers as one lax.scan (the 1B size runs them as a Python loop)
step ultrajax-scanned data.cross_doc_mask=false model.remat=selective model.scan_layers=true
# shellcheck disable=SC2086
if want hf-eager; then run hf-eager 90 python3 "$HF" --label eager $HF_ARGS; fi

python3 "$(dirname "$0")/step_table.py" "$OUT" "$RUNS" | tee "$OUT/step_table.txt"
echo "total $(($(date +%s) - start)) s"
