"""The jitted train step: one program for train.py and analyze.py.

A step takes a global batch shaped (grad_accum, micro_batch x dp, seq_len + 1),
scans over the micro-batches accumulating fp32 gradients, and applies one
optimizer update. The loss is the sum of per-token losses over every
micro-batch divided by the total count of target tokens, so grad_accum=4 and
grad_accum=1 on the same global batch give the same loss and gradients even
when micro-batches hold different numbers of valid tokens. Accumulating inside
one jitted step is also our `no_sync`: gradients are reduced once per step,
not once per micro-batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from ultrajax.config import Config
from ultrajax.mesh import Rules, tree_shardings
from ultrajax.model import forward, init_params, logical_axes


def init_state(cfg: Config, tx: optax.GradientTransformation, key) -> dict:
    params = init_params(cfg.model, key)
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}


def state_shardings(cfg: Config, mesh, rules: Rules, tx) -> dict:
    """Where every leaf of the train state lives (ZeRO >= 1 shards it over fsdp)."""
    abstract = jax.eval_shape(functools.partial(init_state, cfg, tx), jax.random.key(0))
    params = tree_shardings(mesh, logical_axes(cfg.model), rules, "stored")
    replicated = NamedSharding(mesh, PartitionSpec())
    opt = optax.tree_map_params(
        tx, lambda _, s: s, abstract["opt_state"], params, transform_non_params=lambda _: replicated
    )
    return {"step": replicated, "params": params, "opt_state": opt}


def target_mask(segment_ids, cross_doc_mask: bool):
    """Which next-token targets count: not padding (segment 0) and, with cross-document
    masking, not the first token of the next document."""
    seg_in, seg_tgt = segment_ids[..., :-1], segment_ids[..., 1:]
    valid = seg_tgt > 0
    if cross_doc_mask:
        valid &= seg_tgt == seg_in
    return valid


def loss_sum(cfg: Config, params, batch, rules=None):
    """(sum of token NLLs, count of target tokens) for one micro-batch (batch, seq_len + 1)."""
    tokens, seg, pos = batch["tokens"], batch["segment_ids"], batch["positions"]
    cross_doc = cfg.data.cross_doc_mask
    logits = forward(
        cfg.model,
        params,
        tokens[:, :-1],
        pos[:, :-1],
        seg[:, :-1] if cross_doc else None,
        rules=rules,
    )
    targets = tokens[:, 1:]
    mask = target_mask(seg, cross_doc)
    # one-hot dot instead of a gather: with vocabulary-parallel logits the partitioner
    # turns both reductions into partial sums + all-reduce, never gathering the vocab.
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1]), axis=-1)
    nll = (log_z - target_logit) * mask
    return nll.sum(), mask.sum()


def make_train_step(cfg: Config, tx, schedule, mesh=None, rules: Rules | None = None):
    """Build train_step(state, batch) -> (state, metrics). Jit it with `jit_train_step`."""
    dtype = jnp.dtype(cfg.model.dtype)
    axes = logical_axes(cfg.model)

    def constrain(tree, kind):
        if mesh is None or rules is None:
            return tree
        return jax.lax.with_sharding_constraint(tree, tree_shardings(mesh, axes, rules, kind))

    def train_step(state, batch):
        params = state["params"]
        # compute copy: cast once per step, outside the micro-batch loop (ZeRO-1/2 gather here)
        cparams = constrain(jax.tree.map(lambda p: p.astype(dtype), params), "compute")
        n_targets = target_mask(batch["segment_ids"], cfg.data.cross_doc_mask).sum()
        scale = 1.0 / jnp.maximum(n_targets, 1).astype(jnp.float32)

        def micro(carry, mb):
            grads, loss = carry
            mean_part = lambda p: loss_sum(cfg, p, mb, rules)[0] * scale  # noqa: E731
            part, g = jax.value_and_grad(mean_part)(cparams)
            grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
            grads = constrain(grads, "stored" if cfg.parallel.zero >= 2 else "compute")
            return (grads, loss + part), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        (grads, loss), _ = jax.lax.scan(micro, (zeros, jnp.zeros((), jnp.float32)), batch)
        grads = constrain(grads, "stored")
        grad_norm = optax.global_norm(grads)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new = {
            "step": state["step"] + 1,
            "params": optax.apply_updates(params, updates),
            "opt_state": opt_state,
        }
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": schedule(state["step"]),
            "n_targets": n_targets,
        }
        return new, metrics

    return train_step


def make_eval_step(cfg: Config, rules: Rules | None = None):
    """eval_step(params, batch) -> (sum of NLL, count) over all micro-batches."""
    dtype = jnp.dtype(cfg.model.dtype)

    def eval_step(params, batch):
        cparams = jax.tree.map(lambda p: p.astype(dtype), params)

        def micro(carry, mb):
            s, n = loss_sum(cfg, cparams, mb, rules)
            return (carry[0] + s, carry[1] + n), None

        (s, n), _ = jax.lax.scan(micro, (jnp.zeros(()), jnp.zeros((), jnp.int32)), batch)
        return s, n

    return eval_step


def jit_train_step(cfg: Config, mesh, rules: Rules, tx, schedule, shardings: dict, batch_sh):
    """The jitted step with donated state: what train.py runs and analyze.py compiles."""
    step = make_train_step(cfg, tx, schedule, mesh, rules)
    return jax.jit(
        step,
        in_shardings=(shardings, batch_sh),
        out_shardings=(shardings, None),
        donate_argnums=0,
    )
