#!/usr/bin/env bash
# One GPU call for the kernels: their numerics against the jnp references (the CPU tests,
# then compiled: the Pallas flash attention, and the Triton RMSNorm through jax-triton),
# then their speed: the fused add + RMSNorm beside XLA's fusion, the flash attention
# beside cuDNN (packed documents, a sweep of tile sizes, warps and stages, causal), in
# that order, so that a small budget keeps the first.
#   bash scripts/gpu_check_kernels.sh [OUT_DIR]
# With issue 10's benchmark in one call of at most 10 minutes (docs/kernels.md):
#   BUDGET=210 bash scripts/gpu_check_kernels.sh $OUT/kernels; BUDGET=330 bash scripts/bench_gpu.sh $OUT/bench
# Wheels the GPU image lacks (grain, array-record, portpicker, jax-triton) come from .whl/;
# each step has its own time limit inside a running budget (BUDGET s, default 480) and
# writes OUT_DIR/<name>.txt.
set -u
OUT=${1:-${OUT:-/tmp/gpu_kernels}}
BUDGET=${BUDGET:-480}
mkdir -p "$OUT"
start=$(date +%s)
source "$(dirname "$0")/gpu_common.sh"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import jax, triton; print('jax', jax.__version__, 'triton', triton.__version__)"
  python3 -c "import jax_triton; print('jax-triton', jax_triton.__version__)"
  git log -1 --format='commit %h %s' 2>/dev/null || true
} 2>&1 | tee "$OUT/versions.txt"

PYTEST=(python3 -m pytest -q -p no:cacheprovider --override-ini=addopts= -rs)
run tests-kernels 150 "${PYTEST[@]}" tests/test_kernels.py tests/test_triton.py
run flash-compiled 100 python3 - <<'PY'
import jax, jax.numpy as jnp, numpy as np
from ultrajax.kernels.flash_attention import BlockSizes, flash_attention
from ultrajax.model.attention import xla
def reference(q, k, v, qs, ks):  # the one jnp attention, in the kernel's conventions
    o, lse = xla.reference(q, k, v, qs, ks)
    return o.astype(q.dtype), lse.transpose(0, 2, 1)
rng = np.random.default_rng(0)
for (b, t, h, kv, d, dt) in [(2, 200, 8, 2, 64, jnp.float32), (2, 512, 8, 2, 64, jnp.bfloat16)]:
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, d)), dt) for n in (h, kv, kv))
    seg = np.ones((b, t), np.int32); seg[:, t // 3:] = 2; seg[:, -5:] = 0
    seg = jnp.asarray(seg)
    f = lambda q, k, v: flash_attention(q, k, v, seg, seg, blocks=BlockSizes(64, 64, 64, 64))
    r = lambda q, k, v: reference(*(x.astype(jnp.float32) for x in (q, k, v)), seg, seg)
    (o, lse), (ro, rl) = jax.jit(f)(q, k, v), r(q, k, v)
    do = jnp.asarray(rng.standard_normal(o.shape), jnp.float32)
    g = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)[0].astype(jnp.float32) * do), (0, 1, 2)))(q, k, v)
    gr = jax.grad(lambda *a: jnp.sum(r(*a)[0] * do), (0, 1, 2))(q, k, v)
    err = lambda a, b: float(jnp.abs(a.astype(jnp.float32) - b).max())
    print(dt.__name__, "out", err(o, ro), "lse", err(lse, rl), "grads", [err(a, b) for a, b in zip(g, gr)])
PY
run bench-norm 60 python3 scripts/bench_norm.py
run bench-packed 80 python3 scripts/bench_attention.py --seqs 2048,8192 --packed
run sweep-4096 150 python3 scripts/bench_attention.py --seqs 4096 --sweep --iters 5
run bench-causal 100 python3 scripts/bench_attention.py
echo "total $(($(date +%s) - start)) s"
