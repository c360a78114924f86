"""The Triton kernel (fused residual add + RMSNorm) against its jnp reference.

On this CPU the kernel's own Triton source runs in Triton's interpreter, launched by the
same JAX wrapper as on a GPU (kernels/triton_call.py): forward, backward, bf16, rows
split over several backward programs, and inside `shard_map`; and Triton's compiler
takes it to an sm_90 cubin. Where a GPU is present, one test runs it through jax-triton
in a process of its own.
"""

import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

pytest.importorskip("triton", reason="triton is not installed (the [test] extra has it on Linux)")
pytest.importorskip("torch", reason="Triton's interpreter reads torch CPU tensors")

from ultrajax.kernels import rms_norm as kernel  # noqa: E402
from ultrajax.model.nn import rms_norm as model_norm  # noqa: E402


def inputs(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    x, r = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2))
    w = jnp.asarray(1 + 0.3 * rng.standard_normal(shape[-1]), jnp.float32)
    dy, dh = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))
    return x, r, w, dy, dh


def value_and_grads(fn, x, r, w, dy, dh, residual):
    """The outputs, and the gradients of a loss that uses both y and h."""

    def loss(x, r, w):
        y, h = fn(x, w, r if residual else None)
        return jnp.sum(y.astype(jnp.float32) * dy) + jnp.sum(h.astype(jnp.float32) * dh)

    outs = fn(x, w, r if residual else None)
    return outs, jax.grad(loss, (0, 1, 2))(x, r, w)


CASES = {  # shape (rows..., features), with a residual; 40 and 96: not powers of two
    "add-ragged": ((3, 5, 40), True),
    "add-2d": ((7, 96), True),
    "norm-only": ((2, 6, 40), False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_fp32(case, monkeypatch):
    shape, residual = CASES[case]
    monkeypatch.setattr(kernel, "MAX_PROGRAMS", 4)  # several rows per backward program
    args = inputs(shape, jnp.float32, seed=len(case))
    (y, h), grads = value_and_grads(kernel.rms_norm, *args, residual)
    (ry, rh), rgrads = value_and_grads(kernel.reference, *args, residual)
    assert np.isfinite(np.asarray(y)).all()
    np.testing.assert_allclose(y, ry, atol=2e-6, rtol=2e-6)
    np.testing.assert_array_equal(h, rh)
    for got, want, name in zip(grads, rgrads, ("dx", "dr", "dw"), strict=True):
        if name == "dr" and not residual:
            np.testing.assert_array_equal(got, 0.0)
            continue
        assert np.abs(np.asarray(want)).max() > 0
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=name)


def test_bf16_within_bf16_tolerance():
    x, r, w, dy, dh = inputs((4, 8, 48), jnp.bfloat16, seed=11)
    (y, h), grads = value_and_grads(kernel.rms_norm, x, r, w, dy, dh, True)
    (ry, rh), rgrads = value_and_grads(kernel.reference, x, r, w, dy, dh, True)
    assert y.dtype == h.dtype == jnp.bfloat16
    assert [g.dtype for g in grads] == [jnp.bfloat16, jnp.bfloat16, jnp.float32]
    f32 = lambda a: np.asarray(a, np.float32)
    # one bf16 unit apart at most: Triton's interpreter truncates fp32 -> bf16, where a GPU
    # (and XLA) rounds to nearest
    np.testing.assert_allclose(f32(h), f32(rh), rtol=2**-7, atol=0)
    np.testing.assert_allclose(f32(y), f32(ry), rtol=2e-2, atol=2e-2)
    for got, want in zip(grads, rgrads, strict=True):
        assert np.isfinite(f32(got)).all()
        np.testing.assert_allclose(f32(got), f32(want), atol=3e-2 * np.abs(f32(want)).max())


def test_reference_is_the_models_norm():
    """The kernel's reference computes what the model's RMSNorm computes."""
    x, r, w, _, _ = inputs((2, 4, 32), jnp.float32, seed=3)
    h = x + r
    np.testing.assert_allclose(kernel.reference(x, w, r)[0], model_norm(h, w, 1e-5), rtol=1e-6)
    np.testing.assert_array_equal(kernel.reference(x, w)[1], x)


def test_inside_shard_map_rows_split_over_devices():
    """Rows split over `data`: outputs and dx stay per device; the scale's gradient is
    summed over `data`, as JAX's own transpose sums a replicated input's."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tensor"))
    x, r, w, dy, dh = inputs((4, 3, 24), jnp.float32, seed=5)

    def step(fn):
        def local(x, r, w, dy, dh):
            (y, h), grads = value_and_grads(fn, x, r, w, dy, dh, True)
            return y, h, *grads

        rows = P("data")
        return jax.jit(
            jax.shard_map(
                local,
                mesh=mesh,
                in_specs=(rows, rows, P(), rows, rows),
                out_specs=(rows, rows, rows, rows, P()),
            )  # fmt: skip
        )(x, r, w, dy, dh)

    got, want = step(kernel.rms_norm), step(kernel.reference)
    for g, v, name in zip(got, want, ("y", "h", "dx", "dr", "dw"), strict=True):
        np.testing.assert_allclose(g, v, atol=1e-5, rtol=1e-5, err_msg=name)
    _, unsplit = value_and_grads(kernel.reference, x, r, w, dy, dh, True)
    # dw summed over devices: the sum over 12 rows of dy * normalised h, in other orders;
    # each order is within n eps sum|terms| of the exact sum (a pure rtol failed near-zero
    # entries of other seeds' dw: rounding 1e-7, against |dw| 1e-2 there)
    h = np.asarray(x, np.float64) + np.asarray(r, np.float64)
    hat = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + 1e-5)
    terms = np.abs(np.asarray(dy, np.float64) * hat).reshape(-1, h.shape[-1]).sum(axis=0)
    eps = np.finfo(np.float32).eps
    err = np.abs(np.asarray(got[-1], np.float64) - np.asarray(unsplit[2], np.float64))
    assert np.all(err <= 2 * 12 * eps * terms), (err / (2 * 12 * eps * terms)).max()


def test_no_rows_have_a_gradient_of_zeros():
    """Zero rows: the backward divided by zero programs (a traceback); the forward ran."""
    x, r, w, _, _ = inputs((0, 16), jnp.float32, seed=1)
    dx, dw = jax.grad(lambda x, w: jnp.sum(kernel.rms_norm(x, w)[0]), (0, 1))(x, w)
    assert dx.shape == (0, 16) and np.array_equal(dw, np.zeros(16, np.float32))


def test_mismatched_inputs_are_refused():
    x, r, w, _, _ = inputs((2, 16), jnp.float32, seed=1)
    with pytest.raises(ValueError, match="weight"):
        kernel.rms_norm(x, w[:8])
    with pytest.raises(ValueError, match="residual"):
        kernel.rms_norm(x, w, r.astype(jnp.bfloat16))


COMPILE_CHECK = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ultrajax.kernels import rms_norm_triton as source

def signature(fn, types, constants):
    names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    return {n: types.get(n, "constexpr" if n in constants else "i32") for n in names}

for dt in ("bf16", "fp32"):
    ptr = {n: f"*{dt}" for n in ("x_ptr", "r_ptr", "y_ptr", "h_ptr", "dy_ptr", "dh_ptr", "dx_ptr")}
    ptr.update(w_ptr="*fp32", rstd_ptr="*fp32", dw_ptr="*fp32", eps="fp32")
    for fn, constants in (
        (source.forward_kernel, dict(HAS_RESIDUAL=True, BLOCK=2048)),
        (source.forward_kernel, dict(HAS_RESIDUAL=False, BLOCK=64)),
        (source.backward_kernel, dict(HAS_DH=True, ROWS=32, BLOCK=2048)),
        (source.backward_kernel, dict(HAS_DH=False, ROWS=1, BLOCK=64)),
    ):
        ast = ASTSource(fn=triton.jit(fn), signature=signature(fn, ptr, constants),
                        constexprs=constants)
        kernel = triton.compile(ast, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        assert kernel.asm["cubin"], fn.__name__
        print(dt, fn.__name__, constants, len(kernel.asm["ptx"]), "bytes of PTX")
print("ok")
"""


def test_triton_source_compiles_for_an_h100(tmp_path):
    """What the interpreter cannot show: Triton's own compiler takes the kernels to an
    sm_90 cubin (its bundled ptxas; no GPU needed), both dtypes and both variants, in a
    process without the interpreter setting."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # never the user's ~/.triton
    out = subprocess.run(
        [sys.executable, "-c", COMPILE_CHECK], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr
    assert out.stdout.count("bytes of PTX") == 8


GPU_CHECK = """
import jax, jax.numpy as jnp, numpy as np
from ultrajax.kernels.rms_norm import reference, rms_norm
assert jax.default_backend() == "gpu", jax.default_backend()
rng = np.random.default_rng(0)
for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)):
    x, r, dy, dh = (jnp.asarray(rng.standard_normal((3, 100, 1000)), dtype) for _ in range(4))
    w = jnp.asarray(1 + 0.3 * rng.standard_normal(1000), jnp.float32)
    def loss(fn):
        return lambda x, r, w: sum(
            jnp.sum(a.astype(jnp.float32) * b.astype(jnp.float32))
            for a, b in zip(fn(x, w, r), (dy, dh)))
    both = lambda *a: (rms_norm(a[0], a[2], a[1]), jax.grad(loss(rms_norm), (0, 1, 2))(*a))
    got = jax.jit(both)(x, r, w)
    want = (reference(x, w, r), jax.grad(loss(reference), (0, 1, 2))(x, r, w))
    for g, v in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, v = np.asarray(g, np.float32), np.asarray(v, np.float32)
        err = float(np.abs(g - v).max()) / max(float(np.abs(v).max()), 1e-30)
        print(dtype.__name__, g.shape, "max error / max", err)
        assert np.isfinite(g).all() and err < tol, err
print("ok")
"""


def test_compiled_through_jax_triton_on_a_gpu():
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no GPU here (nvidia-smi not found): jax-triton compiles for CUDA only")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TRITON_INTERPRET")}
    probe = subprocess.run(
        [sys.executable, "-c", "import jax_triton"], env=env, capture_output=True, text=True
    )
    if probe.returncode != 0:
        pytest.skip(f"jax-triton does not import here: {probe.stderr.strip().splitlines()[-1]}")
    out = subprocess.run(
        [sys.executable, "-c", GPU_CHECK], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr
