"""DiLoCo over the `data` axis (Douillard et al., 2023): data parallelism that talks over
the slow links once every H steps instead of every step.

With `parallel.diloco_steps: H` every rank of `data` (the axis across hosts or sites) is a
replica: it trains H inner steps on its own rows with its own optimizer state, its
gradients reduced only inside the replica (fsdp, tensor, sequence, expert as configured:
`Layout.token_axes` leaves `data` out, so `ops.finish` never sums over it). Every H steps
the pseudo-gradient, the outer parameters minus the replica's, is averaged over `data`
(one all-reduce of the parameters' size, in `diloco_dtype`) and applied by an outer
Nesterov SGD (PyTorch's form, the paper's):

    m <- mu m + delta,    theta <- theta - lr_out (delta + mu m)

and every replica restarts from the new outer parameters (its inner optimizer state is
kept). The train state's `params` are the outer parameters (what evaluation, checkpoints
and the Hugging Face export read); `opt_state` holds the replicas' parameters and
optimizer states, stacked along a leading axis split over `data`, and the outer momentum.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from ultrajax.config.schema import Config
from ultrajax.kernels.varying import vma
from ultrajax.model import fp8
from ultrajax.parallel.axes import DATA
from ultrajax.parallel.grads import FP8


def active(cfg: Config) -> bool:
    return cfg.parallel.diloco_steps > 0


def _stack(r: int, tree):
    return jax.tree.map(lambda p: jnp.broadcast_to(p, (r, *p.shape)), tree)


def init(cfg: Config, tx: optax.GradientTransformation, params) -> dict:
    """The optimizer state under DiLoCo: each replica's parameters (all the outer ones to
    begin with) and inner optimizer state, stacked; the outer momentum (fp32)."""
    replicas = _stack(cfg.mesh.data, params)
    return {
        "inner": jax.vmap(tx.init)(replicas),
        "replicas": replicas,
        "momentum": jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
    }


def own(cfg: Config, tree):
    """`tree` once per replica, stacked (model.fp8=delayed: each replica's histories)."""
    return _stack(cfg.mesh.data, tree)


def restart(cfg: Config, state: dict) -> dict:
    """`state` with every replica at its outer parameters (after they were loaded from
    elsewhere: checkpoint.init_from)."""
    opt = dict(state["opt_state"], replicas=_stack(cfg.mesh.data, state["params"]))
    return dict(state, opt_state=opt)


def _lead(spec: PartitionSpec) -> PartitionSpec:
    return PartitionSpec(DATA, *spec)


def shardings(mesh, params: dict, abstract_opt: dict, place) -> dict:
    """Where the DiLoCo optimizer state lives: the replicas' leaves split over `data`
    along their leading axis (each rank holds its own replica, laid out as the outer
    parameters are, and its optimizer's step counters), the momentum as the parameters.
    `place(optimizer state, parameter shardings, the rest's)`: the plain step's rule."""
    stacked = jax.tree.map(lambda s: NamedSharding(mesh, _lead(s.spec)), params)
    own = NamedSharding(mesh, PartitionSpec(DATA))  # a replica's counters: its own row
    inner = place(abstract_opt["inner"], stacked, own)
    return {"inner": inner, "replicas": stacked, "momentum": params}


def per_replica(layout, per_device, out_specs, batch_spec):
    """make_gradients' (params, batch) -> per_device(...) with a leading replica axis: each
    `data` rank reads its own replica's parameters, and every output (gradients, loss,
    target count, statistics) leaves with a leading axis over `data`, one row a replica."""
    if layout.gspmd:
        raise ValueError("DiLoCo runs under parallel.collectives=explicit")
    lead = lambda tree: jax.tree.map(  # noqa: E731
        _lead, tree, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )

    def fn(params, batch, seen):
        # this rank's replica (and with model.fp8=delayed its amax histories' maxima)
        params, seen = jax.tree.map(lambda a: a[0], (params, seen))
        cparams = layout.compute_copy(params)
        grads, loss, n_targets, stats = per_device(params, cparams, batch, seen)
        up = lambda t: jax.tree.map(lambda a: a[None], t)  # noqa: E731
        return up(grads), loss[None], n_targets[None], up(stats)

    grads, *rest = out_specs
    row = PartitionSpec(DATA)
    in_specs = (lead(layout.specs["stored"]), batch_spec, row)
    sharded = layout.shard_map(fn, in_specs, (lead(grads), row, row, row))
    return lambda params, batch, seen=None: sharded(params, batch, seen)


def due(count, h: int, fragments: int, last: int | None = None):
    """Which synchronisation runs after the `count`-th step: 0 none, f + 1 fragment f,
    F + 1 all fragments at once. Fragment f syncs at the steps where count / (H / F) = f
    (mod F): every H steps each, one every H / F steps in turn (streaming DiLoCo); F = 1:
    all at every H-th step. The run's `last` step syncs everything, whatever H: the model
    it ends with holds every step (its last steps % H inner steps were lost before)."""
    every = h // fragments
    regular = jnp.where(count % every == 0, (count // every) % fragments + 1, 0)
    if last is None:
        return regular
    return jnp.where(count == last, 1 if fragments == 1 else fragments + 1, regular)


def _rows(layered: bool, fragment: int | None, fragments: int):
    """The part of a leaf fragment `fragment` synchronises: a layer stack's rows of its
    share of the layers (fragments of whole layers, in the model's order), the rest
    (embedding, final norm, LM head) with fragment 0; everything when not streaming."""
    if fragment is None:
        return lambda a: slice(None)
    if layered:
        return lambda a: slice(
            fragment * a.shape[0] // fragments, (fragment + 1) * a.shape[0] // fragments
        )
    return lambda a: slice(None) if fragment == 0 else slice(0, 0)


def synchronise(cfg: Config, layout, fragment: int | None = None):
    """sync(outer, momentum, replicas) -> the same after the outer step, per device (every
    axis manual, as the explicit step): each device's shard of the pseudo-gradient
    (outer minus its replica), summed over `data` in `diloco_dtype` (one all-reduce of
    this device's share of the parameters; fp8: each replica's quantised with its own
    scale and all-gathered, a byte a value from each), the outer Nesterov step on the
    mean, and the
    replica set to the new outer parameters. `fragment`: streaming DiLoCo's fragment
    (`_rows`), whose rows alone move; None, all of them."""
    par = cfg.parallel
    lr, mu = par.diloco_outer_lr, par.diloco_outer_momentum
    dt, f32 = jnp.dtype(par.diloco_dtype), jnp.float32
    r, fragments = cfg.mesh.data, par.diloco_fragments

    def mean(pseudo):
        """The replicas' mean pseudo-gradient, sent over `data` in `dt`."""
        if dt.itemsize == 1:  # fp8: each replica's scaled by its own amax, with its scale
            # the replica's whole tensor's amax (a shard's would make the scale depend
            # on the layout): over the axes that split it, inside the replica
            split = tuple(sorted(vma(pseudo) - {DATA}))
            amax = jnp.max(jnp.abs(pseudo))
            q, scale = fp8.quantize(pseudo, dt, jax.lax.pmax(amax, split) if split else amax)
            gather = functools.partial(jax.lax.all_gather, axis_name=DATA, to="invarying")
            qs, scales = gather(q), gather(scale)
            each = qs.astype(f32) / scales.reshape(-1, *(1,) * q.ndim)
            return jnp.mean(each, axis=0)
        return (jax.lax.psum(pseudo.astype(dt), DATA) / jnp.asarray(r, dt)).astype(f32)

    def one(theta, m, rep):
        delta = mean(theta.astype(f32) - rep[0].astype(f32))
        m = mu * m + delta
        theta = (theta.astype(f32) - lr * (delta + mu * m)).astype(theta.dtype)
        return theta, m, theta[None].astype(rep.dtype)

    def part(rows, theta, m, rep):
        """`one` on this fragment's rows of the leaf, the other rows as they were."""
        at = rows(theta)
        if at == slice(None):
            return one(theta, m, rep)
        if at.start == at.stop:
            return theta, m, rep
        new = one(theta[at], m[at], rep[:, at])
        return theta.at[at].set(new[0]), m.at[at].set(new[1]), rep.at[:, at].set(new[2])

    def per_device(outer, momentum, replicas):
        out = {}
        for k in outer:
            rows = _rows(k == "layers", fragment, fragments)
            out[k] = jax.tree.map(lambda *a, rows=rows: part(rows, *a), outer[k], momentum[k],
                                  replicas[k])  # fmt: skip
        pick = lambda i: jax.tree.map(lambda _, o: o[i], outer, out)  # noqa: E731
        return pick(0), pick(1), pick(2)

    stored = layout.specs["stored"]
    lead = jax.tree.map(_lead, stored, is_leaf=lambda x: isinstance(x, PartitionSpec))
    return layout.shard_map(per_device, (stored, stored, lead), (stored, stored, lead))


def make_update(cfg: Config, tx, gradients, syncs, scale, update_bias):
    """update(state, batch, lr) -> (state, loss, grad norm, targets, MoE statistics) under
    DiLoCo: every replica one inner step (`gradients` with a leading replica axis, the
    optimizer vmapped over it: clipping and Adam per replica), then the synchronisation
    `due` (`syncs`: one `synchronise` per fragment, and when streaming one of all of them
    last, for the run's last step) as a branch of a switch whose other branch does
    nothing: the compiled program reduces over `data` only there.
    `scale(updates, lr)` and `update_bias` are the plain step's (train/step.py)."""
    h = cfg.parallel.diloco_steps

    def inner(p, g, o, lr):
        updates, o = tx.update(g, o, p)
        return optax.apply_updates(p, scale(updates, lr)), o, optax.tree.norm(g)

    def update(state, batch, lr):
        opt, history = state["opt_state"], state.get(FP8)
        seen = None if history is None else jax.tree.map(fp8.seen, history)
        grads, loss, n_targets, stats = gradients(opt["replicas"], batch, seen)
        amaxes = grads.pop(FP8, None)
        step = jax.vmap(inner, in_axes=(0, 0, 0, None))
        replicas, inner_state, norms = step(opt["replicas"], grads, opt["inner"], lr)
        if stats:  # MoE bias balance: each replica's router biases move by its own load
            layers = replicas["layers"]
            bias = update_bias(cfg.model, layers["router_bias"], stats["load"])
            replicas = dict(replicas, layers=dict(layers, router_bias=bias))
        count = state["step"] + 1
        branches = [lambda a: a] + [lambda a, sync=sync: sync(*a) for sync in syncs]
        at = due(count, h, cfg.parallel.diloco_fragments, cfg.train.steps)
        outer, momentum, replicas = jax.lax.switch(
            at, branches, (state["params"], opt["momentum"], replicas)
        )
        opt = {"inner": inner_state, "replicas": replicas, "momentum": momentum}
        new = {"step": count, "params": outer, "opt_state": opt}
        if history is not None:  # each replica's own amaxes, never reduced over `data`
            new[FP8] = jax.tree.map(fp8.record, history, amaxes)
        # per replica (a leading axis over `data`): averaged on the host, so that no
        # collective over `data` runs for the metrics (across sites, its latency)
        return new, loss, norms, n_targets, stats

    return update
