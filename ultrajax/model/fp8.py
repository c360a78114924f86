"""FP8 matmuls (model.fp8=tensorwise|rowwise|delayed): one byte a value in the matmul's
operands, fp32 accumulation and scales.

Why this recipe: the forward operands (activations, weights) go to e4m3, more mantissa
for values whose range a per-tensor scale already fits; the backward's gradient operand
goes to e5m2, more range for gradients whose spread is wider. Each operand is scaled so
its largest magnitude lands on the format's largest finite value (448 for e4m3, 57344
for e5m2), clipped there, cast; the product of two quantised operands is divided by
both scales. Nothing overflows to inf: a value far beyond the format is clipped after
scaling by its own tensor's amax, so it lands on the largest finite value.

Three recipes (model.fp8):

- tensorwise: one scale a tensor. The backward quantises the output's cotangent to e5m2
  and reuses the forward's e4m3 operands (kept for the backward: one byte a value).
- rowwise: one scale per index an operand keeps in the product, its amax taken over
  the indices the product contracts: per token (row) of an activation, per output
  column of a weight, and in the weight gradient per feature over the tokens. Why: one
  outlier token no longer coarsens every other token's grid, and a token's forward
  does not depend on the rest of the batch. The scales factor out of the sum, so the
  product divides by their outer product. Each product quantises along its own axes,
  so the backward re-quantises the forward's inputs (kept in their own dtype).

- delayed: one scale a tensor, as tensorwise, but from the largest amax of the last
  model.fp8_history steps (Transformer Engine's delayed scaling) rather than the
  tensor's own: the scale is known before the tensor is, so quantising needs no
  reduction over it first. Each matmul records its operands' amaxes (x, w and the
  cotangent g) for the next step: they leave the backward rule as the cotangent of a
  zero "sink", as weight gradients do (model/ops.py), are max-reduced over the
  micro-batches and every mesh axis that splits the tensors (parallel/grads.py; a
  pipeline's tick loop), and roll into the history in the train state (`record`). A
  value beyond the history's amax is clipped to the format's largest, never inf. A
  tensor with no history yet (the first step, or all zeros so far) is scaled by its
  own amax, as tensorwise.

`matmul(eq, x, w, recipe)` is einsum(eq, x, w) in fp32 through FP8 operands.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn  # forward operands
E5M2 = jnp.float8_e5m2  # the backward's gradient operand


RECIPES = ("tensorwise", "rowwise", "delayed")
# the weights whose matmuls take FP8 operands (model.fp8_layers chooses among them): the
# attention projections and the dense MLP; embedding, head, norms and experts do not
WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
# delayed: the operands of one matmul whose amaxes it records, in this order
OPERANDS = ("x", "w", "g")


def quantize(x, dtype, amax=None, axes=None):
    """(q, scale): x ~ q / scale, q in `dtype`, scale = the format's max / amax(x) (1
    where x is all zeros), fp32. `axes`: the axes the amax is taken over, kept as size-1
    axes of the scale (None: all, one scalar scale). `amax`: the whole tensor's, where x
    is a shard of it."""
    top = float(jnp.finfo(dtype).max)
    x32 = x.astype(jnp.float32)
    if amax is None:
        amax = jnp.max(jnp.abs(x32), axis=axes, keepdims=axes is not None)
    scale = jnp.where(amax > 0, top / jnp.maximum(amax, jnp.finfo(jnp.float32).tiny), 1.0)
    return jnp.clip(x32 * scale, -top, top).astype(dtype), scale


def scaled(eq: str, a, sa, b, sb):
    """einsum(eq) of two quantised operands, fp32, their scalar scales divided out."""
    return jnp.einsum(eq, a, b, preferred_element_type=jnp.float32) / (sa * sb)


def _transposes(eq: str) -> tuple[str, str]:
    """'A,B->C' -> ('C,B->A', 'A,C->B'): the einsums of dx and dw."""
    ins, out = eq.split("->")
    a, b = ins.split(",")
    return f"{out},{b}->{a}", f"{a},{out}->{b}"


def rowwise(eq: str, a, b, a_dtype, b_dtype):
    """einsum(eq, a, b) in fp32 with a in `a_dtype` and b in `b_dtype`, each scaled per
    index it keeps (amax over the indices eq contracts), the scales' outer product
    divided out."""
    ins, out = eq.split("->")
    spec_a, spec_b = ins.split(",")
    summed_a = tuple(i for i, c in enumerate(spec_a) if c not in out)
    summed_b = tuple(i for i, c in enumerate(spec_b) if c not in out)
    aq, sa = quantize(a, a_dtype, axes=summed_a)
    bq, sb = quantize(b, b_dtype, axes=summed_b)
    kept_a = "".join(c for c in spec_a if c in out)
    kept_b = "".join(c for c in spec_b if c in out)
    inv = jnp.einsum(
        f"{kept_a},{kept_b}->{out}",
        1.0 / jnp.squeeze(sa, summed_a),
        1.0 / jnp.squeeze(sb, summed_b),
    )
    return jnp.einsum(eq, aq, bq, preferred_element_type=jnp.float32) * inv


def amax(x):
    """The largest magnitude of x, fp32."""
    return jnp.max(jnp.abs(x.astype(jnp.float32)))


def _known(history, current):
    """The history's amax where it has one, else the tensor's own (delayed's first step)."""
    return jnp.where(history > 0, history, current)


def delayed_forward(eq: str, x, w, seen):
    """(einsum through e4m3 operands scaled by `seen`, the history's amaxes of (x, w, g),
    fp32[3]; tensorwise's residuals; the amaxes of x and w, fp32[2])."""
    ax, aw = amax(x), amax(w)
    xq, sx = quantize(x, E4M3, _known(seen[0], ax))
    wq, sw = quantize(w, E4M3, _known(seen[1], aw))
    return scaled(eq, xq, sx, wq, sw), (kept(xq), sx, kept(wq), sw), jnp.stack([ax, aw])


def delayed_backward(eq: str, res, g, seen):
    """(dx, dw, g's amax): tensorwise's backward with g scaled by the history's amax."""
    eq_dx, eq_dw = _transposes(eq)
    xq, sx, wq, sw = res
    xq, wq, ag = unkept(xq), unkept(wq), amax(g)
    gq, sg = quantize(g, E5M2, _known(seen[2], ag))
    return scaled(eq_dx, gq, sg, wq, sw), scaled(eq_dw, xq, sx, gq, sg), ag


def delayed_split_backward(eq: str, w, g, seen):
    """(dx, g's amax) of `delayed_backward` from the weight itself (zero bubble's input
    step: its weight step is `delayed_weight_gradient` of (x, g, seen))."""
    eq_dx = _transposes(eq)[0]
    ag = amax(g)
    gq, sg = quantize(g, E5M2, _known(seen[2], ag))
    wq, sw = quantize(w, E4M3, _known(seen[1], amax(w)))
    return scaled(eq_dx, gq, sg, wq, sw), ag


def delayed_weight_gradient(eq: str, x, g, seen):
    """dw of `delayed_backward` from the forward's input x and the cotangent g."""
    eq_dw = _transposes(eq)[1]
    xq, sx = quantize(x, E4M3, _known(seen[0], amax(x)))
    gq, sg = quantize(g, E5M2, _known(seen[2], amax(g)))
    return scaled(eq_dw, xq, sx, gq, sg)


def history(rows: int, length: int):
    """A weight's empty amax history: fp32 (rows, OPERANDS, length), newest first."""
    return jnp.zeros((rows, len(OPERANDS), length), jnp.float32)


def record(hist, amaxes):
    """The history with this step's amaxes (rows, OPERANDS) in front, the oldest dropped."""
    return jnp.concatenate([amaxes[..., None], hist[..., :-1]], axis=-1)


def seen(hist):
    """What a step scales by: the largest amax of the history, (rows, OPERANDS)."""
    return jnp.max(hist, axis=-1)


def kept(q):
    """An e4m3 operand as the backward keeps it: its bytes, as uint8. Why: under
    jax.checkpoint with a policy, JAX rounds every saved float residual through
    reduce_precision(4 exponent bits, 3 mantissa bits), which XLA treats as an IEEE
    format (largest finite 240, then inf); e4m3fn's values above 240 came back NaN.
    Integers pass as they are (`unkept` reads them back)."""
    return jax.lax.bitcast_convert_type(q, jnp.uint8)


def unkept(u):
    return jax.lax.bitcast_convert_type(u, E4M3)


def forward(eq: str, x, w, recipe: str = "tensorwise"):
    """(einsum(eq, x, w) in fp32 through e4m3 operands, what `backward` needs: tensorwise,
    the quantised operands (`kept`: one byte a value) and their scales; rowwise, x and w)."""
    if recipe == "rowwise":
        return rowwise(eq, x, w, E4M3, E4M3), (x, w)
    (xq, sx), (wq, sw) = quantize(x, E4M3), quantize(w, E4M3)
    return scaled(eq, xq, sx, wq, sw), (kept(xq), sx, kept(wq), sw)


def backward(eq: str, res, g, recipe: str = "tensorwise"):
    """(dx, dw) in fp32 from `forward`'s residuals: the cotangent in e5m2 against e4m3
    operands (tensorwise: the forward's own; rowwise: re-quantised along each product's
    kept indices)."""
    eq_dx, eq_dw = _transposes(eq)
    if recipe == "rowwise":
        x, w = res
        return rowwise(eq_dx, g, w, E5M2, E4M3), rowwise(eq_dw, x, g, E4M3, E5M2)
    xq, sx, wq, sw = res
    xq, wq = unkept(xq), unkept(wq)
    gq, sg = quantize(g, E5M2)
    return scaled(eq_dx, gq, sg, wq, sw), scaled(eq_dw, xq, sx, gq, sg)


def input_gradient(eq: str, w, g, recipe: str):
    """dx of `backward` from the weight itself rather than the forward's residuals: zero
    bubble's input step (its weight step is `weight_gradient` of (x, g)). Quantising the
    same tensor the same way again gives the same operands."""
    eq_dx = _transposes(eq)[0]
    if recipe == "rowwise":
        return rowwise(eq_dx, g, w, E5M2, E4M3)
    (gq, sg), (wq, sw) = quantize(g, E5M2), quantize(w, E4M3)
    return scaled(eq_dx, gq, sg, wq, sw)


def weight_gradient(eq: str, x, g, recipe: str):
    """dw of `backward` from the forward's input x and the cotangent g."""
    eq_dw = _transposes(eq)[1]
    if recipe == "rowwise":
        return rowwise(eq_dw, x, g, E4M3, E5M2)
    (xq, sx), (gq, sg) = quantize(x, E4M3), quantize(g, E5M2)
    return scaled(eq_dw, xq, sx, gq, sg)


def matmul(eq: str, x, w, recipe: str = "tensorwise"):
    """einsum(eq, x, w) in fp32 with e4m3 operands (module docstring). No history reaches a
    plain matmul (evaluation, decoding, a reference): delayed scales as tensorwise."""
    if recipe not in RECIPES:
        raise ValueError(f"FP8 recipe {recipe!r}: expected one of {', '.join(RECIPES)}")
    recipe = "tensorwise" if recipe == "delayed" else recipe
    return _matmul(eq, recipe, x.dtype.name, w.dtype.name, x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _matmul(eq: str, recipe: str, x_dtype: str, w_dtype: str, x, w):
    return forward(eq, x, w, recipe)[0]


def _matmul_fwd(eq, recipe, x_dtype, w_dtype, x, w):
    return forward(eq, x, w, recipe)


def _matmul_bwd(eq, recipe, x_dtype, w_dtype, res, g):
    dx, dw = backward(eq, res, g, recipe)
    return dx.astype(x_dtype), dw.astype(w_dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)
