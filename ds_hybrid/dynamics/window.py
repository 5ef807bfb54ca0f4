"""Features 0-38 of the state encoding: statistics over fixed-size windows of history.

``window_features(hist, counts)`` is a pure tensor function of right-aligned histories
``hist [NUM_CHANNELS, WINDOW]`` (one row per channel below) with ``counts[c]`` valid values in
channel c. It is the torch reference of ``kernels/encoder.cu``; ``kernels.window_features``
dispatches between the two and ``dynamics.encoder.StateEncoder`` calls that dispatcher. The
feature table is in ``dynamics/encoder.py``'s docstring.
"""
from __future__ import annotations

import torch

WINDOW = 32
# History channels (one row each of the [NUM_CHANNELS, WINDOW] history).
CH_LOSS, CH_GRAD, CH_UPD, CH_COS, CH_PROJ, CH_ERR, CH_SERR, CH_ACC = range(8)
NUM_CHANNELS = 8
NUM_WINDOW_FEATURES = 39   # features 0-38 come from the histories; 39-63 are the encoder's scalars


def _slope_curv(y: torch.Tensor, degree: int) -> torch.Tensor:
    """Least-squares coefficient of x (degree 1) or x^2 (degree 2) over centred x = 0..n-1,
    in closed form: with centred x, the x column is orthogonal to 1 and x^2."""
    n = y.numel()
    if n <= degree:
        return torch.zeros((), dtype=y.dtype)
    x = torch.arange(n, dtype=y.dtype) - (n - 1) / 2
    if degree == 1:
        return (x * y).sum() / (x * x).sum()
    x2 = x * x
    s0, s2, s4 = float(n), float(x2.sum()), float((x2 * x2).sum())
    det = s0 * s4 - s2 * s2
    if abs(det) < 1e-12:
        return torch.zeros((), dtype=y.dtype)
    return (s0 * (x2 * y).sum() - s2 * y.sum()) / det


def window_features(hist: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Features 0-38 from right-aligned histories ``hist [NUM_CHANNELS, WINDOW]`` with
    ``counts[c]`` valid values in channel c (the torch reference of kernels/encoder.cu)."""
    out = torch.zeros(NUM_WINDOW_FEATURES, dtype=torch.float64)
    h = hist.double()

    def last(c: int, w: int) -> torch.Tensor:
        n = int(min(int(counts[c]), w))
        return h[c, WINDOW - n:] if n > 0 else h[c, :0]

    def mean(t): return t.mean() if t.numel() else torch.zeros((), dtype=torch.float64)
    def std(t): return t.std(unbiased=False) if t.numel() > 1 else torch.zeros((), dtype=torch.float64)

    L = lambda w: last(CH_LOSS, w)  # noqa: E731
    if counts[CH_LOSS] > 0:
        out[0] = L(1)[0]
        for j, w in enumerate((4, 8, 16, 32)):
            out[1 + j], out[5 + j] = mean(L(w)), std(L(w))
        out[9], out[10] = L(32).min(), L(32).max()
        for j, w in enumerate((8, 16, 32)):
            out[11 + j] = _slope_curv(L(w), 1)
        out[14], out[15] = _slope_curv(L(16), 2), _slope_curv(L(32), 2)
        l16 = L(16)
        if l16.numel() >= 3:
            x = torch.arange(l16.numel(), dtype=torch.float64)
            slope = _slope_curv(l16, 1)
            resid = l16 - (l16.mean() + slope * (x - x.mean()))
            out[35] = resid.std(unbiased=False) / max(abs(float(l16.mean())), 1e-8)
            d = l16[1:] - l16[:-1]
            out[36] = (d > 0).double().mean()
            out[37] = ((d[1:] * d[:-1]) < 0).double().mean() if d.numel() > 1 else 0.0
            sd = float(std(l16))
            out[38] = (l16[-1] - l16.mean()) / sd if sd > 0 else 0.0
    if counts[CH_GRAD] > 0:
        G = lambda w: last(CH_GRAD, w)  # noqa: E731
        out[16], out[17], out[18], out[19] = G(1)[0], mean(G(8)), mean(G(32)), std(G(8))
        out[20] = _slope_curv(G(16), 1)
        out[21] = G(1)[0] - mean(G(32))
    if counts[CH_UPD] > 0:
        U = lambda w: last(CH_UPD, w)  # noqa: E731
        out[22], out[23] = U(1)[0], mean(U(8))
        out[24] = U(1)[0] - mean(U(8))
    if counts[CH_COS] > 0:
        C = last(CH_COS, 8)
        out[25], out[26], out[27] = C[-1], C.mean(), C.min()
    if counts[CH_PROJ] > 0:
        P = last(CH_PROJ, 8)
        out[28], out[29], out[30] = P[-1], P.mean(), std(P)
    if counts[CH_ERR] > 0:
        E = last(CH_ERR, 8)
        out[31], out[32] = E[-1], E.mean()
    if counts[CH_SERR] > 0:
        out[33] = mean(last(CH_SERR, 8))
    if counts[CH_ACC] > 0:
        out[34] = mean(last(CH_ACC, 8))
    return out
