"""AdamW with warmup + cosine or warmup-stable-decay, built from optax's pieces.

Moments are kept in the dtype of the master weights (fp32 by default); norm
scales get no weight decay (decaying them pulls every activation toward zero).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from ultrajax.config.schema import Config
from ultrajax.model.llama import NO_DECAY


def schedule_steps(cfg: Config) -> int:
    """The steps the learning-rate schedule spans: optim.schedule_steps, else train.steps."""
    return cfg.optim.schedule_steps or cfg.train.steps


def lr_schedule(cfg: Config) -> optax.Schedule:
    """The learning rate at a position (the steps trained before this one, in config
    batches: step k reads k - 1): a linear warmup from lr / warmup_steps at step 1 (the
    first step already moves the weights) to lr at step warmup_steps, then constant,
    cosine or warmup-stable-decay down to min_lr at the schedule's last step, held past
    it. (The decay ended one position past the last step: a WSD run never reached
    min_lr, and the peak came a step after the warmup.)"""
    o, steps = cfg.optim, schedule_steps(cfg)
    peak = max(o.warmup_steps, 1) - 1  # the position of the first step at lr
    last = steps - 1  # the position of the schedule's last step: min_lr there
    if peak > 0:  # lr / warmup_steps at position 0 (step 1) up to lr at position peak
        warmup = optax.linear_schedule(o.lr / o.warmup_steps, o.lr, peak)
    else:
        warmup = optax.constant_schedule(o.lr)
    if o.schedule == "constant":
        main, starts = [optax.constant_schedule(o.lr)], []
    elif o.schedule == "cosine":
        main = [optax.cosine_decay_schedule(o.lr, max(last - peak, 1), alpha=o.min_lr / o.lr)]
        starts = []
    else:  # wsd: hold the peak, then linearly to min_lr over the last `decay` steps
        decay = max(int(round(o.decay_fraction * steps)), 1)
        hold = max(last - decay, peak)
        main = [optax.constant_schedule(o.lr), optax.linear_schedule(o.lr, o.min_lr, last - hold)]
        starts = [hold]
    return optax.join_schedules([warmup, *main], [peak, *starts])


def decay_mask(params: dict) -> dict:
    """True where weight decay applies: everything but the norm scales and biases
    (llama.NO_DECAY)."""

    def keep(path, _):
        return not any(getattr(k, "key", None) in NO_DECAY for k in path)

    return jax.tree_util.tree_map_with_path(keep, params)


def _unit(count):
    """adamw's learning rate: 1. The step multiplies the update by the schedule's value
    itself (`scale`), read at a position in tokens, so that a change of batch size does not
    change it; a callable, so the optimizer state keeps its step count as before."""
    return 1.0


def scale(updates, lr):
    """The update times the learning rate: what adamw's own scaling did, cast alike."""
    return jax.tree.map(lambda u: jnp.asarray(lr, u.dtype) * u, updates)


def optimizer(cfg: Config) -> optax.GradientTransformation:
    """Clipping, then AdamW (or plain SGD) at learning rate 1 (times `lr_schedule` in the
    step)."""
    o = cfg.optim
    parts = []
    if o.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(o.clip_norm))
    if o.name == "sgd":  # DiLoCo's exactness tests (docs/diloco.md): linear in the gradient
        if o.weight_decay:
            parts.append(optax.add_decayed_weights(o.weight_decay, mask=decay_mask))
        parts.append(optax.sgd(_unit))
        return optax.chain(*parts)
    parts.append(
        optax.adamw(
            _unit,
            b1=o.b1,
            b2=o.b2,
            eps=o.eps,
            weight_decay=o.weight_decay,
            mask=decay_mask,
            mu_dtype=jnp.float32,  # first moment in fp32 even for bf16 parameters
        )
    )
    return optax.chain(*parts)
