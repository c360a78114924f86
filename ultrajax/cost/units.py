"""Bytes and counts for people: parsing and printing sizes, dtype widths."""

from __future__ import annotations

import math

import jax.numpy as jnp


def human(n: float, digits: int = 4) -> str:
    """1234567 -> '1.235M': counts and rates in tables and logs."""
    for unit in ("", "K", "M", "B", "T"):
        if abs(n) < 1000:
            return f"{n:.{digits}g}{unit}"
        n /= 1000
    return f"{n:.{digits}g}P"


def si(n: float, unit: str, digits: int = 4) -> str:
    """4.86e11, 'FLOP/s' -> '486 GFLOP/s': a rate in SI prefixes (G, not human's B, which
    reads as billions only in counts), spaced from its number."""
    for prefix in ("", "k", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.{digits}g} {prefix}{unit}"
        n /= 1000
    return f"{n:.{digits}g} P{unit}"


GiB = 2**30


def dtype_bytes(name: str) -> int:
    return jnp.dtype(name).itemsize


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def parse_bytes(text: str) -> int:
    """'80GB' (10^9), '80GiB' / '80G' (2^30), '85899345920': bytes, or ValueError."""
    units = {
        "": 1,
        "b": 1,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
        "k": 2**10,
        "m": 2**20,
        "g": 2**30,
        "t": 2**40,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
    }
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num) :]
    if unit not in units or not num:
        raise ValueError(text)
    value = float(num) * units[unit]
    if not math.isfinite(value) or value <= 0:
        raise ValueError(text)
    return int(value)
