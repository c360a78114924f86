"""tools/roofline.py: each kernel of a compiled module with the bytes it moves and its
matmul FLOPs, counted with its loop's trips, on a program whose traffic is known."""

import jax
import jax.numpy as jnp
import pytest

from ultrajax.tools import roofline

ROWS, COLS, STEPS = 256, 512, 4
MIB = 2**20


@pytest.fixture(scope="module")
def found():
    """A scan of 4 steps: a matmul, tanh, and the tanh stacked into the scan's output."""

    def f(x, w):
        def body(c, _):
            y = jnp.tanh(c @ w)
            return y * 2.0 + 1.0, y

        return jax.lax.scan(body, x, None, length=STEPS)

    x = jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32)  # 0.5 MiB
    w = jax.ShapeDtypeStruct((COLS, COLS), jnp.float32)  # 1 MiB
    return roofline.kernels(jax.jit(f).lower(x, w).compile().as_text())


def test_matmul_flops_and_bytes_count_every_trip(found):
    (dot,) = [k for k in found if k.flops]
    assert dot.count == STEPS
    assert dot.flops == STEPS * 2 * ROWS * COLS * COLS
    assert dot.bytes == STEPS * (0.5 + 1 + 0.5) * MIB  # reads c and w, writes c @ w


def test_a_stacked_output_is_written_a_slice_a_step_in_place(found):
    """The scan's ys buffer (4 x 0.5 MiB): zeroed once, then each step writes its slice
    in place: 0.5 MiB read and 0.5 written a step, not the whole buffer."""
    stacked = [k for k in found if k.shape.startswith(f"f32[{STEPS},{ROWS},{COLS}]")]
    per_step = [k for k in stacked if k.count == STEPS]
    once = [k for k in stacked if k.count == 1]
    assert len(per_step) == 1  # and the step's index, 4 bytes:
    assert per_step[0].bytes == pytest.approx(STEPS * (0.5 + 0.5) * MIB, abs=STEPS * 4)
    # the zeros, written (from a scalar)
    assert sum(k.bytes for k in once) == pytest.approx(STEPS * 0.5 * MIB, abs=8)


def test_summary_names_each_kind_with_its_bound(found):
    """The matmuls' row: its runs, and its bound, FLOPs / rate here (at 1 GFLOP/s and
    1 GB/s: 537 ms against 8 ms); the memory-bound row; the top kernels listed."""
    text = roofline.summary(found, bandwidth=1e9, matmul_rate=1e9, top=2)
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if "|" in line}
    cells = [c.strip() for c in rows["matmuls"].strip("|").split("|")]
    assert cells[1] == str(STEPS)
    flops = STEPS * 2 * ROWS * COLS**2
    assert float(cells[4].replace(",", "")) == pytest.approx(flops / 1e9 * 1e3, abs=0.1)
    memory_bound = [c.strip() for c in rows["memory-bound (fusions, copies)"].strip("|").split("|")]
    moved = sum(k.bytes for k in found if not k.flops and k.op != "custom-call")
    assert float(memory_bound[4]) == pytest.approx(moved / 1e9 * 1e3, abs=0.05)
    top = text.split("moving the most:")[1].strip().splitlines()[2:]
    assert len(top) == 2 and float(top[0].split("|")[1]) >= float(top[1].split("|")[1])


def test_collectives_are_a_row_of_their_own_without_an_hbm_bound():
    """A psum over two devices: its all-reduce is counted apart from the memory-bound
    kernels (its time is the links', cost/comms.py), with no bound of its own."""
    mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2])
    spec = jax.sharding.PartitionSpec("d")

    @jax.jit
    def f(x):
        return jax.shard_map(lambda a: jax.lax.psum(a * 2.0, "d"), mesh=mesh, in_specs=spec,
                             out_specs=jax.sharding.PartitionSpec())(x)  # fmt: skip

    x = jax.ShapeDtypeStruct((2 * ROWS, COLS), jnp.float32,
                             sharding=jax.sharding.NamedSharding(mesh, spec))  # fmt: skip
    found = roofline.kernels(f.lower(x).compile().as_text())
    reduce = [k for k in found if k.op.removesuffix("-start") == "all-reduce"]
    assert len(reduce) == 1 and reduce[0].bytes == 2 * 0.5 * MIB  # operand and result
    rows = roofline.summary(found, 1e9, 1e9).splitlines()
    (row,) = [r for r in rows if r.startswith("| collectives")]
    assert row.rstrip().endswith("| - |")
