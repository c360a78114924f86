"""A layer's backward pass split from its forward, with `jax.vjp`'s residuals as arrays.

A pipeline runs a micro-batch's forward at one tick and its backward many ticks later,
inside another branch of the same loop. Between the two, what the backward needs (the
activations autodiff would keep) must live in buffers of fixed shape: this file turns
`jax.vjp`'s closure into a flat list of arrays and back.

Inputs the backward can be handed again (the layer's weights, the positions and
segment ids of the micro-batch, the zeros it is differentiated at) are not stored: each
residual that *is* one of them is re-supplied at the backward, so a buffer of k
micro-batches holds k sets of activations and no copy of the weights. `model.remat` still
decides what the activations are: under `jax.checkpoint` the residuals are what its
policy saves.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax


@dataclass(frozen=True)
class Split:
    """How one function's vjp closure maps onto (given inputs, stored arrays)."""

    treedef: object  # of the vjp closure (holds the backward's program, static)
    reuse: tuple[int, ...]  # per closure leaf: index into the given leaves, or -1 (stored)
    stored: tuple  # ShapeDtypeStructs of the stored leaves (with their varying axes)
    aux: object = None  # ShapeDtypeStructs of fn's auxiliary output (an MoE layer's stats)


def _split(fn, given, const, x):
    """fn returns (output, aux): aux (statistics) is not differentiated."""
    out, pullback, aux = jax.vjp(lambda c, x: fn(given, c, x), const, x, has_aux=True)
    leaves, treedef = jax.tree.flatten(pullback)
    known = jax.tree.leaves((given, const))  # under jax.checkpoint the inputs are residuals
    reuse = tuple(next((i for i, g in enumerate(known) if leaf is g), -1) for leaf in leaves)
    return out, leaves, treedef, reuse, aux


def probe(fn, given, const, x) -> Split:
    """Trace `fn(given, const, x)` abstractly once: the residuals' structure and types.

    The backward differentiates with respect to `const` (values the caller can make
    again, e.g. zeros) and `x` (the activation, which is stored where it is needed)."""
    found = {}

    def run(given, const, x):
        _, leaves, treedef, reuse, aux = _split(fn, given, const, x)
        found.update(treedef=treedef, reuse=reuse)
        return [leaf for leaf, r in zip(leaves, reuse, strict=True) if r < 0], aux

    stored, aux = jax.eval_shape(run, given, const, x)
    return Split(found["treedef"], found["reuse"], tuple(stored), aux)


def forward(split: Split, fn, given, const, x):
    """(fn's output, the residual arrays to store for `backward`, fn's aux)."""
    out, leaves, _, reuse, aux = _split(fn, given, const, x)
    if reuse != split.reuse:
        raise RuntimeError("the layer's residuals changed between two traces of it")
    return out, [leaf for leaf, r in zip(leaves, reuse, strict=True) if r < 0], aux


def backward(split: Split, given, const, stored, cotangent):
    """(cotangent of `const`, of `x`) from the stored residuals and the re-supplied
    `given` and `const` (the same values the forward had: they are not stored)."""
    known, it = jax.tree.leaves((given, const)), iter(stored)
    leaves = [known[r] if r >= 0 else next(it) for r in split.reuse]
    return jax.tree.unflatten(split.treedef, leaves)(cotangent)
