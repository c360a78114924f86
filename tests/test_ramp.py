"""Batch-size ramps: stages by tokens and by loss, the learning rate in tokens, one compile
per batch size, exact resume in the middle of a ramp, and the noise scale logged."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from ultrajax.config import parse, validate
from ultrajax.config.schema import ConfigError
from ultrajax.train import loop as train
from ultrajax.train import optim, resume
from ultrajax.train.ramp import Ramp

TINY = Path(__file__).parents[1] / "configs" / "tiny.yaml"
# 8 devices, 1 sequence of 32 tokens each a micro-batch: the base batch is 256 tokens a step
SMALL = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
    "model.d_ff=64", "model.seq_len=32", "train.micro_batch_size=1", "train.grad_accum=1",
    "mesh.data=-1",
    "train.log_every=1", "train.eval_batches=0", "optim.warmup_steps=2",
    "optim.schedule_steps=24", "data.streams=2",
]  # fmt: skip
# 8 sequences, then 16 from 1024 tokens, then 32 once the smoothed loss is below 5.4
RAMP = "train.batch_schedule=[{tokens_per_step: 512, from_tokens: 1024}, {tokens_per_step: 1024, from_loss: 5.4}]"  # noqa: E501


def _load(*extra):
    cfg = parse.load(TINY, [*SMALL, *extra])
    validate.resolve_mesh(cfg, 8)
    return cfg


def test_stages_switch_by_tokens_then_by_loss_and_state_round_trips():
    r = Ramp(_load(RAMP, "train.steps=24"))
    assert (r.unit, r.base, r.total, r.sizes()) == (256, 256, 24 * 256, [1, 2, 4])
    assert r.batches() == [8, 16, 32]  # every global batch in rows: what the data splits
    switches = [r.step_done() for _ in range(4)]  # 4 steps of 256 tokens reach 1024
    assert switches == [False, False, False, True] and r.grad_accum == 2
    assert r.position == 4.0  # the schedule's step: tokens / the config's batch
    r.step_done()
    assert r.position == 6.0  # a step of 512 tokens moves the schedule by 2
    assert not r.observe(5.9) and not r.observe(5.6)  # smoothed: ~5.74
    saved = json.loads(json.dumps(r.state()))
    while not r.observe(4.0):
        pass
    assert r.grad_accum == 4 and r.started == [0, 1024, 1536]
    again = Ramp(_load(RAMP, "train.steps=24"))
    again.load(saved, step=5)
    assert (again.tokens, again.stage, again.loss_ema) == (1536, 1, pytest.approx(r_ema(5.9, 5.6)))
    old = Ramp(_load("train.steps=24"))
    old.load(None, step=7)  # a checkpoint from before ramps: the config's batch all along
    assert old.tokens == 7 * 256 and old.sizes() == [1]


def r_ema(*losses, decay=0.9):
    ema = 0.0
    for x in losses:
        ema = decay * ema + (1 - decay) * x
    return ema / (1 - decay ** len(losses))


@pytest.mark.parametrize(
    "entry, message",
    [
        (
            "{tokens_per_step: 100, from_tokens: 256}",
            r"\[0\].tokens_per_step \(100\) must be a positive multiple of .* = 256 tokens",
        ),  # noqa: E501
        ("{tokens_per_step: 512}", r"\[0\] needs exactly one of from_tokens or from_loss"),
        ("{tokens_per_step: 512, from_tokens: 1, from_loss: 2.0}", "exactly one"),
        (
            "{tokens_per_step: 512, from_tokens: 512}, {tokens_per_step: 1024, from_tokens: 256}",
            r"\[1\].from_tokens \(256\) must be after",
        ),  # noqa: E501
        (
            "{tokens_per_step: 512, from_loss: 3.0}, {tokens_per_step: 1024, from_loss: 3.5}",
            r"\[1\].from_loss \(3.5\) must be positive and below",
        ),  # noqa: E501
        # a smaller batch, or the same: trained without a word before
        ("{tokens_per_step: 256, from_tokens: 512}", r"larger than the config's batch \(256"),
        (
            "{tokens_per_step: 1024, from_tokens: 512}, {tokens_per_step: 512, from_tokens: 2048}",
            r"\[1\].tokens_per_step \(512\) must be larger than the previous stage's batch",
        ),  # noqa: E501
    ],
)
def test_bad_schedules_are_one_line_errors_naming_the_entry(entry, message):
    with pytest.raises(ConfigError, match=message) as e:
        _load(f"train.batch_schedule=[{entry}]")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="needs mesh.pipeline=1"):
        _load("mesh.pipeline=2", "train.grad_accum=2", RAMP)


def _records(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def ramp_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ramp")
    cfg = _load(RAMP, "train.steps=24", "train.noise_every=4", f"train.run_dir={run_dir}")
    assert train.train(cfg) == 0
    return run_dir, cfg


@pytest.mark.slow
def test_a_ramp_trains_the_same_tokens_with_the_learning_rate_in_tokens(ramp_run):
    run_dir, cfg = ramp_run
    records = _records(run_dir)
    sizes = [r["tokens_per_step"] for r in records]
    assert sizes[0] == 256 and 512 in sizes and sizes[-1] == 1024  # both stages happened
    assert sizes == sorted(sizes)
    assert records[-1]["tokens"] == 24 * 256  # the budget of the fixed batch, in tokens
    schedule = optim.lr_schedule(cfg)
    before = 0
    for r in records:  # the step's learning rate, read at its position in tokens
        assert r["lr"] == pytest.approx(float(schedule(before / 256)), rel=1e-6)
        before = r["tokens"]
    # the loss stage began at the first log whose smoothed loss was below 5.4
    first_big = next(i for i, s in enumerate(sizes) if s == 1024)
    assert records[first_big - 1]["loss_ema"] < 5.4 <= records[first_big - 2]["loss_ema"]
    # the noise scale: measured while a step has several micro-batches, finite, logged
    crit = [r["b_simple"] for r in records if "b_simple" in r]
    assert crit and all(math.isfinite(c) and c > 0 for c in crit)


def _said_at_the_ramps_position(cfg, run_dir):
    """The rescheduling note read both schedules at the step count (6), where the next
    step reads them at its position in tokens (2048 / 256 = 8): other learning rates."""
    longer = _load(RAMP, "train.steps=24", "optim.schedule_steps=48", "train.reschedule=true",
                   f"train.run_dir={run_dir}")  # fmt: skip
    said = []
    ramp = resume.check_resume(longer, (run_dir / "checkpoints", 6), said.append)
    assert ramp.position == 8.0
    old, new = (float(optim.lr_schedule(c)(8)) for c in (cfg, longer))
    assert [s for s in said if "rescheduled" in s][0].endswith(
        f"the learning rate of step 7 goes from {old:.2e} to {new:.2e}"
    )


@pytest.mark.slow
def test_resuming_in_the_middle_of_the_ramp_gives_the_same_losses(ramp_run, tmp_path, capsys):
    """Two runs chained by a checkpoint taken inside the token stage (the loss stage then
    starts in the second) give the losses of the one run, and each run compiles one step
    per batch size, ahead."""
    run_dir, _ = ramp_run
    expected = {r["step"]: r["loss"] for r in _records(run_dir)}
    for steps in (7, 24):  # a budget of 7 and 24 config batches of tokens
        cfg = _load(RAMP, f"train.steps={steps}", "train.noise_every=4",
                    f"train.run_dir={tmp_path}")  # fmt: skip
        assert train.train(cfg) == 0
        if steps == 7:  # a longer schedule from here: its jump said where the step reads it
            _said_at_the_ramps_position(cfg, tmp_path)
    out = capsys.readouterr().out
    assert out.count("compiled the step for 8 sequences") == 2
    assert out.count("compiled the step for 32 sequences") == 2
    assert out.count("compiled the step") == 6
    assert out.count("compiling the step for 32 sequences ...") == 2  # each said first
    first = _records(tmp_path)[:6]  # the first run stopped at 8 x 256 tokens, in stage 1
    assert first[-1]["tokens"] == 2048 and first[-1]["tokens_per_step"] == 512
    got = {r["step"]: r["loss"] for r in _records(tmp_path)}
    assert sorted(got) == sorted(expected)
    np.testing.assert_allclose([got[s] for s in expected], list(expected.values()), rtol=1e-6)
