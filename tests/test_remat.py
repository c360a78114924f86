"""Activation recomputation (model.remat): the same gradients under every policy, less
compiled memory the more is recomputed, and exactly the predicted extra FLOPs."""

import math
import re

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ultrajax.config import parse
from ultrajax.config.schema import ConfigError
from ultrajax.cost import activations, flops, memory, sizes
from ultrajax.model.loss import loss_sum
from ultrajax.model.remat import remat_policy
from ultrajax.tools import analyze, hlo
from ultrajax.train import batch as batch_lib
from ultrajax.train import setup

FAST = harness.FAST
TINY = harness.TINY
# attention-dominated: the s² scores outweigh the MLP (s = 256 > 6·d_ff·c / ((4 + c)·a))
SHAPE = [
    "model.n_layers=2", "train.micro_batch_size=1", "train.grad_accum=1", "model.seq_len=256",
    "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
    "model.vocab_size=256", "model.dtype=float32", "model.scan_unroll=1",
    "model.attention=xla",  # the plain attention, whose scores the policies keep or drop
]  # fmt: skip


def make(*overrides):
    return harness.make(*overrides, base=SHAPE)[0]


def test_gradients_identical_across_policies(random_params):
    cfg = make("model.seq_len=32", "model.n_layers=2")
    params = random_params(cfg.model)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, cfg.model.vocab_size, (2, 33)), jnp.int32)
    packed = {
        "tokens": tokens,
        "segment_ids": np.repeat([[1] * 20 + [2] * 13], 2, 0),
        "positions": np.repeat([list(range(20)) + list(range(13))], 2, 0),
    }
    batch = jax.tree.map(jnp.asarray, batch_lib.make(packed, cross_doc_mask=True))
    grads = {}
    for remat in ("none", "full", "selective", "[query,key,value]"):
        for scan in (True, False):  # the layers as one lax.scan, or a Python loop
            cfg.model.remat = parse.load(TINY, [f"model.remat={remat}"]).model.remat
            cfg.model.scan_layers = scan
            fn = jax.jit(jax.value_and_grad(lambda p, c=cfg: loss_sum(c, p, batch)[0]))
            grads[f"{remat}, scan_layers={scan}"] = fn(params)
    ref_loss, ref = grads["none, scan_layers=True"]
    # the same arithmetic in other fusions: each element within a few roundings of its
    # weight's largest gradient (2 ulps of it seen), where a wrong recomputation is off by
    # a whole term
    eps = np.finfo(np.float32).eps
    for remat, (loss, g) in grads.items():
        assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6), remat
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref), strict=True):
            atol = 16 * eps * float(np.max(np.abs(b)))
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=atol, err_msg=remat)


@pytest.fixture(scope="module")
def compiled_policies():
    out = {}
    for remat in ("none", "selective", "full"):
        cfg = make(f"model.remat={remat}")
        out[remat] = (cfg, analyze.compile_step(cfg, jax.devices()[:1], FAST))
    return out


def test_compiled_temp_memory_ordered_none_selective_full(compiled_policies):
    temp = {k: analyze.compiled_memory(c)["temp"] for k, (_, c) in compiled_policies.items()}
    print({k: f"{v / 2**20:.2f} MiB" for k, v in temp.items()})
    assert temp["none"] > temp["selective"] > temp["full"]
    # and the estimate orders them the same way, each within 10%
    for remat, (cfg, c) in compiled_policies.items():
        peak = analyze.compiled_memory(c)["peak"]
        assert memory.estimate(cfg).peak == pytest.approx(peak, rel=0.10), remat


def test_recomputation_holds_with_every_layer_unrolled():
    """model.scan_unroll = the layers: unrolled, XLA merges each layer's recomputation with
    its forward and keeps every layer's activations (model/remat.py), so wherever the
    backward recomputes the layers run one per loop iteration. The compiled memory stays
    ordered none > selective > full, and full remat holds what it holds rolled."""
    temp = {}
    for remat, unroll in (("none", 4), ("selective", 4), ("full", 4), ("full", 1)):
        cfg = make(f"model.remat={remat}", "model.n_layers=4", f"model.scan_unroll={unroll}")
        compiled = analyze.compile_step(cfg, jax.devices()[:1], FAST)
        temp[remat, unroll] = analyze.compiled_memory(compiled)["temp"]
    print({k: f"{v / 2**20:.2f} MiB" for k, v in temp.items()})
    assert temp["none", 4] > temp["selective", 4] > temp["full", 4]
    assert temp["full", 4] <= 1.02 * temp["full", 1]


def test_a_python_layer_loop_recomputes_what_each_policy_drops(compiled_policies):
    """model.scan_layers=false: each layer is checkpointed on its own with prevent_cse, so
    XLA cannot merge a recomputation back into the forward. Policy by policy, the compiled
    dots are the scan's (forward, backward and the FLOPs model's recomputation), and no
    loop runs one. Without recomputation the loop holds less than the scan (8.0 against
    11.5 MiB of temporaries here): nothing is stacked, and XLA may fuse an elementwise
    producer into its backward consumer where a scan must store its output."""
    temp = {}
    for remat, (_, scanned) in compiled_policies.items():
        cfg = make(f"model.remat={remat}", "model.scan_layers=false")
        looped = analyze.compile_step(cfg, jax.devices()[:1], FAST)
        text, temp[remat] = looped.as_text(), analyze.compiled_memory(looped)["temp"]
        (dots, once), (scan_dots, scan_once) = map(hlo.matmul_flops, (text, scanned.as_text()))
        assert dots == pytest.approx(scan_dots, rel=1e-9), remat
        # every dot runs once: no loop is left that holds a matmul (a scatter may be a loop)
        assert dots == once and scan_dots > scan_once, remat
    print({k: f"{v / 2**20:.2f} MiB" for k, v in temp.items()})
    assert temp["none"] < 0.8 * analyze.compiled_memory(compiled_policies["none"][1])["temp"]


@pytest.mark.parametrize("remat", ["full", "selective"])
def test_a_layer_loop_slices_held_weights_again_in_the_backward(random_params, remat):
    """Gradient accumulation holds the weights' compute copy through its micro-batch loop
    (parallel/grads.py): the layer loop then slices each layer's weights inside its
    checkpoint (model/stack.py `Held`), so the backward slices them again rather than
    keep every layer's slice from the forward, a second copy of the layers' weights
    (compiled for 8 H100s, configs/llama-1b.yaml's step: 19.26 -> 17.77 GiB). The
    saved residuals hold no layer's weights then, and the output and its gradient are
    the plain loop's."""
    import contextlib
    import io

    from jax.ad_checkpoint import print_saved_residuals

    from ultrajax.model import stack

    cfg = make(f"model.remat={remat}", "model.scan_layers=false").model
    w = {"w": random_params(cfg)["layers"]}
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((1, 64, cfg.d_model)), jnp.float32)
    positions = jnp.arange(64)[None]

    def loss(x, held):
        prepare = stack.Held(lambda p: p["w"], "w") if held else lambda p: p["w"]
        return jnp.sum(stack.layers(cfg, w, x, positions, prepare=prepare)[0] ** 2)

    def saved(held):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            print_saved_residuals(lambda x: loss(x, held), x)
        return out.getvalue()

    slices = {f"f32[{','.join(map(str, a.shape[1:]))}]" for a in jax.tree.leaves(w)}
    kept = [s for s in slices if s in saved(False)]
    assert kept, saved(False)  # the plain loop keeps each layer's slices
    assert not [s for s in slices if s in saved(True)], saved(True)
    (y, g), (y_held, g_held) = (jax.value_and_grad(loss)(x, h) for h in (False, True))
    assert np.isfinite(y) and np.isfinite(g).all()
    # the same arithmetic, maybe in other fusions: a few roundings of the largest term
    eps = np.finfo(np.float32).eps
    np.testing.assert_allclose(y_held, y, rtol=8 * eps)
    np.testing.assert_allclose(g_held, g, rtol=0, atol=8 * eps * np.abs(g).max())


@pytest.mark.parametrize("fp8", ["none", "tensorwise"])
def test_a_python_layer_loop_on_several_devices_makes_weight_gradients_in_order(fp8):
    """The layers as a Python loop over several devices: each matmul's reduced weight
    gradient is made before its input's gradient leaves for the next layer (model/ops.py
    `ordered`). Without it XLA's GPU scheduler made and reduced them after the whole
    backward and held every layer's inputs to them: compiled for an H200, the 1B step
    over data 8 under full recomputation held 34.04 GiB, the scan 22.87, the loop now
    19.95 (docs/memory.md; XLA:CPU holds the same either way, so this reads the lowered
    step). One barrier joins each matmul's two gradients: one per matmul of a layer per
    layer more than on one device, and than the scan (which orders them by its loop)."""

    def barriers(*overrides):
        cfg, devices = harness.make(*overrides, f"model.fp8={fp8}", base=SHAPE)
        return cfg, analyze.lower_step(cfg, devices).as_text().count("optimization_barrier")

    full = ("model.remat=full", "model.attention=xla")
    cfg, loop = barriers(*full, "model.scan_layers=false", "mesh.data=2")
    _, one = barriers(*full, "model.scan_layers=false")
    _, scan = barriers(*full, "mesh.data=2")
    matmuls = 7  # wq, wk, wv, wo, gate, up, down
    assert loop - one == matmuls * cfg.model.n_layers, (loop, one, scan)
    assert loop - scan >= matmuls * cfg.model.n_layers, (loop, one, scan)
    # selective keeps the MLP's inputs: its down projection is left out (its barrier would
    # split the SwiGLU's recomputation from its backward, parallel/layout.py)
    kept = ("model.remat=selective", "model.attention=xla", "model.scan_layers=false")
    _, loop = barriers(*kept, "mesh.data=2")
    _, one = barriers(*kept)
    assert loop - one == (matmuls - 1) * cfg.model.n_layers, (loop, one)


def test_hfu_exceeds_mfu_by_exactly_the_recomputed_flops(compiled_policies):
    """HFU - MFU counts the recomputed forward work: against the compiled step's dots
    (each counted with its loop's trip count), policy by policy."""
    model_dots = None
    for remat, (cfg, c) in compiled_policies.items():
        dots, _ = hlo.matmul_flops(c.as_text())
        tokens = cfg.tokens_per_step
        mfu = flops.flops_per_token(cfg.model) * tokens
        hfu = flops.hardware_flops_per_token(cfg.model) * tokens
        assert hfu - mfu == pytest.approx(flops.recompute_flops_per_token(cfg.model) * tokens)
        assert dots == pytest.approx(hfu, rel=1e-6), remat
        if remat == "none":
            model_dots = dots
            assert hfu == mfu
    assert model_dots is not None


@pytest.mark.parametrize("remat", ["[query,key,value]", "[attn_out,mlp_in]", "[]"])
def test_recompute_flops_of_named_policies(remat):
    """Lists of names: the recomputation model against the compiled dots (2 layers x 2
    micro-batches, so the layer scan and the micro-batch scan both count)."""
    cfg = make(f"model.remat={remat}", "train.grad_accum=2", "model.seq_len=64")
    dots, _ = hlo.matmul_flops(analyze.compile_step(cfg, jax.devices()[:1], FAST).as_text())
    assert dots == pytest.approx(
        flops.hardware_flops_per_token(cfg.model) * cfg.tokens_per_step, rel=1e-6
    )


def test_full_equals_an_empty_list_of_names():
    full, empty = make("model.remat=full"), make("model.remat=[]")
    assert flops.recompute_flops_per_token(full.model) == flops.recompute_flops_per_token(
        empty.model
    )
    assert activations.saved_per_layer(full) == activations.saved_per_layer(empty)


def test_offload_is_a_clear_error_on_cpu_and_analysed_without_compiling():
    cfg = make("model.remat=offload")
    assert remat_policy("offload") is not None
    with pytest.raises(ConfigError, match="offload needs host offloading"):
        setup.check_backend(cfg)
    est = memory.estimate(cfg)
    d = sizes.dims(cfg)
    # the tagged matmul outputs and the residual stream after attention
    assert est.host == cfg.model.n_layers * d.c * (2 * d.Q + 2 * d.K + 2 * d.F + d.X_res)
    assert est.activations["norms"] == cfg.model.n_layers * d.c * d.X  # only block inputs
    with pytest.raises(ConfigError, match="offload"):
        analyze.analyze(cfg, compile=True, devices=jax.devices()[:1])
    assert math.isfinite(analyze.analyze(cfg, devices=jax.devices()[:1])["predicted"]["peak"])


def _offloaded_bytes(text: str) -> int:
    """Bytes the lowered module places in pinned host memory (one layer's, in a scan)."""
    total = 0
    for line in text.splitlines():
        if '_xla_buffer_placement = "pinned_host"' in line:
            shape, dtype = re.search(r"\(tensor<([0-9x]+)x(f32|bf16)>\)", line).groups()
            total += math.prod(int(n) for n in shape.split("x")) * (4 if dtype == "f32" else 2)
    return total


@pytest.mark.parametrize(
    "layout",
    [
        (),
        ("model.dtype=bfloat16",),
        ("mesh.data=2", "mesh.fsdp=2", "parallel.zero=3"),
        ("mesh.tensor=2", "parallel.sequence_parallel=true"),
        ("mesh.sequence=2",),
        ("model.moe_experts=4", "mesh.expert=2"),
        ("model.moe_experts=4", "model.moe_every=2", "model.n_layers=4"),
    ],
    ids=["one", "bf16", "zero3", "tp-sp", "cp2", "moe-ep2", "moe-every2"],
)
def test_offload_lowers_for_a_gpu_moving_what_the_memory_model_counts(layout):
    """model.remat=offload compiles on a GPU only, but its step lowers for one here
    (StableHLO for cuda, not compiled): the layer loop's body places in pinned host
    memory exactly the bytes per device that the memory model's host row counts, under
    data, ZeRO-3, tensor + sequence and context parallelism, and with MoE layers (their
    experts' rows; a dense and an MoE layer a body with moe_every=2); selective places
    none there. (Before, the host row counted a dense MLP's rows in an MoE layer: 1/3 of
    what expert parallelism over 2 moves.)"""
    over = ("model.remat=offload", "model.n_layers=2", "model.scan_unroll=1", *layout)
    cfg, devices = harness.make(*over)
    moved = _offloaded_bytes(analyze.lower_step(cfg, devices, "cuda").as_text())
    bodies = cfg.model.n_layers // (cfg.model.moe_every if cfg.model.moe else 1)
    assert moved > 0
    assert moved * bodies == memory.estimate(cfg).host
    kept, devices = harness.make(*over, "model.remat=selective")
    assert _offloaded_bytes(analyze.lower_step(kept, devices, "cuda").as_text()) == 0


def test_offload_with_a_pipeline_is_refused_at_validation():
    """The pipeline's schedule stores each micro-batch's saved activations in one device
    buffer of its loop (dynamic_update_slice), which host arrays cannot join: jax refuses
    it while tracing ("memory_space of all inputs ... must be the same"), so validation
    says so first."""
    with pytest.raises(ConfigError, match="offload with mesh.pipeline > 1"):
        harness.make("model.remat=offload", "mesh.pipeline=2", "train.grad_accum=4")
    harness.make("model.remat=selective", "mesh.pipeline=2", "train.grad_accum=4")


def test_offload_with_the_layer_loop_is_refused_at_validation():
    """Compiled for an H200 (scripts/gpu_compile.py), offload under the Python layer loop
    moved 1.75 of the 11.5 GiB the scan moves to the host: validation refuses the pair."""
    with pytest.raises(ConfigError, match="offload with model.scan_layers=false"):
        harness.make("model.remat=offload", "model.scan_layers=false")
    harness.make("model.remat=selective", "model.scan_layers=false")


@pytest.mark.parametrize("attention", ["blocked", "pallas"])
def test_selective_keeps_a_flash_attentions_residuals_and_runs_no_attention_forward_again(
    attention,
):
    """Selective recomputation keeps a flash attention's output and log-sum-exp
    (remat.ATTN_SAVED, named by its forward rule; cuDNN's by its primitive), so the
    backward pass runs no attention forward again: the blocked attention (plain XLA) and
    our Pallas kernel (interpreted), whose compiled dots under selective exceed their
    dots without recomputation by exactly the recomputation flops counts with the
    attention kept (none: the residual stream after wo is kept too, so no matmul runs
    again; the Pallas forward that jax's remat still emits is dead, and XLA removes it),
    and blocked's under full by the whole layers' forward. (Both run more than the
    counted attention, padded blocks and the backward's recomputed scores, the same
    with every policy, so differences are compared.) Before,
    selective ran the attention forward a second time: on a GPU the cuDNN or Pallas
    kernel's, about a third of the attention's time, every layer."""
    shape = ("model.seq_len=128",) if attention == "pallas" else ()
    policies = ("none", "selective", "full") if attention == "blocked" else ("none", "selective")
    dots, cfgs = {}, {}
    for policy in policies:
        cfg = make(f"model.remat={policy}", f"model.attention={attention}", *shape)
        compiled = analyze.compile_step(cfg, jax.devices()[:1], FAST)
        dots[policy] = hlo.matmul_flops(compiled.as_text())[0] / cfg.tokens_per_step
        cfgs[policy] = cfg
        assert activations.keeps_residuals(cfg)
    for policy in policies[1:]:
        redo = flops.recompute_flops_per_token(cfgs[policy].model, attention_saved=True)
        assert dots[policy] - dots["none"] == pytest.approx(redo, rel=1e-9), policy
    m = cfgs["selective"].model
    saved = flops.recompute_flops_per_token(m, attention_saved=True)
    assert flops.recompute_flops_per_token(m) - saved == flops.attention_flops_per_token(m) / 2
