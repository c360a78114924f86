"""Context parallelism: the zig-zag layout, the work per device, what the compiled step
sends, and its activation memory. Equivalence with one device (losses, gradient norms,
parameters) is in test_parallel.py beside the other layouts, sharing its compiles."""

from __future__ import annotations

import re

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_parallel as grid

from ultrajax.config import schema as config
from ultrajax.cost import comms as comms_lib
from ultrajax.parallel import context
from ultrajax.tools import hlo
from ultrajax.train import batch as batch_lib
from ultrajax.train import step as step_lib


def test_zigzag_gives_device_i_chunks_i_and_mirror():
    np.testing.assert_array_equal(context.chunks(4, True), [[0, 7], [1, 6], [2, 5], [3, 4]])
    np.testing.assert_array_equal(context.chunks(4, False), [[0, 1], [2, 3], [4, 5], [6, 7]])
    order = context.order(16, 4, True)
    np.testing.assert_array_equal(order[:4], [0, 1, 14, 15])  # device 0: chunks 0 and 7
    assert sorted(order.tolist()) == list(range(16))
    assert context.order(16, 4, False) is None and context.order(16, 1, True) is None


def test_batch_order_moves_every_field_alike():
    rng = np.random.default_rng(0)
    seq = 16
    tokens = rng.integers(0, 100, (2, seq + 1)).astype(np.int32)
    seg = np.where(np.arange(seq + 1) < 7, 1, 2).astype(np.int32)[None].repeat(2, 0)
    pos = np.where(np.arange(seq + 1) < 7, np.arange(seq + 1), np.arange(seq + 1) - 7)
    packed = {"tokens": tokens, "segment_ids": seg, "positions": pos[None].repeat(2, 0)}
    plain = batch_lib.make(packed, cross_doc_mask=True)
    order = context.order(seq, 4, True)
    zig = batch_lib.make(packed, cross_doc_mask=True, order=order)
    for a, b in zip(plain, zig, strict=True):
        np.testing.assert_array_equal(a[..., order], b)
    # a token keeps its own target: the shift happened before the permutation
    np.testing.assert_array_equal(zig.targets, tokens[:, 1:][:, order])


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_balances_causal_work_and_contiguous_does_not(cp):
    zig, contiguous = context.work(cp, True), context.work(cp, False)
    total = (2 * cp) ** 2 / 2  # causal pairs of chunks, diagonal counting half
    assert zig.sum() == contiguous.sum() == total
    assert zig.max() / zig.min() <= 1.1
    np.testing.assert_array_equal(contiguous, 4 * np.arange(cp) + 2)  # the formula
    assert contiguous.max() / contiguous.min() == 2 * cp - 1


def test_pairs_in_the_future_or_in_other_documents_are_skipped():
    one, two = jnp.ones((1, 4), jnp.int32), jnp.full((1, 4), 2, jnp.int32)
    assert int(context._kind(3, 3, one, one)) == context.CAUSAL
    assert int(context._kind(3, 1, one, one)) == context.FULL
    assert int(context._kind(1, 3, one, one)) == context.SKIP  # causal future
    assert int(context._kind(3, 1, one, two)) == context.SKIP  # no document in common
    mixed = jnp.array([[1, 1, 2, 2]], jnp.int32)
    assert int(context._kind(3, 1, mixed, two)) == context.FULL  # one document crosses


def test_ring_sends_kv_blocks_and_never_gathers():
    found, cfg = grid.collectives("cp4-ring-data2")
    sent = hlo.summarize(found)
    assert sent["all-gather"]["ops"] == 0 and sent["reduce-scatter"]["ops"] == 0
    expected = comms_lib.permute_bytes(cfg)["collective-permute"]
    assert sent["collective-permute"]["traffic"] == pytest.approx(expected, rel=0.01)


def test_selective_recomputation_sends_no_second_forward_ring():
    """Selective keeps the ring's output and log-sum-exp (model/remat.py ATTN_SAVED), so
    its backward pass reruns no forward ring: the compiled step sends what it sends
    without recomputation, the formula's bytes (before: a second forward ring, 30% more
    at cp=4). Full recomputation still sends more."""
    sent = {}
    for policy in ("none", "selective", "full"):
        r = grid.run("cp4-ring-data2", "explicit", f"model.remat={policy}")
        found, notes = hlo.collectives(r[3])
        assert not notes, notes
        sent[policy] = hlo.summarize(found)["collective-permute"]["traffic"]
        if policy == "selective":
            expected = comms_lib.permute_bytes(r[5])["collective-permute"]
            assert sent[policy] == pytest.approx(expected, rel=0.01)
    assert sent["selective"] == sent["none"] < sent["full"]


def test_allgather_gathers_kv_and_never_permutes():
    found, cfg = grid.collectives("cp2-allgather")
    sent = hlo.summarize(found)
    assert sent["collective-permute"]["ops"] == 0
    expected = comms_lib.permute_bytes(cfg)
    for kind in ("all-gather", "reduce-scatter"):
        assert sent[kind]["traffic"] == pytest.approx(expected[kind], rel=0.01), kind


COMPUTE = ("while", "dot", "convolution", "conditional", "custom-call", "call")


def _ancestors(instrs, name: str) -> set[str]:
    """The instructions `name` depends on inside its computation."""
    operands = {n: set(re.findall(r"%([\w.\-]+)", rest)) for n, _, rest in instrs}
    seen, todo = set(), [name]
    while todo:
        for op in operands.get(todo.pop(), ()):
            if op in operands and op not in seen:
                seen.add(op)
                todo.append(op)
    return seen


def test_ring_sends_wait_on_nothing_their_hop_computes():
    """Forward and backward: each hop's sends (the next K/V block, the dK/dV summed so far)
    depend on none of the hop's compute, so a GPU can overlap them with its pairs. The
    earlier backward added the hop's dK/dV into the arriving ones and sent the sum: its
    sends waited on the whole hop. Read in the compiled program (cp 4: two hops looped)."""
    ctx = context.Context(4, "ring", True)
    q, k, v = (jnp.zeros((2, 64, n, 16)) for n in (4, 2, 2))
    seg = jnp.ones((2, 64), jnp.int32)
    loss = lambda q, k, v: jnp.sum(_attend_split(ctx, q, k, v, seg))  # noqa: E731
    text = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, v).compile(harness.FAST).as_text()
    mod = hlo.parse_module(text)
    hops = {}
    for comp, instrs in mod.computations.items():
        sends = [n for n, _, rest in instrs if rest.startswith("collective-permute")]
        work = {n for n, _, rest in instrs if rest.split("(", 1)[0] in COMPUTE}
        if sends and work and comp != mod.entry:
            hops[comp] = (sends, work)
            for name in sends:
                assert not _ancestors(instrs, name) & work, (comp, name)
    # the forward's hop sends K, V, segment ids; the backward's those and dK, dV
    assert sorted(len(sends) for sends, _ in hops.values()) == [3, 5], hops


def _temp_bytes(*overrides) -> int:
    """Compiled temporaries of one train step at seq 2048 (the activations), per device."""
    cfg, devices = harness.make("model.seq_len=2048", "train.micro_batch_size=1", *overrides)
    mesh, rules, tx, schedule, shardings, batch_sh = harness.setup(cfg, devices)
    with jax.set_mesh(mesh):
        state = jax.eval_shape(lambda k: step_lib.init_state(cfg, tx, k), jax.random.key(0))
        state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings
        )
        batch = batch_lib.abstract(1, 1, cfg.model.seq_len, batch_sh)
        fn = step_lib.jit_train_step(cfg, mesh, rules, tx, schedule, shardings, batch_sh)
        compiled = fn.lower(state, batch).compile(harness.FAST)
    return compiled.memory_analysis().temp_size_in_bytes


def test_activation_memory_divides_along_the_sequence():
    """cp=4 against one device running the memory-efficient blocked attention (the plain
    one would keep the full 2048² scores and flatter the ratio)."""
    one = _temp_bytes("model.attention=blocked")
    four = _temp_bytes("mesh.sequence=4")
    assert four <= 0.35 * one, (four, one)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["mesh.sequence=4", "model.seq_len=36"], "2 x mesh.sequence"),
        (["mesh.sequence=2", "model.seq_len=64", "model.loss_chunk=64"], "loss_chunk"),
        (["parallel.context=rings"], "parallel.context"),
    ],
)
def test_bad_context_config_is_one_clear_error(overrides, match):
    with pytest.raises(config.ConfigError, match=match):
        harness.make(*overrides)


def _attend_split(ctx: context.Context, q, k, v, seg):
    """ctx.attend with the sequence split over ctx.size devices (its token order)."""
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh(
        (ctx.size,), ("sequence",), axis_types=(AxisType.Auto,), devices=jax.devices()[: ctx.size]
    )
    spec = P(None, "sequence")
    fn = jax.shard_map(
        lambda q, k, v, s: ctx.attend(q, k, v, s, "xla"),
        mesh=mesh,
        in_specs=(spec,) * 4,
        out_specs=spec,
        # Pallas's CPU interpreter fails JAX's varying-axes check inside its own loops
        # (jax 0.10: "Scan carry input and output got mismatched varying manual axes")
        check_vma=ctx.kernel != "pallas",
    )
    return fn(q, k, v, seg)


@pytest.mark.parametrize(
    "ctx",
    [
        context.Context(4, "ring", True),
        context.Context(2, "allgather", False),
        context.Context(2, "ring", True, kernel="pallas"),  # blocks: the kernel tests' own
    ],
    ids=["ring-zigzag-cp4", "allgather-contiguous-cp2", "ring-pallas-kernel-cp2"],
)
def test_context_attention_equals_plain_attention(ctx):
    """Output and gradients of q, k, v against the plain attention of the whole sequence,
    GQA, two documents per row crossing device boundaries, padding at the end."""
    from ultrajax.model.attention.xla import xla_attention

    if ctx.kernel == "pallas":
        from test_kernels import BLOCKS

        tiles = (BLOCKS.q, BLOCKS.k, BLOCKS.q_bwd, BLOCKS.k_bwd)  # as model.attention_blocks
        ctx = context.Context(ctx.size, ctx.mode, ctx.zigzag, kernel="pallas", blocks=tiles)
    t = 64
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.standard_normal((2, t, n, 16)), jnp.float32) for n in (4, 2, 2))
    cut = rng.integers(5, t - 5, (2, 1))
    seg = np.where(np.arange(t) < cut, 1, 2).astype(np.int32)
    seg[:, -3:] = 0
    w = jnp.asarray(rng.standard_normal((2, t, 4, 16)), jnp.float32)
    order = context.order(t, ctx.size, ctx.zigzag)
    order = np.arange(t) if order is None else order
    perm = lambda x: x[:, order]  # noqa: E731

    def ref_loss(q, k, v):
        return jnp.sum(perm(xla_attention(q, k, v, seg)) * perm(w))

    def ctx_loss(q, k, v):
        return jnp.sum(_attend_split(ctx, perm(q), perm(k), perm(v), perm(seg)) * perm(w))

    ref, ref_grads = jax.value_and_grad(ref_loss, argnums=(0, 1, 2))(q, k, v)
    got, got_grads = jax.jit(jax.value_and_grad(ctx_loss, argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    for a, b in zip(got_grads, ref_grads, strict=True):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)
