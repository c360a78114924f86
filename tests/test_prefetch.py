"""ZeRO-3's prefetch in the compiled program (model/prefetch.py): the next layer's gather
beside this layer's compute, forward and backward. Apart from test_parallel.py so the
two files' compiles run on both workers."""

from __future__ import annotations

import pytest
from test_parallel import ACCUM, run

from ultrajax.tools import hlo, overlap


def _layer_gathers(text: str, layers: int) -> dict[str, list]:
    """Layer loop body -> its all-gathers (overlap.rows), for loops of `layers` - 1
    (the backward: layer 0's is after it) or `layers` iterations per micro-batch."""
    out = {}
    for r in overlap.rows(text):
        if r.kind == "all-gather" and r.count in (ACCUM * (layers - 1), ACCUM * layers):
            out.setdefault(r.computation, []).append(r)
    return out


@pytest.mark.parametrize("prefetch", [True, False])
def test_zero_3_gathers_the_next_layer_while_this_one_computes(prefetch):
    """ZeRO-3's prefetch (model/prefetch.py), in the compiled program: in the forward
    and the backward layer loop, each all-gather waits on no compute of its iteration
    and none of its iteration's compute waits on it: all of that compute is beside it,
    for a GPU to overlap. Without the prefetch (the test's negative) the layer's matmuls
    wait on their own weights' gathers. 3 layers: the backward loop has 2 iterations."""
    extra = ("model.n_layers=3",) + (() if prefetch else ("parallel.prefetch=false",))
    text = run("fsdp8-zero3", "explicit", *extra)[3]
    found = _layer_gathers(text, 3)
    assert len(found) == 2, found  # the forward and the backward loop
    mod = hlo.parse_module(text)
    computing = overlap._computing(mod)
    for comp, rows in found.items():
        assert len(rows) == 9, rows  # the layer's weights: 2 norms, 4 attention, 3 MLP
        compute = overlap._Graph(mod.computations[comp], computing).compute
        assert len(compute) >= 3
        beside = all(not r.waits_on and len(r.beside) == len(compute) for r in rows)
        assert beside == prefetch, [(r.name, len(r.waits_on), len(r.beside)) for r in rows]
