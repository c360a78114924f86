"""What the benchmark scripts share: the median time of a call, and of a compiled train
step from a fresh sharded state on one host batch."""

from __future__ import annotations

import functools
import statistics
import time


def median_ms(f, iters: int, warmup: int = 2) -> float:
    """`f()` (which blocks until its work is done) `warmup` times, then `iters` times
    timed: the median in ms."""
    for _ in range(warmup):
        f()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def median_step_ms(compiled, cfg, devices, batch, steps: int) -> float:
    """Place `batch` (a host `batch.Batch`) and a fresh state on `devices` as the train
    command would, run `compiled` once to warm up, then `steps` times: the median in ms."""
    import jax

    from ultrajax.parallel import mesh as mesh_lib
    from ultrajax.train import batch as batch_lib
    from ultrajax.train import optim
    from ultrajax.train import step as step_lib

    mesh = mesh_lib.make_mesh(cfg, devices)
    tx = optim.optimizer(cfg)
    shardings = step_lib.state_shardings(cfg, mesh, mesh_lib.rules(cfg), tx)
    with jax.set_mesh(mesh):
        init = jax.jit(functools.partial(step_lib.init_state, cfg, tx), out_shardings=shardings)
        state = init(jax.random.key(0))
        placed = batch_lib.place(batch, batch_lib.sharding(mesh))
        times = []
        for _ in range(steps + 1):
            t0 = time.perf_counter()
            state, out = compiled(state, placed)
            jax.block_until_ready(out["loss"])
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[1:])
