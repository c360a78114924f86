"""Shapes shared by test_analyze.py and test_memory.py: one definition, so that a session
compiles each of their programs once (the persistent cache keys on the exact program)."""

from pathlib import Path

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
]
