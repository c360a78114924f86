"""The one test harness: a config and its devices for any layout, and everything the step
needs on that mesh. Tests that compile the same shapes (analyze, memory) build them here,
so a session compiles each program once (the persistent cache keys on the exact program).
"""

import dataclasses
import math
import os
from pathlib import Path

import jax

from ultrajax.config import parse, validate
from ultrajax.parallel import mesh as mesh_lib
from ultrajax.train import batch as batch_lib
from ultrajax.train import optim
from ultrajax.train import step as step_lib

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
FAST = {"xla_backend_optimization_level": 0}  # same buffers and HLO, half the compile time
BASE = [
    "model.n_layers=2",
    "train.micro_batch_size=2",
    "train.grad_accum=1",
    "model.seq_len=64",
    "model.d_model=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=192",
    "model.vocab_size=256",
    "model.dtype=float32",
    "model.scan_unroll=1",  # the rolled layer loop the memory and HLO tests read
    "model.attention=xla",  # the plain attention whose s² scores the memory model counts
]


def child_env(**extra) -> dict[str, str]:
    """The environment for a run a test starts: CPU, devices from its own --cpu-devices,
    and of XLA_FLAGS only conftest's: the collective timeout (a late thread on 2 loaded
    cores is starvation, not a deadlock: without it a child aborts after XLA's 40 s) and
    the fast compiles (conftest's optimisation level and code generation); and a narrower
    CPU's vector width where the suite was asked to run as on one (README, tests/)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    ours = (
        "collective_call_terminate",
        "xla_backend_optimization_level",
        "fusion_emitters",
        "xla_cpu_max_isa",
    )
    keep = [f for f in env.pop("XLA_FLAGS", "").split() if any(o in f for o in ours)]
    if keep:
        env["XLA_FLAGS"] = " ".join(keep)
    env.update(extra)
    return env


def make(*overrides, base=BASE, path=TINY):
    """(config, its devices): the mesh sizes, all six axes, give the device count."""
    cfg = parse.load(path, list(base) + list(overrides))
    n = math.prod(cfg.mesh.sizes().values())
    validate.resolve_mesh(cfg, n)
    return cfg, jax.devices()[:n]


def setup(cfg, devices=None):
    """(mesh, rules, optimizer, schedule, state shardings, batch sharding) of a config."""
    devices = devices or jax.devices()[: math.prod(cfg.mesh.sizes().values())]
    mesh = mesh_lib.make_mesh(cfg, devices)
    rules = mesh_lib.rules(cfg)
    tx, schedule = optim.optimizer(cfg), optim.lr_schedule(cfg)
    shardings = step_lib.state_shardings(cfg, mesh, rules, tx)
    return mesh, rules, tx, schedule, shardings, batch_lib.sharding(mesh)


def init_state(cfg, tx, shardings, seed: int = 0):
    """The train state `step.init_state` gives `cfg` (key `seed`), placed with `shardings`.
    Initialised once per model and optimizer, on one device, and placed: the values do
    not depend on the layout (JAX's partitionable random bits), and a sharded
    initialisation is a compile per layout (~3 s each, most of a small layout test)."""
    # DiLoCo's state holds a replica per data rank (parallel/diloco.py)
    replicas = cfg.mesh.data if cfg.parallel.diloco_steps else 0
    key = (repr(init_model(cfg.model)), repr(cfg.optim), seed, replicas)
    if key not in _HOST_STATES:
        k = jax.random.key(seed)
        init = jax.jit(lambda k: step_lib.init_state(cfg, tx, k)).lower(k).compile(FAST)
        _HOST_STATES[key] = jax.device_get(init(k))
    return jax.device_put(_HOST_STATES[key], shardings)


_HOST_STATES: dict = {}  # the session's initial states, by model, optimizer and seed

# model fields that change how the step computes, not the state it starts from: states
# are shared across them (tests/test_model.py holds them to that), an init compile fewer
# for every remat policy, attention, loss chunk or unroll a test varies
NOT_IN_STATE = dict(
    dtype="float32", remat="none", attention="auto", attention_blocks=None,
    attention_backward="split", loss_chunk=None, scan_unroll=1, seq_len=256, norm_eps=1e-5,
    moe_grouped="auto", moe_capacity=0.0, moe_aux_coef=0.01, moe_z_coef=0.0,
)  # fmt: skip


def init_model(model):
    """The model config `init_state` keys its states by: NOT_IN_STATE's fields at one value."""
    return dataclasses.replace(model, **NOT_IN_STATE)
