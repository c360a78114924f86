"""The suite's guard against XLA:CPU running out of memory mappings (conftest.py,
pytest_runtest_teardown) still frees what it is meant to free."""

import jax
import jax.numpy as jnp
import pytest
from conftest import _mappings


def test_emptying_jax_caches_gives_back_the_compiled_programs_mappings():
    """Each compiled program holds memory mappings while jax's caches keep it; emptying
    the caches (what the conftest does past its threshold) gives them back. If a jax
    upgrade kept them, full runs would crash again at the kernel's mapping limit."""
    import gc

    def compile_(count, offset):  # programs no other test compiles (their shapes)
        for n in range(offset, offset + count):
            jax.block_until_ready(jax.jit(lambda x, n=n: jnp.sin(x) * n)(jnp.ones((n,))))

    if not _mappings()[1]:
        pytest.skip("no /proc/self/maps here: not Linux")
    compile_(5, 997)  # what a process maps once, at its first compiles, stays
    before = _mappings()[0]
    compile_(30, 1002)
    grown = _mappings()[0] - before
    assert grown >= 30, grown
    jax.clear_caches()
    gc.collect()
    assert _mappings()[0] - before <= 0.2 * grown, (before, grown, _mappings())
