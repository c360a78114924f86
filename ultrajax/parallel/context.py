"""Context parallelism over the `sequence` mesh axis: ring attention, the all-gather
variant, and zig-zag load balancing (the playbook's "Context parallelism" section).

With `mesh.sequence = cp`, every sequence is cut into 2·cp equal chunks and each device
holds two of them. Everything outside attention is per token (norms, MLP, LM head, loss),
so only attention ever sees another device's tokens:

- ring (`parallel.context: ring`; Liu et al. 2023, "Ring Attention"): each device keeps
  its queries and passes its keys and values (with their segment ids) to the next device,
  cp - 1 times. Each block's partial output is merged into the running one with its
  log-sum-exp (an online softmax across devices). The next block's transfer is issued
  before the current block is computed, so the two can overlap. The backward pass is a
  second ring in which dK and dV travel with their blocks and arrive home after the last
  hop, so a device only ever holds its own activations (O(seq/cp) memory); each hop
  computes its share into fresh buffers while the previous share is in flight, so those
  transfers overlap too.
- all-gather (`parallel.context: allgather`; Llama 3 training, Dubey et al. 2024): K, V
  and their segment ids are all-gathered once (small under GQA), the local queries attend
  to all of them, and dK, dV are reduce-scattered home in the backward pass.

Zig-zag (`parallel.context_zigzag`, Brandon et al. 2023 "Striped Attention" and the
ring-flash-attention zig-zag layout): under a causal mask the device holding the last
chunks has the most work. Device i holds chunks i and 2·cp-1-i instead of 2i and 2i+1,
so every device computes the same number of (query chunk, key chunk) pairs. The batch is
permuted when it is built (`order`), so the loss, a sum over tokens, never notices.

Work is skipped, not masked: a (query chunk, key chunk) pair is computed only if some
query may see some key. A key chunk after the query chunk is in the causal future (skip);
before it, every key is in the past (no causal mask); the same chunk is the causal
diagonal. Packed documents: a pair with no common segment id is skipped too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from ultrajax.kernels import flash_attention as fa
from ultrajax.kernels.varying import vary, vary_like, vma, zeros
from ultrajax.model import remat
from ultrajax.model.attention.backends import BACKENDS, attend, output_residual, resolve
from ultrajax.model.attention.blocked import block_grads
from ultrajax.model.attention.xla import NEG_INF, reference, scores, visible
from ultrajax.parallel.axes import SEQUENCE

AXIS = SEQUENCE
SKIP, FULL, CAUSAL = 0, 1, 2  # what a (query chunk, key chunk) pair needs


def chunks(cp: int, zigzag: bool) -> np.ndarray:
    """(cp, 2): the global chunk index of each device's two chunks, in the order held."""
    r = np.arange(cp)
    if zigzag:
        return np.stack([r, 2 * cp - 1 - r], axis=1)
    return np.stack([2 * r, 2 * r + 1], axis=1)


def order(seq_len: int, cp: int, zigzag: bool) -> np.ndarray | None:
    """The token order the batch is laid out in along the sequence (device after device),
    or None where it is the natural one (cp == 1 or no zig-zag)."""
    if cp == 1 or not zigzag:
        return None
    size = seq_len // (2 * cp)
    return np.concatenate([np.arange(c * size, (c + 1) * size) for c in chunks(cp, True).ravel()])


def token_order(cfg) -> np.ndarray | None:
    """`order` for a run's config: what the batch builder applies."""
    return order(cfg.model.seq_len, cfg.mesh.sequence, cfg.parallel.context_zigzag)


def pair_kernel(cfg, platform: str) -> str:
    """The per-pair attention for a run: our Pallas kernel where `model.attention` means a
    flash kernel on this platform and the chunk fits its blocks, else plain XLA."""

    name = resolve(cfg.model.attention, platform, cfg.data.cross_doc_mask)
    if not BACKENDS[name].gpu_kernel:  # a flash kernel on a GPU: ours runs the pairs
        return "xla"

    return "pallas" if pair_chunk(cfg) % pair_tile(cfg) == 0 else "xla"


def pair_chunk(cfg) -> int:
    """The tokens of one chunk of the ring: seq_len / (2 x mesh.sequence)."""
    return cfg.model.seq_len // (2 * cfg.mesh.sequence)


def pair_tile(cfg) -> int:
    """What a chunk must be a multiple of for the Pallas kernel to run a pair: the least
    common multiple of its tiles."""
    b = fa.BlockSizes.of(cfg.model.attention_blocks, cfg.model.hd)
    return math.lcm(b.q, b.k, b.q_bwd, b.k_bwd)


def pair_kind(q_chunk, k_chunk):
    """SKIP, FULL or CAUSAL for a (query chunk, key chunk) pair of a causal mask."""
    return jnp.where(k_chunk == q_chunk, CAUSAL, jnp.where(k_chunk < q_chunk, FULL, SKIP))


def work(cp: int, zigzag: bool) -> np.ndarray:
    """Attention work of each device in (chunk x chunk) pairs, a causal diagonal counting
    half: the FLOPs per device are this times 4·b·(s/2cp)²·a·hd (forward). Contiguous:
    device i does 4i + 2, so the last one does 2·cp - 1 times the first; zig-zag: 2·cp each."""
    table = chunks(cp, zigzag)
    weight = {SKIP: 0.0, FULL: 1.0, CAUSAL: 0.5}
    out = np.zeros(cp)
    for r in range(cp):
        for qc in table[r]:
            for kc in table.ravel():
                out[r] += weight[int(pair_kind(qc, kc))]
    return out


# ----------------------------------------------------------------- one pair of chunks


def pair_backward(q, k, v, qs, ks, lse, delta, do, causal):
    """This pair's share of (dq, dk, dv), fp32, from the *final* log-sum-exp and delta =
    rowsum(dout * out), both (b, h, t): the flash backward, probabilities recomputed."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    seen = visible(qs, ks, t, k.shape[1], causal)
    qg, s = scores(q, k, seen)
    p = jnp.where(seen, jnp.exp(s - lse.reshape(b, kv, g, t)[..., None]), 0.0)
    dog = do.reshape(b, t, kv, g, d)
    dq, dk, dv = block_grads(qg, k, v, dog, p, delta.reshape(b, kv, g, t), d**-0.5)
    return dq.reshape(b, t, h, d), dk, dv


def _interpret() -> bool:
    return jax.default_backend() != "gpu"  # Pallas kernels run interpreted off a GPU


def _merge(o, lse, o_new, lse_new):
    """Online softmax across blocks: two normalised partial results -> one."""
    both = jnp.logaddexp(lse, lse_new)
    w_old = jnp.exp(lse - both).transpose(0, 2, 1)[..., None]
    w_new = jnp.exp(lse_new - both).transpose(0, 2, 1)[..., None]
    return o * w_old + o_new * w_new, both


def _kind(q_chunk, k_chunk, qs, ks):
    """Which branch a pair takes; a pair with no common document is skipped."""
    shared = jnp.any(qs[:, :, None] == ks[:, None, :])
    return jnp.where(shared, pair_kind(q_chunk, k_chunk), SKIP)


def _halves(x, axis=1):
    n = x.shape[axis] // 2
    return jax.lax.slice_in_dim(x, 0, n, axis=axis), jax.lax.slice_in_dim(x, n, 2 * n, axis=axis)


def _half(x, i, axis=1):
    """Half i (traced) of x along `axis`."""
    n = x.shape[axis] // 2
    return jax.lax.dynamic_slice_in_dim(x, i * n, n, axis=axis)


def _add_half(x, i, part, axis=1):
    """x with `part` added to its half i."""
    n = x.shape[axis] // 2
    return jax.lax.dynamic_update_slice_in_dim(x, _half(x, i, axis) + part, i * n, axis=axis)


def _set_half(x, i, part, axis=1):
    n = x.shape[axis] // 2
    return jax.lax.dynamic_update_slice_in_dim(x, part, i * n, axis=axis)


def _pairs(mine, theirs, qs, ks, state, compute):
    """state = compute(state, qi, ki, causal) for each (query half, key half) pair of two
    devices' chunks in which some query sees some key; the others are skipped.

    One loop over the pairs that run (0 to 4 trips), the halves picked by index: a single
    loop body (so one pair's working set at a time), and no lax.cond, whose partial
    evaluation inside a differentiated layer scan keeps every branch's intermediates."""
    idx = jnp.arange(4)
    qi, ki = idx % 2, idx // 2
    kinds = jnp.stack([_kind(mine[i % 2], theirs[i // 2], _halves(qs)[i % 2],
                             _halves(ks)[i // 2]) for i in range(4)])  # fmt: skip
    active = jnp.argsort(kinds == SKIP, stable=True)  # the pairs that run come first

    def body(n, st):
        p = active[n]
        return compute(st, qi[p], ki[p], kinds[p] == CAUSAL)

    return jax.lax.fori_loop(0, jnp.sum(kinds != SKIP), body, state)


# --------------------------------------------------------------------- the two sweeps


@dataclass(frozen=True)
class KernelRegion:
    """Where the partitioner lays the step out, attention runs per device in a shard_map
    manual over those axes: left to it, the kernel it cannot split (Pallas's, cuDNN's,
    the ring's pairs) ran on every row and head on each device. Pallas's forward and
    backward kernels each run in one (flash_attention's `per_device`), unchecked, as
    interpreted Pallas fails the vma check; nothing is differentiated through those, so
    they nest in a partly manual step too. cuDNN's call and the ring run `checked`."""

    axes: frozenset
    q: PartitionSpec  # (batch, length, heads, head_dim)
    kv: PartitionSpec  # (batch, length, kv_heads, head_dim)
    ids: PartitionSpec  # (batch, length)
    checked: bool = False

    def __call__(self, fn, ins: tuple, outs: tuple | str):
        """fn per device, its operands and results named by kind ("q", "kv", "ids", and
        "rows": (batch, heads, length)); one result: its kind alone."""
        b, t, h, _ = (*self.q, None, None, None, None)[:4]
        spec = {"q": self.q, "kv": self.kv, "ids": self.ids, "rows": PartitionSpec(b, h, t)}
        out_specs = spec[outs] if isinstance(outs, str) else tuple(spec[k] for k in outs)
        run = jax.shard_map(fn, in_specs=tuple(spec[k] for k in ins), out_specs=out_specs,
                            axis_names=self.axes, check_vma=self.checked)  # fmt: skip
        if self.checked:
            return run
        # untyped out of an unchecked region: typed as its operands vary over the outer
        # manual axes (a partly manual step's data axes)
        return lambda *args: vary_like(run(*args), *args)


@dataclass(frozen=True)
class Context:
    """How attention runs across the `sequence` axis, for per-device code in shard_map."""

    size: int = 1
    mode: str = "ring"  # ring | allgather
    zigzag: bool = True
    # code outside runs under the partitioner (parallel.collectives=gspmd): attention
    # enters its own shard_map, manual over `sequence` only
    own_shard_map: bool = False
    # the attention of one pair of chunks: "xla" (plain jnp, fp32 scores of the pair) or
    # "pallas" (kernels/flash_attention.py; chunk length a multiple of its block sizes)
    kernel: str = "xla"
    blocks: tuple | None = None  # model.attention_blocks: the Pallas tiles (None: defaults)
    fused_bwd: bool = False  # model.attention_backward=fused: the kernel's one backward
    # manual over some mesh axes, the partitioner's over others (parallel/layout.py): auto
    # picks no cuDNN here, whose custom partitioning fails in such a region
    partly_manual: bool = False
    # where the partitioner lays the step out: attention's kernels run per device there
    region: KernelRegion | None = None
    axis: str = AXIS

    def attend(self, q, k, v, segment_ids, implementation: str):
        if self.size == 1:
            return self._kernel(q, k, v, segment_ids, implementation)
        if segment_ids is None:
            segment_ids = jnp.ones(q.shape[:2], jnp.int32)
        if not self.own_shard_map:
            return _context_attention(self, q, k, v, segment_ids)
        # manual over the partitioner's axes too where it can be (`region`): left to it,
        # the pair kernel ran on every row of the fsdp group on each device
        alone = PartitionSpec(None, self.axis)
        region = self.region if not self.partly_manual else None  # nested: Shardy's error
        region = region or KernelRegion(frozenset({self.axis}), alone, alone, alone)
        ring = dataclasses.replace(region, checked=True)
        ring = ring(functools.partial(_context_attention, self), ("q", "kv", "kv", "ids"), "q")
        return ring(q, k, v, segment_ids)

    def _kernel(self, q, k, v, segment_ids, implementation: str):
        """One device's attention. A GPU kernel (Pallas's or cuDNN's call) is one op the
        partitioner cannot split: left to it, Pallas's ran on the whole batch and every
        head on each device (compiled for 8 H200s, gspmd ZeRO-2 over fsdp: 64 rows, not
        8), so where the step is the partitioner's it runs in a shard_map of its own:
        Pallas's forward and backward kernels each (`KernelRegion`), cuDNN's whole call
        (not in a partly manual step, where it is refused)."""
        packed = segment_ids is not None
        name = resolve(implementation, jax.default_backend(), packed, k.shape[1],
                       self.partly_manual)  # fmt: skip
        fn = functools.partial(attend, implementation=name, blocks=self.blocks,
                               fused_bwd=self.fused_bwd)  # fmt: skip
        backend = BACKENDS[name]
        if not self.region or not backend.gpu_kernel:
            return fn(q, k, v, segment_ids)
        if backend.tiles:
            return fn(q, k, v, segment_ids, per_device=self.region)
        args = (q, k, v, segment_ids) if packed else (q, k, v)
        whole = dataclasses.replace(self.region, checked=True)
        return whole(fn, ("q", "kv", "kv", "ids")[: len(args)], "q")(*args)

    def output_residual(self, implementation: str, segment_ids, seq_len: int) -> str:
        """What the attention keeps of its output for its backward: across devices, the
        ring's or the all-gather's output and log-sum-exp, named (model/remat.py)."""
        if self.size == 1:
            return output_residual(implementation, segment_ids, seq_len)
        return "saved"

    def _pair_forward(self, q, k, v, qs, ks, causal):
        if self.kernel == "xla":
            return reference(q, k, v, qs, ks, causal=causal)

        opts = dict(
            blocks=fa.BlockSizes.of(self.blocks, q.shape[-1], q.dtype.itemsize, self.fused_bwd),
            interpret=_interpret(),
        )

        def run(c):
            return lambda: fa.pair_forward(q, k, v, qs, ks, causal=c, **opts)

        o, lse = jax.lax.cond(causal, run(True), run(False))
        return o, lse  # fp32 from the kernel: the merge rounds nothing per pair

    def _pair_backward(self, q, k, v, qs, ks, lse, delta, do, causal):
        if self.kernel == "xla":
            return pair_backward(q, k, v, qs, ks, lse, delta, do, causal)

        opts = dict(
            blocks=fa.BlockSizes.of(self.blocks, q.shape[-1], q.dtype.itemsize, self.fused_bwd),
            interpret=_interpret(),
        )

        def run(c):
            return lambda: fa.pair_backward(q, k, v, qs, ks, lse, delta, do, causal=c, **opts)

        return jax.lax.cond(causal, run(True), run(False))

    def _send(self, x):
        """To the next device of the ring."""
        return jax.lax.ppermute(x, self.axis, [(i, (i + 1) % self.size) for i in range(self.size)])

    def _sweep(self, k, v, ks, fixed, step):
        """(fixed, travelling) after `fixed, own = step(fixed, (k, v, ks) block, chunks it
        holds)` over every device's block. `own` is None or this device's contribution to
        what travels with the block (the backward ring's dK, dV), in fresh buffers.

        ring: the block in hand is sent on before it is computed with, and the sum of the
        previous devices' contributions to it is sent on from the previous hop at the same
        time: neither transfer waits on this hop's compute, so both can overlap it. The
        sum arrives, the own part is added, and the next hop sends it on; after the last
        hop the sum goes home. The first hop (nothing has arrived) and the last (nothing
        more to send) are outside the scan, so no transfer carries zeros or goes unused.
        allgather: K, V, segment ids gathered once and sliced per device; `travelling` is
        each device's `own`, stacked (the caller reduce-scatters it home)."""
        table = jnp.asarray(chunks(self.size, self.zigzag), jnp.int32)
        r = jax.lax.axis_index(self.axis)
        if self.mode != "ring":
            block = self._gathered(k, v, ks)
            return jax.lax.scan(lambda f, j: step(f, block(j), table[j]), fixed,
                                jnp.arange(self.size))  # fmt: skip

        def at(j):
            return table[(r - j) % self.size]

        def send(x):
            return None if x is None else self._send(x)

        def add(arrived, own):
            return None if own is None else jax.tree.map(jnp.add, arrived, own)

        def hop(c, j):
            blk, fixed, pending = c
            nxt = self._send(blk)  # the next hop's block
            arrived = send(pending)  # this block's sum so far, from the previous device
            fixed, own = step(fixed, blk, at(j))  # depends on neither transfer
            return (nxt, fixed, add(arrived, own)), None

        blk = tuple(vary(a, (self.axis,)) for a in (k, v, ks))  # as after a hop
        nxt = self._send(blk)
        fixed, pending = step(fixed, blk, at(0))
        (blk, fixed, pending), _ = jax.lax.scan(
            hop, (nxt, fixed, pending), jnp.arange(1, self.size - 1)
        )
        arrived = send(pending)
        fixed, own = step(fixed, blk, at(self.size - 1))
        return fixed, send(add(arrived, own))  # the last hop: home

    def _gathered(self, k, v, ks):
        """All-gather K, V and segment ids over `sequence`; block(j) is device j's part."""
        full = [jax.lax.all_gather(a, self.axis, axis=1, tiled=True) for a in (k, v, ks)]
        n = k.shape[1]
        return lambda j: tuple(jax.lax.dynamic_slice_in_dim(a, j * n, n, axis=1) for a in full)

    def forward(self, q, k, v, qs, ks):
        mine = jnp.asarray(chunks(self.size, self.zigzag))[jax.lax.axis_index(self.axis)]
        axes = tuple(sorted(set().union(*(vma(a) for a in (q, k, v, qs, ks)))))
        b, t, h, d = q.shape
        o = zeros((b, t, h, d), jnp.float32, axes)
        lse = vary(jnp.full((b, h, t), NEG_INF, jnp.float32), axes)

        def step(state, blk, theirs):
            kb, vb, ksb = blk

            def compute(st, qi, ki, causal):
                o, lse = st
                new = self._pair_forward(_half(q, qi), _half(kb, ki), _half(vb, ki),
                                         _half(qs, qi), _half(ksb, ki), causal)  # fmt: skip
                oq, lq = _merge(_half(o, qi), _half(lse, qi, 2), *new)
                return _set_half(o, qi, oq), _set_half(lse, qi, lq, 2)

            return _pairs(mine, theirs, qs, ksb, state, compute), None

        (o, lse), _ = self._sweep(k, v, ks, (o, lse), step)
        return o.astype(q.dtype), lse

    def backward(self, q, k, v, qs, ks, o, lse, do):
        mine = jnp.asarray(chunks(self.size, self.zigzag))[jax.lax.axis_index(self.axis)]
        axes = tuple(sorted(set().union(*(vma(a) for a in (q, k, v, qs, ks, do)))))
        z = lambda a: zeros(a.shape, jnp.float32, axes)  # noqa: E731
        # rowsum(dout * out), once for every pair: (b, h, t) like the log-sum-exp
        delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), -1).transpose(0, 2, 1)

        def step(dq, blk, theirs):
            kb, vb, ksb = blk

            def compute(st, qi, ki, causal):
                dq, dk, dv = st
                g = self._pair_backward(_half(q, qi), _half(kb, ki), _half(vb, ki),
                                        _half(qs, qi), _half(ksb, ki), _half(lse, qi, 2),
                                        _half(delta, qi, 2), _half(do, qi), causal)  # fmt: skip
                return _add_half(dq, qi, g[0]), _add_half(dk, ki, g[1]), _add_half(dv, ki, g[2])

            # this block's dK, dV into fresh buffers: the ring adds what arrived after
            dq, dk, dv = _pairs(mine, theirs, qs, ksb, (dq, z(kb), z(vb)), compute)
            return dq, (dk, dv)

        dq, (dk, dv) = self._sweep(k, v, ks, z(q), step)
        if self.mode != "ring":  # each slice's dK, dV go home in one reduce-scatter
            dk, dv = self._home(dk), self._home(dv)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    def _home(self, x):
        """(cp, b, n, ...) stacked per gathered slice -> this device's (b, n, ...) sum."""
        x = jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])
        return jax.lax.psum_scatter(x, self.axis, scatter_dimension=1, tiled=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _context_attention(ctx: Context, q, k, v, segment_ids):
    return ctx.forward(q, k, v, segment_ids, segment_ids)[0]


def _fwd(ctx, q, k, v, segment_ids):
    out, lse = ctx.forward(q, k, v, segment_ids, segment_ids)
    # named, so that selective recomputation keeps them rather than run the ring again
    out, lse = checkpoint_name(out, remat.ATTN_SAVED), checkpoint_name(lse, remat.ATTN_SAVED)
    return out, (q, k, v, segment_ids, out, lse)


def _bwd(ctx, res, do):
    q, k, v, seg, out, lse = res
    dq, dk, dv = ctx.backward(q, k, v, seg, seg, out, lse, do)
    return dq, dk, dv, None


_context_attention.defvjp(_fwd, _bwd)
