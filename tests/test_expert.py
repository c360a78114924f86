"""An MoE model's training on 8 simulated devices against one device: data parallelism,
ZeRO-1/3 and expert parallelism (parallel/expert.py), in both collectives modes, dropless
and in capacity mode (fp32, 3 steps: losses, gradient norms and weights)."""

from __future__ import annotations

import harness
import jax
import numpy as np
import pytest
import test_parallel as tp

from ultrajax.cost import comms
from ultrajax.tools import hlo
from ultrajax.train import batch as batch_lib
from ultrajax.train import step as step_lib

# 8 experts (mesh.expert up to 8), top-2, the z-loss and the default auxiliary loss; the
# grouped matmuls a GPU runs by default (jax's ragged_dot; blocks: their own test below)
MOE = (
    "model.moe_experts=8", "model.moe_top_k=2", "model.moe_d_ff=32", "model.moe_z_coef=0.001",
    "model.moe_grouped=ragged",
)  # fmt: skip


@pytest.mark.parametrize(
    "name,mode",
    [
        ("hsdp-data2-fsdp4-zero3", "gspmd"),  # the partitioner's MoE layer, no expert axis
        ("expert8", "explicit"),
        ("data2-expert4", "explicit"),
        ("data2-expert4", "gspmd"),
        ("expert2-fsdp4-zero1", "gspmd"),
        ("expert4-tp2-sp", "gspmd"),
        ("expert2-fsdp2-tp2-zero3-sp", "explicit"),
        ("cp2-expert2-data2", "gspmd"),  # context parallelism: ring attention beside it
        ("cp2-fsdp2-tp2-zero3-sp", "explicit"),
    ],
)
def test_moe_layouts_match_single_device(name, mode):
    """Dropless: the balance losses are over each micro-batch's tokens on every rank, each
    token's assignments reach the experts wherever they live (all-to-all over `expert`)
    and come back to it, ZeRO-3 gathers the experts' shards layer by layer (prefetched),
    and tensor parallelism's ranks, which hold the same tokens, count each balance loss
    once (counted on each rank, the explicit tensor layout fails)."""
    tp.assert_same_training(tp.run(name, mode, *MOE), tp.run(None, "explicit", *MOE))


# a dense layer before each MoE layer, 2 units, selective recomputation (model/units.py)
EVERY = ("model.n_layers=4", "model.moe_every=2", "model.remat=selective")


def test_blocked_grouped_matmuls_train_as_one_device():
    """model.moe_grouped=blocked (a CPU's default, model/grouped.py) under expert, tensor
    (+ SP) and ZeRO-3 parallelism: its weight gradients leave their backward rule typed
    and reduced like ragged_dot's, and the training is one device's with the same
    matmuls as ragged_dot's (the reference the other layouts share: the two differ in
    fp32 summation order only). (Also run by hand: data=2 x expert=4 explicit,
    expert=4 x tensor=2 + SP under gspmd.) The model of the test below: it shares its
    reference."""
    blocked = (*MOE[:-1], "model.moe_grouped=blocked")
    got = tp.run("expert2-fsdp2-tp2-zero3-sp", "explicit", *blocked, *EVERY)
    tp.assert_same_training(got, tp.run(None, "explicit", *MOE, *EVERY))


def test_dense_layers_between_moe_layers_train_as_one_device():
    """model.moe_every=2 (a dense layer, then an MoE layer; model/units.py): the scan walks
    units of both, ZeRO-3 gathers (and prefetches) each layer's own weights, tensor
    parallelism splits the dense MLP and the experts alike, and each MoE layer's
    statistics are its own (4 layers: 2 units, so the prefetch has one to fetch ahead;
    selective recomputation: each layer of a unit under its own checkpoint)."""
    got = tp.run("expert2-fsdp2-tp2-zero3-sp", "explicit", *MOE, *EVERY)
    tp.assert_same_training(got, tp.run(None, "explicit", *MOE, *EVERY))
    assert got[2]["layers"]["w_gate"].shape[0] == got[2]["layers"]["router"].shape[0] == 2


@pytest.mark.parametrize(
    "name,mode", [("data2-expert4", "explicit"), ("expert2-fsdp2-tp2-zero3-sp", "explicit")]
)
def test_the_compiled_step_moves_the_formulas_bytes(name, mode):
    """cost/comms.py against the compiled step (the layout test's): the all-to-alls
    exactly (four per layer and micro-batch, slots of T·k rows, and the forward's local
    expert ids), the gradient reductions within 1.5% with the experts' summed over the
    data axes but `expert` (ZeRO: every weight reduce-scattered over fsdp)."""
    r = tp.run(name, mode, *MOE)
    found, notes = hlo.collectives(r[3])
    assert not notes, notes
    want = comms.expected_by_kind(comms.expected(r[5]))

    def traffic(kind, least=0):
        return sum(c.traffic * c.count for c in found if c.kind == kind and c.bytes >= least)

    assert traffic("all-to-all") == pytest.approx(want["all-to-all"], rel=1e-9)
    assert want["all-to-all"] > 0
    if "zero3" in name:  # tensor parallelism's router gradients add a few all-reduces
        assert traffic("reduce-scatter") == pytest.approx(want["reduce-scatter"], rel=0.015)
    else:
        assert traffic("all-reduce", tp.SMALL) == pytest.approx(want["all-reduce"], rel=0.015)


def test_recomputation_runs_the_exchange_again_and_trains_alike():
    """model.remat=full: the backward recomputes each MoE layer's forward, all-to-alls
    included (six per layer and micro-batch, as the formula counts), and the training is
    one device's."""
    full = (*MOE, "model.remat=full")
    got = tp.run("data2-expert4", "explicit", *full)
    tp.assert_same_training(got, tp.run(None, "explicit", *full))
    found, _ = hlo.collectives(got[3])
    moved = sum(c.traffic * c.count for c in found if c.kind == "all-to-all")
    assert moved == pytest.approx(comms.expected_by_kind(comms.expected(got[5]))["all-to-all"])
    assert "forward again" in " ".join(t.what for t in comms.expected(got[5]))


def test_capacity_mode_drops_what_one_device_drops():
    """Capacity 1: each expert keeps the micro-batch's first assignments in token order,
    counted across the ranks that split the tokens, so every layout drops the same ones
    (one device drops some: the comparison is not of dropless runs)."""
    capacity = (*MOE, "model.moe_capacity=1")
    got, ref = tp.run("data2-expert4", "explicit", *capacity), tp.run(None, "explicit", *capacity)
    assert all(d > 0 for d in ref[7]), ref[7]
    assert got[7] == ref[7]
    tp.assert_same_training(got, ref)


@pytest.mark.parametrize(
    "name,mode", [("data2-expert4", "explicit"), ("expert2-fsdp2-tp2-zero3-sp", "gspmd")]
)
def test_evaluation_matches_one_device(name, mode):
    """The eval step routes, drops (capacity 1) and dispatches as the train step does: its
    summed loss and target count are one device's."""
    capacity = (*MOE, "model.moe_capacity=1")
    got, want = _evaluate(name, mode, *capacity), _evaluate(None, "explicit", *capacity)
    assert got[1] == want[1]
    np.testing.assert_allclose(got[0], want[0], rtol=2e-6)


def _evaluate(name, mode, *extra):
    """(summed NLL, target count) of one batch at initialisation."""
    layout = dict(
        {**tp.LAYOUTS, **tp.EXPERT}[name] if name else {}, **{"parallel.collectives": mode}
    )
    cfg = tp.make_cfg(layout, *extra)
    mesh, rules, tx, _, shardings, batch_sh = harness.setup(cfg)
    with jax.set_mesh(mesh):
        state = harness.init_state(cfg, tx, shardings)
        fn = jax.jit(step_lib.make_eval_step(cfg, mesh, rules))
        total, count = fn(state["params"], batch_lib.place(tp.batches(1, cfg)[0], batch_sh))
    return float(total), float(count)
