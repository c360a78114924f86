"""Device peaks for MFU, the FLOPs-per-token formula (GUIDE section 6), and the metrics
writer's TensorBoard and W&B scalars."""

import json
import struct
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import pytest

from ultrajax.config import parse
from ultrajax.config import schema as config
from ultrajax.cost import flops, units
from ultrajax.model.llama import matmul_param_count
from ultrajax.parallel import mesh as mesh_lib
from ultrajax.train import metrics, peaks, record, report

BF16 = config.ModelConfig(dtype="bfloat16")


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
    got, source = peaks.device_peak(SimpleNamespace(device_kind=kind), BF16)
    assert got == peak and "data sheet" in source


def test_fp8_mfu_divides_by_the_time_its_flops_take_at_peak():
    """model.fp8: the FP8 matmuls' FLOPs at the FP8 peak (2x bf16's on an H100), the rest
    (attention scores, LM head) at bf16's; the model's FLOPs over that time is the peak.
    An A100 lists no FP8 peak: bf16's."""
    m = parse.load(Path(__file__).parents[1] / "configs" / "tiny.yaml").model
    m.dtype, m.fp8 = "bfloat16", "rowwise"
    total, f8 = flops.flops_per_token(m), flops.fp8_flops_per_token(m)
    per_layer = m.d_model * (2 * m.n_heads + 2 * m.n_kv_heads) * m.hd + 3 * m.d_model * m.d_ff
    assert f8 == 6 * m.n_layers * per_layer and 0 < f8 < total
    h100 = SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3")
    got, source = peaks.device_peak(h100, m)
    assert got == pytest.approx(total / ((total - f8) / 989e12 + f8 / 1979e12), rel=1e-12)
    assert 989e12 < got < 1979e12 and "float8" in source
    a100 = SimpleNamespace(device_kind="NVIDIA A100-SXM4-80GB")
    assert peaks.device_peak(a100, m)[0] == pytest.approx(312e12, rel=1e-12)
    m.fp8 = "none"
    assert flops.fp8_flops_per_token(m) == 0 and peaks.device_peak(h100, m)[0] == 989e12


def test_unknown_device_has_no_peak():
    got, source = peaks.device_peak(SimpleNamespace(device_kind="Some TPU"), BF16)
    assert got is None and "unknown" in source


def test_flops_per_token_is_6n_plus_12lhs():
    m = parse.load(Path(__file__).parents[1] / "configs" / "tiny.yaml").model
    expected = 6 * matmul_param_count(m) + 12 * m.n_layers * m.n_heads * m.hd * m.seq_len
    assert flops.flops_per_token(m) == expected
    assert flops.hardware_flops_per_token(m) == expected  # remat none: nothing recomputed


def test_causal_flops_halve_only_the_attention_term():
    """mfu_causal's FLOPs: 6N + 6·L·h·s, the score square halved for the causal mask."""
    m = parse.load(Path(__file__).parents[1] / "configs" / "tiny.yaml").model
    attention = 12 * m.n_layers * m.n_heads * m.hd * m.seq_len
    assert flops.flops_per_token(m, causal=True) == 6 * matmul_param_count(m) + attention / 2
    assert flops.flops_per_token(m) - flops.flops_per_token(m, causal=True) == attention / 2


def test_mfu_both_ways_in_the_record_and_the_summary(monkeypatch, tmp_path):
    """metrics.jsonl's record and the run's summary give mfu (whole square) and
    mfu_causal (attention halved), each from its own FLOPs per token."""
    cfg = parse.load(Path(__file__).parents[1] / "configs" / "tiny.yaml")
    monkeypatch.setattr(peaks, "host_peak", lambda cfg: (1e9, "a test peak"))
    speed = record.Throughput(cfg)
    rate = 1000.0
    out = {"loss": 5.0, "grad_norm": 1.0, "lr": 1e-3}
    ramp = SimpleNamespace(tokens=4096, loss_ema=5.0)
    r = record.step_record(1, out, ramp, 2048, rate, speed, None)
    m = cfg.model
    assert r["mfu"] == pytest.approx(rate * flops.flops_per_token(m) / 1e9)
    half = 6 * matmul_param_count(m) + 6 * m.n_layers * m.n_heads * m.hd * m.seq_len
    assert r["mfu_causal"] == pytest.approx(rate * half / 1e9)
    assert r["mfu_causal"] < r["mfu"]
    speed.rates = [rate]
    lines = report.summary_lines(cfg, speed, [r], None, None, 2048, tmp_path)
    assert f"MFU causal   {r['mfu_causal']:.1%}" in "\n".join(lines)


def test_human():
    assert units.human(885888) == "885.9K" and units.human(1.278e11) == "127.8B"


def test_rates_in_si_prefixes_with_a_space():
    """The train log's peak: '486 GFLOP/s', not human()'s count-style '486BFLOP/s'."""
    assert units.si(4.86e11, "FLOP/s") == "486 GFLOP/s"
    assert units.si(989e12, "FLOP/s") == "989 TFLOP/s"
    assert units.si(2.5e15, "FLOP/s") == "2.5 PFLOP/s"
    assert units.si(3e18, "FLOP/s") == "3000 PFLOP/s"
    assert units.si(750, "FLOP/s") == "750 FLOP/s"


def test_the_mesh_line_counts_one_device_in_the_singular():
    cfg = config.Config()
    mesh = mesh_lib.make_mesh(cfg)
    assert "(1 device, " in mesh_lib.describe(mesh, mesh_lib.rules(cfg)).splitlines()[0]
    assert mesh_lib.describe_hosts(mesh).startswith("hosts: 1 process(es) x 1 device;")


# --------------------------------------------------------------------------- CPU peak


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    """The CPU peak cache under tmp_path, never the real home; measurements counted."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    rates = iter([5e10, 9e10, 7e10, 1e12, 2e12, 3e12])
    calls = []

    def fake_rate():
        calls.append(1)
        return next(rates)

    monkeypatch.setattr(peaks, "measure_matmul_rate", fake_rate)
    return tmp_path / "xdg" / "ultrajax" / "cpu_peak.json", calls


def test_cpu_peak_is_measured_once_and_cached(cache_home, monkeypatch):
    path, calls = cache_home
    assert peaks.cpu_peak_cache() == path
    rate, label = peaks.cached_cpu_peak()
    assert rate == 9e10 and len(calls) == 3  # the best of three
    assert f"cached in {path}" in label
    assert json.loads(path.read_text())[peaks.cpu_key()]["flops"] == 9e10
    rate, label = peaks.cached_cpu_peak()
    assert rate == 9e10 and len(calls) == 3 and "measured once" in label  # not re-measured
    if jax.devices()[0].platform == "cpu":
        peak, label = peaks.host_peak(config.Config())
        assert peak == 9e10 and len(calls) == 3 and str(path) in label
    # another machine (CPU model or cores) gets its own entry; the first one stays
    here = peaks.cpu_key()
    monkeypatch.setattr(peaks, "cpu_key", lambda: "other CPU | 4 cores")
    assert peaks.cached_cpu_peak()[0] == 3e12 and len(calls) == 6
    table = json.loads(path.read_text())
    assert table["other CPU | 4 cores"]["flops"] == 3e12
    assert table[here]["flops"] == 9e10
    assert len(table) == 2


def test_cpu_peak_cache_defaults_to_home(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert peaks.cpu_peak_cache() == tmp_path / ".cache" / "ultrajax" / "cpu_peak.json"


def test_cpu_peak_cache_unreadable_or_unwritable(cache_home):
    path, calls = cache_home
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    rate, label = peaks.cached_cpu_peak()  # a broken file is measured over
    assert rate == 9e10 and "cached in" in label
    path.unlink()
    path.mkdir()  # a directory where the file should be: measured, not cached, no crash
    rate, label = peaks.cached_cpu_peak()
    assert rate == 3e12 and "not cached" in label and len(calls) == 6
    assert [p.name for p in path.parent.iterdir()] == ["cpu_peak.json"]  # no temporary left


# --------------------------------------------------------------------------- writer


def read_events(tb_dir: Path) -> list:
    """Every Event in the TFRecord files of a directory (length, crc, data, crc)."""
    from tensorboardX.proto.event_pb2 import Event

    events = []
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        while data:
            (n,) = struct.unpack("<Q", data[:8])
            events.append(Event.FromString(data[12 : 12 + n]))
            data = data[12 + n + 4 :]
    return events


def scalar_points(tb_dir: Path) -> dict:
    points = {}
    for e in read_events(tb_dir):
        for v in e.summary.value:
            points.setdefault(v.tag, []).append((e.step, v.simple_value, e.wall_time))
    return points


RECORDS = [
    {"step": 1, "loss": 5.5, "grad_norm": 2.0, "lr": 1e-4, "mfu": 0.25, "time": 1.7e9 + 1},
    {"step": 2, "loss": 5.0, "grad_norm": 1.5, "lr": 2e-4, "mfu": 0.5, "time": 1.7e9 + 2},
    {
        "step": 4,
        "loss": 4.25,
        "grad_norm": 1.0,
        "lr": 3e-4,
        "mfu": 0.75,
        "tokens": 4096,
        "eval_loss": 4.5,
        "memory": {"peak_gib": 1.5},
        "note": "text is skipped",
        "time": 1.7e9 + 4,
    },
]


def test_metrics_writer_tensorboard_scalars(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    w = metrics.MetricsWriter(tmp_path, fresh=True)
    for r in RECORDS:
        w.write(r)
    deadline = time.monotonic() + 20  # on disk within seconds, before close: a crash loses little
    while scalar_points(tmp_path / "tensorboard").get("train/loss", [()])[-1][:2] != (4, 4.25):
        assert time.monotonic() < deadline, "the scalars were not flushed before close"
        time.sleep(0.1)
    w.close()
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()] == RECORDS
    points = scalar_points(tmp_path / "tensorboard")
    assert set(points) == {
        "train/loss",
        "train/grad_norm",
        "train/lr",
        "train/mfu",
        "train/tokens",
        "eval/loss",
        "train/memory/peak_gib",
    }
    for key in ("loss", "grad_norm", "lr", "mfu"):
        got = [(step, value) for step, value, _ in points[f"train/{key}"]]
        assert got == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in RECORDS], key
    assert [p[:2] for p in points["eval/loss"]] == [(4, 4.5)]
    assert [p[:2] for p in points["train/tokens"]] == [(4, 4096.0)]
    assert [p[:2] for p in points["train/memory/peak_gib"]] == [(4, 1.5)]
    assert [p[2] for p in points["train/loss"]] == [r["time"] for r in RECORDS]  # wall clock


def test_the_writer_imports_no_torch(tmp_path):
    """tensorboardX imports torch where it is installed, to accept torch tensors (1.7 s
    of every run's start here); the writer is handed floats and leaves torch out of it,
    and torch still imports afterwards."""
    pytest.importorskip("torch")
    code = (
        "import sys; from ultrajax.train import metrics; "
        "w = metrics.MetricsWriter(sys.argv[1], fresh=True); w.write({'step': 1, 'loss': 2.0}); "
        "w.close(); print('torch' in sys.modules); import torch"
    )
    argv = [sys.executable, "-c", code, str(tmp_path)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False"]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_metrics_writer_resume_purges_and_fresh_restarts(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    w = metrics.MetricsWriter(tmp_path, fresh=True)
    for r in RECORDS:
        w.write(r)
    w.close()
    w = metrics.MetricsWriter(tmp_path, fresh=False)  # resumed from the step-2 checkpoint
    w.write({"step": 3, "loss": 4.0})
    w.close()
    events = read_events(tmp_path / "tensorboard")
    purge = [e for e in events if e.HasField("session_log")]
    assert [(e.step, e.session_log.status) for e in purge] == [(3, 1)]  # START at 3: 4 dropped
    assert len(list((tmp_path / "tensorboard").glob("events.*"))) == 2
    (tmp_path / "config.yaml").write_text("train: {}\n")
    kept = metrics.keep_earlier(tmp_path)  # a fresh start: a fresh plot, the old one kept
    assert kept == tmp_path / "earlier-1"
    assert not list((tmp_path / "tensorboard").glob("events.*"))
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "config.yaml").exists()
    assert len(list((kept / "tensorboard").glob("events.*"))) == 2
    steps = [json.loads(line)["step"] for line in (kept / "metrics.jsonl").open()]
    assert steps == [r["step"] for r in RECORDS] + [3]
    assert (kept / "config.yaml").read_text() == "train: {}\n"
    assert metrics.keep_earlier(tmp_path) is None  # nothing left to keep
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    assert metrics.keep_earlier(tmp_path) == tmp_path / "earlier-2"  # the first free name


def test_a_fresh_start_says_where_the_earlier_metrics_went(tmp_path):
    """A run whose checkpoints were removed (or that crashed before its first save) started
    again at step 0 and overwrote its metrics.jsonl and TensorBoard events without a word."""
    from ultrajax.train import loop

    cfg = parse.load(None, [f"train.run_dir={tmp_path}"])
    said = []
    loop.open_run_dir(cfg, fresh=True, say=said.append)
    assert said == [] and (tmp_path / "config.yaml").is_file()  # nothing to keep
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    loop.open_run_dir(cfg, fresh=False, say=said.append)  # a resume appends: nothing moves
    assert said == [] and (tmp_path / "metrics.jsonl").is_file()
    loop.open_run_dir(cfg, fresh=True, say=said.append)
    assert said == [
        f"metrics: those of the run before in {tmp_path} (no checkpoint of it to resume "
        f"from) moved to {tmp_path / 'earlier-1'}; this run starts at step 0"
    ]
    assert (tmp_path / "earlier-1" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (tmp_path / "config.yaml").is_file()  # this run's


def test_metrics_writer_wandb_hook(tmp_path, monkeypatch, capsys):
    logged = []

    class Run:
        def log(self, values, step):
            logged.append((step, values))

        def finish(self):
            logged.append("finished")

    fake = SimpleNamespace(init=lambda **kw: logged.append(kw) or Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_PROJECT", "proj")
    w = metrics.MetricsWriter(tmp_path / "run", fresh=True)
    w.write(RECORDS[0])
    w.close()
    assert logged[0]["project"] == "proj" and logged[0]["name"] == "run"
    assert logged[1] == (
        1,
        {"train/loss": 5.5, "train/grad_norm": 2.0, "train/lr": 1e-4, "train/mfu": 0.25},
    )
    assert logged[2] == "finished"
    # WANDB_PROJECT without wandb installed: one warning line, and the run goes on
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    capsys.readouterr()
    w = metrics.MetricsWriter(tmp_path / "run2", fresh=True)
    w.write(RECORDS[0])
    w.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["warning: WANDB_PROJECT is set but wandb is not installed; not logging to W&B"]
    assert "train/loss" in scalar_points(tmp_path / "run2" / "tensorboard")
