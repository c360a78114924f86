"""The one hardware table drives MFU (metrics), the memory verdict (memory) and the
planner's step time (steptime): change an entry and each of them follows."""

from dataclasses import replace
from types import MappingProxyType, SimpleNamespace

import pytest

from ultrajax.config import schema as config
from ultrajax.cost import flops, hardware, steptime
from ultrajax.cost import hardware as hardware_lib
from ultrajax.train import peaks

H100 = "NVIDIA H100 80GB HBM3"


def _fake(kind):
    return SimpleNamespace(device_kind=kind, platform="gpu", memory_stats=lambda: {})


@pytest.fixture
def doubled(monkeypatch):
    """The H100 entry with twice the FLOPs, memory and links."""
    h100 = hardware.by_name("h100")
    fast = replace(
        h100,
        peak=MappingProxyType({k: 2 * v for k, v in h100.peak.items()}),
        memory=2 * h100.memory,
        intra_bw=2 * h100.intra_bw,
        inter_bw=2 * h100.inter_bw,
    )
    table = tuple(fast if a.name == "h100" else a for a in hardware.ACCELERATORS)
    monkeypatch.setattr(hardware, "ACCELERATORS", table)
    return h100, fast


def test_metrics_and_memory_read_the_table(doubled):
    h100, fast = doubled
    assert hardware.lookup(H100) is fast
    peak, source = peaks.device_peak(_fake(H100), config.ModelConfig(dtype="bfloat16"))
    assert peak == fast.flops("bfloat16") == 2 * 989e12 and "h100" in source
    assert hardware_lib.device_memory(_fake(H100))[0] == fast.memory == 2 * h100.memory
    assert hardware.lookup("NVIDIA H100 PCIe").name == "h100-pcie"  # the specific one first


def _cfg(**mesh):
    cfg = config.Config()
    m = cfg.model
    m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads = 32000, 2048, 16, 16, 8
    m.d_ff, m.seq_len, m.attention = 5632, 2048, "cudnn"
    cfg.train.micro_batch_size, cfg.train.grad_accum = 2, 4
    for k, v in mesh.items():
        setattr(cfg.mesh, k, v)
    return cfg


def test_planner_step_time_reads_the_table():
    """Twice the FLOP/s halves the compute; twice the NIC bandwidth shortens the gradient
    reduction of a data axis that crosses nodes; the node size decides which link."""
    h100 = hardware.by_name("h100")
    cfg = _cfg(data=2, tensor=8)  # two nodes of 8: one replica each
    base = steptime.predict(cfg, h100, 8)
    faster = steptime.predict(
        cfg, replace(h100, peak=MappingProxyType({"bfloat16": 2 * 989e12})), 8
    )
    assert faster.compute == pytest.approx(base.compute / 2)
    f = steptime.features(cfg, h100, 8)
    f2 = steptime.features(cfg, replace(h100, inter_bw=2 * h100.inter_bw), 8)
    (link, _), (link2, _) = f.hidden[0], f2.hidden[0]
    assert link.inter and link.bw == h100.inter_bw and link2.bw == 2 * link.bw
    exposed = steptime.Fit(overlap=0.0)  # nothing hidden behind the backward
    assert steptime.step_time(f2, exposed).data == pytest.approx(
        steptime.step_time(f, exposed).data / 2, rel=0.01
    )
    one_node = steptime.features(cfg, h100, 16)  # a 16-GPU node: NVLink only
    assert not one_node.hidden[0][0].inter and one_node.hidden[0][0].bw == h100.intra_bw


def test_planner_compute_takes_fp8_matmuls_at_the_fp8_peak():
    """model.fp8: the predicted compute is the bf16 prediction x bf16's peak / the model's
    blended peak (flops.model_peak); the A100, with no FP8 peak, predicts no change."""
    cfg = _cfg(data=8)
    cfg.model.dtype = "bfloat16"
    h100, a100 = hardware.by_name("h100"), hardware.by_name("a100")
    base, base_a100 = steptime.predict(cfg, h100, 8), steptime.predict(cfg, a100, 8)
    cfg.model.fp8 = "rowwise"
    blended = flops.model_peak(cfg.model, h100.flops)
    assert 989e12 < blended < 1979e12
    fp8 = steptime.predict(cfg, h100, 8)
    assert fp8.compute == pytest.approx(base.compute * 989e12 / blended, rel=1e-9)
    assert steptime.predict(cfg, a100, 8).compute == pytest.approx(base_a100.compute)


def test_links_follow_the_mesh_order_and_node_size():
    h100 = hardware.by_name("h100")
    sizes = {"data": 4, "fsdp": 1, "pipeline": 1, "sequence": 1, "tensor": 8}
    link = steptime.links(sizes, h100, 8)
    assert not link["tensor"].inter and link["tensor"].bw == h100.intra_bw
    # data: one member per node (tensor fills the node): one NIC each
    assert link["data"].inter and link["data"].bw == h100.inter_bw
    sizes = {"data": 32, "fsdp": 1, "pipeline": 1, "sequence": 1, "tensor": 1}
    # 8 members per node: the node's 8 NICs carry the ring, min(NVLink, 8 x NIC)
    assert steptime.links(sizes, h100, 8)["data"].bw == min(h100.intra_bw, 8 * h100.inter_bw)
