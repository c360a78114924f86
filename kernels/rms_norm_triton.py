"""The Triton source of the fused residual add + RMSNorm (kernels/rms_norm.py calls it).

Imported only when the kernel runs: `triton` is a GPU dependency (on a CPU it is
installed for the tests, which run these same functions in Triton's interpreter).
The functions are plain Python here; `kernels/triton_call.py` compiles them with
`triton.jit` for a GPU or wraps them for the interpreter.

Arguments come in jax-triton's order: inputs (arrays and scalars), then one pointer
per output, then the `constexpr` metaparameters. Rows are the flattened leading axes;
each row of `n_cols` features is contiguous (`stride` apart). One program normalises
one row in the forward. The backward runs fewer programs, each over a contiguous run
of rows, and writes its own fp32 partial sum of the scale's gradient: no atomics, and
the (programs, n_cols) partials are summed by XLA afterwards.
"""

import triton.language as tl


def forward_kernel(
    x_ptr, r_ptr, w_ptr, n_cols, stride, eps, y_ptr, h_ptr, rstd_ptr,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """h = x + r (rounded to x's dtype, as the unfused model rounds it); y = h * rstd * w
    with rstd = 1 / sqrt(mean(h²) + eps) in fp32; rstd is kept for the backward."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    offs = row * stride + cols
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(r_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        x = x.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + offs, x, mask=inside)
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=inside)
    tl.store(rstd_ptr + row, rstd)


def backward_kernel(
    dy_ptr, dh_ptr, h_ptr, w_ptr, rstd_ptr, n_rows, n_cols, stride,
    dx_ptr, dw_ptr, HAS_DH: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """dx = rstd * (g - x̂ * mean(g * x̂)) + dh with g = dy * w and x̂ = h * rstd: the
    gradient through the norm plus the one that reached h by the residual stream (which
    is also the gradient of both addends). dw accumulates dy * x̂ over this program's
    ROWS rows (a constant: the loop's bounds are never tensors), in fp32; rows past
    n_rows load zeros and store nothing."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), tl.float32)
    for i in range(ROWS):
        row = pid * ROWS + i
        # as a block: Triton 3.9's interpreter mis-types a scalar mask and'ed with a block
        real = (cols * 0 + row) < n_rows
        offs = row * stride + cols
        x = tl.load(h_ptr + offs, mask=inside & real, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=inside & real, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + tl.minimum(row, n_rows - 1))  # its x, dy are zeros past
        xhat = x * rstd
        g = dy * w
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / n_cols))
        if HAS_DH:
            dx += tl.load(dh_ptr + offs, mask=inside & real, other=0.0).to(tl.float32)
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=inside & real)
        dw += dy * xhat
    tl.store(dw_ptr + pid * n_cols + cols, dw, mask=inside)
