"""Pipeline parallelism (`mesh.pipeline`) on 8 simulated CPU devices: every schedule gives
the single-device run's losses, gradient norms and parameters (fp32, same global batch),
alone and beside data/ZeRO/TP+SP in both collective modes; 1F1B holds a fraction of
AFAB's activations; checkpoints move between pipeline and no pipeline; bad layouts are
one-line errors. The schedule tables themselves: tests/test_schedule.py.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import harness
import jax
import numpy as np
import pytest
import test_parallel as grid

from ultrajax.config import parse
from ultrajax.config.schema import ConfigError
from ultrajax.parallel import mesh as mesh_lib
from ultrajax.parallel.pipeline import plan as plan_lib
from ultrajax.parallel.pipeline import schedules as schedule
from ultrajax.tools import hlo
from ultrajax.train import batch as batch_lib
from ultrajax.train import loop as train
from ultrajax.train import step as step_lib

# rows a micro-batch, over the data-parallel ranks: half grid.ROWS, as a step of p=4 with
# 8 micro-batches of 8 layers is compute, not compiles (1 s of XLA:CPU a step)
ROWS = 4


def batches(m: int, n: int = 3) -> list[batch_lib.Batch]:
    """`grid.batches` with m micro-batches of ROWS rows: two documents a row, some padding."""
    rng = np.random.default_rng(1234)
    out = []
    for _ in range(n):
        tokens = rng.integers(0, grid.VOCAB, (m, ROWS, grid.SEQ + 1)).astype(np.int32)
        cut = rng.integers(4, grid.SEQ - 4, (m, ROWS, 1))
        idx = np.arange(grid.SEQ + 1)
        seg = np.where(idx < cut, 1, 2).astype(np.int32)
        seg[..., -3:] = 0
        pos = np.where(idx < cut, idx, idx - cut).astype(np.int32)
        packed = {"tokens": tokens, "segment_ids": seg, "positions": pos}
        out.append(batch_lib.make(packed, cross_doc_mask=True))
    return out


@functools.cache
def run(layout: tuple, m: int, *model: str):
    """3 steps: (losses, grad norms, params, compiled HLO, eval (total, count, HLO))."""
    sizes = {k: v for k, v in layout if k in ("mesh.data", "mesh.fsdp")}
    rows = ROWS // (sizes.get("mesh.data", 1) * sizes.get("mesh.fsdp", 1))
    cfg = grid.make_cfg(
        dict(layout), f"train.grad_accum={m}", f"train.micro_batch_size={rows}", *model
    )
    mesh, rules, tx, sched, shardings, batch_sh = harness.setup(cfg)
    with jax.set_mesh(mesh):
        state = harness.init_state(cfg, tx, shardings)
        fn = step_lib.jit_train_step(cfg, mesh, rules, tx, sched, shardings, batch_sh)
        data = [batch_lib.place(b, batch_sh) for b in batches(m)]
        compiled = fn.lower(state, data[0]).compile(harness.FAST)
        losses, norms = [], []
        for b in data:
            state, out = compiled(state, b)
            losses.append(float(out["loss"]))
            norms.append(float(out["grad_norm"]))
        evaluate = jax.jit(step_lib.make_eval_step(cfg, mesh, rules))
        evaluate = evaluate.lower(state["params"], data[0]).compile(harness.FAST)
        total, count = evaluate(state["params"], data[0])
    params = jax.device_get(state["params"])
    evaluation = (float(total), int(count), evaluate.as_text())
    return losses, norms, params, compiled.as_text(), evaluation


def pp(p, kind, *extra, v=1, collectives="explicit"):
    layout = {"mesh.pipeline": p, "parallel.pipeline_schedule": kind}
    layout.update({"parallel.virtual_stages": v, "parallel.collectives": collectives})
    layout.update(dict(extra))
    return tuple(layout.items())


# (layout, m, model overrides): p=2 and p=4, m=4 and 8, every schedule, tied and untied,
# the CPU's attentions (interleaved at p=2 and 1F1B beside other axes: in COMPOSED)
SCHEDULES = {
    "p2-m4-afab-tiled-attention": (pp(2, "afab"), 4, ("model.attention=tiled",)),
    "p2-m4-1f1b": (pp(2, "1f1b"), 4, ()),
    "p4-m8-interleaved-v2-tied": (
        pp(4, "interleaved", v=2),
        8,
        ("model.n_layers=8", "model.tie_embeddings=true"),
    ),
    "p4-m8-zb-h1-tied": (pp(4, "zb-h1"), 8, ("model.n_layers=4", "model.tie_embeddings=true")),
    "p2-m8-1f1b-remat-full": (pp(2, "1f1b"), 8, ("model.remat=full",)),
    "p2-m4-zb-h1-blocked-attention": (pp(2, "zb-h1"), 4, ("model.attention=blocked",)),
}
TP_SP = (("mesh.data", 2), ("mesh.tensor", 2), ("parallel.zero", 1))
TP_SP += (("parallel.sequence_parallel", True),)
COMPOSED = {  # p=2 x data/fsdp=2 x tensor=2 (ZeRO-1, SP), both modes; ZeRO-2 over fsdp
    "p2-dp2-tp2-zero1-sp": (pp(2, "1f1b", *TP_SP), 4, ()),
    "p2-dp2-tp2-zero1-sp-gspmd": (pp(2, "zb-h1", *TP_SP, collectives="gspmd"), 4, ()),
    "p2-fsdp2-tp2-zero1-sp-interleaved-gspmd": (
        pp(
            2,
            "interleaved",
            ("mesh.fsdp", 2),
            ("mesh.tensor", 2),
            ("parallel.zero", 1),
            ("parallel.sequence_parallel", True),
            v=2,
            collectives="gspmd",
        ),  # fmt: skip
        4,
        ("model.n_layers=4", "model.remat=selective"),
    ),
    "p2-data2-fsdp2-zero2": (
        pp(2, "1f1b", ("mesh.data", 2), ("mesh.fsdp", 2), ("parallel.zero", 2)),
        4,
        (),
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", list(SCHEDULES) + list(COMPOSED))
def test_pipeline_matches_single_device(name):
    layout, m, model = {**SCHEDULES, **COMPOSED}[name]
    got, ref = run(layout, m, *model), run((), m, *model)
    grid.assert_same_training(got, ref)
    assert min(ref[1]) > 0.1  # gradients that move the weights (random data: the loss may not)
    total, count, _ = got[4]  # evaluation runs the stages forwards: the same sum
    assert count == ref[4][1] > 0
    np.testing.assert_allclose(total, ref[4][0], rtol=2e-6)


def test_evaluation_runs_the_stages_forwards_without_gathering_them():
    """The eval step sends activations down the stages (collective-permutes) and never
    all-gathers the layers: no device holds another stage's weights. The one all-gather
    is the (tied) embedding's, stored split over `pipeline`: the whole table, once."""
    layout, m, model = SCHEDULES["p4-m8-interleaved-v2-tied"]
    found, _ = hlo.collectives(run(layout, m, *model)[4][2])
    assert "collective-permute" in {c.kind for c in found}
    gathers = [(c.bytes, c.count) for c in found if c.kind == "all-gather"]
    assert gathers == [(4 * grid.VOCAB * grid.D, 1)], gathers


def test_data_reductions_run_once_per_step_outside_the_schedule():
    """p=2 x data=2 x fsdp=2, ZeRO-2: the gradients are reduce-scattered once per step,
    after the last micro-batch (not per micro-batch inside the tick loop): over `fsdp`,
    4 bytes x this stage's parameters / 2; the embedding and head first over `pipeline`
    (into the state's split of them: each device's result is half of each table), then
    their half over `fsdp`. Nothing is summed whole over `pipeline` but the final norm."""
    layout, m, model = COMPOSED["p2-data2-fsdp2-zero2"]
    found, notes = hlo.collectives(run(layout, m, *model)[3])
    cfg = grid.make_cfg(dict(layout), f"train.grad_accum={m}")
    psi = grid.n_params(cfg)
    tables = grid.VOCAB * grid.D * 2
    stage = (psi - tables - grid.D) // 2 + grid.D  # half the layers, the final norm
    scattered = sum(c.bytes * c.count for c in found if c.kind == "reduce-scatter")
    by_fsdp = 4 * (stage + tables / 2) / 2  # results: the fsdp shards
    assert scattered == pytest.approx(by_fsdp + 4 * tables / 2, rel=0.02)
    assert all(c.count == 1 for c in found if c.kind == "reduce-scatter"), found


@functools.cache
def temp_bytes(kind: str, m: int = 16) -> int:
    """XLA's temporary bytes per device for p=4, seq 256, 4 rows a micro-batch."""
    cfg, devices = harness.make(
        "mesh.pipeline=4",
        f"train.grad_accum={m}",
        f"parallel.pipeline_schedule={kind}",
        "model.n_layers=4",
        "model.seq_len=256",
        "train.micro_batch_size=4",
    )
    mesh, rules, tx, sched, shardings, batch_sh = harness.setup(cfg, devices)
    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(lambda k: step_lib.init_state(cfg, tx, k), jax.random.key(0))
        abstract = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
        )
        fn = step_lib.jit_train_step(cfg, mesh, rules, tx, sched, shardings, batch_sh)
        b = batch_lib.abstract(m, cfg.train.micro_batch_size, cfg.model.seq_len, batch_sh)
        return fn.lower(abstract, b).compile(harness.FAST).memory_analysis().temp_size_in_bytes


def test_1f1b_holds_a_fraction_of_afab_activations():
    """p=4, m=16: AFAB keeps all 16 micro-batches' activations, 1F1B at most 4 (p/m =
    0.25 of them, plus buffers and fixed costs that do not scale with m)."""
    afab, one = temp_bytes("afab"), temp_bytes("1f1b")
    assert one < 0.45 * afab, (one, afab)
    plan = plan_lib.make_plan("1f1b", 4, 16)
    assert plan.slots["res"] == 4 and plan_lib.make_plan("afab", 4, 16).slots["res"] == 16


def test_plans_free_every_slot_and_match_the_table():
    for kind, v in (("afab", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)):
        plan = plan_lib.make_plan(kind, 4, 8, v)
        assert plan.slots["res"] == schedule.in_flight(plan.table)
        busy = plan.rows[..., 0] != plan_lib.IDLE
        assert busy.sum() == (plan.table[..., 0] != schedule.IDLE).sum()


def test_layer_order_puts_each_devices_chunks_together():
    order = plan_lib.layer_order(8, 2, 2)  # 4 chunks of 2 layers; device 0: chunks 0, 2
    assert order.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert plan_lib.layer_order(4, 2, 1).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["mesh.pipeline=2", "model.n_layers=3"], "divisible by mesh.pipeline"),
        (["mesh.pipeline=4", "model.n_layers=4", "train.grad_accum=2"], "must be >= mesh.pipeline"),
        (["mesh.pipeline=2", "mesh.sequence=2", "train.grad_accum=2"], "context parallelism"),
        (["mesh.pipeline=2", "mesh.fsdp=2", "parallel.zero=3", "train.grad_accum=2"], "ZeRO-3"),
        (["parallel.virtual_stages=2"], "needs parallel.pipeline_schedule=interleaved"),
        # one chunk a device is 1F1B: it ran as such without a word
        (["mesh.pipeline=2", "parallel.pipeline_schedule=interleaved"], "is 1F1B"),
        (
            [
                "mesh.pipeline=2",
                "model.n_layers=4",
                "train.grad_accum=3",
                "parallel.pipeline_schedule=interleaved",
                "parallel.virtual_stages=2",
            ],  # fmt: skip
            "pipeline_schedule=interleaved",
        ),
    ],
)
def test_bad_pipeline_layouts_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        harness.make(*overrides)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ checkpoints

SMALL = [
    "model.d_model=32",
    "model.n_layers=4",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "model.d_ff=64",
    "model.seq_len=32",
    "train.grad_accum=2",
    "train.log_every=1",
    "train.eval_batches=0",
    "optim.warmup_steps=2",
    "checkpoint.every=3",
]
PIPELINED = [  # interleaved: the devices hold the layers out of the model's order
    "mesh.pipeline=2",
    "mesh.data=2",
    "mesh.tensor=2",
    "parallel.pipeline_schedule=interleaved",
    "parallel.virtual_stages=2",
    "train.micro_batch_size=2",
]
NO_PIPELINE = ["mesh.data=2", "mesh.tensor=4", "train.micro_batch_size=2"]  # the same batch


def _train(run_dir: Path, steps: int, *extra: str) -> dict[int, float]:
    cfg = parse.load(harness.TINY, [*SMALL, f"train.steps={steps}", f"train.run_dir={run_dir}",
                                     *extra])  # fmt: skip
    assert train.train(cfg) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return {r["step"]: r["loss"] for r in records}


@pytest.mark.slow
def test_checkpoints_move_between_pipeline_and_no_pipeline(tmp_path):
    """Interleaved PP writes step 3 -> a layout without PP resumes it, and writes step 6
    -> PP resumes that: the same next losses both ways (the stored layer order is the
    model's, whatever the schedule; the embedding and head, split over `pipeline` in one
    and whole in the other, restore into either sharding)."""
    a = _train(tmp_path / "a", 8, *PIPELINED)  # every run: the same 8-step schedule
    assert mesh_lib.vocab_over_pipeline(parse.load(harness.TINY, [*SMALL, *PIPELINED]))
    b = _train(tmp_path / "b", 8, *NO_PIPELINE,
               f"checkpoint.resume={tmp_path / 'a' / 'checkpoints' / '3'}")  # fmt: skip
    assert sorted(b) == list(range(4, 9))
    np.testing.assert_allclose([b[s] for s in b], [a[s] for s in b], rtol=2e-5)
    c = _train(tmp_path / "c", 8, *PIPELINED,
               f"checkpoint.resume={tmp_path / 'b' / 'checkpoints' / '6'}")  # fmt: skip
    assert sorted(c) == [7, 8]
    np.testing.assert_allclose([c[s] for s in c], [a[s] for s in c], rtol=2e-5)
