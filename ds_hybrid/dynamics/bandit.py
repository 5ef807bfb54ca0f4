"""The Predict-run length as a contextual bandit (LinUCB, disjoint arms).

Arms are run lengths (1, 2, 4, ... up to ``max_predict_steps``). The context
is a handful of encoded state features plus the calibrated confidence; the
reward of a finished run is what it saved minus what it cost, per possible
step:

    reward = (accepted * (1 - rho) - rolled_back * (1 + rho) - loss_penalty * excess) / max_horizon

``rho`` is the measured cost of a Predict step relative to a Full step (the
verification forward), ``excess`` the verified loss above the prediction in
noise units. So long runs pay off only when their steps are accepted; when
prediction gets harder, rejections make long arms lose and the bandit
shortens the horizon, and it lengthens it again when they succeed.
All inputs are shared values: every rank picks the same arm.
"""
from __future__ import annotations

import math

import torch


def horizon_arms(max_steps: int, min_steps: int = 1) -> list[int]:
    arms, h = [], 1
    while h < max_steps:
        if h >= min_steps:
            arms.append(h)
        h *= 2
    arms.append(max_steps)
    return sorted(set(a for a in arms if a >= min_steps))


class LinUCBHorizon:
    def __init__(self, arms: list[int], dim: int, alpha: float = 0.5, ridge: float = 1.0):
        self.arms, self.dim, self.alpha = list(arms), dim, alpha
        self.A = [torch.eye(dim, dtype=torch.float64) * ridge for _ in arms]
        self.b = [torch.zeros(dim, dtype=torch.float64) for _ in arms]
        self.pulls = [0] * len(arms)
        self.history: list[tuple[int, int, float]] = []  # (step, arm, reward)

    def scores(self, x: torch.Tensor) -> list[float]:
        x = x.double()
        out = []
        for A, b in zip(self.A, self.b):
            Ainv = torch.linalg.inv(A)
            theta = Ainv @ b
            out.append(float(theta @ x + self.alpha * math.sqrt(float(x @ Ainv @ x))))
        return out

    def choose(self, x: torch.Tensor) -> int:
        """The run length with the highest upper confidence bound (ties: the shorter)."""
        s = self.scores(x)
        best = max(range(len(s)), key=lambda i: (round(s[i], 12), -i))
        return self.arms[best]

    def update(self, arm: int, x: torch.Tensor, reward: float, step: int = 0) -> None:
        i = self.arms.index(arm)
        x = x.double()
        self.A[i] += torch.outer(x, x)
        self.b[i] += reward * x
        self.pulls[i] += 1
        self.history.append((step, arm, reward))
        del self.history[:-1000]

    def state_dict(self) -> dict:
        return {"arms": self.arms, "A": [a.clone() for a in self.A], "b": [b.clone() for b in self.b],
                "pulls": list(self.pulls), "history": list(self.history)}

    def load_state_dict(self, sd: dict) -> None:
        if list(sd["arms"]) != self.arms:
            raise ValueError(f"bandit arms {sd['arms']} in the checkpoint differ from {self.arms} "
                             "(hybrid_predict.min/max_predict_steps changed)")
        self.A, self.b = [a.clone() for a in sd["A"]], [b.clone() for b in sd["b"]]
        self.pulls, self.history = list(sd["pulls"]), [tuple(h) for h in sd["history"]]


def run_reward(accepted: int, rolled_back: int, rho: float, excess: float, max_horizon: int,
               loss_penalty: float = 0.5, progress: float | None = None) -> float:
    r = accepted * (1 - rho) - rolled_back * (1 + rho) - loss_penalty * max(excess, 0.0)
    if progress is not None and progress < 0:
        r -= accepted  # steps that were accepted but made the held-out loss worse saved nothing
    return r / max(max_horizon, 1)
