#!/usr/bin/env bash
# One GPU call for the kernels: the Pallas flash attention's numerics against the jnp
# reference at small shapes (compiled, not interpreted), then its speed beside cuDNN's.
#   bash scripts/gpu_check_kernels.sh [OUT_DIR]
set -u
OUT=${1:-${OUT:-/tmp/gpu_kernels}}
mkdir -p "$OUT"
[ -e ultrajax/kernels ] || ln -s ../kernels ultrajax/kernels  # what pip's mapping does
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/versions.txt"
timeout 120 python3 -m pytest -q -x tests/test_kernels.py -p no:cacheprovider \
  --override-ini="addopts=" 2>&1 | tail -5 | tee "$OUT/kernels-interpret.txt"
timeout 100 python3 - <<'PY' 2>&1 | tee "$OUT/kernels-compiled.txt"
import jax, jax.numpy as jnp, numpy as np
from ultrajax.kernels.flash_attention import BlockSizes, flash_attention, reference
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
timeout 150 python3 scripts/bench_attention.py 2>&1 | tee "$OUT/bench-causal.txt"
timeout 90 python3 scripts/bench_attention.py --seqs 2048,8192 --packed 2>&1 | tee "$OUT/bench-packed.txt"
