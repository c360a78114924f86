"""The batch size during a run: the config's batch, then the stages of `train.batch_schedule`.

A stage changes the global batch by changing gradient accumulation only (the micro-batch
and the mesh stay, so the memory per device does not change). It starts once a number of
tokens is trained (`from_tokens`) or once the smoothed training loss falls below a value
(`from_loss`, the playbook's "double the batch when the critical batch has doubled").

Everything that used to count steps counts tokens here, so that a change of batch changes
nothing else:

- the learning-rate schedule is read at `position` = tokens trained / the config's
  batch in tokens (`base`: the run's first, kept by its checkpoints), which is the step
  count when the batch never changes;
- the run ends after `train.steps` x that batch in tokens, the same budget as without a
  ramp;
- the tokens trained, the stage, the smoothed loss and the batch the run started with
  are saved with each checkpoint, so a resume continues the ramp exactly, and the
  learning-rate position and the token budget stay those of the run's start on any layout.
"""

from __future__ import annotations

import math

from ultrajax.config.schema import Config

LOSS_DECAY = 0.9  # the smoothed loss: an EMA over the logged losses


class Ramp:
    def __init__(self, cfg: Config):
        t = cfg.train
        self.unit = cfg.micro_tokens  # one micro-batch, tokens
        self.seq = cfg.model.seq_len
        self.base = cfg.tokens_per_step  # the config's batch: the schedule's unit
        self.steps = t.steps
        self.total = t.steps * self.base
        self.stages = [(t.grad_accum, 0, None)] + [
            (s.tokens_per_step // self.unit, s.from_tokens, s.from_loss)
            for s in t.batch_schedule or []
        ]
        self.tokens, self.stage = 0, 0
        self.started = [0]  # the tokens at which each stage began
        self._ema, self._count = 0.0, 0

    # ------------------------------------------------------------------ the current stage

    @property
    def grad_accum(self) -> int:
        return self.stages[self.stage][0]

    @property
    def tokens_per_step(self) -> int:
        return self.grad_accum * self.unit

    @property
    def position(self) -> float:
        """Where the learning-rate schedule is read for the next step, in config batches."""
        return self.tokens / self.base

    @property
    def done(self) -> bool:
        return self.tokens >= self.total

    def sizes(self) -> list[int]:
        """Every gradient accumulation the run may use: one compiled step each."""
        return sorted({ga for ga, _, _ in self.stages})

    def batches(self) -> list[int]:
        """Every global batch the run may train on, in rows: the data's default stream
        count splits each (ultrajax/data/streams.py)."""
        return [ga * (self.unit // self.seq) for ga in self.sizes()]

    @property
    def loss_ema(self) -> float | None:
        if not self._count:
            return None
        return self._ema / (1 - LOSS_DECAY**self._count)

    # ------------------------------------------------------------------ moving on

    def step_done(self) -> bool:
        """Count the step just trained; True when a token threshold starts the next stage."""
        self.tokens += self.tokens_per_step
        return self._advance(lambda nxt: nxt[1] is not None and self.tokens >= nxt[1])

    def observe(self, loss: float) -> bool:
        """A logged training loss; True when the smoothed loss starts the next stage."""
        if math.isfinite(loss):
            self._ema = LOSS_DECAY * self._ema + (1 - LOSS_DECAY) * loss
            self._count += 1
        ema = self.loss_ema
        return self._advance(lambda nxt: nxt[2] is not None and ema is not None and ema < nxt[2])

    def _advance(self, due) -> bool:
        moved = False
        while self.stage + 1 < len(self.stages) and due(self.stages[self.stage + 1]):
            self.stage += 1
            self.started.append(self.tokens)
            moved = True
        return moved

    # ------------------------------------------------------------------ checkpoints

    def state(self) -> dict:
        return {
            "tokens": self.tokens,
            "stage": self.stage,
            "started": list(self.started),
            "loss_ema": [self._ema, self._count],
            "base": self.base,
        }

    def load(self, state: dict | None, step: int, base: int | None = None) -> None:
        """A checkpoint's ramp state; without one (an older checkpoint), the config's batch
        for every step so far.

        The schedule's unit and the budget stay the run's own (saved, else `base`: the
        checkpoint config's batch in tokens). A config whose batch differs now (another
        device count under mesh.data=-1) would otherwise move the learning rate's position
        and the end of the run."""
        self.base = int((state or {}).get("base") or base or self.base)
        self.total = self.steps * self.base
        if not state:
            self.tokens = step * self.base
            return
        self.tokens, self.stage = int(state["tokens"]), int(state["stage"])
        self.started = [int(x) for x in state["started"]]
        self._ema, self._count = float(state["loss_ema"][0]), int(state["loss_ema"][1])
        if self.stage >= len(self.stages):
            self.stage = len(self.stages) - 1
