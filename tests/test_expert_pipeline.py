"""An MoE model through the pipeline schedules (parallel/pipeline/): 3 steps against one
device, the MoE statistics carried through the ticks back to the model's layer order
(the bias balance reads them), with expert parallelism and under gspmd; evaluation too."""

from __future__ import annotations

import numpy as np
import pytest
from test_pipeline import grid, pp, run

MOE = ("model.moe_experts=4", "model.moe_top_k=2", "model.moe_d_ff=32", "model.moe_z_coef=0.001")
CASES = {
    # 4 layers as 2 chunks on each of 2 stages: the statistics come back in the model's
    # order, or each layer's bias moves by another layer's load
    "p2-interleaved-v2-bias": (
        pp(2, "interleaved", v=2),
        ("model.n_layers=4", "model.moe_balance=bias", "model.moe_bias_rate=0.01"),
    ),
    "p2-expert2-data2-1f1b": (pp(2, "1f1b", ("mesh.expert", 2), ("mesh.data", 2)), ()),
    "p2-expert2-fsdp2-zero1-afab-gspmd": (
        pp(
            2,
            "afab",
            ("mesh.expert", 2),
            ("mesh.fsdp", 2),
            ("parallel.zero", 1),
            collectives="gspmd",
        ),
        (),
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", list(CASES))
def test_moe_pipelines_match_single_device(name):
    layout, model = CASES[name]
    got, ref = run(layout, 4, *model, *MOE), run((), 4, *model, *MOE)
    grid.assert_same_training(got, ref)
    total, count, _ = got[4]
    assert count == ref[4][1] > 0
    np.testing.assert_allclose(total, ref[4][0], rtol=2e-6)
