"""The Warmup -> Full -> Predict -> Correct state machine.

One ``PhaseController`` per rank. It advances once per optimizer step (an
accumulation boundary), and its only inputs at a decision are values every rank
shares (all-reduced losses and statistics, the step count), so every rank takes
the same phase at the same step and no collective is left waiting.

Transitions::

    WARMUP (warmup_steps) -> FULL (full_steps) -> decide
    decide: confident -> PREDICT (horizon h), else FULL (full_steps) -> decide
    PREDICT: run completed -> CORRECT (correction_steps) -> decide
             (correction_steps = 0: decide at once; with ``check: next_step`` FULL
             (full_steps) instead, since a real step must check the run)
    PREDICT: verification rejected -> rollback -> FULL (full_steps) -> decide
"""
from __future__ import annotations

import enum
from typing import Callable

from .config import HybridPredictConfig


class Phase(str, enum.Enum):
    WARMUP = "warmup"
    FULL = "full"
    PREDICT = "predict"
    CORRECT = "correct"
    # A Full step whose lower layer groups were predicted (group_predict); the controller
    # never enters it, it labels the step's result and statistics.
    PARTIAL = "partial"

    @property
    def runs_backward(self) -> bool:
        return self is not Phase.PREDICT

    @property
    def code(self) -> int:
        """A number for scalar monitors (TensorBoard / CSV)."""
        return list(Phase).index(self)


Decision = Callable[[], "tuple[bool, int]"]  # () -> (predict?, horizon)


class PhaseController:
    """Which phase the next optimizer step runs in."""

    def __init__(self, cfg: HybridPredictConfig):
        self.cfg = cfg
        self.phase = Phase.WARMUP
        self.remaining = cfg.warmup_steps
        self.horizon = 0          # length of the current Predict run
        self.predict_index = 0    # steps already taken in the current Predict run

    # -- queries about the step about to run --------------------------------
    def verify_now(self) -> bool:
        """Whether the Predict step about to finish is verified by a forward pass."""
        assert self.phase is Phase.PREDICT
        k = self.predict_index + 1
        return k % self.cfg.verify_every == 0 or k == self.horizon

    def may_predict_next(self) -> bool:
        """Whether the step about to run ends a Full or Correct phase, so that a Predict run may
        follow it (the decision is made after it, from what the step shows)."""
        return self.phase in (Phase.FULL, Phase.CORRECT) and self.remaining == 1

    # -- transitions ---------------------------------------------------------
    def end_step(self, decide: Decision, rolled_back: bool = False) -> None:
        """Account for the step that just ran and choose the next phase."""
        if self.phase is Phase.PREDICT:
            self.predict_index += 1
            if rolled_back:
                self._enter(Phase.FULL, self.cfg.full_steps)
            elif self.predict_index >= self.horizon:
                if self.cfg.correction_steps > 0:
                    self._enter(Phase.CORRECT, self.cfg.correction_steps)
                elif self.cfg.check == "next_step":
                    # Back to back runs would never meet the real step that checks them.
                    self._enter(Phase.FULL, self.cfg.full_steps)
                else:
                    self._decide(decide)
            return
        self.remaining -= 1
        if self.remaining > 0:
            return
        if self.phase is Phase.WARMUP:
            self._enter(Phase.FULL, self.cfg.full_steps)
        else:  # end of FULL or CORRECT
            self._decide(decide)

    def _decide(self, decide: Decision) -> None:
        predict, horizon = decide()
        if predict:
            self.phase, self.horizon, self.predict_index, self.remaining = Phase.PREDICT, horizon, 0, 0
        else:
            self._enter(Phase.FULL, self.cfg.full_steps)

    def _enter(self, phase: Phase, steps: int) -> None:
        self.phase, self.remaining, self.horizon, self.predict_index = phase, steps, 0, 0

    # -- checkpoints ---------------------------------------------------------
    def state_dict(self) -> dict:
        return {"phase": self.phase.value, "remaining": self.remaining,
                "horizon": self.horizon, "predict_index": self.predict_index}

    def load_state_dict(self, sd: dict) -> None:
        self.phase = Phase(sd["phase"])
        self.remaining, self.horizon, self.predict_index = sd["remaining"], sd["horizon"], sd["predict_index"]
