"""A small recurrent state-space model (RSSM) of training dynamics, as an ensemble.

Per member (DreamerV3's shape, scaled down): a deterministic GRU state ``h``
(``deter`` = 256), a stochastic Gaussian latent ``z`` (``stoch`` = 32) with a
prior ``p(z_t | h_t)`` and a posterior ``q(z_t | h_t, x_t)`` tied by a KL term,
and heads on ``[h_t, z_t]``:

* **loss head**: a Gaussian (mean, log std) for each horizon k = 1..K of the
  loss k steps ahead, as a residual of the ``LossBase`` forecast in units of
  its innovation scale (so the model learns what a simple forecast misses);
* **scale head**: a Gaussian for the projection of the next real Adam
  direction on the current one: how far a Predict step should go.

Inputs per step: the 64 normalised features ``x_t`` (``encoder.py``) and the
action ``a_t`` = [Predict?, step scale applied, lr / max lr].

The members' parameters are stacked on a leading ensemble axis, so one batched
matmul runs every member; ``kernels/rssm.cu`` implements ``step`` and
``rollout`` below on the GPU with exactly these shapes and gate order
(``torch.nn.GRUCell``'s r, z, n). Members differ in their initialisation (one
seed each) and in the data they see (each trains on its own random windows).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ACTION_DIM = 3


@dataclass(frozen=True)
class RSSMShape:
    features: int = 64
    action: int = ACTION_DIM
    deter: int = 256
    stoch: int = 32
    hidden: int = 128
    members: int = 3
    horizon: int = 8
    min_std: float = 0.1

    @property
    def head_out(self) -> int:
        return 2 * self.horizon + 2


def _init(shape: tuple, fan_in: int, gen: torch.Generator) -> torch.Tensor:
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(shape, generator=gen) * 2 - 1) * bound


class RSSMEnsemble(nn.Module):
    """Parameters of all members, stacked: every weight is ``[E, in, out]``."""

    PARAM_ORDER = ("W_emb", "b_emb", "W_in", "b_in", "W_ih", "b_ih", "W_hh", "b_hh",
                   "W_pr", "b_pr", "W_po", "b_po", "W_h1", "b_h1", "W_h2", "b_h2")

    def __init__(self, shape: RSSMShape = RSSMShape(), seed: int = 0):
        super().__init__()
        self.shape = s = shape
        E, F_, A, D, S, H = s.members, s.features, s.action, s.deter, s.stoch, s.hidden
        dims = {"emb": (F_, H), "in": (S + A, H), "ih": (H, 3 * D), "hh": (D, 3 * D),
                "pr": (D, 2 * S), "po": (D + H, 2 * S), "h1": (D + S, H), "h2": (H, s.head_out)}
        for name, (i, o) in dims.items():
            w = torch.stack([_init((i, o), i, torch.Generator().manual_seed(seed * 1009 + m * 31 + len(name)))
                             for m in range(E)])
            b = torch.stack([_init((1, o), i, torch.Generator().manual_seed(seed * 2003 + m * 37 + len(name)))
                             for m in range(E)])
            self.register_parameter(f"W_{name}", nn.Parameter(w))
            self.register_parameter(f"b_{name}", nn.Parameter(b))
        with torch.no_grad():  # start the heads near "the base forecast is right, unit noise"
            self.W_h2.mul_(0.1)
            self.b_h2.zero_()

    # -- pieces (all members at once; leading axis E) -------------------------
    @staticmethod
    def _lin(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        # [E, ..., in] @ [E, in, out] + [E, 1, out]: members batched in one matmul.
        lead = x.shape[:-1]
        return torch.baddbmm(b, x.reshape(x.shape[0], -1, x.shape[-1]), W).view(*lead, W.shape[-1])

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self._lin(x, self.W_emb, self.b_emb))

    def step(self, h: torch.Tensor, z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """One GRU transition ``h_{t-1}, z_{t-1}, a_t -> h_t`` for every member: [E, B, D]."""
        u = F.silu(self._lin(torch.cat([z, a], -1), self.W_in, self.b_in))
        gi = self._lin(u, self.W_ih, self.b_ih)
        gh = self._lin(h, self.W_hh, self.b_hh)
        i_r, i_z, i_n = gi.chunk(3, -1)
        h_r, h_z, h_n = gh.chunk(3, -1)
        r = torch.sigmoid(i_r + h_r)
        zg = torch.sigmoid(i_z + h_z)
        n = torch.tanh(i_n + r * h_n)
        return (1 - zg) * n + zg * h

    def _gauss(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, std = raw.chunk(2, -1)
        return mean, F.softplus(std) + self.shape.min_std

    def prior(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._gauss(self._lin(h, self.W_pr, self.b_pr))

    def posterior(self, h: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._gauss(self._lin(torch.cat([h, e], -1), self.W_po, self.b_po))

    def heads(self, h: torch.Tensor, z: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self._lin(F.silu(self._lin(torch.cat([h, z], -1), self.W_h1, self.b_h1)), self.W_h2, self.b_h2)
        K = self.shape.horizon
        return {"loss_mean": out[..., :K], "loss_std": F.softplus(out[..., K:2 * K]) + 1e-2,
                "scale_mean": out[..., 2 * K], "scale_std": F.softplus(out[..., 2 * K + 1]) + 1e-2}

    # -- sequences -------------------------------------------------------------
    def initial(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.shape
        dev = self.W_in.device
        return (torch.zeros(s.members, batch, s.deter, device=dev), torch.zeros(s.members, batch, s.stoch, device=dev))

    def filter(self, x: torch.Tensor, a: torch.Tensor, sample: bool = False,
               gen: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Run the posterior over a window: ``x [E, B, T, F]``, ``a [E, B, T, A]``.
        Returns per-step heads, the prior / posterior parameters and the final state."""
        E, B, T, _ = x.shape
        h, z = self.initial(B)
        e_all = self.embed(x.reshape(E, B * T, -1)).reshape(E, B, T, -1)
        outs: dict[str, list] = {k: [] for k in ("h", "z", "pm", "ps", "qm", "qs")}
        for t in range(T):
            h = self.step(h, z, a[:, :, t])
            pm, ps = self.prior(h)
            qm, qs = self.posterior(h, e_all[:, :, t])
            if sample:
                # gen is a CPU generator (the same draws on every device)
                noise = torch.randn(qm.shape, generator=gen).to(qm.device) if gen is not None else torch.randn_like(qm)
                z = qm + qs * noise
            else:
                z = qm
            for k, v in zip(("h", "z", "pm", "ps", "qm", "qs"), (h, z, pm, ps, qm, qs)):
                outs[k].append(v)
        st = {k: torch.stack(v, 2) for k, v in outs.items()}  # [E, B, T, .]
        st.update(self.heads(st["h"], st["z"]))
        st["h_last"], st["z_last"] = h, z
        return st

    @torch.no_grad()
    def rollout(self, h: torch.Tensor, z: torch.Tensor, actions: torch.Tensor) -> dict[str, torch.Tensor]:
        """Imagine ``actions [E, B, K, A]`` forward from ``(h, z)`` with the prior mean:
        the heads at every imagined step (the reference for kernels/rssm.cu's rollout)."""
        hs, zs = [], []
        for k in range(actions.shape[2]):
            h = self.step(h, z, actions[:, :, k])
            z, _ = self.prior(h)
            hs.append(h)
            zs.append(z)
        H, Z = torch.stack(hs, 2), torch.stack(zs, 2)
        out = self.heads(H, Z)
        out["h"], out["z"] = H, Z
        return out


def kl_gauss(qm, qs, pm, ps) -> torch.Tensor:
    """KL(N(qm, qs) || N(pm, ps)) summed over the last axis."""
    return (torch.log(ps / qs) + (qs ** 2 + (qm - pm) ** 2) / (2 * ps ** 2) - 0.5).sum(-1)


def gaussian_nll(y: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    return torch.log(std) + 0.5 * ((y - mean) / std) ** 2 + 0.5 * math.log(2 * math.pi)


def sequence_loss(model: RSSMEnsemble, x, a, y_loss, m_loss, y_scale, m_scale, free_nats: float = 1.0,
                  kl_dyn: float = 0.5, kl_rep: float = 0.1, gen: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    """Training loss on windows (all [E, B, T, ...]): masked Gaussian NLL of the loss
    residuals (``y_loss``, mask ``m_loss`` [.., K]) and the next projection, plus
    DreamerV3's balanced KL with free nats."""
    out = model.filter(x, a, sample=True, gen=gen)
    nll_l = (gaussian_nll(y_loss, out["loss_mean"], out["loss_std"]) * m_loss).sum() / m_loss.sum().clamp_min(1)
    nll_s = (gaussian_nll(y_scale, out["scale_mean"], out["scale_std"]) * m_scale).sum() / m_scale.sum().clamp_min(1)
    dyn = kl_gauss(out["qm"].detach(), out["qs"].detach(), out["pm"], out["ps"]).clamp_min(free_nats).mean()
    rep = kl_gauss(out["qm"], out["qs"], out["pm"].detach(), out["ps"].detach()).clamp_min(free_nats).mean()
    total = nll_l + nll_s + kl_dyn * dyn + kl_rep * rep
    return total, {"nll_loss": float(nll_l.detach()), "nll_scale": float(nll_s.detach()), "kl": float(dyn.detach())}
