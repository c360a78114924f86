"""batchfit: the power-law fit of the critical batch against the loss, recovered from
synthetic metrics.jsonl files with a planted law, the schedule it implies, the command
line and its one-line errors. numpy only (matplotlib for --plot)."""

import json
import math
import sys

import numpy as np
import pytest
import yaml

from ultrajax.tools import batchfit

C, ALPHA = 2e6, 3.0  # planted: B_crit = C * L^-ALPHA tokens; 31k at L=4, 250k at L=2
NOISE = 0.05  # multiplicative log-normal noise on b_simple


def planted(rng, loss):
    return C * loss**-ALPHA * np.exp(NOISE * rng.standard_normal(np.shape(loss)))


def write_run(path, records):
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return path


def run_records(rng, steps, tokens_per_step, loss_of):
    """One run's records: b_simple on every other line; "loss" noisy around "loss_ema"
    (fitting it instead would flatten the slope); in the first 10% of tokens b_simple is
    far off the law, as a fresh model's noise scale can be."""
    records = []
    for step in range(1, steps + 1):
        frac = step / steps
        ema = float(loss_of(frac))
        r = {
            "step": step,
            "tokens": step * tokens_per_step,
            "loss": ema + 0.4 * float(rng.standard_normal()),
            "loss_ema": ema,
            "tokens_per_step": tokens_per_step,
        }
        if step % 2 == 0:
            early = step * tokens_per_step < 0.1 * steps * tokens_per_step
            r["b_simple"] = 1e9 if early else float(planted(rng, ema))
        records.append(r)
    return records


@pytest.fixture
def runs(tmp_path):
    """Two runs, loss from 4 down to 2 on different curves and batch sizes. The second
    was resumed: a crash had logged steps 201-230 (with nonsense) past its checkpoint at
    200, and the resumed run logged them again."""
    rng = np.random.default_rng(0)
    a = run_records(rng, 400, 8192, lambda f: 2 + 2 * math.exp(-4 * f) / (1 - 0.2 * f))
    b = run_records(rng, 300, 16384, lambda f: 4 - 2 * f**0.5)
    crashed = [{**r, "b_simple": 1e9} for r in b[200:230]]
    return [
        write_run(tmp_path / "run-a", a),
        write_run(tmp_path / "run-b", b[:200] + crashed + b[200:]),
    ]


def test_fit_recovers_the_planted_law(runs):
    got = batchfit.read_runs(runs)
    assert [len(r["loss"]) for r in got] == [181, 136]  # even steps from 40 of 400, 30 of 300
    assert [r["early"] for r in got] == [19, 14]
    assert [r["tokens_per_step"] for r in got] == [8192, 16384]
    assert all(max(r["b_simple"]) < 1e6 for r in got)  # the crash's records dropped
    f = batchfit.fit(batchfit.points(got))
    assert f["n"] == 317
    assert abs(f["alpha"] - ALPHA) < 4 * f["alpha_se"] and f["alpha"] == pytest.approx(ALPHA, 0.1)
    assert abs(f["log_c"] - math.log(C)) < 4 * f["log_c_se"]
    assert f["c"] == pytest.approx(C, rel=0.1)
    assert f["c_se"] == pytest.approx(f["c"] * f["log_c_se"])
    assert 0.95 < f["r2"] < 1


def test_fit_is_exact_on_exact_points():
    losses = np.linspace(2, 4, 7)
    f = batchfit.fit(list(zip(losses, C * losses**-ALPHA, strict=True)))
    assert (f["c"], f["alpha"], f["r2"]) == pytest.approx((C, ALPHA, 1.0), rel=1e-9)
    assert f["alpha_se"] < 1e-9 and f["n"] == 7


def test_standard_errors_match_the_spread_of_repeated_fits():
    """The errors come from the regression covariance: over many noisy data sets, the
    spread of the estimates must be what one fit's errors say."""
    rng = np.random.default_rng(1)
    losses = np.linspace(2, 4, 40)
    fits = [batchfit.fit(list(zip(losses, planted(rng, losses), strict=True))) for _ in range(400)]
    for key, se in [("alpha", "alpha_se"), ("log_c", "log_c_se")]:
        spread = np.std([f[key] for f in fits])
        assert np.mean([f[se] for f in fits]) == pytest.approx(spread, rel=0.15)


def test_fit_refuses_too_few_points_and_one_loss():
    with pytest.raises(batchfit.ConfigError, match="2 points to fit; need at least 3"):
        batchfit.fit([(3.0, 1e5), (2.5, 2e5)])
    with pytest.raises(batchfit.ConfigError, match="same loss"):
        batchfit.fit([(3.0, 1e5), (3.0, 2e5), (3.0, 3e5)])


def test_thresholds_follow_the_formula():
    f = {"c": C, "alpha": ALPHA}
    got = batchfit.thresholds(f, 8192, 4)
    want = [(C / (8192 * 2**k)) ** (1 / ALPHA) for k in (1, 2, 3, 4)]
    assert got == pytest.approx(want, rel=1e-12)
    for k, loss in enumerate(got, 1):  # the fitted critical batch is start * 2^k there
        assert C * loss**-ALPHA == pytest.approx(8192 * 2**k, rel=1e-9)
    with pytest.raises(batchfit.ConfigError, match="does not grow"):
        batchfit.thresholds({"c": C, "alpha": -0.5}, 8192, 3)


def test_min_tokens_keeps_what_it_is_told(runs):
    got = batchfit.read_runs(runs, min_tokens=0)
    assert [r["early"] for r in got] == [0, 0]
    assert max(got[0]["b_simple"]) == 1e9  # the early nonsense is back in
    assert batchfit.fit(batchfit.points(got))["r2"] < 0.5


def test_cli_prints_the_schedule(runs, capsys):
    assert batchfit.main([str(d) for d in runs]) == 0
    out = capsys.readouterr().out
    f = batchfit.fit(batchfit.points(batchfit.read_runs(runs)))
    losses = batchfit.thresholds(f, 8192, 3)  # start: the first run's tokens_per_step
    assert losses[0] > 3.97 > losses[1]  # the first is above every loss seen: left out
    assert "note: 16,384 tokens per step" in out
    line = [x for x in out.splitlines() if x.startswith("train.batch_schedule=")]
    assert line == [
        "train.batch_schedule='[{tokens_per_step: 32768, from_loss: "
        f"{round(losses[1], 3)}}}, {{tokens_per_step: 65536, from_loss: {round(losses[2], 3)}}}]'"
    ]
    value = yaml.safe_load(line[0].split("=", 1)[1].strip("'"))
    assert value == [
        {"tokens_per_step": 32768, "from_loss": round(losses[1], 3)},
        {"tokens_per_step": 65536, "from_loss": round(losses[2], 3)},
    ]
    assert f"alpha = {f['alpha']:.4f}" in out and "317 points from 2 of 2 runs" in out

    assert batchfit.main([str(runs[1]), "--start-tokens", "100000", "--doublings", "2"]) == 0
    out = capsys.readouterr().out
    assert "left out, above" not in out and "tokens_per_step: 200000, from_loss: " in out
    assert "tokens_per_step: 400000" in out
    # a threshold past the lowest loss fitted (2): kept, and said to be extrapolated
    one = batchfit.fit(batchfit.points(batchfit.read_runs([runs[1]])))
    past = batchfit.thresholds(one, 100000, 2)
    assert past[0] > 2.0 > past[1]
    assert f"note: from loss {past[1]:.3f}: below the lowest loss fitted (2.000)" in out


def fails(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        batchfit.main([str(a) for a in argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    return err


def test_errors_are_one_line(runs, tmp_path, capsys):
    assert "is not a directory" in fails(capsys, [runs[0], tmp_path / "nope"])
    (tmp_path / "empty").mkdir()
    assert "metrics.jsonl does not exist" in fails(capsys, [tmp_path / "empty"])
    few = write_run(
        tmp_path / "few", run_records(np.random.default_rng(2), 5, 4096, lambda f: 3 - f)
    )
    assert "2 records with b_simple past" in fails(capsys, [few])  # steps 2 and 4
    bad = tmp_path / "bad"
    write_run(bad, run_records(np.random.default_rng(3), 20, 4096, lambda f: 4 - f))
    with open(bad / "metrics.jsonl", "a") as f:
        f.write('{"step": 21, "tokens": 86016, "loss": 2.9, "b_simple": 3\n')
    assert f"{bad / 'metrics.jsonl'}:21: not JSON" in fails(capsys, [runs[0], bad])
    no_tps = tmp_path / "no-tps"
    records = run_records(np.random.default_rng(4), 20, 4096, lambda f: 4 - f)
    write_run(no_tps, [{k: v for k, v in r.items() if k != "tokens_per_step"} for r in records])
    assert "pass --start-tokens" in fails(capsys, [no_tps])
    assert "--doublings" in fails(capsys, [runs[0], "--doublings", "x"])
    # 2^100000 overflowed a float: a traceback
    assert "--doublings must be in 1..30" in fails(capsys, [runs[0], "--doublings", "100000"])
    # a run whose every b_simple is negative logged them: "0 records" alone misled
    negative = tmp_path / "negative"
    write_run(negative, [{**r, "b_simple": -r["b_simple"]} for r in records if "b_simple" in r])
    assert "0 records with b_simple past each run's first 10% of tokens in 1 run, and 10 more" in (
        fails(capsys, [negative])
    )


def test_plot_writes_a_png(runs, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "fit.png"
    assert batchfit.main([*map(str, runs), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a directory that is not there: said before the fit (it was a traceback after it)
    err = fails(capsys, [*runs, "--plot", tmp_path / "nowhere" / "fit.png"])
    assert f"--plot: the directory {tmp_path / 'nowhere'} does not exist" in err


def test_plot_without_matplotlib_says_how_to_install(runs, tmp_path, capsys, monkeypatch):
    for name in ["matplotlib", "matplotlib.backends.backend_agg", "matplotlib.figure"]:
        monkeypatch.setitem(sys.modules, name, None)  # importing it now fails
    err = fails(capsys, [*runs, "--plot", tmp_path / "fit.png"])
    assert 'pip install -e ".[plot]"' in err
    assert not (tmp_path / "fit.png").exists()


def test_entries_the_runs_layout_refuses_are_noted(runs, capsys):
    """A schedule from --start-tokens 100000 in a run of 8 rows x 1 dp x 1024 tokens: its
    entries (200,000, 400,000) are no multiples of 8,192, which train.batch_schedule refuses
    in that layout. Printed as ready to paste before; now a note says so. From 98,304
    (12 x 8,192) the entries are ones the layout takes: no note."""
    from ultrajax.config import parse

    cfg = parse.load(None, ["train.micro_batch_size=8", "model.seq_len=1024", "mesh.data=1"])
    (runs[0] / "config.yaml").write_text(parse.dump(cfg))
    argv = [str(runs[0]), "--doublings", "2", "--start-tokens"]
    assert batchfit.main([*argv, "100000"]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if "not a multiple" in line]
    assert len(notes) == 1 and "200,000, 400,000 tokens per step are" in notes[0], out
    assert "= 8,192 tokens in" in notes[0]
    assert batchfit.main([*argv, str(12 * 8192)]) == 0
    out = capsys.readouterr().out
    assert "tokens_per_step: 196608" in out and "not a multiple" not in out, out
