"""model.qk_norm (Qwen3) under tensor parallelism: its scales' gradients summed over the
ranks' heads."""

from __future__ import annotations

import harness
import jax
import numpy as np
from test_parallel import LAYOUTS, batches, make_cfg, setup

from ultrajax.train import batch as batch_lib
from ultrajax.train import step as step_lib


def _one_step_gradients(name, *extra):
    layout = dict(LAYOUTS[name] if name else {}, **{"parallel.collectives": "explicit"})
    cfg = make_cfg(layout, *extra)
    mesh, rules, tx, _, shardings, batch_sh = setup(cfg)
    with jax.set_mesh(mesh):
        params = harness.init_state(cfg, tx, shardings)["params"]
        gradients = jax.jit(step_lib.make_gradients(cfg, mesh, rules))
        grads = gradients(params, batch_lib.place(batches(1, cfg)[0], batch_sh))[0]
    return jax.device_get(grads)


def test_qk_norm_gradients_match_single_device_under_tensor_parallelism():
    """model.qk_norm (Qwen3): each head's queries and keys normalised by a scale the
    tensor ranks share, so its gradient sums over the ranks' heads. One step's gradients,
    every weight within fp32 summation noise of one device's (the 3-step comparison
    would let Adam amplify that noise in the few elements whose gradient is near it)."""
    got = _one_step_gradients("tp2", "model.qk_norm=true")
    want = _one_step_gradients(None, "model.qk_norm=true")
    assert {"q_norm", "k_norm"} <= set(got["layers"])
    flat = jax.tree_util.tree_leaves_with_path(got)
    for (path, a), b in zip(flat, jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.isfinite(a).all()
        # fp32 sums of ~10^3 products in another order: a few 1e-7 of the largest term
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max(), jax.tree_util.keystr(path)
