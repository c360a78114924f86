"""The suite's guard against XLA:CPU running out of memory mappings (conftest.py,
pytest_runtest_teardown) still frees what it is meant to free."""

import gc

import jax
import jax.numpy as jnp
import pytest
from conftest import _mappings


def _ranges() -> set[str]:
    """The address ranges of this process's memory mappings."""
    with open("/proc/self/maps") as maps:
        return {line.split(maxsplit=1)[0] for line in maps}


def test_emptying_jax_caches_gives_back_the_compiled_programs_mappings():
    """Each compiled program holds memory mappings while jax's caches keep it; emptying
    the caches (what the conftest does past its threshold) gives them back. If a jax
    upgrade kept them, full runs would crash again at the kernel's mapping limit.

    The mappings are followed by address, not counted: in a worker that ran other tests
    first, their garbage collected mid-test and their threads ending unmap memory too
    (CI, 2026-11-28: 260 fewer mappings after 30 compiles than before them)."""

    def compile_(count, offset):  # programs no other test compiles (their shapes)
        for n in range(offset, offset + count):
            jax.block_until_ready(jax.jit(lambda x, n=n: jnp.sin(x) * n)(jnp.ones((n,))))

    if not _mappings()[1]:
        pytest.skip("no /proc/self/maps here: not Linux")
    compile_(5, 997)  # what a process maps once, at its first compiles, stays
    gc.collect()
    before = _ranges()
    compile_(30, 1002)
    new = _ranges() - before
    assert len(new) >= 30, len(new)
    jax.clear_caches()
    gc.collect()
    kept = new & _ranges()
    assert len(kept) <= 0.2 * len(new), (len(kept), len(new))
