"""Pipeline parallelism over `mesh.pipeline`: one executor for any schedule table.

The layer stack is cut into S = v·p virtual stages along `layers`; device d holds the
stages d, d + p, ... (its v chunks). A schedule (parallel/pipeline/schedules.py) says what every
device does at every tick: a forward, a backward (or zero-bubble's input and weight
halves) of one micro-batch on one chunk, or nothing. The executor is one `lax.scan`
over the ticks inside the step's `shard_map`; at each tick every device reads its own
row of the plan and runs its op (each buffer is updated under its own `lax.cond`, see
`when`), then one `ppermute` moves activations down the ring and one moves gradients
up. It is a single SPMD program: no per-device programs, no host loop.

Between a forward and its backward the residuals `jax.vjp` would keep (the activations;
`model.remat` decides which) wait in buffers of fixed size, whose slots this file
assigns on the host from the table; so does every arriving activation and gradient.
The backward never recomputes the forward unless `model.remat` asks for it.

The first stage also embeds, the last also runs the final norm, the LM head and the
loss (its forward tick makes the loss gradient, its backward tick reads it back). Every
device holds the embedding, the final norm and the LM head (replicated over
`pipeline`); the gradients of those are summed over `pipeline` at the end, which is
where a tied embedding's two halves (lookup on the first stage, head on the last) meet.
All weight gradients stay unreduced over the data axes until the last micro-batch is
done, then each is reduced once (parallel.zero's reduce-scatter where it shards them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ultrajax.config.schema import Config
from ultrajax.kernels.varying import like, vary, vma, zeros
from ultrajax.model.llama import block
from ultrajax.model.loss import head_nll
from ultrajax.model.ops import Deferred, Reduce, Weight, finish
from ultrajax.model.remat import remat_policy
from ultrajax.model.stack import embed, final_norm, layers
from ultrajax.parallel.axes import PIPELINE, TOKEN_AXES
from ultrajax.parallel.partitioned import RESIDUAL
from ultrajax.parallel.pipeline import residuals, schedules
from ultrajax.parallel.pipeline.plan import (
    BWD,
    BWD_FIRST,
    BWD_IN,
    BWD_IN_FIRST,
    BWD_W,
    COLUMNS,
    FWD,
    FWD_FIRST,
    FWD_LAST,
    Plan,
)

AXIS = PIPELINE


def _zeros(struct, axes, lead=()):
    """Zeros shaped like `struct` behind the leading dimensions `lead`, typed by `axes`."""
    return zeros((*lead, *struct.shape), struct.dtype, axes)


def run(plan: Plan, cfg: Config, layout, cparams: dict, batch, scale):
    """Per device, inside the step's shard_map: (unreduced fp32 gradients of `cparams`'
    shape, varying over the data axes and `pipeline`; this device's share of the loss).

    `cparams` is this device's compute copy: its `layers` hold the v chunks of this
    device in `layer_order`."""
    m, tp = cfg.model, layout.tp
    p, v = plan.p, plan.v
    d = jax.lax.axis_index(AXIS)
    red = Reduce(cfg.parallel.grad_reduce_dtype)
    token_axes = tuple(a for a in TOKEN_AXES if a in layout.manual)
    grad_axes = (*token_axes, AXIS)
    # everything the ticks touch varies over `pipeline` (the branch differs per device)
    batch = jax.tree.map(lambda a: vary(a, (AXIS,)), batch)
    cparams = jax.tree.map(lambda a: vary(a, (AXIS,)), cparams)
    segments = batch.segment_ids if cfg.data.cross_doc_mask else None

    def sink(w):
        """fp32 zeros typed like w's gradient before any data reduction."""
        return zeros(w.shape, jnp.float32, vma(w) | set(grad_axes))

    layer_w = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), cparams["layers"])
    per_layer = jax.tree.map(lambda a: a[0, 0], layer_w)
    layer_sink = jax.tree.map(sink, per_layer)
    head_keys = ("final_norm", "embed" if m.tie_embeddings else "lm_head")
    head_sink = {k: sink(cparams[k]) for k in head_keys}
    embed_sink = sink(cparams["embed"])

    def weights(values, sinks):
        return {k: Weight.make(values[k], sinks[k], None, red) for k in sinks}

    # zero bubble: the layer's weights hand out (input, cotangent) pairs in the input step
    # and the weight step computes their gradients from those alone (weights.Deferred);
    # the other schedules differentiate the layer with respect to its sinks
    split_backward = schedules.SCHEDULES[plan.kind].splits_backward
    deferred = {k: Deferred() for k in per_layer}

    def deferring(w, pairs):
        return {
            k: Weight.make(w[k], layer_sink[k], pairs[k], Reduce(red.dtype, defer=deferred[k]))
            for k in w
        }

    def layer(given, diff, x):
        w, pos, seg = given
        ws = deferring(w, diff) if split_backward else weights(w, diff)
        return block(ws, x, pos, seg, cfg=m, tp=tp)

    policy = remat_policy(m.remat)
    if policy is not None:
        layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)

    def micro_batch(i):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), batch)

    def given(i):
        mb = micro_batch(i)
        seg = None if segments is None else jax.lax.dynamic_index_in_dim(segments, i, 0, False)
        return mb, seg

    mb0, seg0 = given(0)
    x0 = jax.eval_shape(lambda: embed(m, cparams, mb0.inputs, tp=tp))
    act_axes = tuple(sorted(vma(x0) | {AXIS}))
    act = jax.ShapeDtypeStruct(x0.shape, x0.dtype)
    x_probe = _zeros(act, act_axes)
    given0 = (per_layer, mb0.positions, seg0)
    if split_backward:  # a shape trace records each weight's (input, cotangent) pair
        pairs_none = {k: None for k in per_layer}
        jax.eval_shape(lambda: block(deferring(per_layer, pairs_none), x_probe, *given0[1:],
                                     cfg=m, tp=tp))  # fmt: skip
    diff0 = {k: deferred[k].zeros() for k in per_layer} if split_backward else layer_sink
    # weights that read the same input (wq, wk, wv; w_gate, w_up) keep it once, with the
    # first of them: W reads it from there
    first_reader: dict = {}
    shares = {k: first_reader.setdefault(deferred[k].source, k) for k in deferred}
    if not split_backward:
        shares = {}
    split = residuals.probe(layer, given0, diff0, x_probe)
    n_per = jax.tree.leaves(layer_w)[0].shape[1]
    unroll = max(1, min(m.scan_unroll, n_per))

    # ----------------------------------------------------------------- stage pieces

    def residual(x):
        """The residual stream's type and (under the partitioner) layout, wherever it
        comes from: both branches of a conditional must agree."""
        return tp.constrain(vary(x, act_axes), RESIDUAL)

    def chunk_w(j):
        if v == 1:
            return jax.tree.map(lambda a: a[0], layer_w)
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, j, 0, False), layer_w)

    def diff():
        if split_backward:
            return {k: deferred[k].zeros() for k in per_layer}
        return layer_sink

    def stage_forward(j, x, mb, seg):
        def body(x, w):
            y, res = residuals.forward(split, layer, (w, mb.positions, seg), diff(), x)
            return vary(y, act_axes), res

        return jax.lax.scan(body, x, chunk_w(j), unroll=unroll)

    def stage_backward(j, res, g, mb, seg):
        """(input gradient, per layer: the weight gradients, or zero bubble's pairs)."""

        def body(g, xs):
            w, r = xs
            out, dx = residuals.backward(split, (w, mb.positions, seg), diff(), r, g)
            if split_backward:  # an input read by several weights is kept once
                out = {k: (x if shares[k] == k else None, gk) for k, (x, gk) in out.items()}
            return vary(dx, act_axes), out

        return jax.lax.scan(body, g, (chunk_w(j), res), reverse=True, unroll=unroll)

    def stage_weights(pairs):
        """Zero bubble's weight step: every layer's weight gradients from its pairs."""
        reduce_ = {
            k: Reduce(red.dtype, varying=vma(s_), shape=s_.shape) for k, s_ in layer_sink.items()
        }

        def body(_, pair):
            pair = {k: (pair[shares[k]][0], g) for k, (_, g) in pair.items()}
            return None, {k: deferred[k].weight_gradient(pair[k], reduce_[k]) for k in pair}

        return jax.lax.scan(body, None, pairs, unroll=unroll)[1]

    def head_loss(sinks, y, mb):
        w = weights(cparams, sinks)
        xn = final_norm(m, w, y, tp=tp)
        return head_nll(cfg, w, xn, mb.targets, mb.loss_mask, tp) * scale

    def read(buf, slot):
        return jax.tree.map(lambda b: jax.lax.dynamic_index_in_dim(b, slot, 0, False), buf)

    def write(buf, slot, value):
        return jax.tree.map(
            lambda b, x: jax.lax.dynamic_update_index_in_dim(b, x.astype(b.dtype), slot, 0),
            buf,
            value,
        )

    def add_layers(gw, j, ds):
        if v == 1:
            return jax.tree.map(lambda a, b: a.at[0].add(b), gw, ds)
        return jax.tree.map(
            lambda a, b: jax.lax.dynamic_update_index_in_dim(
                a, jax.lax.dynamic_index_in_dim(a, j, 0, False) + b, j, 0
            ),
            gw,
            ds,
        )

    def when(pred, update, *operands):
        """update(*operands) where pred holds, else the operands unchanged. The unchanged
        case is branch 0 of the conditional: XLA forwards a pass-through operand of
        branch 0 in place, but copies one of any later branch (every tick, whole
        buffers), so each buffer is only ever updated under its own two-way `when`."""
        first = operands[0]

        def apply(*ops):
            out = update(*ops)
            return (like(out[0], first), *out[1:])

        def keep(*ops):
            out = jax.eval_shape(apply, *ops)
            return (ops[0], *(zeros(s.shape, s.dtype, vma(s)) for s in out[1:]))

        return jax.lax.cond(pred, apply, keep, *operands)

    # ----------------------------------------------------------------- one tick

    def forward(res_buf, act_buf, r, b):
        i, j = r["micro"], r["chunk"]
        mb, seg = given(i)
        x = jax.lax.cond(
            b == FWD_FIRST,
            lambda: residual(embed(m, cparams, mb.inputs, tp=tp)),
            lambda: residual(read(act_buf, r["act"])),
        )
        y, res = stage_forward(j, x, mb, seg)
        return write(res_buf, r["res"], res), y

    def head(acc, y, r):
        mb, _ = given(r["micro"])
        loss, pull = jax.vjp(lambda s, y: head_loss(s, y, mb), head_sink, y)
        dhead, dy = pull(jnp.ones_like(loss))
        return jax.tree.map(jnp.add, acc, dhead), vary(dy, act_axes), loss

    def backward_weights(gw, res_buf, grad_buf, cot_buf, r, b):
        """BACKWARD (both halves) or zero-bubble's weight step: the layer gradients."""
        i, j = r["micro"], r["chunk"]
        if split_backward:  # W: from the pairs the input step kept
            return add_layers(gw, j, stage_weights(read(cot_buf, r["cot"]))), _zeros(act, act_axes)
        mb, seg = given(i)
        dx, ds = stage_backward(j, read(res_buf, r["res"]), read(grad_buf, r["grad"]), mb, seg)
        return add_layers(gw, j, ds), dx

    def backward_input(cot_buf, res_buf, grad_buf, r):
        """Zero-bubble's input step: the gradient to send, and every layer's pairs."""
        i, j = r["micro"], r["chunk"]
        mb, seg = given(i)
        res = read(res_buf, r["res"])
        dx, pairs = stage_backward(j, res, read(grad_buf, r["grad"]), mb, seg)
        return write(cot_buf, r["cot"], pairs), dx

    def embed_backward(acc, dx, r):
        """The first stage's input gradient is the embedding's: its lookup, differentiated."""
        mb, _ = given(r["micro"])
        _, pull = jax.vjp(
            lambda s: embed(
                m, {"embed": Weight.make(cparams["embed"], s, None, red)}, mb.inputs, tp=tp
            ),  # fmt: skip
            embed_sink,
        )
        (de,) = pull(dx.astype(act.dtype))
        return (acc + de,)

    slots = plan.slots
    res_axes = [vma(s) | {AXIS} for s in split.stored]
    state = {
        "res": [
            _zeros(s, ax, (slots["res"] + 1, n_per))
            for s, ax in zip(split.stored, res_axes, strict=True)
        ],
        "act": _zeros(act, act_axes, (slots["act"] + 1,)),
        "grad": _zeros(act, act_axes, (slots["grad"] + 1,)),
        "cot": {  # zero bubble: each layer's (input, cotangent) pairs, input step to W
            k: tuple(
                None
                if (n == 0 and shares[k] != k)
                else _zeros(a, ax | {AXIS}, (slots["cot"] + 1, n_per))
                for n, (a, ax) in enumerate(dk.seen[1:])
            )
            for k, dk in deferred.items()
        }
        if split_backward
        else _zeros(act, act_axes, (1,)),
        "layers": jax.tree.map(
            lambda s: zeros((v, n_per, *s.shape), s.dtype, vma(s)),
            layer_sink,
        ),  # fmt: skip
        "head": head_sink,  # a tied embedding's lookup adds into head["embed"] as well
        "embed": None if m.tie_embeddings else embed_sink,
        "loss": zeros((), jnp.float32, grad_axes),
    }
    template = state
    down = [(k, (k + 1) % p) for k in range(p)]
    up = [(k, (k - 1) % p) for k in range(p)]
    junk_grad = slots["grad"]

    def tick(st, xs):
        row, sends = xs
        mine = jax.lax.dynamic_index_in_dim(row, d, 0, False)
        r = {c: mine[k] for k, c in enumerate(COLUMNS)}
        b = r["branch"]
        is_fwd = (b == FWD) | (b == FWD_FIRST) | (b == FWD_LAST)
        st = dict(st)
        st["res"], y = when(is_fwd, forward, st["res"], st["act"], r, b)
        st["head"], dy, loss = when(b == FWD_LAST, head, st["head"], y, r)
        st["loss"] = st["loss"] + vary(loss, grad_axes)
        st["grad"] = write(st["grad"], jnp.where(b == FWD_LAST, r["grad"], junk_grad), dy)
        # a buffer is written before it is read within a tick: the other order makes XLA
        # copy it whole (its read in one conditional outlives the update in the next)
        dx_in = 0
        if split_backward:
            is_bi = (b == BWD_IN) | (b == BWD_IN_FIRST)
            st["cot"], dx_in = when(is_bi, backward_input, st["cot"], st["res"], st["grad"], r)
        both = (b == BWD) | (b == BWD_FIRST) | (b == BWD_W)
        st["layers"], dx = when(
            both, backward_weights, st["layers"], st["res"], st["grad"], st["cot"], r, b
        )
        dx = dx + dx_in
        first = (b == BWD_FIRST) | (b == BWD_IN_FIRST)
        if m.tie_embeddings:  # one accumulator for the lookup and the LM head
            (st["head"],) = when(first, lambda h, dx, r: ({**h, "embed": embed_backward(
                h["embed"], dx, r)[0]},), st["head"], dx, r)  # fmt: skip
        else:
            (st["embed"],) = when(first, embed_backward, st["embed"], dx, r)
        y = jax.lax.cond(sends[0], lambda a: jax.lax.ppermute(a, AXIS, down), lambda a: a, y)
        dx = jax.lax.cond(sends[1], lambda a: jax.lax.ppermute(a, AXIS, up), lambda a: a, dx)
        st["act"] = write(st["act"], r["act_in"], y)
        st["grad"] = write(st["grad"], r["grad_in"], dx)
        return like(st, template), None

    state, _ = jax.lax.scan(tick, state, (jnp.asarray(plan.rows), jnp.asarray(plan.sends)))
    grads = {k: state["head"][k] for k in head_keys}
    if not m.tie_embeddings:
        grads["embed"] = state["embed"]
    grads["layers"] = jax.tree.map(lambda a: a.reshape(v * n_per, *a.shape[2:]), state["layers"])
    return grads, state["loss"]


def evaluate(plan: Plan, cfg: Config, layout, cparams: dict, batch):
    """Per device: this device's share of the summed NLL of every micro-batch, the
    stages run forwards only (`plan` is FORWARD_ONLY's): each device holds its own
    layers and the activations in flight, never the whole model."""
    m, tp, v = cfg.model, layout.tp, plan.v
    d = jax.lax.axis_index(AXIS)
    batch = jax.tree.map(lambda a: vary(a, (AXIS,)), batch)
    cparams = jax.tree.map(lambda a: vary(a, (AXIS,)), cparams)
    segments = batch.segment_ids if cfg.data.cross_doc_mask else None
    stack = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), cparams["layers"])

    def given(i):
        mb = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, False), batch)
        seg = None if segments is None else jax.lax.dynamic_index_in_dim(segments, i, 0, False)
        return mb, seg

    x0 = jax.eval_shape(lambda: embed(m, cparams, given(0)[0].inputs, tp=tp))
    axes = tuple(sorted(vma(x0) | {AXIS}))
    act = jax.ShapeDtypeStruct(x0.shape, x0.dtype)

    def residual(x):
        return tp.constrain(vary(x, axes), RESIDUAL)

    def forward(act_buf, r):
        mb, seg = given(r["micro"])
        x = jax.lax.cond(
            r["branch"] == FWD_FIRST,
            lambda: residual(embed(m, cparams, mb.inputs, tp=tp)),
            lambda: residual(jax.lax.dynamic_index_in_dim(act_buf, r["act"], 0, False)),
        )
        chunk = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, r["chunk"], 0, False), stack)
        return residual(layers(m, chunk, x, mb.positions, seg, tp=tp))

    def head(y, r):
        mb, _ = given(r["micro"])
        xn = final_norm(m, cparams, y, tp=tp)
        return vary(head_nll(cfg, cparams, xn, mb.targets, mb.loss_mask, tp), (AXIS,))

    zero_loss = vary(jnp.zeros((), jnp.float32), tuple(sorted(vma(
        jax.eval_shape(lambda y: head(y, {"micro": 0}), _zeros(act, axes))) | {AXIS})))  # fmt: skip
    down = [(k, (k + 1) % plan.p) for k in range(plan.p)]

    def tick(carry, xs):
        act_buf, total = carry
        row, sends = xs
        mine = jax.lax.dynamic_index_in_dim(row, d, 0, False)
        r = {c: mine[k] for k, c in enumerate(COLUMNS)}
        b = r["branch"]
        is_fwd = (b == FWD) | (b == FWD_FIRST) | (b == FWD_LAST)
        y = jax.lax.cond(is_fwd, lambda: forward(act_buf, r), lambda: residual(_zeros(act, axes)))
        part = jax.lax.cond(b == FWD_LAST, lambda: head(y, r), lambda: zero_loss)
        y = jax.lax.cond(sends[0], lambda a: jax.lax.ppermute(a, AXIS, down), lambda a: a, y)
        act_buf = jax.lax.dynamic_update_index_in_dim(act_buf, y, r["act_in"], 0)
        return (act_buf, total + vary(part, tuple(sorted(vma(zero_loss))))), None

    init = (_zeros(act, axes, (plan.slots["act"] + 1,)), zero_loss)
    (_, total), _ = jax.lax.scan(tick, init, (jnp.asarray(plan.rows), jnp.asarray(plan.sends)))
    return total


def reduce(cfg: Config, layout, grads: dict, params: dict) -> dict:
    """Each accumulated gradient reduced once: over the data axes (ZeRO >= 1: scattered
    into this rank's shard of `params`), and the replicated weights over `pipeline`."""
    dtype = cfg.parallel.grad_reduce_dtype
    out = {}
    for k, g in grads.items():
        names = layout.names[k]
        if k == "layers":
            out[k] = {
                kk: _finish(layout, gg, params[k][kk], names[kk], dtype) for kk, gg in g.items()
            }
        else:
            out[k] = _finish(layout, g, params[k], names, dtype)
    return out


def _finish(layout, g, param, names, dtype):
    scatter = layout.zero.scatter(names, last=True) if layout.zero.shards_state else None
    if scatter is not None and scatter[0] not in layout.manual:
        scatter = None
    return finish(g, None, Reduce(dtype, scatter, varying=vma(param), shape=param.shape))


def _moves(p: int, v: int, back: bool = False):
    """The point-to-point copies that turn each device's contiguous layers (model order:
    device s holds chunks s·v .. s·v + v - 1) into its interleaved chunks (device t holds
    chunks t, t + p, ...), or `back`. Per (target slot, source slot): one ppermute whose
    pairs are distinct sources and targets."""
    moves = []
    for b in range(v):  # slot b of device t holds chunk b·p + t (stage order)
        for a in range(v):  # slot a of device s holds chunk s·v + a (model order)
            chunks = [c for c in range(b * p, (b + 1) * p) if c % v == a]
            pairs = [(c // v, c % p) for c in chunks]  # model -> stage
            if back:
                moves.append((a, b, [(t, s) for s, t in pairs]))
            elif pairs:
                moves.append((b, a, pairs))
    return moves


def _reorder(stack, p: int, v: int, back: bool):
    if v == 1:
        return stack

    def one(w):
        local = w.reshape(v, w.shape[0] // v, *w.shape[1:])
        out = [jnp.zeros_like(local[0]) for _ in range(v)]
        for dst, src, pairs in _moves(p, v, back):
            out[dst] = out[dst] + jax.lax.ppermute(local[src], AXIS, pairs)
        return jnp.concatenate(out, axis=0)

    return jax.tree.map(one, stack)


def to_stages(stack, p: int, v: int):
    """Per device: this device's layers (a contiguous slice of the model's order, as the
    train state and checkpoints keep them, so a checkpoint moves between pipeline layouts
    unchanged) -> its chunks in `layer_order` (interleaved: chunks d, d + p, ...).

    Point-to-point copies over `pipeline`, once a step: each device sends and receives one
    stage's weights; nobody gathers the stack. The identity unless v > 1."""
    return _reorder(stack, p, v, back=False)


def to_model(stack, p: int, v: int):
    """The inverse of `to_stages` (the layer gradients go home before the optimizer)."""
    return _reorder(stack, p, v, back=True)
