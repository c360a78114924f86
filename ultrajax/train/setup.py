"""Everything before the loop: the mesh, the data, the sharded state, the compiled
steps; and the host batches turned into the step's global arrays."""

from __future__ import annotations

import time
from typing import NamedTuple

import jax
import numpy as np

from ultrajax.config.schema import Config, ConfigError
from ultrajax.config.validate import resolve_mesh
from ultrajax.data import loader as data_lib
from ultrajax.model.attention import backends as attention
from ultrajax.parallel import mesh as mesh_lib
from ultrajax.parallel.context import token_order
from ultrajax.parallel.layout import unsupported
from ultrajax.train import batch as batch_lib
from ultrajax.train import distributed, optim
from ultrajax.train.ramp import Ramp
from ultrajax.train.step import (
    init_state,
    jit_train_step,
    make_eval_step,
    state_shardings,
)


class RunParts(NamedTuple):
    """What `build_run` makes, by name (it still unpacks as the 7-tuple scripts take apart)."""

    mesh: jax.sharding.Mesh
    rules: dict  # logical axis -> mesh axes (parallel/mesh.py)
    data: data_lib.Data  # the train stream and the eval batches
    state: dict  # params, opt_state, step; ShapeDtypeStructs when a checkpoint replaces it
    step_fn: object  # the jitted train step, to be compiled per batch size
    eval_fn: object  # jitted (params, batch) -> (summed loss, targets)
    batch_sh: jax.sharding.NamedSharding  # where the step's batch lives


def check_backend(cfg: Config) -> None:
    """Options that need hardware this process does not have."""
    backend = jax.default_backend()
    name = attention.resolve(
        cfg.model.attention, backend, cfg.data.cross_doc_mask, cfg.model.seq_len
    )
    if attention.problem(name, backend):
        raise ConfigError(attention.problem(name, backend))
    problem = unsupported(cfg, backend)
    if problem:
        raise ConfigError(problem)
    if cfg.model.remat == "offload" and backend != "gpu":
        raise ConfigError(
            f"model.remat=offload needs host offloading, which the {backend} backend lacks; "
            "use full or selective"
        )


def to_global(packed: dict, sharding, cfg: Config) -> batch_lib.Batch:
    """Packed rows (global_batch, S+1) on the host -> the step's Batch on the devices."""
    b = batch_lib.make(packed, cfg.data.cross_doc_mask, cfg.train.grad_accum, token_order(cfg))
    return batch_lib.place(b, sharding)


def rows_to_global(packed: dict, rows, grad_accum: int, sharding, cfg: Config) -> batch_lib.Batch:
    """This process's packed rows (numbered `rows` in a global batch of grad_accum
    micro-batches) -> the global Batch."""
    b = batch_lib.make(packed, cfg.data.cross_doc_mask, None, token_order(cfg))
    total = grad_accum * cfg.train.micro_batch_size * cfg.dp
    return batch_lib.place_rows(b, rows, total, grad_accum, sharding)


def compile_steps(step_fn, state, ramp: Ramp, batch_sh, cfg: Config, say) -> dict:
    """One compiled step per batch size of the run, ahead of the loop: a ramp never stops
    to compile (the number of micro-batches is part of the program)."""
    rows = cfg.train.micro_batch_size * cfg.dp
    position = jax.ShapeDtypeStruct((), np.float32)
    out = {}
    for ga in ramp.sizes():
        t0 = time.perf_counter()
        size = f" for {ga * rows} sequences" if len(ramp.sizes()) > 1 else ""
        say(f"compiling the step{size} ...")  # minutes for a large model: said first
        batch = batch_lib.abstract(ga, rows, cfg.model.seq_len, batch_sh)
        out[ga] = step_fn.lower(state, batch, position).compile()
        say(f"compiled the step{size} in {time.perf_counter() - t0:.1f}s")
    return out


def build_run(cfg: Config, *, fresh: bool = True) -> RunParts:
    """Everything before the loop: mesh, data, state, the jitted steps. (Not to be confused
    with `python -m ultrajax.data.prepare`, which tokenizes a corpus into shards.)

    fresh=False (a checkpoint is about to replace the state): the state is returned as
    ShapeDtypeStructs carrying its shardings, and nothing is initialised for nothing."""
    distributed.check_local_devices()  # SLURM: one process per node uses all its GPUs
    resolve_mesh(cfg, jax.device_count())
    check_backend(cfg)
    mesh = mesh_lib.make_mesh(cfg)
    rules = mesh_lib.rules(cfg)
    batch_sh = batch_lib.sharding(mesh)
    # Each process packs only the streams holding its devices' rows (ultrajax/data/streams.py):
    # the global batch is that of a single process, whatever the process count.
    rows = batch_lib.rows_needed(
        batch_sh, cfg.train.grad_accum, cfg.global_batch, cfg.model.seq_len
    )
    data = data_lib.build(
        cfg.data,
        seq_len=cfg.model.seq_len,
        batch_size=cfg.global_batch,
        seed=cfg.train.seed,
        vocab_size=cfg.model.vocab_size,
        grad_accum=cfg.train.grad_accum,
        rows=rows,
        batch_sizes=Ramp(cfg).batches(),  # the default stream count splits each
    )
    distributed.check_same_data(data.corpora)
    tx, schedule = optim.optimizer(cfg), optim.lr_schedule(cfg)
    shardings = state_shardings(cfg, mesh, rules, tx)
    with jax.set_mesh(mesh):
        init = jax.jit(lambda k: init_state(cfg, tx, k), out_shardings=shardings)
        if fresh:
            key = jax.random.key(cfg.train.seed)
            # run once: on a CPU XLA's optimisations cost more compile time than they save
            fast = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else {}
            state = init.lower(key).compile(fast or None)(key)
        else:
            state = jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                jax.eval_shape(init, jax.random.key(cfg.train.seed)),
                shardings,
            )
        step_fn = jit_train_step(cfg, mesh, rules, tx, schedule, shardings, batch_sh, position=True)
        eval_fn = jax.jit(
            make_eval_step(cfg, mesh, rules), in_shardings=(shardings["params"], batch_sh)
        )
    return RunParts(mesh, rules, data, state, step_fn, eval_fn, batch_sh)
