"""How the model reads a weight, and where that weight's gradient goes.

A `Weight` pairs the value the forward pass reads (compute dtype, in the layout the
matmul wants: gathered under ZeRO, this rank's heads under TP) with a *sink*: an
fp32 zeros array in the layout of the gradient the optimizer wants (this rank's
ZeRO shard, reduced over the data axes). The step differentiates the loss with
respect to the sinks, never the values, so:

- the weight gradient leaves its matmul in `parallel.grad_reduce_dtype` (fp32
  accumulation in the dot, fp32 by default), and the embedding gradient is a
  scatter-add into fp32: frequent tokens keep their gradient;
- every reduction of a weight's gradient runs inside that weight's backward rule,
  i.e. inside the backward layer loop, right after the layer's gradient exists,
  where XLA's latency-hiding scheduler can overlap it with the next layer's backward;
- which reductions run is read off the types: under `shard_map` with
  `check_vma`, the gradient varies over the axes its inputs vary over, the sink
  is typed with the axes the result may vary over, and the difference is summed
  (`psum`). A gradient that still varies where the sink does not is an error,
  never a silently wrong sum. A sink typed as varying over the data axes defers
  that reduction (gradient accumulation's `no_sync`): the running sum `acc` rides
  along and is added before the last micro-batch reduces.

Plain arrays are accepted everywhere (decoding, reference computations): then the
ops are ordinary `jnp` with ordinary autodiff.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from ultrajax.kernels.varying import partitioned_axes, vary, vma, zeros
from ultrajax.model import fp8, grouped
from ultrajax.model.order import zeros_after


@dataclass(frozen=True)
class Reduce:
    """What a weight's backward rule does with the local gradient (static).

    dtype: the dtype the gradient leaves the matmul in and is reduced in.
    scatter: (mesh axis, dimension) for a ZeRO reduce-scatter into this rank's shard,
      or None. Whatever the gradient still varies over that the sink does not is
      then all-reduced (psum), in `dtype`."""

    dtype: str = "float32"
    scatter: tuple[str, int] | None = None
    spec: object = None  # a PartitionSpec for the result (gspmd: the partitioner reduces)
    varying: frozenset = frozenset()  # the sink's varying axes: where the result may vary
    shape: tuple = ()  # the sink's shape
    defer: Deferred | None = None  # zero bubble: hand out (input, cotangent), see Deferred
    # the reduced gradient made before the input's gradient leaves (`ordered`)
    ordered: bool = False


class Deferred:
    """Zero bubble's split backward for one weight (parallel/pipeline/stage.py).

    The input step (B) needs only the activation gradients; the weight step (W) later
    needs, per matmul, its input and its output's cotangent, nothing else. A weight whose
    `reduce.defer` is set has a backward rule that computes the input gradient and hands
    out (input, cotangent) as the cotangent of its `acc` (a pair of zeros shaped like
    them) instead of the weight gradient; `weight_gradient` turns the pair into the same
    gradient the ordinary rule computes. A first trace with `acc=None` records the op
    and the pair's shapes (`seen`), so the zeros can be made.

    A grouped matmul's (the experts', `ragged_dense`) pair has a third member, its group
    sizes, carried in fp32 (exact below 2^24 rows): an integer cotangent would be float0,
    no values. A weight the layer never multiplies by (the router's bias, read for the
    choice only) records nothing: its pair is () and its gradient zero."""

    def __init__(self):
        # (op: an einsum equation, "scale" or ("ragged", impl, groups), then the structs
        # of the pair's members: input, output, [group sizes])
        self.seen = None
        self.source = None  # which input (wq, wk and wv read the same one): kept once

    def zeros(self):
        """The pair of zeros to pass as the weight's `acc` (types included)."""
        if self.seen is None:
            return ()
        return tuple(zeros(s.shape, s.dtype, axes) for s, axes in self.seen[1:])

    def weight_gradient(self, pair, red: Reduce):
        """The weight's gradient from its (input, cotangent): the ordinary rule's math."""
        red = dataclasses.replace(red, defer=None)
        if self.seen is None:  # not multiplied by: the gradient autodiff would give
            return zeros(red.shape, jnp.float32, red.varying)
        x, g, *sizes = pair
        op = self.seen[0]
        if op == "scale":
            return finish(_scale_dw(x, g), None, red)
        if op[0] == "fp8":  # through FP8 operands, as the forward's matmul (model/fp8.py)
            _, recipe, eq = op
            if recipe == "delayed":  # the pair's third member: the history's amaxes
                return finish(fp8.delayed_weight_gradient(eq, x, g, sizes[0]), None, red)
            return finish(fp8.weight_gradient(eq, x, g, recipe), None, red)
        if op[0] == "ragged":
            _, impl, groups = op
            shape = (groups, x.shape[-1], g.shape[-1])
            return finish(_ragged_dw(x, g, sizes[0].astype(jnp.int32), shape, red, impl), None, red)
        return finish(dense_dw(op, x, g, red), None, red)


def _struct(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype), vma(x)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Weight:
    value: jax.Array  # read by the forward pass; never differentiated
    sink: jax.Array  # fp32 zeros shaped and typed like the reduced gradient
    acc: jax.Array | None  # gradients of earlier micro-batches (not yet reduced), or None
    reduce: Reduce = field(metadata=dict(static=True))
    # model.fp8=delayed: (the history's amaxes of x, w and g, fp32[3]; a zero fp32[3] sink
    # whose cotangent is this matmul's amaxes, model/fp8.py), else None
    fp8: tuple | None = None

    @classmethod
    def make(cls, value, sink, acc, reduce: Reduce, fp8=None) -> Weight:
        """The sink's type goes into the static `reduce`: the backward rules need it, not
        its (zero) values, so the sinks are never kept for the backward pass."""
        red = dataclasses.replace(reduce, varying=vma(sink), shape=sink.shape)
        return cls(value, sink, acc, red, fp8)

    @property
    def shape(self):
        return self.value.shape


def finish(dw, acc, red: Reduce):
    """Local gradient -> the sink's gradient: reduce, add the running sum, reduce.

    The running sum `acc` is already reduced over the axes it does not vary over, so
    the gradient is reduced over those first, alone; over the axes `acc` still varies
    over (a deferred reduction), it is reduced with `acc` added. Sums stay in fp32;
    only the collectives run in `red.dtype`."""
    f32, rdt = jnp.float32, jnp.dtype(red.dtype)

    def psum(x, axes):
        axes = tuple(sorted(axes))
        return jax.lax.psum(x.astype(rdt), axes).astype(f32) if axes else x

    dw = dw.astype(f32)
    scatter_axis = red.scatter[0] if red.scatter is not None else None
    held = vma(acc) if acc is not None else frozenset()
    first = vma(dw) - red.varying - held - {scatter_axis}  # acc is already reduced over these
    whole = acc is not None and acc.shape == dw.shape  # full-size running sum (ZeRO-0/1)
    if whole:
        dw = psum(dw, first) + acc
    if red.scatter is not None:  # ZeRO: this rank keeps the sum of its shard
        axis, dim = red.scatter
        dw = jax.lax.psum_scatter(dw.astype(rdt), axis, scatter_dimension=dim, tiled=True)
        dw = dw.astype(f32)
    if not whole:  # reduce the (now smaller) shard, then add the sharded running sum
        dw = psum(dw, first)
        if acc is not None:
            dw = dw + acc
    dw = psum(dw, vma(dw) - red.varying)
    if red.spec is not None:
        dw = jax.lax.with_sharding_constraint(dw, red.spec)
    missing = tuple(sorted(red.varying - vma(dw)))
    return jax.lax.pcast(dw, missing, to="varying") if missing else dw


# --------------------------------------------------------------------------- matmul


def transposes(eq: str) -> tuple[str, str]:
    """'A,B->C' -> ('C,B->A', 'A,C->B'): the einsums of dx and dw."""
    ins, out = eq.split("->")
    a, b = ins.split(",")
    return f"{out},{b}->{a}", f"{a},{out}->{b}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 6))
def _dense(eq, out_dtype, x, value, sink, acc, red):
    return jnp.einsum(eq, x, value, preferred_element_type=out_dtype).astype(out_dtype)


def _dense_fwd(eq, out_dtype, x, value, sink, acc, red):
    keep = None if red.defer is not None else acc  # deferred: acc is only the pair's zeros
    return _dense(eq, out_dtype, x, value, sink, acc, red), (x, value, keep)


def dense_dw(eq, x, g, red):
    return jnp.einsum(transposes(eq)[1], x, g, preferred_element_type=jnp.dtype(red.dtype))


def _dense_bwd(eq, out_dtype, red, res, g):
    x, value, acc = res
    eq_dx, _ = transposes(eq)
    g = g.astype(x.dtype)
    dx = jnp.einsum(eq_dx, g, value).astype(x.dtype)
    if red.defer is not None:
        return dx, None, None, (x, g)
    dx, dw = ordered(dx, finish(dense_dw(eq, x, g, red), acc, red), red)
    return dx, None, dw, None


def ordered(dx, dw, red: Reduce):
    """(dx, dw), dx available only once the reduced weight gradient(s) dw are, where
    `red.ordered`: the layers as a Python loop on several devices, where nothing else
    made a layer's weight gradients and their collectives before the next layer's
    backward, as a scan's iteration does. XLA's GPU scheduler put them after the whole
    backward, holding every layer's inputs to them and their unreduced fp32 gradients
    (compiled for an H200 under full recomputation: the 1B step over data 8 34.04 GiB,
    19.95 with this; docs/memory.md). The barrier's own copy of dw is dropped: dw keeps
    its type, and where it varies over an axis dx does not, nothing is ordered."""
    axes = vma(dx)
    if red.ordered and all(vma(d) <= axes for d in jax.tree.leaves(dw)):
        dx, _ = jax.lax.optimization_barrier((dx, jax.tree.map(lambda d: vary(d, axes), dw)))
    return dx, dw


_dense.defvjp(_dense_fwd, _dense_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 8))
def _dense_fp8(eq, recipe, out_dtype, x_dtype, x, value, sink, acc, red):
    return fp8.matmul(eq, x, value, recipe).astype(out_dtype)


def _dense_fp8_fwd(eq, recipe, out_dtype, x_dtype, x, value, sink, acc, red):
    y, res = fp8.forward(eq, x, value, recipe)
    if red.defer is not None:  # zero bubble: the inputs, for dx now and (x, g) for later
        return y.astype(out_dtype), ((x, value), None)
    return y.astype(out_dtype), (res, acc)


def _dense_fp8_bwd(eq, recipe, out_dtype, x_dtype, red, res, g):
    """_dense_bwd's through fp8.matmul's rule, the weight gradient reduced by `finish`;
    zero bubble: dx, and (x, g) handed out for the weight step (`Deferred`)."""
    res, acc = res
    if red.defer is not None:
        x, value = res
        dx = fp8.input_gradient(eq, value, g, recipe)
        return dx.astype(x_dtype), None, None, (x, g.astype(x.dtype))
    dx, dw = fp8.backward(eq, res, g, recipe)
    dx, dw = ordered(dx, finish(dw, acc, red), red)
    return dx.astype(x_dtype), None, dw, None


_dense_fp8.defvjp(_dense_fp8_fwd, _dense_fp8_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 9, 10))
def _dense_delayed(eq, out_dtype, x_dtype, x, value, sink, acc, seen, amax_sink, red, axes):
    return fp8.delayed_forward(eq, x, value, seen)[0].astype(out_dtype)


def _dense_delayed_fwd(eq, out_dtype, x_dtype, x, value, sink, acc, seen, amax_sink, red, axes):
    y, res, amaxes = fp8.delayed_forward(eq, x, value, seen)
    if red.defer is not None:  # zero bubble: the inputs, for dx now and (x, g) for later
        return y.astype(out_dtype), ((x, value), None, seen, amaxes)
    return y.astype(out_dtype), (res, acc, seen, amaxes)


def _dense_delayed_bwd(eq, out_dtype, x_dtype, red, axes, res, g):
    """_dense_fp8_bwd's with the history's scales; the amaxes of x, w and g leave as the
    cotangent of their sink, typed as it is (varying over `axes`: parallel/grads.py
    max-reduces them once, after the last micro-batch)."""
    res, acc, seen, amaxes = res
    if red.defer is not None:  # zero bubble: dx now, (x, g, the scales' amaxes) for W
        x, value = res
        dx, ag = fp8.delayed_split_backward(eq, value, g, seen)
        pair, dw = (x, g.astype(x.dtype), seen), None
    else:
        dx, dw, ag = fp8.delayed_backward(eq, res, g, seen)
        dx, dw = ordered(dx, finish(dw, acc, red), red)
        pair = None
    amaxes = jnp.concatenate([amaxes, ag[None]])
    missing = tuple(sorted(axes - vma(amaxes)))
    amaxes = jax.lax.pcast(amaxes, missing, to="varying") if missing else amaxes
    return dx.astype(x_dtype), None, dw, pair, None, amaxes


_dense_delayed.defvjp(_dense_delayed_fwd, _dense_delayed_bwd)


def _traced(w: Weight, op, x, out, *more):
    """Zero bubble's shape trace (a deferred weight, no pair yet): record the matmul's op
    and its pair's types, the input, the output's cotangent and `more` (model.ops.Deferred)."""
    if w.reduce.defer is not None and w.acc is None:
        w.reduce.defer.seen = (op, _struct(x), _struct(out.astype(x.dtype)), *map(_struct, more))
        w.reduce.defer.source = id(x)  # the trace holds x: ids of live inputs
    return out


def dense(x, w, eq: str, out_dtype=None, fp8_recipe: str = "none"):
    """einsum(eq, x, w) in x's dtype (or `out_dtype`), w cast to x's dtype; with an
    `fp8_recipe` (model.fp8) through FP8 operands (model/fp8.py)."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if fp8_recipe == "delayed" and isinstance(w, Weight) and w.fp8 is not None:
        seen, amax_sink = w.fp8
        value, axes = w.value.astype(x.dtype), frozenset(vma(amax_sink))
        args = (x, value, w.sink, w.acc, seen, amax_sink, w.reduce, axes)
        out = _dense_delayed(eq, out_dtype, x.dtype.name, *args)
        return _traced(w, ("fp8", "delayed", eq), x, out, seen)
    if fp8_recipe != "none" and isinstance(w, Weight):
        value = w.value.astype(x.dtype)
        args = (x, value, w.sink, w.acc, w.reduce)
        out = _dense_fp8(eq, fp8_recipe, out_dtype, x.dtype.name, *args)
        return _traced(w, ("fp8", fp8_recipe, eq), x, out)
    if fp8_recipe != "none":
        return fp8.matmul(eq, x, w.astype(x.dtype), fp8_recipe).astype(out_dtype)
    if isinstance(w, Weight):
        out = _dense(eq, out_dtype, x, w.value.astype(x.dtype), w.sink, w.acc, w.reduce)
        return _traced(w, eq, x, out)
    return jnp.einsum(eq, x, w.astype(x.dtype), preferred_element_type=out_dtype).astype(out_dtype)


# --------------------------------------------------------------------------- one input, one matmul


def _joined(values, shapes, axis, dtype):
    parts = [v.astype(dtype).reshape(s) for v, s in zip(values, shapes, strict=True)]
    return jnp.concatenate(parts, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 8))
def _dense_joined(eq, shapes, axis, out_dtype, x, values, sinks, accs, reds):
    w = _joined(values, shapes, axis, x.dtype)
    return jnp.einsum(eq, x, w, preferred_element_type=out_dtype).astype(out_dtype)


def _dense_joined_fwd(eq, shapes, axis, out_dtype, x, values, sinks, accs, reds):
    out = _dense_joined(eq, shapes, axis, out_dtype, x, values, sinks, accs, reds)
    return out, (x, values, accs)


def _dense_joined_bwd(eq, shapes, axis, out_dtype, reds, res, g):
    x, values, accs = res
    eq_dx, _ = transposes(eq)
    g = g.astype(x.dtype)
    dx = jnp.einsum(eq_dx, g, _joined(values, shapes, axis, x.dtype)).astype(x.dtype)
    # each weight's gradient from its own part of g: one matmul and reduction per weight,
    # as without joining (split after one matmul, the partitioner all-reduced the whole
    # joined gradient over `data` before scattering each part over `fsdp`)
    out_axis = x.ndim - 1 + axis - 1
    cuts = list(itertools.accumulate(s[axis] for s in shapes))[:-1]
    parts = jnp.split(g, cuts, out_axis)
    each = zip(parts, values, reds, strict=True)
    local = [dense_dw(eq, x, gi, r).reshape(v.shape) for gi, v, r in each]
    grads = tuple(finish(d, a, r) for d, a, r in zip(local, accs, reds, strict=True))
    dx, grads = ordered(dx, grads, reds[0])
    return dx, None, grads, None


_dense_joined.defvjp(_dense_joined_fwd, _dense_joined_bwd)


def _contract_first(x_ndim: int, w_ndim: int) -> str:
    """The einsum contracting x's last axis with w's first: 'abz,zcd->abcd'."""
    lead, rest = "abcdefgh"[: x_ndim - 1], "stuvwxy"[: w_ndim - 1]
    return f"{lead}z,z{rest}->{lead}{rest}"


def dense_joined(x, ws, shapes, axis: int, fp8_recipes=None):
    """[dense(x, w) for w in ws], contracting x's last axis with each weight's first, as
    one matmul: each weight reshaped to its entry of `shapes` (same rank, equal but for
    `axis`) and joined along `axis`. Why: the input gradient is then one sum of partial
    products, which the partitioner reduces once, where separate matmuls are reduced
    once each (parallel/partitioned.py). Same values as separate `dense` calls, which
    plain arrays (decoding), split backwards (zero bubble) and FP8 operands still take.
    `fp8_recipes`: each weight's (model.fp8), None: none."""
    recipes = fp8_recipes or ("none",) * len(ws)
    if set(recipes) != {"none"} or not all(
        isinstance(w, Weight) and w.reduce.defer is None for w in ws
    ):
        eqs = [_contract_first(x.ndim, len(w.shape)) for w in ws]
        each = zip(ws, eqs, recipes, strict=True)
        return [dense(x, w, eq, fp8_recipe=r) for w, eq, r in each]
    eq = _contract_first(x.ndim, len(shapes[0]))
    shapes = tuple(tuple(s) for s in shapes)
    out = _dense_joined(
        eq,
        shapes,
        axis,
        x.dtype,
        x,
        tuple(w.value for w in ws),
        tuple(w.sink for w in ws),
        tuple(w.acc for w in ws),
        tuple(w.reduce for w in ws),
    )
    cuts = list(itertools.accumulate(s[axis] for s in shapes))[:-1]
    at = x.ndim - 1 + axis - 1  # the joined axis in the output
    return [
        o.reshape(*x.shape[:-1], *w.shape[1:])
        for o, w in zip(jnp.split(out, cuts, at), ws, strict=True)
    ]


# --------------------------------------------------------------------------- norm scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _scale(y, value, sink, acc, red):
    return y * value.astype(y.dtype)


def _scale_fwd(y, value, sink, acc, red):
    keep = None if red.defer is not None else acc
    return _scale(y, value, sink, acc, red), (y, value, keep)


def _scale_dw(y, g):
    # summed over the leading axes in place: a reshape merging (batch, length) would make
    # the partitioner gather a sequence-parallel fp32 y before it (parallel/partitioned.py)
    return jnp.sum(g * y, axis=tuple(range(y.ndim - 1)))


def _scale_bwd(red, res, g):
    y, value, acc = res
    dy = g * value.astype(g.dtype)
    if red.defer is not None:
        return dy, None, None, (y, g)
    return dy, None, finish(_scale_dw(y, g), acc, red), None


_scale.defvjp(_scale_fwd, _scale_bwd)


def scale(y, w):
    """y * w along the last axis (RMSNorm's learned scale), in y's dtype."""
    if isinstance(w, Weight):
        out = _scale(y, w.value, w.sink, w.acc, w.reduce)
        if w.reduce.defer is not None and w.acc is None:  # the shape trace
            w.reduce.defer.seen = ("scale", _struct(y), _struct(out))
            w.reduce.defer.source = id(y)
        return out
    return y * w.astype(y.dtype)


# --------------------------------------------------------------------------- lookup


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _lookup(idx, value, sink, acc, red):
    return value[idx]


def _lookup_fwd(idx, value, sink, acc, red):
    return _lookup(idx, value, sink, acc, red), (idx, acc)


def _lookup_bwd(red, res, g):
    idx, acc = res
    # the scatter-add accumulates in fp32 whatever the compute dtype, into zeros read off
    # g (model/order.py): a constant table XLA would build before the layers' backward
    # and keep through it. Only where the code is one device's own: the partitioner
    # (parallel.collectives=gspmd) splits a scatter into constant zeros along its updates,
    # but all-gathers the updates (an activation) to scatter into anything else
    own = not partitioned_axes()
    zero = zeros_after(g, red.shape) if own else jnp.zeros(red.shape, jnp.float32)
    dw = zero.at[idx].add(g.astype(jnp.float32))
    return None, None, finish(dw, acc, red), None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def lookup(table, idx, dtype):
    """Rows `idx` of the embedding table, in `dtype`."""
    if isinstance(table, Weight):
        return _lookup(idx, table.value.astype(dtype), table.sink, table.acc, table.reduce)
    return table.astype(dtype)[idx]


# --------------------------------------------------------------------------- grouped matmul


def _grouped(impl: str, x, w, sizes, dtype):
    """x's groups of rows times their weights: jax's ragged_dot or model/grouped.py's blocks."""
    if impl == "blocked":
        return grouped.matmul(x, w, sizes, out_dtype=dtype)
    return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _ragged(x, value, sizes, sink, acc, red, impl):
    return _grouped(impl, x, value, sizes, x.dtype)


def _ragged_fwd(x, value, sizes, sink, acc, red, impl):
    keep = None if red.defer is not None else acc  # deferred: acc is only the pair's zeros
    return _ragged(x, value, sizes, sink, acc, red, impl), (x, value, sizes, keep)


def _ragged_dw(x, g, sizes, shape, red, impl):
    """Each group's x^T g, `shape` (groups, k, n): the transpose of the grouped matmul in
    its weight, local like the other rules' (ragged: the weight typed as varying like x
    and g, as JAX would otherwise sum the transpose over the axes they vary over, and
    `finish` again)."""
    dt = jnp.dtype(red.dtype)
    if impl == "blocked":
        return grouped.weight_gradient(x.astype(dt), g.astype(dt), sizes, shape[0], dtype=dt)
    w = zeros(shape, dt, vma(x) | vma(g))  # the transpose is linear: any w will do
    _, back = jax.vjp(lambda w: jax.lax.ragged_dot(x, w, sizes, preferred_element_type=dt), w)
    return back(g.astype(dt))[0]


def _ragged_bwd(red, impl, res, g):
    x, value, sizes, acc = res
    g = g.astype(x.dtype)
    dx = _grouped(impl, g, jnp.swapaxes(value, 1, 2), sizes, x.dtype)
    if red.defer is not None:  # zero bubble: the pair for the weight step, sizes in fp32
        return dx, None, None, None, (x, g, sizes.astype(jnp.float32))
    dw = finish(_ragged_dw(x, g, sizes, value.shape, red, impl), acc, red)
    return dx, None, None, dw, None


_ragged.defvjp(_ragged_fwd, _ragged_bwd)


def ragged_dense(x, w, sizes, impl: str = "ragged"):
    """jax.lax.ragged_dot(x, w, sizes) in x's dtype: x's rows (m, k) in consecutive
    groups of `sizes`, group i multiplied by w[i] (groups, k, n). A grouped GEMM: the
    experts of an MoE layer (model/moe.py), each on the tokens sorted to it. `impl`:
    "ragged" (jax's ragged_dot) or "blocked" (model/grouped.py), model.moe_grouped
    resolved (`grouped.implementation`)."""
    if isinstance(w, Weight):
        out = _ragged(x, w.value.astype(x.dtype), sizes, w.sink, w.acc, w.reduce, impl)
        if w.reduce.defer is not None and w.acc is None:  # the shape trace
            sizes32 = sizes.astype(jnp.float32)
            op = ("ragged", impl, w.shape[0])
            w.reduce.defer.seen = (op, _struct(x), _struct(out), _struct(sizes32))
            w.reduce.defer.source = id(x)
        return out
    return _grouped(impl, x, w.astype(x.dtype), sizes, x.dtype)
