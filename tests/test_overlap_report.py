"""The overlap report (ultrajax/tools/overlap.py): on hand-written modules, a collective's
dependencies decide its verdict; on a compiled ring-attention step, the forward's K/V
sends in the ring loop have the pair's attention beside them; and the script's table
and its --gpu refusal on a CPU host (scripts/bench_overlap.py)."""

import sys
from pathlib import Path

import harness
import pytest

from ultrajax.tools import analyze, overlap

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

RING = "source_target_pairs={{0,1},{1,2},{2,3},{3,0}}"
DOT = "lhs_contracting_dims={1}, rhs_contracting_dims={0}"
MESH = {"data": 2, "sequence": 4}


def module(entry: str) -> str:
    """A 4-device module: a fused dot computation, and `entry`'s body as ENTRY."""
    return f"""HloModule m, num_partitions=4

%fused_dot (p0: f32[8,8], p1: f32[8,8]) -> f32[8,8] {{
  %p0 = f32[8,8]{{1,0}} parameter(0)
  %p1 = f32[8,8]{{1,0}} parameter(1)
  ROOT %d = f32[8,8]{{1,0}} dot(%p0, %p1), {DOT}
}}

%fused_add (q0: f32[8,8], q1: f32[8,8]) -> f32[8,8] {{
  %q0 = f32[8,8]{{1,0}} parameter(0)
  %q1 = f32[8,8]{{1,0}} parameter(1)
  ROOT %s = f32[8,8]{{1,0}} add(%q0, %q1)
}}

ENTRY %main (a: f32[8,8], b: f32[8,8]) -> (f32[8,8], f32[8,8]) {{
  %a = f32[8,8]{{1,0}} parameter(0)
  %b = f32[8,8]{{1,0}} parameter(1)
{entry}
}}
"""


def test_a_permute_independent_of_the_dot_can_overlap():
    (row,) = overlap.rows(
        module(
            "  %mm = f32[8,8]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused_dot\n"
            f"  %send = f32[8,8]{{1,0}} collective-permute(%b), channel_id=1, {RING}\n"
            "  ROOT %t = (f32[8,8]{1,0}, f32[8,8]{1,0}) tuple(%mm, %send)"
        ),
        MESH,
    )
    assert (row.name, row.kind, row.bytes, row.count) == ("send", "collective-permute", 256, 1)
    assert row.waits_on == [] and row.beside == ["mm"] and row.verdict == "can overlap"
    assert row.axis == "sequence" and row.group == 4  # pairs 0->1->2->3->0 of data=2 x seq=4


def test_a_permute_fed_by_the_dot_alone_is_exposed():
    """An elementwise fusion beside it is no compute to hide behind."""
    (row,) = overlap.rows(
        module(
            f"  %mm = f32[8,8]{{1,0}} dot(%a, %b), {DOT}\n"
            "  %sum = f32[8,8]{1,0} fusion(%a, %b), kind=kLoop, calls=%fused_add\n"
            f"  %send = f32[8,8]{{1,0}} collective-permute(%mm), channel_id=1, {RING}\n"
            "  ROOT %t = (f32[8,8]{1,0}, f32[8,8]{1,0}) tuple(%send, %sum)"
        )
    )
    assert row.waits_on == ["mm"] and row.beside == [] and row.verdict == "exposed"
    assert row.axis == ""  # no mesh given


def test_an_async_pair_spans_from_its_start_to_its_done():
    """The dot scheduled between start and done is beside it and in flight with it; the
    dot that reads the done's result is after it; the one feeding the start, before."""
    pair = "(f32[8,8]{1,0}, f32[8,8]{1,0})"
    rows = overlap.rows(
        module(
            f"  %pre = f32[8,8]{{1,0}} dot(%a, %b), {DOT}\n"
            f"  %start = {pair} collective-permute-start(%pre), channel_id=1, {RING}\n"
            f"  %mid = f32[8,8]{{1,0}} dot(%a, %a), {DOT}\n"
            "  %done = f32[8,8]{1,0} collective-permute-done(%start)\n"
            f"  %use = f32[8,8]{{1,0}} dot(%done, %b), {DOT}\n"
            "  ROOT %t = (f32[8,8]{1,0}, f32[8,8]{1,0}) tuple(%mid, %use)"
        ),
        MESH,
    )
    (row,) = rows
    assert (row.name, row.bytes) == ("start", 256)  # the output half of the start's tuple
    assert row.waits_on == ["pre"] and row.beside == ["mid"] and row.span == ["mid"]


def test_a_wrapped_async_reduce_scatter_reads_its_caller():
    """A GPU's async reduce-scatter lives in a computation of its own, started and ended
    by async-start/async-done in the caller, where its dependencies are."""
    text = module(
        "  %start = ((f32[8,8]{1,0}), f32[2,8]{1,0}) async-start(%b), calls=%wrapped\n"
        f"  %mm = f32[8,8]{{1,0}} dot(%a, %a), {DOT}\n"
        "  %done = f32[2,8]{1,0} async-done(%start)\n"
        "  ROOT %t = (f32[8,8]{1,0}, f32[2,8]{1,0}) tuple(%mm, %done)"
    ).replace(
        "ENTRY",
        "%add (x: f32[], y: f32[]) -> f32[] {\n  %x = f32[] parameter(0)\n"
        "  %y = f32[] parameter(1)\n  ROOT %z = f32[] add(%x, %y)\n}\n\n"
        "%wrapped (w: f32[8,8]) -> f32[2,8] {\n  %w = f32[8,8]{1,0} parameter(0)\n"
        "  ROOT %rs = f32[2,8]{1,0} reduce-scatter(%w), channel_id=1, "
        "replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add\n}\n\nENTRY",
    )
    (row,) = overlap.rows(text)
    assert (row.kind, row.computation, row.group, row.bytes) == ("reduce-scatter", "main", 4, 64)
    assert row.beside == ["mm"] and row.span == ["mm"]


def test_axes_name_the_mesh_axes_a_group_varies_along():
    assert overlap.axes_of([[0, 4], [1, 5], [2, 6], [3, 7]], MESH) == "data"
    assert overlap.axes_of([list(range(8))], MESH) == "data+sequence"
    assert overlap.axes_of([[0, 1], [1, 2], [2, 3], [3, 0]], MESH) == "sequence"


@pytest.fixture(scope="module")
def ring():
    """The train step with ring attention over 4 devices (harness.BASE's small shapes):
    the compiled module and the module as the partitioner left it, from one compile."""
    cfg, devices = harness.make("mesh.sequence=4")
    return cfg, devices, analyze.compile_step_partitioned(cfg, devices, harness.FAST)


def test_the_ring_forward_sends_k_and_v_beside_the_pairs_attention(ring):
    """In the ring loop (the innermost loop that sends, run layers x steps times) the
    forward's K and V sends wait on no compute, and the pair's attention runs beside."""
    _, _, (compiled, partitioned) = ring
    for text in (compiled.as_text(), partitioned):
        found = overlap.rows(text, {"sequence": 4})
        forward = [
            r
            for r in found
            if r.kind == "collective-permute" and r.dtype == "f32" and "transpose(" not in r.where
        ]
        most = max(r.count for r in forward)
        kv = [r for r in forward if r.count == most]
        assert len(kv) == 2 and most > 2, [(r.name, r.count, r.where) for r in forward]
        for r in kv:
            assert r.axis == "sequence" and r.verdict == "can overlap", r
            assert r.beside and not r.waits_on, r


def test_the_script_prints_the_table_of_a_layout(ring, capsys, monkeypatch):
    """The same config as the fixture's (harness.BASE): the script is handed the
    fixture's compile, once it has asked for that config on those devices."""
    import bench_overlap

    from ultrajax.config.parse import dump

    cfg, devices, compiled = ring
    asked = []

    def compile_step_partitioned(other, devs, options):
        asked.append((dump(other), [d.id for d in devs], options))
        return compiled

    monkeypatch.setattr(analyze, "compile_step_partitioned", compile_step_partitioned)
    assert bench_overlap.FAST == harness.FAST
    args = ["--config", harness.TINY, *harness.BASE, "mesh.sequence=4"]
    assert bench_overlap.main(args) == 0
    assert asked == [(dump(cfg), [d.id for d in devices], harness.FAST)]
    out = capsys.readouterr().out
    assert "| collective | kind | axis (group) |" in out and "sequence (4)" in out
    assert "can overlap" in out and "the partitioned module: " in out


def test_the_script_refuses_gpu_timing_without_a_gpu(capfd):
    import bench_overlap

    with pytest.raises(SystemExit) as e:
        bench_overlap.main(["--gpu", "--steps", "1"])
    assert e.value.code == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --gpu needs a GPU"), err
