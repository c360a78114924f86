"""Mixture of experts (model/moe.py): the layer against every expert computed densely,
capacity mode's drops, the balance losses' gradients, the bias rule, the counts and
decoding (the layouts against one device: tests/test_expert.py)."""

from __future__ import annotations

import functools
import math

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_parallel as tp

from ultrajax.config.no_effect import no_effect
from ultrajax.config.schema import ConfigError
from ultrajax.model import decode, llama, moe, stack
from ultrajax.model.boundaries import ONE_DEVICE, ExpertBoundary
from ultrajax.train import batch as batch_lib
from ultrajax.train import step as step_lib
from ultrajax.train.record import moe_record

E, K, D, F, T = 6, 2, 16, 24, 40  # experts, top-k, embed, expert hidden, tokens


def _cfg(*overrides):
    base = [
        "model.d_model=16",
        "model.n_heads=2",
        "model.n_kv_heads=1",
        f"model.moe_experts={E}",
        f"model.moe_top_k={K}",
        f"model.moe_d_ff={F}",
        "model.dtype=float32",
        "model.moe_balance=none",  # the balance losses have their own test
        "model.moe_grouped=ragged",  # a GPU's default; the blocks: the layer test, below
    ]
    return harness.make(*base, *overrides)[0].model


def _weights(cfg, key):
    """One layer's MoE weights, fresh random (the router bias too, to move the choice)."""
    out = {}
    keys = jax.random.split(key, 16)
    for i, p in enumerate(q for q in llama.params_of(cfg) if q.part in (llama.ROUTER, llama.EXPERTS)
                          or q.key.startswith("shared_")):  # fmt: skip
        shape = p.shape(cfg)[1:]
        out[p.key] = jax.random.normal(keys[i], shape, jnp.float32) / math.sqrt(
            shape[-2 if len(shape) > 1 else 0]
        )
    return out


def _reference(cfg, p, h):
    """Every expert on every token, then the chosen ones' outputs gated and summed."""
    x = h.reshape(-1, h.shape[-1])
    logits = x @ p["router"]
    scores = jax.nn.softmax(logits) if cfg.moe_router == "softmax" else jax.nn.sigmoid(logits)
    _, idx = jax.lax.top_k(scores + p["router_bias"], cfg.moe_top_k)
    gates = jnp.take_along_axis(scores, idx, -1)
    gates = gates / gates.sum(-1, keepdims=True) if cfg.moe_norm_topk else gates
    every = jnp.stack(
        [
            (jax.nn.silu(x @ p["moe_gate"][e]) * (x @ p["moe_up"][e])) @ p["moe_down"][e]
            for e in range(cfg.moe_experts)
        ]
    )  # (E, T, d)
    chosen = every[idx, jnp.arange(x.shape[0])[:, None]]  # (T, k, d)
    out = jnp.einsum("tkd,tk->td", chosen, gates)
    if cfg.moe_shared_experts:
        out = out + (jax.nn.silu(x @ p["shared_gate"]) * (x @ p["shared_up"])) @ p["shared_down"]
    return out.reshape(h.shape)


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("model.moe_router=sigmoid", "model.moe_shared_experts=2"),
        ("model.moe_norm_topk=false",),
    ],
)
@pytest.mark.parametrize("grouped", ["ragged", "blocked"])
def test_the_moe_layer_matches_every_expert_computed_densely(overrides, grouped):
    """Dropless (sorted rows, grouped matmuls: jax's ragged_dot or model/grouped.py's
    blocks) = the dense reference, outputs and the gradients of every weight and of the
    input, fp32 on fresh random inputs."""
    cfg = _cfg(*overrides, f"model.moe_grouped={grouped}")
    p = _weights(cfg, jax.random.key(1))
    h = jax.random.normal(jax.random.key(2), (2, T // 2, D), jnp.float32)
    r = jax.random.normal(jax.random.key(3), h.shape, jnp.float32)

    def ours(p, h):
        return jnp.sum(moe.moe_mlp(p, h, cfg=cfg, ep=ONE_DEVICE)[0] * r)

    def ref(p, h):
        return jnp.sum(_reference(cfg, p, h) * r)

    out, _ = moe.moe_mlp(p, h, cfg=cfg, ep=ONE_DEVICE)
    np.testing.assert_allclose(out, _reference(cfg, p, h), rtol=1e-5, atol=1e-5)
    got, want = jax.grad(ours, (0, 1))(p, h), jax.grad(ref, (0, 1))(p, h)
    flat = jax.tree_util.tree_leaves_with_path(got)
    for (path, a), b in zip(flat, jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=jax.tree_util.keystr(path))


def test_capacity_mode_drops_what_exceeds_each_expert_and_counts_it():
    """capacity c: each expert keeps its first ceil(c·T·k/E) assignments in token order;
    the output is the reference with the dropped assignments' gates at zero; a capacity
    no expert can exceed (E/k) is dropless."""
    cfg = _cfg("model.moe_capacity=1")
    p = _weights(cfg, jax.random.key(4))
    p["router_bias"] = p["router_bias"].at[0].add(3.0)  # expert 0 overloaded: drops
    h = jax.random.normal(jax.random.key(5), (1, T, D), jnp.float32)
    out, stats = moe.moe_mlp(p, h, cfg=cfg, ep=ONE_DEVICE)
    # the reference's drops, by hand
    x = np.asarray(h[0])
    scores = np.asarray(jax.nn.softmax(x @ np.asarray(p["router"])))
    _, idx = jax.lax.top_k(scores + np.asarray(p["router_bias"]), K)
    idx = np.asarray(idx)
    c = moe.capacity(cfg, T)
    # each assignment's rank among its expert's, in token order (a stable sort by expert)
    order = np.argsort(idx.reshape(-1), kind="stable")
    rank = np.empty(T * K, int)
    for e in range(E):
        members = order[idx.reshape(-1)[order] == e]
        rank[members] = np.arange(len(members))
    keep = (rank < c).reshape(T, K)
    assert 0 < (~keep).sum() == float(stats["dropped"])
    full = moe.moe_mlp(p, h, cfg=_cfg(f"model.moe_capacity={E / K}"), ep=ONE_DEVICE)
    np.testing.assert_allclose(full[0], _reference(cfg, p, h), rtol=1e-5, atol=1e-5)
    assert float(full[1]["dropped"]) == 0
    # kept assignments only: the reference with dropped gates zeroed
    gates = np.take_along_axis(scores, idx, -1)
    gates = gates / gates.sum(-1, keepdims=True) * keep
    w = {k: np.asarray(v) for k, v in p.items()}
    expert = [
        (jax.nn.silu(x @ w["moe_gate"][e]) * (x @ w["moe_up"][e])) @ w["moe_down"][e]
        for e in range(E)
    ]
    want = sum(
        gates[:, j, None] * np.stack([expert[idx[t, j]][t] for t in range(T)]) for j in range(K)
    )
    np.testing.assert_allclose(out[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("loss", ["aux", "z"])
def test_the_balance_losses_enter_the_gradient_with_their_coefficient(loss):
    """The auxiliary loss and the z-loss are not returned but join the backward pass:
    the gradient equals that of the output's loss plus coef x the loss, computed
    explicitly (over two micro-batches: coef / 2 each)."""
    key = "moe_aux_coef" if loss == "aux" else "moe_z_coef"
    cfg = _cfg("model.moe_balance=aux" if loss == "aux" else "model.moe_balance=none",
               f"model.{key}=0.3")  # fmt: skip
    plain = _cfg("model.moe_balance=none", "model.moe_aux_coef=0", "model.moe_z_coef=0")
    ep = ExpertBoundary(micro_batches=2)
    p = _weights(cfg, jax.random.key(6))
    h = jax.random.normal(jax.random.key(7), (2, T // 2, D), jnp.float32)
    r = jax.random.normal(jax.random.key(8), h.shape, jnp.float32)

    def attached(p):
        return jnp.sum(moe.moe_mlp(p, h, cfg=cfg, ep=ep)[0] * r)

    def explicit(p):
        out, stats = moe.moe_mlp(p, h, cfg=plain, ep=ep)
        x = h.reshape(-1, D)
        logits = x @ p["router"]
        if loss == "aux":
            scores = jax.nn.softmax(logits)
            f = stats["load"] / (x.shape[0] * K)
            value = E * jnp.sum(f * scores.mean(0))
        else:
            value = jnp.mean(jax.nn.logsumexp(logits, -1) ** 2)
        return jnp.sum(out * r) + 0.3 / 2 * value

    got, want = jax.grad(attached)(p), jax.grad(explicit)(p)
    np.testing.assert_allclose(got["router"], want["router"], rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(got["router"] - jax.grad(lambda p: jnp.sum(
        moe.moe_mlp(p, h, cfg=plain, ep=ep)[0] * r))(p)["router"]).max()) > 1e-4  # fmt: skip


def test_the_bias_moves_the_choice_not_the_gates_and_follows_the_load():
    cfg = _cfg("model.moe_balance=bias", "model.moe_bias_rate=0.01")
    logits = jax.random.normal(jax.random.key(9), (T, E))
    bias = jnp.zeros(E).at[3].set(10.0)
    idx, gates, _ = moe.route(cfg, logits, bias)
    idx0, gates0, scores = moe.route(cfg, logits, jnp.zeros(E))
    assert (idx == 3).any(axis=1).all()  # every token now picks expert 3
    want = jnp.take_along_axis(scores, idx, -1)
    np.testing.assert_allclose(gates, want / want.sum(-1, keepdims=True), rtol=1e-6)
    load = jnp.array([[5.0, 1.0, 3.0, 3.0, 2.0, 4.0]])
    new = moe.update_bias(cfg, jnp.zeros((1, E)), load)
    np.testing.assert_allclose(new, [[-0.01, 0.01, 0.0, 0.0, 0.01, -0.01]])
    off = _cfg("model.moe_balance=aux")
    assert moe.update_bias(off, jnp.ones((1, E)), load) is not None
    np.testing.assert_array_equal(moe.update_bias(off, jnp.ones((1, E)), load), jnp.ones((1, E)))


def test_total_and_active_parameter_counts():
    """param_count's closed form = the initialised parameters; active counts top-k of
    the routed experts; the FLOPs' matmul count follows the active experts."""
    cfg = _cfg("model.moe_shared_experts=1")
    params = jax.eval_shape(lambda k: llama.init_params(cfg, k), jax.random.key(0))
    assert llama.param_count(cfg) == sum(math.prod(a.shape) for a in jax.tree.leaves(params))
    experts = 3 * D * F * cfg.n_layers
    assert llama.param_count(cfg) - llama.active_param_count(cfg) == (E - K) * experts
    every = _cfg("model.moe_shared_experts=1", f"model.moe_top_k={E}")
    rest = llama.matmul_param_count(cfg) - K * experts
    assert rest == llama.matmul_param_count(every) - E * experts


def test_bad_moe_settings_are_refused_and_idle_ones_warned():
    for bad in ("model.moe_top_k=7", "model.moe_experts=1", "model.moe_capacity=0.5",
                "model.moe_every=3", "model.moe_every=0"):  # fmt: skip
        with pytest.raises(ConfigError):
            _cfg(bad, "model.n_layers=4")
    every = ("model.moe_experts=4", "model.n_layers=4", "model.moe_every=2", "mesh.pipeline=2",
             "train.grad_accum=2")  # fmt: skip
    with pytest.raises(ConfigError, match="whole units of moe_every layers"):
        harness.make(*every, "parallel.pipeline_schedule=interleaved", "parallel.virtual_stages=2")
    with pytest.raises(ConfigError, match="not of a unit of dense and MoE layers"):
        harness.make(*every, "parallel.pipeline_schedule=zb-h1")
    with pytest.raises(ConfigError, match="context parallelism"):
        harness.make("model.moe_experts=4", "model.moe_capacity=1", "mesh.sequence=2")
    with pytest.raises(ConfigError, match=r"divisible by mesh.expert \(8\)"):
        harness.make("model.moe_experts=4", "mesh.expert=8")
    with pytest.raises(ConfigError, match="needs an MoE model"):
        harness.make("mesh.expert=2")
    # MoE keys in a dense config do nothing: a warning names them
    (line,) = no_effect(harness.make("model.moe_top_k=4", "model.moe_z_coef=0.1")[0])
    assert "model.moe_top_k, model.moe_z_coef have no effect" in line
    assert not no_effect(harness.make("model.moe_experts=4", "model.moe_top_k=4")[0])
    # correct but slow: gspmd's tensor parallelism around the experts
    tp2 = ("model.moe_experts=4", "mesh.tensor=2", "model.n_kv_heads=2")
    assert not no_effect(harness.make(*tp2)[0])
    (line,) = no_effect(harness.make(*tp2, "parallel.collectives=gspmd")[0])
    assert "use parallel.collectives=explicit" in line


def test_interleaved_dense_and_moe_layers_are_the_layers_one_by_one():
    """model.moe_every=3 (model/units.py): the forward pass equals the layers applied one
    after another, layer i reading its rows of each stack (Param.row: layers 2 and 5 are
    the MoE layers, with their shared experts; the others read the dense MLP's rows), and
    the closed-form parameter count holds with both kinds of layer."""
    cfg = _cfg("model.vocab_size=64", "model.n_layers=6", "model.seq_len=16",
               "model.moe_every=3", "model.moe_shared_experts=1")  # fmt: skip
    params = llama.init_params(cfg, jax.random.key(3))
    assert llama.param_count(cfg) == sum(a.size for a in jax.tree.leaves(params))
    assert params["layers"]["w_up"].shape[0] == 4 and params["layers"]["router"].shape[0] == 2
    tokens = jax.random.randint(jax.random.key(4), (2, 12), 0, cfg.vocab_size)
    got = jax.jit(functools.partial(stack.forward, cfg))(params, tokens)
    kinds = []

    def one_by_one(params, tokens):
        x = stack.embed(cfg, params, tokens)
        positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
        for i in range(cfg.n_layers):
            rows = {p.key: p.row(cfg, i) for p in llama.params_of(cfg) if p.layered}
            w = {k: params["layers"][k][r] for k, r in rows.items() if r is not None}
            kinds.append("router" in w)
            x = llama.block(w, x, positions, None, cfg=cfg)
        return stack.head(cfg, params, x)

    np.testing.assert_allclose(got, jax.jit(one_by_one)(params, tokens), atol=1e-5)
    assert kinds == [False, False, True] * 2


MOE = ("model.moe_experts=4", "model.moe_top_k=2", "model.moe_d_ff=32", "model.moe_z_coef=0.001")


def test_the_step_moves_the_router_bias_against_the_steps_load():
    """bias balance: after the optimizer, each router bias moves by rate x sign(mean -
    load), the load counted over the whole step (every micro-batch's assignments: tokens
    x top-k per layer); the metrics report it."""
    cfg = tp.make_cfg({}, *MOE, "model.moe_balance=bias", "model.moe_bias_rate=0.01")
    mesh, rules, tx, schedule, shardings, batch_sh = harness.setup(cfg)
    with jax.set_mesh(mesh):
        state = harness.init_state(cfg, tx, shardings)
        fn = step_lib.jit_train_step(cfg, mesh, rules, tx, schedule, shardings, batch_sh)
        new, metrics = fn(state, batch_lib.place(tp.batches(1, cfg)[0], batch_sh))
    load = np.asarray(metrics["moe"]["load"])
    np.testing.assert_array_equal(load.sum(-1), tp.ACCUM * tp.ROWS * tp.SEQ * 2)
    want = 0.01 * np.sign(load.mean(-1, keepdims=True) - load)
    assert np.abs(want).sum() > 0
    np.testing.assert_allclose(new["params"]["layers"]["router_bias"], want, atol=1e-7)
    record = moe_record(metrics["moe"])
    layer0 = load[0].max() / load[0].mean()
    assert record["moe_load_max_mean"]["layer0"] == pytest.approx(layer0)
    assert record["moe_dropped"]["layer0"] == 0.0


@pytest.mark.parametrize("every", [1, 2])
def test_decoding_with_a_kv_cache_matches_the_forward_pass(every):
    """An MoE model generates with the cache (model/decode.py) as its forward pass reads
    the whole sequence: the routing of a token does not depend on the others (dropless).
    every=2: dense and MoE layers interleaved, the cache walked a unit at a time."""
    cfg = _cfg("model.vocab_size=64", f"model.n_layers={2 * every}", "model.seq_len=16",
               f"model.moe_every={every}")  # fmt: skip
    params = llama.init_params(cfg, jax.random.key(11))
    tokens = jax.random.randint(jax.random.key(12), (2, 9), 0, cfg.vocab_size)
    full = jax.jit(functools.partial(stack.forward, cfg))(params, tokens)
    step = jax.jit(functools.partial(decode.forward_with_cache, cfg))
    cache = decode.init_cache(cfg, 2, 12)
    logits, cache = step(params, tokens[:, :6], cache, 0)
    np.testing.assert_allclose(logits, full[:, :6], atol=1e-5)
    for t in range(6, 9):
        logits, cache = step(params, tokens[:, t : t + 1], cache, t)
        np.testing.assert_allclose(logits[:, 0], full[:, t], atol=1e-5)
