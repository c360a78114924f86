"""Device peaks for MFU, and the FLOPs-per-token formula (GUIDE section 6)."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from ultrajax import config, metrics
from ultrajax.model import matmul_param_count


@pytest.mark.parametrize(
    "kind,peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
    ],
)
def test_known_gpu_peaks_bf16_dense(kind, peak):
    got, source = metrics.device_peak(SimpleNamespace(device_kind=kind), "bfloat16")
    assert got == peak and "data sheet" in source


def test_unknown_device_has_no_peak():
    got, source = metrics.device_peak(SimpleNamespace(device_kind="Some TPU"), "bfloat16")
    assert got is None and "unknown" in source


def test_flops_per_token_is_6n_plus_12lhs():
    m = config.load(Path(__file__).parents[1] / "configs" / "tiny.yaml").model
    expected = 6 * matmul_param_count(m) + 12 * m.n_layers * m.n_heads * m.hd * m.seq_len
    assert metrics.flops_per_token(m) == expected
    assert metrics.hardware_flops_per_token(m) == expected  # remat none: nothing recomputed


def test_human():
    assert metrics.human(885888) == "885.9K" and metrics.human(1.278e11) == "127.8B"
