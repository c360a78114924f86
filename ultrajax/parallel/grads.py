"""Data parallelism and gradient accumulation: where, when and in what dtype gradients
are summed across the ranks that split the batch (`data` x `fsdp`).

The playbook's three lessons, in this file's terms:
- overlap: each weight's gradient is reduced inside its own backward rule
  (model/ops.py), so a layer's reduction sits inside the backward layer loop
  and can run while the next layer differentiates;
- bucketing: left to XLA's combiner thresholds (ultrajax/train/overlap.py);
- no_sync: with gradient accumulation, reductions that can wait for the last
  micro-batch do (ZeRO-0/1: all of them; ZeRO-2/3: the `data` axis, since `fsdp`
  must scatter into the sharded accumulator every micro-batch). The first
  micro-batches run with sinks typed as varying over the deferred axes, so no
  reduction is owed; the last one adds their running sum before reducing.

One fp32 running sum, accumulated in place: each weight's backward rule adds its
gradient into the sum (a Ref the backward pass accumulates into, `backward`), so no
fresh fp32 gradient of a whole micro-batch ever sits beside it. Only the last
micro-batch's reduced gradients are a buffer of their own (ZeRO >= 1: shards).

Used per device inside `shard_map` (explicit collectives, or manual only over the
data axes under `parallel.collectives: gspmd`) or globally under the partitioner:
the same code, with `manual` naming the axes this code sees one shard of.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from ultrajax.kernels.varying import vary, vma, zeros, zeros32
from ultrajax.model import fp8
from ultrajax.model.ops import Reduce, Weight, finish
from ultrajax.model.order import zero_after
from ultrajax.model.prefetch import Prefetch
from ultrajax.model.stack import Held
from ultrajax.parallel.axes import FSDP, TOKEN_AXES  # the batch's tokens are split over these
from ultrajax.parallel.zero import Zero

FP8 = "fp8"  # model.fp8=delayed: the key of the amaxes' sinks, beside the gradients'
# ... and among a layer's sinks: a key after every weight's. Why: JAX 0.10's scan
# transpose misplaces a returned cotangent (jax.ad.GradValue, as the amaxes are) that
# comes before one accumulated into a Ref (the gradients) in the scanned inputs' order
LAYER_FP8 = "~fp8"


def deferred_axes(zero: Zero, manual) -> tuple[str, ...]:
    """The `manual` data axes whose reduction can wait for the last micro-batch: all of
    them below ZeRO-2, all but `fsdp` (scattered into the sum's shards every
    micro-batch) from it."""
    if zero.shards_grads and zero.active:
        axes = tuple(a for a in TOKEN_AXES if a != FSDP)
    else:
        axes = TOKEN_AXES
    return tuple(a for a in axes if a in manual)


def splits_last(grad_accum: int, zero: Zero, manual) -> bool:
    """Whether the last of `grad_accum` micro-batches reduces apart from the others (a
    program of its own, after their loop): some reduction waits for it."""
    return grad_accum > 1 and bool(deferred_axes(zero, manual))


# the name scope of the last micro-batch's conditional (accumulate): its taken branch
# runs every step, as the communication count reads it (tools/hlo.py)
LAST_MICRO_BATCH = "last_micro_batch"


def _bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _stacked_bytes(jaxpr) -> int:
    """Bytes of the stacked outputs of the scans `jaxpr` runs (inside calls and other
    non-loop sub-jaxprs, not loop bodies: those are built per iteration)."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            ys = eqn.outvars[eqn.params["num_carry"] :]
            total += sum(v.aval.size * v.aval.dtype.itemsize for v in ys)
        elif eqn.primitive.name != "while":
            total += sum(_stacked_bytes(sub) for sub in jex_core.jaxprs_in_params(eqn.params))
    return total


@dataclass(frozen=True)
class Gradients:
    """The gradient plan of one step: sinks, reductions and the micro-batch loop.

    zero: the ZeRO stage on this mesh; manual: the mesh axes this code is manual over
    (empty under the partitioner); names: logical names of every parameter;
    specs: PartitionSpecs the partitioner should give the reduced gradients (gspmd),
    or None (explicit: the reductions are the collectives in `finish`)."""

    zero: Zero
    manual: frozenset
    names: dict
    dtype: str = "float32"
    specs: dict | None = None
    grad_accum: int = 1
    # weights whose gradient is completed only after the backward pass, and reduced
    # there: the embedding (read twice when tied), the LM head when the loss is chunked
    after: tuple[str, ...] = ("embed",)
    prefetch: bool = True  # ZeRO-3: gather each layer one iteration ahead (model/prefetch.py)
    # model.fp8=delayed: the weights whose matmuls record their operands' amaxes, and the
    # manual axes whose ranks keep their own (DiLoCo's replicas over `data`)
    fp8: tuple[str, ...] = ()
    fp8_apart: frozenset = frozenset()
    # the layer weights whose reduced gradients are made before their input's leaves (the
    # layers as a Python loop on several devices: parallel/layout.py, model/ops.py)
    ordered: frozenset = frozenset()

    @property
    def deferred(self) -> tuple[str, ...]:
        """Manual data axes whose reduction waits for the last micro-batch."""
        return deferred_axes(self.zero, self.manual)

    @property
    def splits_last(self) -> bool:
        """Whether the last micro-batch reduces differently from the others."""
        return splits_last(self.grad_accum, self.zero, self.manual)

    def adds_inside(self, last: bool) -> bool:
        """Whether the backward rules read the running sum and add it before a deferred
        reduction finally due (the last micro-batch); elsewhere they accumulate into it
        (`backward`)."""
        return last and self.splits_last

    def reduce(self, path: str, names, last: bool) -> Reduce:
        spec = None if self.specs is None else self.specs[path]
        scatter = self.zero.scatter(names, last)
        if scatter is not None and scatter[0] not in self.manual:
            scatter = None  # the partitioner scatters (to `spec`)
        ordered = path.startswith("layers/") and path.split("/", 1)[1] in self.ordered
        return Reduce(self.dtype, scatter, spec, ordered=ordered)

    def sinks(self, params, cparams, last: bool) -> dict:
        """fp32 zeros shaped and typed as this phase's gradients (ZeRO >= 1: the stored
        shards; ZeRO-0/1 before the last micro-batch: whole and unreduced)."""
        whole = self.zero.active <= 1 and not (last and self.zero.active == 1)
        out = jax.tree.map(zeros32, cparams if whole else params)
        out = out if last else jax.tree.map(lambda s: vary(s, self.deferred), out)
        if self.fp8:  # the amaxes' sinks: per layer (x, w, g), one per device until `amaxes`
            manual, n = tuple(sorted(self.manual)), len(fp8.OPERANDS)
            rows = {k: cparams["layers"][k].shape[0] for k in self.fp8}
            out[FP8] = {k: zeros((r, n), jnp.float32, manual) for k, r in rows.items()}
        return out

    def amaxes(self, grads: dict) -> tuple[dict, dict | None]:
        """(the gradients, model.fp8=delayed's amaxes max-reduced over the manual axes but
        `fp8_apart`, or None): the amaxes ride with the gradients until here, never summed."""
        if FP8 not in grads:
            return grads, None
        grads = dict(grads)
        found = grads.pop(FP8)
        axes = tuple(sorted(self.manual - self.fp8_apart))
        return grads, jax.tree.map(lambda a: jax.lax.pmax(a, axes) if axes else a, found)

    def wrt(self, sinks, cparams) -> dict:
        """What the step differentiates: the sinks, with those of `after` replaced by
        whole, unreduced ones (see `attach`)."""
        raw = {
            k: vary(zeros32(cparams[k]), tuple(sorted(self.manual)))
            for k in self.after
            if k in cparams
        }
        return dict(sinks, **raw)

    def attach(self, cparams, sinks, acc, last: bool, gather=None, seen=None):
        """(the weights the model reads, the `prepare` for its layer scan).

        `seen`: model.fp8=delayed's amaxes to scale by, per FP8 weight (rows, x w g); the
        layer scan slices them, and their sinks, with the weights.

        The weights of `after` get unreduced sinks: the embedding is read twice when tied
        (lookup and LM head), the LM head once per chunk of a chunked loss, so their
        gradients are completed, and reduced, only after the backward pass (`finish`)."""
        w = {}
        for k in cparams:
            if k == "layers":
                continue
            if k in self.after:
                w[k] = Weight.make(cparams[k], sinks[k], None, Reduce(self.dtype))
            else:
                w[k] = Weight.make(
                    cparams[k],
                    sinks[k],
                    None if acc is None else acc[k],
                    self.reduce(k, self.names[k], last),
                )
        w["layers"] = {
            "w": cparams["layers"],
            "sink": sinks["layers"],
            "acc": None if acc is None else acc["layers"],
        }
        if self.fp8:  # under "sink", which the layer loops differentiate
            w["layers"]["sink"] = dict(sinks["layers"], **{LAYER_FP8: sinks[FP8]})
            w["layers"][FP8] = seen
        layer_names = {k: n[1:] for k, n in self.names["layers"].items()}

        def bind(p, values):
            out = {}
            for k, value in values.items():
                red = self.reduce(f"layers/{k}", layer_names[k], last)
                acc_k = None if p["acc"] is None else p["acc"][k]
                scales = (p[FP8][k], p["sink"][LAYER_FP8][k]) if k in self.fp8 else None
                out[k] = Weight.make(value, p["sink"][k], acc_k, red, scales)
            return out

        # no stop_gradient on the weights: they are not differentiated (the sinks are),
        # and its staged identity would hide from the layer scan that the backward
        # rules' saved weights are its own inputs, so every forward pass would stack a
        # copy of all the layers' weights
        if gather is None:
            return w, self._held(lambda p: bind(p, p["w"]))
        if not self.prefetch:
            return w, self._held(lambda p: bind(p, {k: gather(v, k) for k, v in p["w"].items()}))
        # ZeRO-3: the gathers can run a layer ahead (model/prefetch.py)
        fetch = lambda p: {k: gather(v, k) for k, v in p["w"].items()}  # noqa: E731
        return w, Prefetch(fetch, bind, wrt="sink", source="w")

    def _held(self, prepare):
        """`prepare` as the layer loop's `Held` when the micro-batch loop holds the
        weights' compute copy (accumulation): their slices are then taken again in the
        backward, not kept from the forward (model/stack.py)."""
        return Held(prepare, "w") if self.grad_accum > 1 else prepare

    def finish(self, g: dict, acc, sinks, last: bool) -> dict:
        """Reduce the gradients of `after` (see `attach`); `acc` their running sum or None."""
        out = dict(g)
        for k in self.after:
            if k in g:
                red = self.reduce(k, self.names[k], last)
                held = None if acc is None else acc[k]
                out[k] = finish(g[k], held, dataclasses.replace(red, varying=vma(sinks[k])))
        return out

    def backward(self, loss_fn, sinks, cparams, acc, last: bool):
        """(acc plus this micro-batch's gradient, `loss_fn`'s aux); acc None: the gradient.

        `loss_fn(wrt, inside) -> (loss, aux)`: `inside` is the running sum the backward
        rules add before their reduction (`adds_inside`), or None. Otherwise the sum is a
        Ref the backward pass accumulates into (`jax.vjp(...).with_refs`, JAX's autodiff
        with refs): each weight's rule adds its gradient to its slice of the sum in place
        (the layer scan's backward carries the sum), so no whole fresh fp32 gradient is
        built beside it; the sum is the same, acc + g in fp32. The weights of `after` are
        completed after the backward pass, so theirs is added then."""
        wrt = self.wrt(sinks, cparams)
        if acc is None or self.adds_inside(last):
            g, aux = jax.grad(lambda w: loss_fn(w, acc), has_aux=True)(wrt)
            return self._most(self.finish(g, acc, sinks, last), acc), aux
        out, vjp, aux = jax.vjp(lambda w: loss_fn(w, None), wrt, has_aux=True)
        value = lambda _: jax.ad.GradValue()  # noqa: E731  returned, not added into a Ref
        given = (*self.after, FP8)
        refs = {k: jax.tree.map(value if k in given else jax.new_ref, acc[k]) for k in wrt}
        (g,) = vjp.with_refs(refs)(jnp.ones_like(out))
        g = self._most(self.finish(g, None, sinks, last), acc)
        out = {k: acc[k] + g[k] if k in self.after else g[k] for k in given if k in wrt}
        rest = {k: jax.tree.map(jax.freeze, refs[k]) for k in wrt if k not in given}
        return dict(rest, **out), aux

    @staticmethod
    def _most(g: dict, acc) -> dict:
        """model.fp8=delayed's amaxes: the larger of this micro-batch's and the earlier
        ones' (a max over the micro-batches, where gradients add)."""
        if FP8 not in g or acc is None:
            return g
        return dict(g, **{FP8: jax.tree.map(jnp.maximum, acc[FP8], g[FP8])})

    def accumulate(self, micro, acc, batch, zero, held=None):
        """Run `micro(acc, mb, last, held) -> (acc, aux)` over the micro-batches (axis 0)
        from the zero running sum `acc`, summing the aux trees (the loss, statistics) from
        `zero`; one micro-batch: `micro(None, ...)`, no sum at all.

        `held` (the gathered weights every micro-batch reads) goes through the loop as a
        carry, and the last micro-batch reads the loop's: read after the loop as well,
        XLA gives the loop a copy of its own (on a GPU, relaid out: the embedding table
        gathered over fsdp comes transposed), and both live through it (the 1B size at
        ZeRO-1/2/3 on an H100 compile: a bf16 embedding table, 0.49 GiB). The barrier keeps
        jax from turning the unchanged carry back into a constant of the loop (one per
        array: one over all of them would type each as varying over every axis any varies
        over)."""
        if jax.tree.leaves(batch)[0].shape[0] == 1:
            return micro(None, jax.tree.map(lambda a: a[0], batch), True, held)

        def add(a, b):
            return jax.tree.map(jnp.add, a, b)

        def body(last: bool):
            def one(carry, mb):
                acc, total, held = carry
                acc, part = micro(acc, mb, last, held)
                held = jax.tree.map(jax.lax.optimization_barrier, held)
                return (acc, add(total, part), held), None

            return one

        if not self.splits_last:  # every micro-batch reduces alike
            (acc, total, _), _ = jax.lax.scan(body(True), (acc, zero, held), batch)
            return acc, total
        first = jax.tree.map(lambda a: a[:-1], batch)
        (acc, total, held), _ = jax.lax.scan(body(False), (acc, zero, held), first)

        def last(ops):
            acc, held = ops
            acc, part = micro(acc, self._last(batch, acc), True, held)
            return acc, part, jax.tree.map(jax.lax.optimization_barrier, held)

        # The last micro-batch's scans stack their outputs (the saved residuals) into
        # zeros made with no operands, which XLA's schedulers (CPU and GPU) build before
        # the loop above, alive all through it: one micro-batch's activations more. Run
        # in a branch XLA cannot drop (its predicate read off the running sum), they are
        # built there. The branch takes the held weights as an operand, and XLA lays out
        # a copy of its own of those it had laid out for the loop (gathered ones): so the
        # branch is taken where the stacked buffers outweigh the held weights
        jaxpr, shapes = jax.make_jaxpr(last, return_shape=True)((acc, held))

        def traced(ops):  # `last` as traced once above (a model's trace takes seconds)
            out = jex_core.jaxpr_as_fun(jaxpr)(*jax.tree.leaves(ops))
            return jax.tree.unflatten(jax.tree.structure(shapes), out)

        def never(ops):  # runs never: zeros typed as the last micro-batch's results
            out = jax.tree.map(lambda s: zeros(s.shape, s.dtype, vma(s)), shapes[:2])
            return *out, ops[1]

        # explicit collectives only: under the partitioner the branch's operands were
        # resharded (an all-to-all of the gathered weights, HSDP ZeRO-3)
        if self.specs is not None or _stacked_bytes(jaxpr.jaxpr) <= _bytes(held):
            acc, part, _ = traced((acc, held))
        else:
            with jax.named_scope(LAST_MICRO_BATCH):  # the branch that runs every step
                pred = self._zero(batch, acc) == 0
                acc, part, _ = jax.lax.cond(pred, traced, never, (acc, held))
        return acc, add(total, part)

    def _zero(self, batch, acc):
        """An int32 0 XLA computes only once the running sum is (see `_last`)."""
        want = vma(jax.tree.leaves(batch)[0])
        sums = [acc[k] for k in self.after if k in acc] + jax.tree.leaves(acc)
        leaf = next((x for x in sums if vma(x) <= want), sums[0])
        zero = zero_after(leaf)
        if extra := tuple(sorted(vma(zero) - want)):
            zero = jax.lax.psum(zero, extra)
        return zero

    def _last(self, batch, acc):
        """The last micro-batch, read at an index that depends on the running sum.

        Nothing else makes its forward pass wait for the earlier micro-batches: XLA's
        schedulers (CPU and GPU) ran it before their loop, its activations live all
        through it (on an H100 compile, HSDP 1B without recomputation: 48.8 GiB where one
        micro-batch's take 30.9). An optimization barrier is gone before scheduling, and
        with one earlier micro-batch the loop itself is inlined, so the index reads a
        running sum, the embedding's where it can (the last gradient the backward pass
        completes), through model/order.py's `zero_after`. A sum varying over more axes
        than the batch (TP's vocabulary split) would make the batch vary there too: that
        zero is summed over them, a scalar all-reduce, where no sum qualifies."""
        rows = jax.tree.leaves(batch)[0]
        at = rows.shape[0] - 1 + self._zero(batch, acc)
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, at, keepdims=False), batch)
