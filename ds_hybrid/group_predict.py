"""Layer-group Predict: real steps in which the lower layer groups take a predicted update.

A *partial* step splits the optimizer's param groups (``models.layer_groups``: embeddings,
bands of blocks, head) into a predicted prefix, the lower ``k`` groups, and the real rest.
The forward runs as usual, but autograd is off below the first real block and that block's
input is detached, so the backward stops there: no weight or activation gradients below it.
The real groups take DeepSpeed's optimizer step; the predicted groups are hidden from the
optimizer for that step (no zero-gradient Adam step, no moment decay, no weight decay, no
step count) and take the predicted update instead. The next step's own first forward is the
check: a loss outside the divergence band rolls the predicted groups back, exactly, and that
forward is run again.

Three pieces, each with one job:

* ``GroupLayout``: which prefixes of the param groups are input-side (embeddings and whole
  blocks below a cut block), and the cut block of each;
* ``BackwardCut``: the two forward pre-hooks that stop autograd at the cut;
* ``GroupPlanner``: how many groups to predict next, from per-group measurements of real
  steps (how much of each real update the velocity foresees, each group's share of the
  persistent update) and the measured time of partial and whole steps.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, field

import torch

from .config import ConfigError, GroupPredictConfig


class GroupLayout:
    """Where each optimizer param group sits in the network's depth.

    ``prefix_valid[k]``: predicting groups ``0..k-1`` leaves every real parameter above a
    block ``cut[k]`` whose input can be detached: the predicted groups hold only input-side
    parameters (embeddings not tied to the head, whole blocks below the cut), and every
    parameter below the cut is in a predicted group.
    """

    def __init__(self, model: torch.nn.Module, param_groups: list[list[torch.nn.Parameter]],
                 names: list[str] | None = None):
        from .models import block_list
        blocks = block_list(model)
        if blocks is None:
            raise ConfigError("hybrid_predict.group_predict: the model has no list of transformer blocks "
                              "(a ModuleList named h, layers or blocks); layer-group Predict needs one")
        self.blocks = blocks
        depth: dict[int, float] = {}
        for i, block in enumerate(blocks):
            for p in block.parameters():
                depth[id(p)] = float(i)
        out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        head_ids = {id(p) for p in out_emb.parameters()} if out_emb is not None else set()
        in_emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        below = {id(p) for p in (in_emb.parameters() if in_emb is not None else [])} - head_ids
        for name, p in model.named_parameters():
            if id(p) in depth:
                continue
            if id(p) in below or any(k in name for k in ("wpe", "position_embeddings", "embed_positions")):
                depth[id(p)] = -1.0          # input side: embeddings not tied to the head
            else:
                depth[id(p)] = math.inf      # final norm, head, tied embedding
        self.names = names or [f"group_{i}" for i in range(len(param_groups))]
        self.lo = [min((depth.get(id(p), math.inf) for p in g), default=math.inf) for g in param_groups]
        self.hi = [max((depth.get(id(p), math.inf) for p in g), default=-math.inf) for g in param_groups]
        self.numel = [sum(p.numel() for p in g) for g in param_groups]
        n = len(param_groups)
        self.cut: list[int | None] = [None] * (n + 1)
        for k in range(1, n):
            below_max = max(self.hi[:k])
            above_min = min(self.lo[k:])
            # The cut is the first block of the real groups; everything predicted lies below it.
            if math.isfinite(above_min) and above_min >= 0 and below_max < above_min:
                self.cut[k] = int(above_min)
        self.max_prefix = max([k for k in range(n + 1) if self.cut[k] is not None], default=0)

    def valid(self, k: int) -> bool:
        return k == 0 or (0 < k < len(self.cut) and self.cut[k] is not None)

    def share_below(self, k: int) -> float:
        """Parameters in the predicted prefix over all parameters."""
        total = sum(self.numel)
        return sum(self.numel[:k]) / total if total else 0.0

    def check(self, k: int, key: str) -> None:
        if not self.valid(k):
            raise ConfigError(f"{key}: predicting the lower {k} layer groups ({', '.join(self.names[:k])}) does "
                              f"not leave a block to stop the backward at; at most {self.max_prefix} of "
                              f"{len(self.names)} groups ({', '.join(self.names)}) can be predicted. Build the "
                              "param groups with ds_hybrid.models.layer_groups (the tied input embedding counts "
                              "as the head's)")


class BackwardCut:
    """Forward pre-hooks that stop autograd below a block: while ``active(block)`` is set, the
    model's forward starts with autograd off and the cut block turns it back on and detaches
    its input. Outside ``active`` the hooks do nothing (and activation checkpointing's
    recomputation in the backward, which re-enters the blocks, sees them inactive)."""

    def __init__(self, model: torch.nn.Module, blocks: torch.nn.ModuleList):
        self.blocks = blocks
        self._cut: int | None = None
        self._grad_before = True
        model.register_forward_pre_hook(self._model_start)
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(self._make_block_hook(i), with_kwargs=True)

    def _model_start(self, module, args):
        if self._cut is not None:
            self._grad_before = torch.is_grad_enabled()
            torch.set_grad_enabled(False)

    def _make_block_hook(self, index: int):
        def hook(module, args, kwargs):
            if self._cut != index:
                return None
            torch.set_grad_enabled(self._grad_before)
            if args:
                return (args[0].detach(),) + tuple(args[1:]), kwargs
            hs = kwargs.get("hidden_states")
            if hs is not None:
                kwargs = dict(kwargs, hidden_states=hs.detach())
            return args, kwargs
        return hook

    @contextlib.contextmanager
    def active(self, block: int | None):
        self._cut = block
        grad = torch.is_grad_enabled()
        try:
            yield
        finally:
            self._cut = None
            torch.set_grad_enabled(grad)   # whatever happened inside, the caller's mode is back


@dataclass
class PlannerStats:
    """Running per-group measurements of real steps (all ranks see the same all-reduced sums)."""

    proj: list = field(default_factory=list)     # EMA of <d, v_old> / |v_old|^2: how much of the velocity the next real update keeps
    persist: list = field(default_factory=list)  # EMA of max(<d, v_old>, 0): the group's persistent movement (its share of progress)
    step_seconds: dict = field(default_factory=dict)  # EMA of the step time by prefix k ("0" = whole step)
    residual: dict = field(default_factory=lambda: {"after_partial": [0.0, 0], "after_whole": [0.0, 0]})
    cooldown: int = 0          # steps left before the planner may predict again after measured harm
    real_updates: int = 0      # real updates folded into the per-group statistics
    since_whole: int = 0       # partial steps since the last whole step
    last_k: int = 0            # the prefix of the last step taken
    chosen: dict = field(default_factory=dict)   # how often each prefix was chosen


class GroupPlanner:
    """How many lower layer groups the next Full step predicts.

    A partial step with prefix ``k`` is worth ``1 - share_k * (1 - w_k)`` of a whole step: the
    real groups make their usual progress, and the predicted groups, whose share of the
    persistent update is ``share_k``, make the part ``w_k`` of theirs that the velocity foresees
    (the running projection of each real update on the velocity, clipped to [0, 1]). It costs
    ``c_k`` of a whole step (measured step times; until measured, a prior from the share of
    parameters whose backward is skipped). The planner takes the ``k`` with the best
    ``worth / cost``, when that beats a whole step by ``min_gain``; never in Warmup or Correct
    steps, below the LR gate, while a group's statistics are missing, or for ``cooldown`` steps
    after steps following partial ones measured a loss excess of half the divergence band.
    Every ``refresh_every``-th Full step is whole, so the predicted groups' velocity and
    statistics keep learning from real updates.
    """

    def __init__(self, cfg: GroupPredictConfig, layout: GroupLayout, ema: float = 0.9):
        self.cfg, self.layout, self.ema = cfg, layout, ema
        n = len(layout.numel)
        self.stats = PlannerStats(proj=[None] * n, persist=[None] * n)

    # -- measurements ----------------------------------------------------------
    def observe_groups(self, sums: torch.Tensor, real: list[bool]) -> None:
        """Per-group fold sums (``zero_access.DIRECTION_STATS`` columns) of a real step; only the
        groups that took a real update (``real``) are measured."""
        a = self.ema
        for g, row in enumerate(sums.tolist()):
            dot, old_sq = row[0], row[1]
            if not real[g] or old_sq <= 0 or not math.isfinite(dot):
                continue
            proj = dot / old_sq
            per = max(dot, 0.0)
            p0, q0 = self.stats.proj[g], self.stats.persist[g]
            self.stats.proj[g] = proj if p0 is None else a * p0 + (1 - a) * proj
            self.stats.persist[g] = per if q0 is None else a * q0 + (1 - a) * per
        self.stats.real_updates += 1

    def observe_time(self, k: int, seconds: float) -> None:
        key = str(k)
        old = self.stats.step_seconds.get(key)
        self.stats.step_seconds[key] = seconds if old is None else self.ema * old + (1 - self.ema) * seconds

    def observe_check(self, after_partial: bool, excess_in_bands: float) -> None:
        """A step's first-forward loss against its forecast, in units of the divergence band."""
        key = "after_partial" if after_partial else "after_whole"
        acc = self.stats.residual[key]
        acc[0] = excess_in_bands if acc[1] == 0 else self.ema * acc[0] + (1 - self.ema) * excess_in_bands
        acc[1] += 1
        p, w = self.stats.residual["after_partial"], self.stats.residual["after_whole"]
        if p[1] >= 16 and w[1] >= 16 and p[0] - w[0] > 0.5:
            # Measured harm: the loss after partial steps sits half a band above the loss after whole ones.
            self.stats.cooldown = 4 * self.cfg.refresh_every * 8
            p[0], p[1] = 0.0, 0

    # -- decision -----------------------------------------------------------------
    def cost(self, k: int) -> float:
        """A partial step's time over a whole step's: measured, else a prior (the backward,
        about two thirds of a step, skipped for the predicted share of the parameters)."""
        whole, part = self.stats.step_seconds.get("0"), self.stats.step_seconds.get(str(k))
        if whole and part:
            return part / whole
        return 1.0 - (2.0 / 3.0) * self.layout.share_below(k)

    def worth(self, k: int) -> float | None:
        per = self.stats.persist
        if any(x is None for x in per) or any(self.stats.proj[g] is None for g in range(k)):
            return None
        total = sum(per)
        if total <= 0:
            return None
        share = sum(per[:k]) / total
        w = sum(per[g] * min(max(self.stats.proj[g], 0.0), 1.0) for g in range(k)) / max(sum(per[:k]), 1e-30)
        return 1.0 - share * (1.0 - w * (1.0 if self.cfg.step_scale > 0 else 0.0))

    def candidates(self) -> list[int]:
        top = self.layout.max_prefix if self.cfg.max_groups is None else min(self.cfg.max_groups, self.layout.max_prefix)
        return [k for k in range(1, top + 1) if self.layout.valid(k)]

    def decide(self, lr_gate_open: bool) -> int:
        """The prefix for the next Full step (0: a whole step)."""
        st = self.stats
        if st.cooldown > 0:
            st.cooldown -= 1
            return self._chose(0)
        if not lr_gate_open or st.since_whole + 1 >= self.cfg.refresh_every:
            return self._chose(0)
        if self.cfg.pinned is not None:
            return self._chose(self.cfg.pinned)
        best, best_ratio = 0, 1.0 + self.cfg.min_gain
        for k in self.candidates():
            w = self.worth(k)
            if w is None:
                continue
            ratio = w / max(self.cost(k), 1e-6)
            if ratio > best_ratio:
                best, best_ratio = k, ratio
        return self._chose(best)

    def _chose(self, k: int) -> int:
        self.stats.chosen[str(k)] = self.stats.chosen.get(str(k), 0) + 1
        return k

    def stepped(self, k: int) -> None:
        """The step with prefix ``k`` was taken."""
        self.stats.since_whole = self.stats.since_whole + 1 if k > 0 else 0
        self.stats.last_k = k

    def scales(self, k: int) -> list[float]:
        """Per-group scale of the predicted update: ``step_scale`` times the group's measured
        projection (how much of the velocity a real step would take), 0 for real groups."""
        n = len(self.layout.numel)
        out = [0.0] * n
        for g in range(k):
            proj = self.stats.proj[g]
            out[g] = self.cfg.step_scale * (min(max(proj, 0.0), 1.0) if proj is not None else 0.0)
        return out

    def summary(self) -> dict:
        return {"projection": self.stats.proj, "persistent_share": self._shares(),
                "cost": {str(k): self.cost(k) for k in self.candidates()},
                "worth": {str(k): self.worth(k) for k in self.candidates()},
                "chosen": dict(self.stats.chosen), "cooldown": self.stats.cooldown,
                "residual_in_bands": {k: v[0] for k, v in self.stats.residual.items()}}

    def _shares(self) -> list:
        per = self.stats.persist
        total = sum(x for x in per if x is not None)
        return [None if x is None or total <= 0 else x / total for x in per]

    def state_dict(self) -> dict:
        return asdict(self.stats)

    def load_state_dict(self, sd: dict) -> None:
        self.stats = PlannerStats(**{k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v)
                                     for k, v in sd.items()})
        self.stats.residual = {k: list(v) for k, v in self.stats.residual.items()}
