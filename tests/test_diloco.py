"""DiLoCo over `data` (parallel/diloco.py) on 8 simulated devices: data=2 replicas, each
fsdp=4 with ZeRO-3 inside. H = 1 with plain SGD, outer lr 1 and no momentum is data
parallelism; H = 2 with AdamW and the outer Nesterov step equals the replicas run one
after the other on one device; the compiled step reduces over `data` only inside the
synchronisation's conditional (fp32, 3 steps)."""

from __future__ import annotations

import functools
import json

import harness
import jax
import ml_dtypes
import numpy as np
import pytest
import test_parallel as tp

from ultrajax.config.schema import ConfigError
from ultrajax.cost import comms
from ultrajax.parallel import grads
from ultrajax.tools import hlo
from ultrajax.train import batch as batch_lib
from ultrajax.train import checkpoint, resume
from ultrajax.train import step as step_lib

LAYOUT = "hsdp-data2-fsdp4-zero3"  # 2 replicas, each ZeRO-3 over fsdp=4
R = 2
# linear in the gradient: clipping (per replica) and Adam are not
SGD = ("optim.name=sgd", "optim.weight_decay=0", "optim.lr=0.1", "optim.clip_norm=0")


@functools.cache
def _run(layout: str | None, *extra: str, rows: tuple[int, int] | None = None):
    """3 steps: (losses, grad norms, every step's state, compiled HLO); a DiLoCo step's
    loss and norm are the replicas' mean. `rows`: train on these rows of every batch."""
    overrides = [*extra] + ([f"train.micro_batch_size={rows[1] - rows[0]}"] if rows else [])
    cfg = tp.make_cfg(tp.LAYOUTS[layout] if layout else {}, *overrides)
    mesh, rules, tx, schedule, shardings, batch_sh = harness.setup(cfg)
    data = tp.batches(cfg=tp.make_cfg(tp.LAYOUTS[LAYOUT]))
    if rows is not None:
        data = [batch_lib.Batch(*(a[:, rows[0] : rows[1]] for a in b)) for b in data]
    with jax.set_mesh(mesh):
        state = harness.init_state(cfg, tx, shardings)
        fn = step_lib.jit_train_step(cfg, mesh, rules, tx, schedule, shardings, batch_sh)
        data = [batch_lib.place(b, batch_sh) for b in data]
        compiled = fn.lower(state, data[0]).compile(harness.FAST)
        losses, norms, states = [], [], []
        for b in data:
            state, m = compiled(state, b)
            losses.append(float(np.mean(m["loss"])))
            norms.append(float(np.mean(m["grad_norm"])))
            states.append(jax.device_get(state))
    return losses, norms, states, compiled.as_text()


def test_one_inner_sgd_step_and_a_plain_outer_step_are_data_parallelism():
    """H = 1, inner SGD, outer lr 1, no momentum: the outer parameters are the replicas'
    mean after one step each, which is data parallelism's step (equal target counts per
    replica). Summed instead of averaged over `data`, or reduced inside a replica's
    backward too, the parameters differ."""
    once = ("parallel.diloco_steps=1", "parallel.diloco_outer_lr=1",
            "parallel.diloco_outer_momentum=0")  # fmt: skip
    got = _run(LAYOUT, *SGD, *once)
    ref = tp.run(LAYOUT, "explicit", *SGD)
    np.testing.assert_allclose(got[0], ref[0], rtol=2e-6)
    tp.assert_same_training((got[0], ref[1], got[2][-1]["params"]), ref)


def _outer(theta, momentum, replicas, lr=0.7, mu=0.9):
    delta = jax.tree.map(lambda t, *r: t - np.mean(r, 0), theta, *replicas)
    momentum = jax.tree.map(lambda m, d: mu * m + d, momentum, delta)
    theta = jax.tree.map(lambda t, d, m: t - lr * (d + mu * m), theta, delta, momentum)
    return theta, momentum


def test_two_inner_adamw_steps_equal_the_replicas_run_one_after_the_other():
    """H = 2, AdamW, outer Nesterov (lr 0.7, momentum 0.9): after 3 steps (a sync after
    the 2nd) the outer parameters, the momentum and each replica's parameters equal a
    reference that trains each replica's rows on one device for 2 steps, takes the outer
    step in numpy, and trains step 3 from the new outer parameters with each replica's
    own Adam state."""
    got = _run(LAYOUT, "parallel.diloco_steps=2")
    final = got[2][-1]
    half = tp.ROWS // R
    refs = [_run(None, rows=(r * half, (r + 1) * half)) for r in range(R)]
    theta0 = got[2][0]["params"]  # step 1 did not sync: still the initial parameters
    zero = jax.tree.map(np.zeros_like, theta0)
    theta, momentum = _outer(theta0, zero, [ref[2][1]["params"] for ref in refs])
    np.testing.assert_allclose(got[0][:2], np.mean([r[0][:2] for r in refs], 0), rtol=2e-6)
    np.testing.assert_allclose(got[1][:2], np.mean([r[1][:2] for r in refs], 0), rtol=2e-5)
    tp.assert_same_training((got[0], got[1], final["params"]), (got[0], got[1], theta))
    tp.assert_same_training(
        (got[0], got[1], final["opt_state"]["momentum"]), (got[0], got[1], momentum)
    )
    # step 3: each replica from the outer parameters, with its own Adam state
    cfg = tp.make_cfg({}, f"train.micro_batch_size={half}")
    mesh, rules, tx, schedule, shardings, batch_sh = harness.setup(cfg)
    data = tp.batches(cfg=tp.make_cfg(tp.LAYOUTS[LAYOUT]))[2]
    with jax.set_mesh(mesh):
        fn = step_lib.jit_train_step(cfg, mesh, rules, tx, schedule, shardings, batch_sh)
        for r, ref in enumerate(refs):
            start = dict(ref[2][1], params=theta)
            start = jax.device_put(start, shardings)
            rows = batch_lib.Batch(*(a[:, r * half : (r + 1) * half] for a in data))
            after, _ = fn(start, batch_lib.place(rows, batch_sh))
            mine = jax.tree.map(lambda a, r=r: a[r], final["opt_state"]["replicas"])
            tp.assert_same_training(
                (got[0], got[1], mine), (got[0], got[1], jax.device_get(after["params"]))
            )


def test_the_runs_last_step_synchronises_whatever_h():
    """A 3-step run at H = 4: its last step syncs (averaging), so the model it ends with
    holds all three steps, and every replica is that model again. It ended with the
    initial parameters before (steps % H inner steps never reached the outer model)."""
    avg = ("parallel.diloco_outer_lr=1", "parallel.diloco_outer_momentum=0")
    got = _run(LAYOUT, "parallel.diloco_steps=4", "train.steps=3", *avg)
    first, last = got[2][1]["params"], got[2][-1]

    def gap(a, b):
        pairs = zip(*map(jax.tree.leaves, (a, b)), strict=True)
        return max(float(np.max(np.abs(x - y))) for x, y in pairs)

    assert gap(first, got[2][0]["params"]) == 0  # step 2: no sync yet
    assert gap(last["params"], first) > 1e-4  # step 3, the run's last: synced
    for r in range(R):
        mine = jax.tree.map(lambda a, r=r: a[r], last["opt_state"]["replicas"])
        assert gap(mine, last["params"]) == 0


def test_the_step_reduces_over_data_only_when_it_synchronises():
    """H = 4: the one collective over `data` (the 2-device groups here; fsdp's are 4
    wide) is the pseudo-gradients' fp32 all-reduce, of the parameters' size on this
    device, inside the conditional's branch that runs every 4th step; no metric is
    reduced over `data` (across sites, even a scalar's all-reduce costs a round trip
    every step)."""
    _, _, states, text = _run(LAYOUT, "parallel.diloco_steps=4")
    found, notes = hlo.collectives(text)
    assert not notes, notes
    over_data = [c for c in found if c.group == R]
    assert [c.kind for c in over_data] == ["all-reduce"], over_data
    mod = hlo.parse_module(text)
    branches = [  # DiLoCo's (the last micro-batch's runs every step: parallel/grads.py)
        rest for comp in mod.computations.values() for _, _, rest in comp
        if rest.startswith("conditional") and grads.LAST_MICRO_BATCH not in rest
    ]  # fmt: skip
    assert len(branches) == 1 and over_data[0].computation in branches[0]
    # the pseudo-gradients of this device's ZeRO-3 shards (fsdp=4 splits every weight)
    elements = sum(np.prod(a.shape) for a in jax.tree.leaves(states[-1]["params"])) / 4
    assert over_data[0].bytes == pytest.approx(4 * elements, rel=0.02)
    assert over_data[0].dtype == "f32"
    # the communication model: the DiLoCo term, 1/H of the all-reduce a step, is what the
    # conditional's all-reduce moves counted 1/H; no gradient reduction over `data`
    cfg = tp.make_cfg(tp.LAYOUTS[LAYOUT], "parallel.diloco_steps=4")
    terms = [t for t in comms.expected(cfg) if t.axis == "data"]
    assert [t.formula for t in terms] == ["2Ψ(N-1)/N / H"], terms
    weighted, _ = hlo.collectives(text, branch=1 / 4)
    (sync,) = [c for c in weighted if c.group == R]
    assert sync.traffic * sync.count == pytest.approx(terms[0].traffic, rel=1e-6)


def _sync_inputs(cfg, seed):
    """(mesh, rules, fresh random (outer, momentum, replicas) shaped as the layout's
    state, their shardings): the replicas 1% apart from the outer parameters."""
    mesh, rules, _, _, shardings, _ = harness.setup(cfg)
    rng = np.random.default_rng(seed)
    state = jax.device_get(_run(LAYOUT, "parallel.diloco_steps=2")[2][0])

    def fresh(a):
        return rng.standard_normal(a.shape).astype(np.float32)

    theta = jax.tree.map(fresh, state["params"])
    mom = jax.tree.map(fresh, theta)
    reps = jax.tree.map(lambda a: a + 0.01 * rng.standard_normal((R, *a.shape), np.float32), theta)
    where = (shardings["params"], shardings["params"], shardings["opt_state"]["replicas"])
    return mesh, rules, (theta, mom, reps), where


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_the_outer_step_is_nesterov_on_the_mean_pseudo_gradient(dtype):
    """diloco.synchronise on fresh random values: delta = the replicas' mean of (outer -
    replica), summed in parallel.diloco_dtype (bf16: each pseudo-gradient and their sum
    rounded to it; fp8: each scaled by its own amax to e4m3 and back, then averaged),
    m <- 0.9 m + delta, outer <- outer - 0.7 (delta + 0.9 m), every replica the new outer
    parameters. (XLA:CPU promotes a bf16 all-reduce to fp32 after the rounding, so its
    bytes are a GPU's to show; the numbers are bf16's.)"""
    from ultrajax.parallel import diloco
    from ultrajax.parallel.layout import Layout

    cfg = tp.make_cfg(tp.LAYOUTS[LAYOUT], "parallel.diloco_steps=2",
                      f"parallel.diloco_dtype={dtype}")  # fmt: skip
    mesh, rules, (theta, mom, reps), where = _sync_inputs(cfg, 7)
    with jax.set_mesh(mesh):
        sync = jax.jit(diloco.synchronise(cfg, Layout(cfg, mesh, rules)))
        got = jax.device_get(sync(*jax.device_put((theta, mom, reps), where)))

    def bf(x):
        return np.asarray(x, ml_dtypes.bfloat16) if dtype == "bfloat16" else np.asarray(x)

    def e4m3(x):  # a replica's pseudo-gradient as it arrives: scaled by its amax, e4m3
        scale = np.float32(448.0) / np.abs(x).max()
        return (x * scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) / scale

    for t, m, r, g_t, g_m, g_r in zip(*map(jax.tree.leaves, (theta, mom, reps, *got)),
                                      strict=True):  # fmt: skip
        if dtype == "float8_e4m3fn":
            delta = (e4m3(t - r[0]) + e4m3(t - r[1])) / 2
        else:
            delta = np.asarray(bf(bf(t - r[0]) + bf(t - r[1])) / 2, np.float32)
        want_m = 0.9 * m + delta
        want_t = t - 0.7 * (delta + 0.9 * want_m)
        np.testing.assert_allclose(g_m, want_m, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(g_t, want_t, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(g_r, np.stack([g_t] * R))


class _Position:
    """The data position restore_train hands back (the loader's own: tests/test_checkpoint)."""

    def restore(self, state):
        self.state = state


def test_the_replicas_and_the_outer_state_are_saved_and_restored_exactly(tmp_path):
    """A checkpoint holds the outer parameters (its `params`: what evaluation and the
    Hugging Face export read), and in its optimizer item each replica's parameters and
    Adam state and the outer momentum: restored bit for bit. checkpoint.init_from starts
    every replica at the loaded parameters."""
    cfg = tp.make_cfg(tp.LAYOUTS[LAYOUT], "parallel.diloco_steps=2", f"checkpoint.dir={tmp_path}")
    state = _run(LAYOUT, "parallel.diloco_steps=2")[2][-1]
    mesh, rules, tx, _, shardings, _ = harness.setup(cfg)
    ck = checkpoint.Checkpoints(cfg)
    ck.save(3, jax.device_put(state, shardings), {"position": 3})
    ck.close()
    abstract = jax.eval_shape(lambda k: step_lib.init_state(cfg, tx, k), jax.random.key(0))
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    back, step = resume.restore_train(tmp_path / "3", cfg, target, _Position())
    assert step == 3
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    source = checkpoint.write_params(tmp_path / "params", state["params"], cfg)
    cfg.checkpoint.init_from, cfg.checkpoint.dir = str(source), str(tmp_path / "new")
    fresh = jax.tree.map(lambda a: jax.numpy.zeros(a.shape, a.dtype, device=a.sharding), target)
    ck, started, _ = resume.start(cfg, fresh, _Position(), say=lambda *a: None)
    ck.close()
    replicas = jax.tree.leaves(started["opt_state"]["replicas"])
    for a, b in zip(replicas, jax.tree.leaves(state["params"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.stack([b] * R))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (("mesh.fsdp=8",), "needs mesh.data > 1"),
        (("mesh.data=2", "parallel.collectives=gspmd"), "explicit step only"),
        (("mesh.data=2", "mesh.pipeline=2", "train.grad_accum=2"), "mesh.pipeline > 1"),
        (("mesh.data=2", "parallel.diloco_outer_momentum=1"), "in \\[0, 1\\)"),
        (("mesh.data=2", "train.noise_every=5"), "train.noise_every=0"),
        (("mesh.data=2", "parallel.diloco_fragments=3"), "must be >= 1 and divide"),
    ],
)
def test_settings_diloco_cannot_run_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        harness.make("parallel.diloco_steps=4", *overrides)
    assert "\n" not in str(e.value)


def test_the_memory_model_holds_the_replicas_state():
    """The step's arguments are the outer parameters, this rank's replica and its
    optimizer state (Adam's moments and counts) and the fp32 outer momentum:
    memory.estimate's equal the compiled step's to 0.1% (the plain step's: tests/
    test_memory.py; dropping the replica or the momentum misses by a third)."""
    from ultrajax.cost import memory
    from ultrajax.tools import analyze

    cfg = tp.make_cfg(tp.LAYOUTS[LAYOUT], "parallel.diloco_steps=4")
    step = analyze.compile_step(cfg, jax.devices(), harness.FAST)
    est = memory.estimate(cfg)
    assert est.arguments == pytest.approx(analyze.compiled_memory(step)["argument"], rel=1e-3)


def test_diloco_settings_are_part_of_the_run_identity():
    """A DiLoCo run trains another model than data parallelism (and holds a replica per
    data rank): its own run directory. Plain AdamW keeps the identity runs had before
    optim.name existed."""
    from ultrajax.config.parse import run_identity

    plain = run_identity(harness.make("mesh.data=2")[0])
    assert run_identity(harness.make("mesh.data=2", "optim.name=adamw")[0]) == plain
    assert run_identity(harness.make("mesh.data=2", "optim.name=sgd")[0]) != plain
    h4 = run_identity(harness.make("mesh.data=2", "parallel.diloco_steps=4")[0])
    h8 = run_identity(harness.make("mesh.data=2", "parallel.diloco_steps=8")[0])
    assert len({plain, h4, h8}) == 3


def test_streaming_fragments_take_turns():
    """parallel.diloco_fragments=F: fragment f synchronises at the steps where step /
    (H / F) = f mod F, each every H steps, one every H / F steps; F = 1 at every H-th."""
    from ultrajax.parallel import diloco

    def order(h, f):
        return [int(diloco.due(count, h, f)) for count in range(1, 9)]

    assert order(4, 1) == [0, 0, 0, 1, 0, 0, 0, 1]
    assert order(4, 2) == [0, 2, 0, 1, 0, 2, 0, 1]
    assert order(4, 4) == [2, 3, 4, 1, 2, 3, 4, 1]
    # the run's last step syncs everything, whatever H: a 6-step run at H = 4 kept steps
    # 5-6 out of its final model (at H > steps, the model it ended with was the initial one)
    assert [int(diloco.due(c, 4, 1, last=6)) for c in range(1, 7)] == [0, 0, 0, 1, 0, 1]
    assert [int(diloco.due(c, 4, 2, last=7)) for c in range(1, 8)] == [0, 2, 0, 1, 0, 2, 3]


def _synchronised(got, whole):
    """As the whole sync left them, within a few roundings: another program computes the
    same update (its fusions may round differently; 2 ulps seen)."""
    atol = 8 * np.finfo(np.float32).eps * float(np.max(np.abs(whole)))
    np.testing.assert_allclose(got, whole, rtol=0, atol=atol)


def _fragment_rows(got, before, whole, f, axis, layered):
    """Fragment f of 2: its half of a layer stack's rows as the whole sync left them, the
    other half exactly as before; the rest moved by fragment 0 alone."""
    if not layered:
        if f == 0:
            _synchronised(got, whole)
        else:
            np.testing.assert_array_equal(got, before)
        return
    n = got.shape[axis] // 2
    mine = np.arange(f * n, (f + 1) * n)
    rest = np.setdiff1d(np.arange(2 * n), mine)
    _synchronised(np.take(got, mine, axis), np.take(whole, mine, axis))
    np.testing.assert_array_equal(np.take(got, rest, axis), np.take(before, rest, axis))


def test_a_fragment_synchronises_its_own_layers_only():
    """Streaming DiLoCo (F = 2): fragment 1's sync moves the second half of every layer
    stack's rows (outer, momentum, replicas) as the whole sync would, and nothing else;
    fragment 0's moves the first half and the embedding, final norm and LM head. The
    compiled step holds one all-reduce over `data` per fragment, in the switch's
    branches, together the whole sync's bytes (the formula's per step, unchanged), and
    one of all of them at once in a branch of its own: the run's last step."""
    from ultrajax.parallel import diloco
    from ultrajax.parallel.layout import Layout

    cfg = tp.make_cfg(tp.LAYOUTS[LAYOUT], "parallel.diloco_steps=4", "parallel.diloco_fragments=2")
    mesh, rules, (theta, mom, reps), where = _sync_inputs(cfg, 3)
    layout = Layout(cfg, mesh, rules)
    with jax.set_mesh(mesh):
        args = jax.device_put((theta, mom, reps), where)
        whole = jax.device_get(jax.jit(diloco.synchronise(cfg, layout))(*args))
        parts = [jax.device_get(jax.jit(diloco.synchronise(cfg, layout, f))(*args)) for f in (0, 1)]
    for f, got in enumerate(parts):
        for i, was in enumerate((theta, mom, reps)):
            axis = 1 if i == 2 else 0  # the replicas' stack leads
            for k in theta:
                trees = (got[i][k], was[k], whole[i][k])
                for a, b, w in zip(*map(jax.tree.leaves, trees), strict=True):
                    _fragment_rows(a, b, w, f, axis, k == "layers")
    text = _run(LAYOUT, "parallel.diloco_steps=4", "parallel.diloco_fragments=2")[3]
    found, _ = hlo.collectives(text, branch=1 / 4)
    over_data = sorted((c for c in found if c.group == R), key=lambda c: c.traffic)
    assert [c.kind for c in over_data] == ["all-reduce"] * 3
    assert len({c.computation for c in over_data}) == 3
    (term,) = [t for t in comms.expected(cfg) if t.axis == "data"]
    *fragments, last = [c.traffic * c.count for c in over_data]
    assert sum(fragments) == pytest.approx(term.traffic, rel=1e-6)
    assert last == pytest.approx(term.traffic, rel=1e-6)  # the whole sync, once a run


def test_fp8_pseudo_gradients_travel_as_one_byte_and_a_scale():
    """parallel.diloco_dtype=float8_e4m3fn: the sync gathers each replica's e4m3
    pseudo-gradients (a byte a value) and their fp32 scales over `data` instead of an
    fp32 all-reduce: a quarter of fp32's bytes a value for 2 replicas, what the
    communication model's term says."""
    from ultrajax.tools import analyze

    fp8 = ("parallel.diloco_steps=4", "parallel.diloco_dtype=float8_e4m3fn")
    cfg = tp.make_cfg(tp.LAYOUTS[LAYOUT], *fp8)
    # as the partitioner left it: XLA:CPU then moves an f8 all-gather as f16 (analyze reads
    # this module too)
    text = analyze.compile_step_partitioned(cfg, jax.devices(), harness.FAST)[1]
    found, _ = hlo.collectives(text, branch=1 / 4)
    over_data = [c for c in found if c.group == R]
    assert {c.kind for c in over_data} == {"all-gather"}, over_data
    values = [c for c in over_data if "f8" in c.dtype]
    states = _run(LAYOUT, "parallel.diloco_steps=4")[2]
    elements = sum(np.prod(a.shape) for a in jax.tree.leaves(states[-1]["params"])) / 4
    assert sum(c.bytes for c in values) == pytest.approx(R * elements, rel=0.02)
    (term,) = [t for t in comms.expected(cfg) if t.axis == "data"]
    assert sum(c.traffic * c.count for c in over_data) == pytest.approx(term.traffic, rel=0.02)


def test_analyze_reports_the_sync_beside_its_formula(tmp_path, capsys):
    """python -m ultrajax.analyze on a DiLoCo config compiles its step (the other
    collectives mode is noted as not compiled: DiLoCo runs in the explicit step) and
    shows the pseudo-gradients' term over `data`, 1/H a step."""
    from ultrajax.config import parse
    from ultrajax.tools import analyze

    path = tmp_path / "diloco.yaml"
    path.write_text(parse.dump(tp.make_cfg(tp.LAYOUTS[LAYOUT], "parallel.diloco_steps=4")))
    assert analyze.main(["--config", str(path), "--cpu-devices", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    text = json.dumps(report)
    assert "pseudo-gradients over data (DiLoCo, once every 4 steps)" in text
    assert "gspmd not compiled: DiLoCo runs in the explicit step only" in text


def test_delayed_fp8_replicas_keep_their_own_histories():
    """model.fp8=delayed under DiLoCo (H = 2): each replica records the amaxes of its own
    rows, reduced over its fsdp ranks but never over `data` (the replicas' histories
    differ, and the one collective over `data` is still the synchronisation's); each
    replica's first two recorded steps are one device's on that replica's rows, within
    FP8's layout bounds (test_fp8_layouts.AMAX_RATIO)."""
    import test_fp8_layouts as fl

    got = _run(LAYOUT, "parallel.diloco_steps=2", "model.fp8=delayed")
    half = tp.ROWS // R
    refs = [_run(None, "model.fp8=delayed", rows=(r * half, (r + 1) * half)) for r in range(R)]
    history = got[2][1]["fp8"]  # after 2 steps: (replicas, layers, x w g, steps)
    for k, h in history.items():
        assert h.shape[0] == R and np.all(h[..., :2] > 0) and not np.any(h[..., 2:]), k
        for r in range(R):
            ratio = h[r, ..., :2] / refs[r][2][1]["fp8"][k][..., :2]
            for i, what in enumerate(fl.fp8.OPERANDS):
                bound = fl.AMAX_RATIO[what]
                assert np.all((1 / bound < ratio[:, i]) & (ratio[:, i] < bound)), (k, r, what)
    assert any(not np.allclose(h[0], h[1]) for h in history.values())
    found, _ = hlo.collectives(got[3])
    assert [c.kind for c in found if c.group == R] == ["all-reduce"]
