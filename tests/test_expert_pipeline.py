"""An MoE model through the pipeline schedules (parallel/pipeline/): 3 steps against one
device, the MoE statistics carried through the ticks back to the model's layer order
(the bias balance reads them), with expert parallelism and under gspmd, zero bubble's
weight step on the experts' grouped matmuls (both implementations); evaluation too.
One model for every case: they share the one-device reference (the suite is compile-bound)."""

from __future__ import annotations

import numpy as np
import pytest
from test_pipeline import grid, pp, run

# 4 layers, bias balance (its update reads every layer's load, brought back from the
# stages in the model's order, or each layer's bias moves by another layer's load): one
# model for every case, so they share the one-device reference
MOE = (
    "model.moe_experts=4", "model.moe_top_k=2", "model.moe_d_ff=32", "model.moe_z_coef=0.001",
    "model.n_layers=4", "model.moe_balance=bias", "model.moe_bias_rate=0.01",
    "model.moe_grouped=ragged",  # a GPU's default (the blocks: tests/test_expert.py)
)  # fmt: skip
CASES = {
    "p2-interleaved-v2": pp(2, "interleaved", v=2),  # 2 chunks on each of 2 stages
    "p2-expert2-fsdp2-zero1-afab-gspmd": pp(
        2, "afab", ("mesh.expert", 2), ("mesh.fsdp", 2), ("parallel.zero", 1), collectives="gspmd"
    ),
    # zero bubble: the experts' weight gradients from the pairs the input step kept, on the
    # rows each expert rank received; the router's bias (no gradient) passes through W
    # (the blocks' deferred gradient: tests/test_grouped.py)
    "p2-expert2-data2-zb-h1": pp(2, "zb-h1", ("mesh.expert", 2), ("mesh.data", 2)),
    # 1F1B beside expert and data parallelism, with a dense layer before each MoE layer
    # (model.moe_every=2): each stage one unit of the two (model/units.py), each layer
    # recomputed on its own; its own one-device reference
    "p2-expert2-data2-1f1b-every2": pp(2, "1f1b", ("mesh.expert", 2), ("mesh.data", 2)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_moe_pipelines_match_single_device(name):
    every = ("model.moe_every=2", "model.remat=full") if name.endswith("-every2") else ()
    got, ref = run(CASES[name], 4, *MOE, *every), run((), 4, *MOE, *every)
    grid.assert_same_training(got, ref)
    total, count, _ = got[4]
    assert count == ref[4][1] > 0
    np.testing.assert_allclose(total, ref[4][0], rtol=2e-6)
