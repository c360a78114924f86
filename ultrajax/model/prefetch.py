"""ZeRO-3's layer prefetch: layer i+1's weights are gathered while layer i computes, in
the forward pass and (i-1's while i differentiates) in the backward pass.

Why a hand-written backward: a gather issued one iteration early travels to the next
iteration in the scan's carry, and JAX's autodiff of a scan keeps every carried value
the backward reads, here every layer's gathered weights (ZeRO-3's memory saving gone).
So the stack gets its own `custom_vjp`: the forward keeps each layer's backward
residuals (`jax.vjp` under the layer's remat policy) *minus* the gathered weights,
and the backward scan runs in reverse, puts the weights (prefetched the iteration
before) back into the residuals and calls the layer's backward. Gathered weights live
two layers at a time: the one computing and the one arriving (cost/memory.py).

The price: one layer gathered for nothing per micro-batch. Each iteration of a loop
fetches one layer, and layer 0's backward, the last, has none left to fetch; peeling
it out of the loop would put a second copy of the layer's backward in the program
(compile time; XLA:CPU then also ran the two copies' ring-attention permutes, which
share channel ids, at once and aborted). It runs beside layer 0's backward.

The weights are never differentiated (their sinks are, model/ops.py); `Prefetch` splits
the step's `prepare` into the communication (`fetch`: a layer's slice -> its gathered
values) and the rest (`bind`: slice and values -> the weights `block` reads).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ultrajax.kernels.varying import vma, zeros

# One layer runs as before (gathered in its own iteration): nothing to fetch ahead.
MIN_LAYERS = 2


@dataclass(frozen=True)
class Prefetch:
    """A `prepare` that can run ahead: `prepare(p) == bind(p, fetch(p))`."""

    fetch: Callable  # {source: a layer's slice of it} -> its gathered weight values
    bind: Callable  # (the slice, the values) -> the weights the block reads
    wrt: str  # the key of the slice that is differentiated (the gradient sinks)
    source: str  # the key of the slice that `fetch` reads (the weights' shards)

    def __call__(self, p):
        return self.bind(p, self.fetch({self.source: p[self.source]}))


def _at(tree, i):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _fetch(pre: Prefetch, fixed, i, after):
    """Layer i's weights fetched, not before `after` exists: tied to it, a fetch whose
    index is known (layer 0) cannot be hoisted out of the micro-batch loop, or merged
    with the backward's, and kept gathered for the whole step. Each leaf is tied on its
    own: a barrier's outputs vary over every manual axis any of its operands varies
    over, and a norm scale typed as varying over `tensor` would break TP's region entry
    (tying to `after`, an activation, adds only the batch's axes: harmless to a value
    that is never differentiated)."""

    def tie(a):
        return jax.lax.optimization_barrier((after, a))[1]

    return pre.fetch({pre.source: jax.tree.map(tie, _at(fixed[pre.source], i))})


def layers(layer, pre: Prefetch, x, stack, aux, policy):
    """`layer(weights, x, aux) -> (x, stats)` over every layer of `stack`, each layer's
    weights fetched one iteration ahead: (x, the stats stacked, never differentiated);
    `aux` what every layer reads besides (positions...);
    `policy` the layer's remat policy (it never keeps the fetched weights: they are not
    even in the residuals it chooses from)."""
    n = jax.tree.leaves(stack)[0].shape[0]
    step = layer if policy is None else jax.checkpoint(layer, policy=policy, prevent_cse=False)

    def given(i, values, sinks, fixed, aux):
        """What the backward has at hand for layer i without keeping it: the fetched
        weights, the layer's slice of the stack, what every layer reads."""
        return (values, _at(sinks, i), _at(fixed, i), aux)

    def vjp(x, i, values, sinks, fixed, aux):
        """(y, the layer's backward residuals less what `given` has, its tree and where
        `given`'s leaves go)."""
        have = given(i, values, sinks, fixed, aux)
        _, s, p, _ = have

        def f(x, s):
            return step(pre.bind(dict(p, **{pre.wrt: s}), values), x, aux)

        y, back, stats = jax.vjp(f, x, s, has_aux=True)
        leaves, tree = jax.tree.flatten(back)
        where = {id(v): k for k, v in enumerate(jax.tree.leaves(have))}
        slots = [where.get(id(leaf)) for leaf in leaves]
        kept = [leaf for leaf, s in zip(leaves, slots, strict=True) if s is None]
        return y, stats, kept, (tree, slots)

    layout = {}  # the residuals' tree and slots, found while tracing the forward

    def forward(x, sinks, fixed, aux):
        def body(carry, i):
            x, values = carry
            ahead = _fetch(pre, fixed, jnp.minimum(i + 1, n - 1), x)
            y, stats, kept, layout["res"] = vjp(x, i, values, sinks, fixed, aux)
            return (y, ahead), (kept, stats)

        first = _fetch(pre, fixed, 0, x)
        (y, last), (kept, stats) = jax.lax.scan(body, (x, first), jnp.arange(n))
        # the last iteration fetched layer n-1 again: the backward starts with it
        return (y, stats), (kept, last, sinks, fixed, aux)

    def backward(i, g, values, res):
        kept, _, sinks, fixed, aux = res
        tree, slots = layout["res"]
        have = jax.tree.leaves(given(i, values, sinks, fixed, aux))
        it = iter(_at(kept, i))
        leaves = [next(it) if s is None else have[s] for s in slots]
        return jax.tree.unflatten(tree, leaves)(g)

    @jax.custom_vjp
    def run(x, sinks, fixed, aux):
        return forward(x, sinks, fixed, aux)[0]

    def run_bwd(res, cotangents):
        g, _ = cotangents  # the statistics are not differentiated
        kept, last, sinks, fixed, aux = res
        grads = jax.tree.map(lambda s: zeros(s.shape, s.dtype, vma(s)), sinks)

        def body(carry, i):
            g, values, grads = carry
            ahead = _fetch(pre, fixed, jnp.maximum(i - 1, 0), g)  # i = 0: unused
            g, d = backward(i, g, values, res)
            grads = jax.tree.map(
                lambda a, u: jax.lax.dynamic_update_index_in_dim(a, u.astype(a.dtype), i, 0),
                grads,
                d,
            )
            return (g, ahead, grads), None

        (g, _, grads), _ = jax.lax.scan(body, (g, last, grads), jnp.arange(n), reverse=True)
        none = jax.tree.map(lambda _: None, (fixed, aux))
        return (g, grads, *none)

    run.defvjp(forward, run_bwd)
    fixed = {k: v for k, v in stack.items() if k != pre.wrt}
    return run(x, stack[pre.wrt], fixed, aux)
