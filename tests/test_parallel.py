"""Parallel layouts on 8 simulated CPU devices, in both ways of placing collectives
(`parallel.collectives: explicit | gspmd`), proven two ways (GUIDE section 4):

1. equivalence: the same model, data and seed on one device and under the layout
   give the same losses, gradient norms and parameters over 3 steps (fp32);
2. the compiled step holds the collectives the technique promises, and not the
   ones it avoids, where the playbook puts them (inside the backward layer loop,
   once per optimizer step), and the state's per-device bytes follow ZeRO.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ultrajax.config import schema as config
from ultrajax.kernels import flash_attention as fa
from ultrajax.model.attention import backends
from ultrajax.model.attention import xla as xla_attention
from ultrajax.model.attention.blocked import block_grads
from ultrajax.parallel import context, grads, layout
from ultrajax.parallel.context import token_order
from ultrajax.tools import analyze, hlo
from ultrajax.train import batch as batch_lib
from ultrajax.train import step as step_lib

SEQ, ACCUM, ROWS = 48, 2, 8  # ROWS: samples per micro-batch, over all data-parallel ranks
D, LAYERS, VOCAB = 64, 2, 256
MODES = ("explicit", "gspmd")

LAYOUTS = {
    "data8": {"mesh.data": 8},
    "fsdp8-zero1": {"mesh.fsdp": 8, "parallel.zero": 1},
    "fsdp8-zero2": {"mesh.fsdp": 8, "parallel.zero": 2},
    "fsdp8-zero3": {"mesh.fsdp": 8, "parallel.zero": 3},
    "hsdp-data2-fsdp4-zero3": {"mesh.data": 2, "mesh.fsdp": 4, "parallel.zero": 3},
    "tp2": {"mesh.tensor": 2},
    "tp2-sp": {"mesh.tensor": 2, "parallel.sequence_parallel": True},
    "tp4": {"mesh.tensor": 4},
    "tp4-sp": {"mesh.tensor": 4, "parallel.sequence_parallel": True},
    "dp2-fsdp2-tp2-zero3-sp": {
        "mesh.data": 2,
        "mesh.fsdp": 2,
        "mesh.tensor": 2,
        "parallel.zero": 3,
        "parallel.sequence_parallel": True,
    },
}

# expert parallelism: an MoE model's layouts (tests/test_expert.py)
EXPERT = {
    "expert8": {"mesh.expert": 8},
    "data2-expert4": {"mesh.data": 2, "mesh.expert": 4},
    "expert2-fsdp4-zero1": {"mesh.expert": 2, "mesh.fsdp": 4, "parallel.zero": 1},
    "expert4-tp2-sp": {"mesh.expert": 4, "mesh.tensor": 2, "parallel.sequence_parallel": True},
    "cp2-expert2-data2": {"mesh.sequence": 2, "mesh.expert": 2, "mesh.data": 2},
    "expert2-fsdp2-tp2-zero3-sp": {
        "mesh.expert": 2,
        "mesh.fsdp": 2,
        "mesh.tensor": 2,
        "parallel.zero": 3,
        "parallel.sequence_parallel": True,
    },
}


# context parallelism (documents cross the device boundaries: `batches` cuts at random)
CONTEXT = {
    "cp4-ring-data2": {"mesh.sequence": 4, "mesh.data": 2},
    "cp4-ring-contiguous": {"mesh.sequence": 4, "parallel.context_zigzag": False},
    "cp2-allgather": {"mesh.sequence": 2, "parallel.context": "allgather"},
    "cp4-allgather-contiguous-fsdp2-zero1": {
        "mesh.sequence": 4,
        "mesh.fsdp": 2,
        "parallel.zero": 1,
        "parallel.context": "allgather",
        "parallel.context_zigzag": False,
    },
    "cp2-fsdp2-tp2-zero2": {  # ZeRO-2, and tensor parallelism without SP
        "mesh.sequence": 2,
        "mesh.fsdp": 2,
        "mesh.tensor": 2,
        "parallel.zero": 2,
    },
    "cp2-fsdp2-tp2-zero3-sp": {
        "mesh.sequence": 2,
        "mesh.fsdp": 2,
        "mesh.tensor": 2,
        "parallel.zero": 3,
        "parallel.sequence_parallel": True,
    },
}


def make_cfg(layout: dict, *extra: str) -> config.Config:
    sizes = {k.split(".")[1]: v for k, v in layout.items() if k.startswith("mesh.")}
    dp = sizes.get("data", 1) * sizes.get("fsdp", 1) * sizes.get("expert", 1)
    base = [
        f"model.d_model={D}",
        f"model.n_layers={LAYERS}",
        "model.n_heads=8",
        "model.n_kv_heads=4",  # GQA, and divisible by tensor=4
        "model.d_ff=128",
        f"model.seq_len={SEQ}",
        f"model.vocab_size={VOCAB}",
        "model.dtype=float32",
        "model.attention=xla",  # the plain attention: the HLO tests count its dots
        "data.cross_doc_mask=true",
        f"train.micro_batch_size={ROWS // dp}",
        f"train.grad_accum={ACCUM}",
        "train.steps=10",
        "optim.warmup_steps=1",
        # Adam divides by sqrt(v) + eps: a gradient element near eps turns fp32 summation
        # noise (layouts sum in different orders) into a visible update difference. eps
        # above that noise floor keeps the comparison about the layout, not about Adam.
        "optim.lr=1e-3",
        "optim.eps=1e-6",
    ]
    overrides = [f"{k}={str(v).lower()}" for k, v in layout.items()] + list(extra)
    return harness.make(*overrides, base=base, path=None)[0]


def batches(n: int = 3, cfg=None) -> list[batch_lib.Batch]:
    """Fresh random packed batches with two documents per row and some padding, laid out
    for `cfg` (its cross-document masking and context-parallel token order)."""
    cross = cfg is None or cfg.data.cross_doc_mask
    order = None if cfg is None else token_order(cfg)
    rng = np.random.default_rng(1234)
    out = []
    for _ in range(n):
        tokens = rng.integers(0, VOCAB, (ACCUM, ROWS, SEQ + 1)).astype(np.int32)
        cut = rng.integers(4, SEQ - 4, (ACCUM, ROWS, 1))
        idx = np.arange(SEQ + 1)
        seg = np.where(idx < cut, 1, 2).astype(np.int32)
        seg[..., -3:] = 0  # padding at the end of every row
        pos = np.where(idx < cut, idx, idx - cut).astype(np.int32)
        packed = {"tokens": tokens, "segment_ids": seg, "positions": pos}
        out.append(batch_lib.make(packed, cross_doc_mask=cross, order=order))
    return out


setup = harness.setup


def run(name: str | None, mode: str = "explicit", *extra: str):
    """`run_layout` of a named layout (None: one device) in a collectives mode."""
    layout = dict(
        {**LAYOUTS, **CONTEXT, **EXPERT}[name] if name else {}, **{"parallel.collectives": mode}
    )
    return run_layout(tuple(layout.items()), *extra)


@functools.cache
def run_layout(layout: tuple, *extra: str):
    """3 steps under a layout, its (key, value) overrides: (losses, grad norms, params,
    compiled HLO text, state bytes, config, lowered step, MoE assignments dropped per
    step, model.fp8=delayed's amax histories or None)."""
    cfg = make_cfg(dict(layout), *extra)
    mesh, rules, tx, schedule, shardings, batch_sh = setup(cfg)
    with jax.set_mesh(mesh):
        state = harness.init_state(cfg, tx, shardings)
        state_bytes = per_device_bytes(state)
        fn = step_lib.jit_train_step(cfg, mesh, rules, tx, schedule, shardings, batch_sh)
        data = [batch_lib.place(b, batch_sh) for b in batches(cfg=cfg)]
        lowered = fn.lower(state, data[0])
        compiled = lowered.compile(harness.FAST)
        losses, norms, dropped = [], [], []
        for b in data:
            state, m = compiled(state, b)
            losses.append(float(m["loss"]))
            norms.append(float(m["grad_norm"]))
            dropped.append(float(m["moe"]["dropped"].sum()) if "moe" in m else 0.0)
    params, history = jax.device_get((state["params"], state.get("fp8")))
    text = compiled.as_text()
    return losses, norms, params, text, state_bytes, cfg, lowered, dropped, history


def per_device_bytes(tree) -> int:
    """Bytes that device 0 holds of every array in the tree (read from the shardings)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shards = [s for s in leaf.addressable_shards if s.device == jax.devices()[0]]
        total += sum(s.data.nbytes for s in shards)
    return total


LR, STEPS = 1e-3, 3  # make_cfg's optim.lr, and the steps `run` takes
TIGHT = 1e-5  # 1% of one Adam step: fp32 summation order, for a well-conditioned element
ILL_CONDITIONED = 1e-4  # the share of a weight's elements Adam may move apart (at least 1)


def assert_same_training(got, ref):
    """Losses and gradient norms tightly; parameters tightly but for a few elements.

    Adam steps each element by lr · m / (sqrt(v) + eps): for an element whose gradient is
    near the fp32 noise of its own sum (the layouts, and the CPU's vector width, sum in
    different orders), that ratio amplifies the noise up to a whole step. Such elements are
    rare (one in ~10^5 here, which one depends on the CPU) and no step moves an element by
    more than lr, so: every element within STEPS x 2 lr, and at most ILL_CONDITIONED of
    each weight's elements (at least one) beyond TIGHT. A wrong reduction, scatter or
    gather changes the losses, the norms, or a whole weight, and fails."""
    loss, norm, params = got[:3]
    ref_loss, ref_norm, ref_params = ref[:3]
    assert all(np.isfinite(loss)) and all(np.isfinite(norm))
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-6)
    np.testing.assert_allclose(norm, ref_norm, rtol=2e-5)
    flat = jax.tree_util.tree_leaves_with_path(params)
    for (path, a), b in zip(flat, jax.tree.leaves(ref_params), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        diff = np.abs(a - b)
        name = jax.tree_util.keystr(path)
        assert np.isfinite(a).all() and (diff <= STEPS * 2 * LR).all(), name
        loose = int(np.sum(diff > TIGHT + TIGHT * np.abs(b)))
        assert loose <= max(1, int(ILL_CONDITIONED * a.size)), (name, loose, float(diff.max()))


def test_the_training_comparison_fails_on_a_wrong_weight():
    """One ill-conditioned element passes; a whole weight a tenth of a step off fails,
    and so does any element beyond what the steps can reach."""
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((64, 64)), "scale": np.ones(64)}
    ref = ([3.0, 2.0, 1.0], [1.0, 1.0, 1.0], params)
    one = dict(params, w=params["w"].copy())
    one["w"][5, 22] += 0.5 * LR
    assert_same_training(([3.0, 2.0, 1.0], [1.0, 1.0, 1.0], one), ref)
    for bad in (
        dict(params, scale=params["scale"] + 0.1 * LR),
        dict(params, w=params["w"] + 0.1 * LR),
    ):
        with pytest.raises(AssertionError):
            assert_same_training(([3.0, 2.0, 1.0], [1.0, 1.0, 1.0], bad), ref)
    far = dict(params, w=params["w"].copy())
    far["w"][0, 0] += 7 * LR
    with pytest.raises(AssertionError):
        assert_same_training(([3.0, 2.0, 1.0], [1.0, 1.0, 1.0], far), ref)


# tp4 without SP trains as tp2 does; its collectives are checked below
GRID = [name for name in LAYOUTS if name != "tp4"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", GRID)
def test_layout_matches_single_device(name, mode):
    ref = run(None)
    assert_same_training(run(name, mode), ref)
    assert ref[0][-1] < ref[0][0]  # the reference actually trains


@pytest.mark.parametrize("mode", ["explicit"])
def test_tiled_attention_trains_like_the_plain_one_under_a_layout(mode):
    """The CPU's default attention (tiles of queries in a loop over rows) under data, ZeRO-3,
    tensor and sequence parallelism: the single-device plain attention's training. Its
    row loop runs over this device's rows inside shard_map (under the partitioner, all rows
    in one iteration: tests/test_pipeline.py's gspmd cases run that way)."""
    got = run("dp2-fsdp2-tp2-zero3-sp", mode, "model.attention=tiled")
    assert_same_training(got, run(None))


@pytest.mark.parametrize("mode", MODES)
def test_a_python_layer_loop_trains_like_the_single_device_scan(mode):
    """model.scan_layers=false (the layers as a Python loop, model/stack.py) under data,
    ZeRO-3 without prefetch (whose loop stays a scan), tensor and sequence parallelism,
    selective recomputation: the single-device training of the scanned layers."""
    extra = ("model.scan_layers=false", "parallel.prefetch=false", "model.remat=selective")
    assert_same_training(run("dp2-fsdp2-tp2-zero3-sp", mode, *extra), run(None))


@pytest.mark.parametrize("name", GRID)
def test_modes_agree(name):
    assert_same_training(run(name, "gspmd"), run(name, "explicit"))


CAUSAL_ONLY = "data.cross_doc_mask=false"


@pytest.mark.parametrize(
    "name,mode,extra",
    [(name, "explicit", ()) for name in CONTEXT]
    + [
        ("cp4-ring-data2", "explicit", (CAUSAL_ONLY,)),
        ("cp4-ring-data2", "gspmd", ()),
        ("cp2-fsdp2-tp2-zero3-sp", "gspmd", ()),
    ],
)
def test_context_parallel_matches_single_device(name, mode, extra):
    """Context parallelism, packed documents crossing device boundaries (and causal
    only): the single-device run, in every mode, alone and beside data/ZeRO/TP+SP."""
    assert_same_training(run(name, mode, *extra), run(None, "explicit", *extra))


def n_params(cfg) -> int:
    from ultrajax.model.llama import param_count

    return param_count(cfg.model)


@pytest.mark.parametrize(
    "name,shards", [("data8", 1), ("fsdp8-zero1", 8), ("fsdp8-zero2", 8), ("fsdp8-zero3", 8)]
)
def test_state_bytes_follow_zero_formulas(name, shards):
    """fp32 master weights (4 bytes) + Adam mu and nu (8 bytes) = 12 Ψ, / N_d with ZeRO."""
    state_bytes, cfg = run(name)[4:6]
    psi = n_params(cfg)
    expected = 12 * psi / shards
    scalars = 16  # step counter and Adam's step count
    assert abs(state_bytes - expected) <= scalars, (state_bytes, expected)


def collectives(name, mode="explicit"):
    r = run(name, mode)
    found, notes = hlo.collectives(r[3])
    assert not notes, notes  # every loop's trip count is known
    return found, r[5]


def _bytes(found, kind, min_bytes=0):
    return sum(c.bytes * c.count for c in found if c.kind == kind and c.bytes >= min_bytes)


def _count(found, kind, min_bytes=0):
    return sum(c.count for c in found if c.kind == kind and c.bytes >= min_bytes)


SMALL = 1024  # loss terms, token counts, norm reductions: below this size


def layer_bytes(cfg) -> int:
    """fp32 bytes of one layer's weights (all but the embedding, LM head, final norm)."""
    return 4 * (n_params(cfg) - (VOCAB * D * 2 + D)) // LAYERS


def layer_loops(text: str) -> dict[str, int]:
    """Layer-loop bodies of a compiled step -> their number of dots. A backward body
    computes input and weight gradients: about twice the dots of a forward body."""
    mod = hlo.parse_module(text)
    mult, _ = hlo.multiplicities(mod)

    @functools.cache
    def dots(comp: str) -> int:  # its own and those of the fusions it calls
        n = 0
        for _, _, rest in mod.computations.get(comp, []):
            n += rest.startswith("dot(")
            n += sum(dots(c) for c in re.findall(r"\bcalls=%?([\w.\-]+)", rest))
        return n

    loops = {}
    for comp in mod.computations:
        body = any(
            f"body=%{comp}" in r or f"body={comp}," in r
            for c in mod.computations.values()
            for _, _, r in c
        )
        if body and dots(comp) and mult.get(comp, 0) in (LAYERS, ACCUM * LAYERS):
            loops[comp] = dots(comp)
    assert loops, "no layer loop found"
    return loops


def in_backward_loop(name, mode, found, kind):
    """The collectives of `kind` that run inside a backward layer loop's body."""
    loops = layer_loops(run(name, mode)[3])
    forward = min(loops.values())
    backward = {c for c, dots in loops.items() if dots >= 1.5 * forward}
    return [c for c in found if c.kind == kind and c.computation in backward]


@pytest.mark.parametrize("mode", MODES)
def test_data_parallel_reduces_gradients_once_per_step(mode):
    """grad_accum=2 and one gradient all-reduce of 4Ψ bytes per step (no_sync): each
    layer's gradients reduced inside the backward layer loop, on the last micro-batch."""
    found, cfg = collectives("data8", mode)
    grads = 4 * n_params(cfg)
    assert _bytes(found, "all-reduce", SMALL) == pytest.approx(grads, rel=0.01)
    assert _count(found, "all-gather") == 0 and _count(found, "reduce-scatter") == 0
    in_loop = in_backward_loop("data8", mode, found, "all-reduce")
    assert sum(c.bytes for c in in_loop) == pytest.approx(layer_bytes(cfg), rel=1e-6)
    assert all(c.count == LAYERS for c in in_loop), in_loop  # not ACCUM x LAYERS


@pytest.mark.parametrize("mode", MODES)
def test_zero_1_reduce_scatters_once_per_step_inside_the_backward_loop(mode):
    found, cfg = collectives("fsdp8-zero1", mode)
    psi = n_params(cfg)
    # reduce-scatter results are 1/8 of the fp32 gradients, once per step
    assert _bytes(found, "reduce-scatter") == pytest.approx(4 * psi / 8, rel=0.01)
    assert _bytes(found, "all-gather") == pytest.approx(4 * psi, rel=0.01)  # fp32 model here
    assert _bytes(found, "all-reduce", SMALL) == 0  # no full-size gradient all-reduce
    in_loop = in_backward_loop("fsdp8-zero1", mode, found, "reduce-scatter")
    assert sum(c.bytes for c in in_loop) == pytest.approx(layer_bytes(cfg) / 8, rel=1e-6)
    assert all(c.count == LAYERS for c in in_loop), in_loop


def test_zero_2_reduce_scatters_every_micro_batch_inside_the_backward_loop():
    found, cfg = collectives("fsdp8-zero2")
    psi = n_params(cfg)
    assert _bytes(found, "reduce-scatter") == pytest.approx(ACCUM * 4 * psi / 8, rel=0.01)
    assert _bytes(found, "all-gather") == pytest.approx(4 * psi, rel=0.01)
    assert _bytes(found, "all-reduce", SMALL) == 0
    in_loop = in_backward_loop("fsdp8-zero2", "explicit", found, "reduce-scatter")
    assert sum(c.bytes for c in in_loop) == pytest.approx(layer_bytes(cfg) / 8, rel=1e-6)
    assert all(c.count == ACCUM * LAYERS for c in in_loop), in_loop


def test_zero_3_gathers_each_layer_twice_and_scatters_gradients():
    found, cfg = collectives("fsdp8-zero3")
    psi = n_params(cfg)
    norms = 2 * LAYERS * D  # the per-layer norm scales (tiny: XLA may keep them gathered)
    layers = psi - (VOCAB * D * 2 + D)  # all but the embedding, LM head and final norm
    per_layer = {}  # loop computation -> bytes gathered per step
    for c in found:
        if c.kind == "all-gather" and c.count == ACCUM * LAYERS:
            per_layer[c.computation] = per_layer.get(c.computation, 0) + c.bytes * c.count
    # two layer loops gather weights: the forward scan and the backward (recomputing) scan
    assert len(per_layer) == 2, per_layer
    forward, backward = sorted(per_layer.values(), reverse=True)
    assert forward == pytest.approx(ACCUM * 4 * layers, rel=1e-6)
    assert ACCUM * 4 * (layers - norms) <= backward <= ACCUM * 4 * layers
    # every gradient is reduce-scattered, every micro-batch, and never all-reduced; the
    # layers' inside the backward loop, beside that loop's gathers
    assert _bytes(found, "reduce-scatter") == pytest.approx(ACCUM * 4 * psi / 8, rel=1e-6)
    assert _bytes(found, "all-reduce", SMALL) == 0
    in_loop = in_backward_loop("fsdp8-zero3", "explicit", found, "reduce-scatter")
    assert {c.computation for c in in_loop} <= set(per_layer)
    assert sum(c.bytes for c in in_loop) == pytest.approx(4 * layers / LAYERS / 8, rel=1e-6)


def test_hsdp_reduces_over_data_once_per_step():
    """ZeRO-3 over fsdp=4 inside, replicas over data=2: the fsdp reduce-scatter runs
    every micro-batch, the all-reduce of the shards over `data` only on the last."""
    found, cfg = collectives("hsdp-data2-fsdp4-zero3")
    psi = n_params(cfg)
    assert _bytes(found, "reduce-scatter") == pytest.approx(ACCUM * 4 * psi / 4, rel=1e-6)
    assert _bytes(found, "all-reduce", SMALL) == pytest.approx(4 * psi / 4, rel=0.01)
    in_loop = in_backward_loop("hsdp-data2-fsdp4-zero3", "explicit", found, "all-reduce")
    assert in_loop and all(c.count == LAYERS for c in in_loop), in_loop


# the computations an HLO call or conditional runs: one name, or a {set} of branches
CALLEES = (
    r"(?:to_apply|calls|branch_computations|true_computation|false_computation)"
    r"=(\{[^}]*\}|%?[\w.\-]+)"
)


def layer_loop_order(text: str) -> str:
    """The layer loops of a compiled step in the order it runs them: F a forward, B a
    backward, loops inside loops (the micro-batch loop) as they are reached."""
    loops = layer_loops(text)
    forward = min(loops.values())
    mod = hlo.parse_module(text)
    order = []

    def walk(comp):
        for _, _, rest in mod.computations.get(comp, []):
            if rest.startswith("while("):
                body = re.search(r"body=%?([\w.\-]+)", rest).group(1)
                if body in loops:
                    order.append("F" if loops[body] < 1.5 * forward else "B")
                else:
                    walk(body)
            elif rest.startswith(("call(", "conditional(")):  # a conditional: every branch
                for group in re.findall(CALLEES, rest):
                    for c in re.findall(r"[\w.\-]+", group):
                        walk(c)

    walk(mod.entry)
    return "".join(order)


@pytest.mark.parametrize(
    "name,mode",
    [("data8", "explicit"), ("data8", "gspmd"), ("fsdp8-zero1", "gspmd"),
     ("hsdp-data2-fsdp4-zero3", "explicit")],
)  # fmt: skip
def test_the_last_micro_batch_runs_after_the_others(name, mode):
    """Where a data reduction waits for the last micro-batch, that one runs apart from
    the micro-batch loop (parallel/grads.py), and its forward pass must wait for the
    loop: XLA's schedulers ran it first, its activations then live through every other
    micro-batch (an H100 compile of HSDP 1B without recomputation: 48.8 GiB where one
    micro-batch's need 30.9). Each micro-batch's forward, then its backward: F B F B,
    never F F B B, in the compiled step's order."""
    assert layer_loop_order(run(name, mode)[3]) == "FB" * ACCUM


@pytest.mark.parametrize("name", ["data8", "fsdp8-zero1", "hsdp-data2-fsdp4-zero3"])
def test_the_last_micro_batch_in_its_branch_trains_the_same(name, monkeypatch):
    """Where its stacked buffers outweigh the held weights, the last micro-batch runs in
    a conditional branch, so that XLA builds them there and not before the micro-batch
    loop (parallel/grads.py; tests/test_memory.py measures it), under explicit
    collectives. These shapes are small, so the branch is forced here: it trains as one
    device does, after the others."""
    monkeypatch.setattr(grads, "_stacked_bytes", lambda jaxpr: 1 << 62)
    layout = dict(LAYOUTS[name], **{"parallel.collectives": "explicit"})
    got = run_layout.__wrapped__(tuple(layout.items()))  # not the cached run without it
    assert "conditional(" in got[3]
    assert_same_training(got, run(None))
    assert layer_loop_order(got[3]) == "FB" * ACCUM


def _activation_bytes(cfg) -> int:
    return cfg.train.micro_batch_size * cfg.dp * SEQ * D * 4  # one micro-batch, fp32


@pytest.mark.parametrize("name", ["tp2", "tp4"])
def test_tensor_parallel_all_reduces_activations(name):
    found, cfg = collectives(name)
    act = _activation_bytes(cfg)
    # forward: 2 region exits per layer + the embedding; backward: 2 entries per layer + head
    expected = ACCUM * 2 * (2 * LAYERS + 1)
    assert _count(found, "all-reduce", act) == expected
    assert _count(found, "all-gather") == 0 and _count(found, "reduce-scatter") == 0


@pytest.mark.parametrize("name", ["tp2-sp", "tp4-sp", "dp2-fsdp2-tp2-zero3-sp"])
def test_sequence_parallel_uses_gather_scatter_pairs(name):
    found, cfg = collectives(name)
    tp = cfg.mesh.tensor
    local_rows = cfg.train.micro_batch_size
    full = local_rows * SEQ * D * 4  # an all-gathered activation: whole sequence
    shard = full // tp  # a reduce-scattered activation: 1/tp of the sequence
    gathers = sum(c.count for c in found if c.kind == "all-gather" and c.bytes == full)
    scatters = sum(c.count for c in found if c.kind == "reduce-scatter" and c.bytes == shard)
    # per micro-batch: 2 region entries per layer + the LM head, 2 exits per layer + the
    # embedding, each once forward and once (transposed) backward. Under ZeRO-3 the layer
    # is rematerialised for its weights and XLA may gather the sequence again there.
    assert scatters == ACCUM * 2 * (2 * LAYERS + 1)
    assert gathers == scatters if cfg.parallel.zero < 3 else gathers >= scatters
    # no activation all-reduce left: none of an activation's size (the combined layout's
    # gradient all-reduces over `data`, one per layer, have the size of weight shards)
    activation = [c for c in found if c.kind == "all-reduce" and c.bytes in (full, shard)]
    assert not activation, activation


@pytest.mark.parametrize("name", ["tp2", "tp4-sp"])
def test_vocabulary_parallel_loss_never_gathers_logits(name):
    found, cfg = collectives(name)
    logits = cfg.train.micro_batch_size * SEQ * VOCAB * 4
    too_big = [
        c for c in found if c.kind in ("all-gather", "all-reduce") and c.bytes >= logits // 2
    ]
    assert not too_big, too_big


# --------------------------------------------------------------------------- dtypes

BF16 = ("model.dtype=bfloat16",)


def partitioned_text(lowered) -> str | None:
    """The module as XLA's SPMD partitioner left it (None on one device)."""
    return hlo.compile_partitioned(lowered)[1]


def partitioned(name, mode, *extra):
    """Collectives of the step as XLA's partitioner wrote them (the dtypes a GPU runs)."""
    text = partitioned_text(run(name, mode, *extra)[6])
    assert text is not None
    found, _ = hlo.collectives(text)
    return found


@pytest.mark.parametrize("name, mode", [("fsdp8-zero1", "explicit"), ("fsdp8-zero3", "gspmd")])
def test_bf16_weights_gather_in_bf16_and_gradients_reduce_in_fp32(name, mode):
    found = partitioned(name, mode, *BF16)
    floats = ("bf16", "f32")  # (the partitioner also moves token ids, in s32)
    gathers = [c for c in found if c.kind == "all-gather" and c.bytes >= SMALL]
    gathers = [c for c in gathers if c.dtype in floats]
    reductions = [c for c in found if c.kind in ("reduce-scatter", "all-reduce")]
    big = [c for c in reductions if c.bytes >= SMALL]
    assert gathers and all(c.dtype == "bf16" for c in gathers), gathers
    assert big and all(c.dtype == "f32" for c in big), big
    loss = run(name, mode, *BF16)[0]
    assert all(np.isfinite(loss))
    np.testing.assert_allclose(loss, run(None)[0], rtol=2e-2)  # bf16 against fp32


@pytest.mark.parametrize("mode", MODES)
def test_grad_reduce_dtype_bfloat16_reduces_in_bf16(mode):
    """Both modes as DDP; gspmd's step there is manual over every axis (no partly manual
    region, whose bf16 all-reduce aborts XLA:CPU: refused there, on a CPU only)."""
    extra = (*BF16, "parallel.grad_reduce_dtype=bfloat16")
    found = partitioned("data8", mode, *extra)
    big = [c for c in found if c.kind == "all-reduce" and c.bytes >= SMALL]
    assert big and all(c.dtype == "bf16" for c in big), big
    found32 = partitioned("data8", mode, *BF16)
    big32 = [c for c in found32 if c.kind == "all-reduce" and c.bytes >= SMALL]
    assert sum(c.bytes for c in big) == pytest.approx(sum(c.bytes for c in big32) / 2)
    np.testing.assert_allclose(run("data8", mode, *extra)[0], run(None)[0], rtol=2e-2)
    assert layout.unsupported(run("data8", mode, *extra)[5], "cpu") is None
    mixed = make_cfg(dict(LAYOUTS["dp2-fsdp2-tp2-zero3-sp"], **{"parallel.collectives": mode}))
    mixed.parallel.grad_reduce_dtype, mixed.train.grad_accum = "bfloat16", 1
    mixed.parallel.zero = 1  # manual over data and fsdp, tensor the partitioner's
    refused = layout.unsupported(mixed, "cpu")
    assert (refused is not None) == (mode == "gspmd") and layout.unsupported(mixed, "gpu") is None


# --------------------------------------------------------------------------- custom partitioning


def custom_partitioned(fn):
    """fn(q, k, v) as one op XLA's partitioner hands to jax's custom partitioning, as
    cuDNN's attention is (jax.nn.dot_product_attention), with fn's own backward."""
    from jax.experimental.custom_partitioning import custom_partitioning

    op = custom_partitioning(fn)

    def partition(mesh, arg_shapes, result_shape):
        s = arg_shapes[0].sharding
        return mesh, fn, s, (s, s, s)

    op.def_partition(
        infer_sharding_from_operands=lambda mesh, args, result: args[0].sharding,
        partition=partition,
        sharding_rule="b s h d, b t g d, b t g d -> b s h d",
    )

    @jax.custom_vjp
    def attend(q, k, v):
        return op(q, k, v)

    attend.defvjp(lambda q, k, v: (op(q, k, v), (q, k, v)), lambda r, g: jax.vjp(fn, *r)[1](g))
    return attend


@pytest.mark.parametrize("name", ["data8", "fsdp8-zero1"])
def test_a_custom_partitioned_attention_compiles_in_gspmds_manual_step(name, monkeypatch):
    """gspmd's step is manual over the data axes where a reduction is deferred (ZeRO-0/1)
    and nothing is left to the partitioner there: it is made manual over the one-wide
    axes too, as explicit's is, so jax inlines a custom-partitioned op instead of calling
    its partitioner in a partly manual region, which failed (AssertionError in jax 0.10):
    the 1B step with cuDNN's attention over 8 H200s, as DDP or ZeRO-1 under gspmd, did not
    compile for a GPU (scripts/gpu_compile.py, docs/parallelism.md)."""
    plain = backends.BACKENDS["xla"].fn
    op = custom_partitioned(lambda q, k, v: plain(q, k, v, None))
    patched = dataclasses.replace(
        backends.BACKENDS["xla"], fn=lambda q, k, v, seg=None: op(q, k, v)
    )
    monkeypatch.setitem(backends.BACKENDS, "xla", patched)
    cfg = make_cfg(dict(LAYOUTS[name], **{"parallel.collectives": "gspmd"}), "train.grad_accum=1")
    assert not layout.partly_manual(cfg)
    text = analyze.lower_step(cfg, jax.devices()[:8]).compile(harness.FAST).as_text()
    assert "all-reduce" in text or "reduce-scatter" in text  # the data reduction is there


def test_a_partly_manual_gspmd_step_picks_no_cudnn():
    """Where gspmd's step is manual over `data` beside TP left to the partitioner, cuDNN's
    custom partitioning fails to compile for a GPU (jax 0.10): `auto` picks our Pallas
    kernel there, and asking for cuDNN is refused with the way out; explicit's step, and
    gspmd's without a manual region, keep cuDNN."""
    mixed = {"mesh.data": 4, "mesh.tensor": 2, "parallel.sequence_parallel": True}
    causal = ("model.attention=auto", "data.cross_doc_mask=false")
    cfg = make_cfg(dict(mixed, **{"parallel.collectives": "gspmd"}), *causal)
    assert layout.partly_manual(cfg) and layout.attention_backend(cfg, "gpu") == "pallas"
    assert layout.unsupported(cfg, "gpu") is None
    cfg.model.attention = "cudnn"
    assert "parallel.collectives=explicit" in layout.unsupported(cfg, "gpu")
    explicit = dict(mixed, **{"parallel.collectives": "explicit"})
    alone = dict(LAYOUTS["tp2-sp"], **{"parallel.collectives": "gspmd"})
    for other in (explicit, alone):
        cfg = make_cfg(other, *causal)
        assert not layout.partly_manual(cfg) and layout.attention_backend(cfg, "gpu") == "cudnn"


def test_a_gpu_kernel_runs_on_its_devices_rows_and_heads_under_gspmd(monkeypatch):
    """A GPU kernel is one call the partitioner cannot split: left to it, Pallas's ran on
    all 64 rows on each of 8 H200s (gspmd ZeRO-2 compiled for them: 8x the attention's
    work and 43.6 GiB, not 24.9). Under gspmd a kernel called whole (cuDNN's) runs in a
    shard_map of its own, on this device's rows and heads, and trains as one device
    does. A stand-in (the plain attention, marked a GPU kernel) records its shapes."""
    plain, seen = backends.BACKENDS["xla"], []

    def kernel(q, k, v, seg=None):
        seen.append(q.shape)
        return plain.fn(q, k, v, seg)

    stand_in = dataclasses.replace(plain, name="pallas", fn=kernel, gpu_kernel=True)
    monkeypatch.setitem(backends.BACKENDS, "pallas", stand_in)
    over = dict(LAYOUTS["dp2-fsdp2-tp2-zero3-sp"], **{"parallel.collectives": "gspmd"})
    cfg = make_cfg(over)
    assert not layout.partly_manual(cfg)
    got = run_layout.__wrapped__(tuple(over.items()), "model.attention=pallas")
    rows, heads = ROWS // 4, cfg.model.n_heads // 2  # data x fsdp, and tensor
    assert seen and all(shape[0] == rows and shape[2] == heads for shape in seen), seen
    assert_same_training(got, run(None))


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,layout_",
    [
        ("whole", LAYOUTS["dp2-fsdp2-tp2-zero3-sp"]),
        ("partly manual", {"mesh.data": 4, "mesh.tensor": 2, "parallel.sequence_parallel": True}),
    ],
)
def test_pallas_kernels_run_on_their_devices_rows_and_heads_under_gspmd(name, layout_, monkeypatch):
    """Pallas's forward and backward kernels each run per device in a shard_map of their
    own under gspmd (`context.KernelRegion`), so none is differentiated through one and
    it nests in a partly manual step too (there it ran on every head of each tensor
    device: data 4 x TP 2 + SP compiled for 8 H200s, 22.2 GiB, now 20.4). The calls'
    shapes are this device's rows and heads, and the step trains as one device with the
    same kernels does. Interpreted where the step's region is whole; in the partly manual
    one jax's Pallas interpreter fails its vma check (a loop carry loses the outer manual
    axes), so plain-jnp kernels with the same signatures stand in."""
    calls = []
    partly = name == "partly manual"
    kernels = {"_forward": _jnp_forward, "_backward": _jnp_backward} if partly else {}
    for fn in ("_forward", "_backward"):
        real = kernels.get(fn, getattr(fa, fn))
        monkeypatch.setattr(fa, fn, functools.partial(_recorded, real, calls, fn))
    over = dict(layout_, **{"parallel.collectives": "gspmd"})
    assert layout.partly_manual(make_cfg(over)) == partly
    got = run_layout.__wrapped__(tuple(over.items()), "model.attention=pallas")
    assert {fn for fn, _ in calls} == {"_forward", "_backward"}, calls
    rows, heads = ROWS // 4, 4  # data (x fsdp), and the tensor axis's half of 8 heads
    assert all(q[0] == rows and q[2] == heads for _, q in calls), calls
    calls.clear()  # one device's: the whole batch and every head
    assert_same_training(got, run_layout.__wrapped__((), "model.attention=pallas"))
    assert calls and all(q[0] == ROWS and q[2] == 8 for _, q in calls), calls


def _recorded(real, calls, name, q, *rest, **kw):
    calls.append((name, q.shape))
    return real(q, *rest, **kw)


def _jnp_forward(q, k, v, qs, ks, *, causal, out_dtype=None, **_):
    """flash_attention's `_forward` in plain jnp: (out, lse (b, h, t))."""
    out, lse = xla_attention.reference(q, k, v, qs, ks, causal=causal)
    return out.astype(out_dtype or q.dtype), lse


def _jnp_backward(q, k, v, qs, ks, delta, lse, do, *, causal, **_):
    """flash_attention's `_backward` in plain jnp: (dq, dk, dv) from the probabilities
    recomputed off the log-sum-exp, as the kernel does."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    seen = xla_attention.visible(qs, ks, t, k.shape[1], causal)
    qg, s = xla_attention.scores(q, k, seen)
    p = jnp.where(seen, jnp.exp(s - lse.reshape(b, kv, h // kv, t, 1)), 0.0)
    dog = do.reshape(qg.shape)
    dq, dk, dv = block_grads(qg, k, v, dog, p, delta.reshape(p.shape[:-1]), d**-0.5)
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def test_context_parallel_attention_runs_on_its_devices_rows_and_heads_under_gspmd(
    monkeypatch,
):
    """Context parallelism under gspmd enters a shard_map of its own for the ring; manual
    over `sequence` alone, the partitioner ran its pair kernel (Pallas's on a GPU) on all
    the fsdp group's rows on each device (compiled for 8 H200s, fsdp4 x sequence2: 32
    rows, not 8). It is manual over the partitioner's axes too, and trains as one device."""
    ring, seen = context._context_attention, []

    def recorded(ctx, q, *rest):
        seen.append(q.shape)
        return ring(ctx, q, *rest)

    monkeypatch.setattr(context, "_context_attention", recorded)
    name = "cp2-fsdp2-tp2-zero2"
    over = dict(CONTEXT[name], **{"parallel.collectives": "gspmd"})
    cfg = make_cfg(over)
    got = run_layout.__wrapped__(tuple(over.items()))
    rows, heads = ROWS // 2, cfg.model.n_heads // 2  # fsdp, and tensor
    assert seen and all(s[0] == rows and s[1] == SEQ // 2 and s[2] == heads for s in seen), seen
    assert_same_training(got, run(None))


# --------------------------------------------------------------------------- vma


def test_the_step_checks_varying_axes():
    """A gradient left unreduced over a data axis is JAX's error, not a wrong number: the
    step's shard_map runs with check_vma, and its sinks say which reductions are owed."""
    from jax.sharding import PartitionSpec as P

    from ultrajax.model.ops import Reduce, Weight, dense

    cfg = make_cfg(LAYOUTS["data8"])
    mesh, rules = setup(cfg)[:2]
    plan = step_lib.Layout(cfg, mesh, rules)
    x = np.ones((8, 4, 4), np.float32)
    w = np.ones((4, 4), np.float32)

    def local_grad(x, w):  # differentiated where w already varies: nothing reduces it
        return jax.grad(lambda w: (x @ w).sum())(jax.lax.pcast(w, "data", to="varying"))

    @jax.custom_vjp
    def forgetful(w):  # a backward rule that drops its reduction over `data`
        return jax.lax.pcast(w, "data", to="varying")

    forgetful.defvjp(lambda w: (forgetful(w), None), lambda _, g: (g,))

    def dropped(x, w):
        return jax.grad(lambda w: (x @ forgetful(w)).sum())(w)

    def sinked(x, w):  # the weights' own rule: finish reduces what the sink does not vary on
        sink = jax.numpy.zeros_like(w)
        loss = lambda s: dense(x, Weight.make(w, s, None, Reduce()), "btd,df->btf").sum()  # noqa: E731
        return jax.grad(loss)(sink)

    with jax.set_mesh(mesh):
        for fn in (local_grad, dropped):
            bad = plan.shard_map(fn, in_specs=(P("data"), P()), out_specs=P())
            with pytest.raises(ValueError, match="manual axis|vary"):
                jax.jit(bad)(x, w)
        good = plan.shard_map(sinked, in_specs=(P("data"), P()), out_specs=P())
        np.testing.assert_allclose(jax.jit(good)(x, w), np.full((4, 4), 32.0))


# --------------------------------------------------------------------------- eval


@functools.cache
def evaluate(name: str | None, mode: str = "explicit"):
    """The eval step's (NLL sum, target count) on the first batch, fresh parameters."""
    layout = dict({**LAYOUTS, **CONTEXT}[name] if name else {}, **{"parallel.collectives": mode})
    cfg = make_cfg(layout)
    mesh, rules, tx, _, shardings, batch_sh = setup(cfg)
    with jax.set_mesh(mesh):
        params = harness.init_state(cfg, tx, shardings)["params"]
        fn = jax.jit(
            step_lib.make_eval_step(cfg, mesh, rules), in_shardings=(shardings["params"], batch_sh)
        )
        total, count = fn(params, batch_lib.place(batches(cfg=cfg)[0], batch_sh))
    return float(total), int(count)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "name", ["data8", "fsdp8-zero3", "dp2-fsdp2-tp2-zero3-sp", "cp4-ring-data2"]
)
def test_eval_step_matches_single_device(name, mode):
    total, count = evaluate(name, mode)
    ref_total, ref_count = evaluate(None)
    assert count == ref_count > 0
    np.testing.assert_allclose(total, ref_total, rtol=2e-6)


@pytest.mark.parametrize(
    "name,mode", [("tp2-sp", "explicit"), ("fsdp8-zero1", "explicit"), ("tp2", "gspmd")]
)
def test_chunked_loss_matches_single_device(name, mode):
    """model.loss_chunk under the vocabulary-parallel loss (TP, TP+SP) and with the LM
    head's gradient reduced after the backward pass (ZeRO-1): the single-device run."""
    assert_same_training(run(name, mode, "model.loss_chunk=16"), run(None))


def test_chunked_loss_computes_each_chunks_logits_once():
    """model.loss_chunk on trained weights: each chunk's logit gradient becomes the input's
    and the weight's gradients in the forward pass (model/loss.py), so the compiled step
    has one logits matmul a chunk, not a second one recomputing them for the backward
    pass: the dots giving fp32 logits, each run as often as its loops run it, are one a
    micro-batch whole and one a chunk of each micro-batch chunked."""

    def logits(chunk: int, text: str) -> float:  # runs of dots giving (..., chunk, vocab)
        mod = hlo.parse_module(text)
        runs, _ = hlo.multiplicities(mod)
        shape = re.compile(rf"f32\[(?:\d+,)*{chunk},{VOCAB}\]")
        return sum(
            runs.get(comp, 0)
            for comp, instrs in mod.computations.items()
            for _name, out, rest in instrs
            if rest.startswith("dot(") and shape.match(out)
        )

    whole = run("fsdp8-zero1", "explicit")
    micro = whole[5].train.grad_accum
    assert logits(SEQ, whole[3]) == micro
    chunked = logits(16, run("fsdp8-zero1", "explicit", "model.loss_chunk=16")[3])
    assert chunked == micro * SEQ // 16
