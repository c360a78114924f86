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

Used per device inside `shard_map` (explicit collectives, or manual only over the
data axes under `parallel.collectives: gspmd`) or globally under the partitioner:
the same code, with `manual` naming the axes this code sees one shard of.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ultrajax.kernels.varying import vary, vma, zeros, zeros32
from ultrajax.model.ops import Reduce, Weight, finish
from ultrajax.parallel.axes import FSDP, TOKEN_AXES  # the batch's tokens are split over these
from ultrajax.parallel.zero import Zero


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

    @property
    def deferred(self) -> tuple[str, ...]:
        """Manual data axes whose reduction waits for the last micro-batch."""
        if self.zero.shards_grads and self.zero.active:
            axes = tuple(a for a in TOKEN_AXES if a != FSDP)
        else:
            axes = TOKEN_AXES
        return tuple(a for a in axes if a in self.manual)

    @property
    def splits_last(self) -> bool:
        """Whether the last micro-batch reduces differently from the others."""
        return self.grad_accum > 1 and bool(self.deferred)

    def adds_inside(self, last: bool) -> bool:
        """Whether the running sum joins the backward rules: only where a deferred
        reduction is finally due (else it is added after the backward pass, so it is
        never kept as a residual of the layer scan)."""
        return last and self.splits_last

    def reduce(self, path: str, names, last: bool) -> Reduce:
        spec = None if self.specs is None else self.specs[path]
        scatter = self.zero.scatter(names, last)
        if scatter is not None and scatter[0] not in self.manual:
            scatter = None  # the partitioner scatters (to `spec`)
        return Reduce(self.dtype, scatter, spec)

    def sinks(self, params, cparams, last: bool) -> dict:
        """fp32 zeros shaped and typed as this phase's gradients (ZeRO >= 1: the stored
        shards; ZeRO-0/1 before the last micro-batch: whole and unreduced)."""
        whole = self.zero.active <= 1 and not (last and self.zero.active == 1)
        out = jax.tree.map(zeros32, cparams if whole else params)
        return out if last else jax.tree.map(lambda s: vary(s, self.deferred), out)

    def wrt(self, sinks, cparams) -> dict:
        """What the step differentiates: the sinks, with those of `after` replaced by
        whole, unreduced ones (see `attach`)."""
        raw = {
            k: vary(zeros32(cparams[k]), tuple(sorted(self.manual)))
            for k in self.after
            if k in cparams
        }
        return dict(sinks, **raw)

    def attach(self, cparams, sinks, acc, last: bool, gather=None):
        """(the weights the model reads, the `prepare` for its layer scan).

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
        layer_names = {k: n[1:] for k, n in self.names["layers"].items()}

        def prepare(p):
            out = {}
            for k, value in p["w"].items():
                value = jax.lax.stop_gradient(value)
                if gather is not None:
                    value = gather(value, k)
                red = self.reduce(f"layers/{k}", layer_names[k], last)
                acc_k = None if p["acc"] is None else p["acc"][k]
                out[k] = Weight.make(value, p["sink"][k], acc_k, red)
            return out

        return w, prepare

    def finish(self, g: dict, acc, sinks, last: bool) -> dict:
        """Reduce the gradients of `after` (see `attach`); `acc` their running sum or None."""
        out = dict(g)
        for k in self.after:
            if k in g:
                red = self.reduce(k, self.names[k], last)
                held = None if acc is None else acc[k]
                out[k] = finish(g[k], held, dataclasses.replace(red, varying=vma(sinks[k])))
        return out

    def accumulate(self, micro, acc, batch):
        """Run `micro(acc, mb, last) -> (acc, loss)` over the micro-batches (axis 0)."""

        def body(last: bool):
            def one(carry, mb):
                acc, loss = carry
                acc, part = micro(acc, mb, last)
                return (acc, loss + part), None

            return one

        zero = zeros((), jnp.float32, vma(batch.inputs))
        if not self.splits_last:  # every micro-batch reduces alike
            (acc, loss), _ = jax.lax.scan(body(True), (acc, zero), batch)
            return acc, loss
        first = jax.tree.map(lambda a: a[:-1], batch)
        (acc, loss), _ = jax.lax.scan(body(False), (acc, zero), first)
        acc, part = micro(acc, jax.tree.map(lambda a: a[-1], batch), True)
        return acc, loss + part
