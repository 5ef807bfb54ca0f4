"""The systems the bench runs ("arms") and the ds_config each one's runs take.

Plain DeepSpeed (the LR-tuned baseline), the hybrid's variants (whole-model drift or gradient
Predict runs, layer-group Predict, the preset's own section) and DeepSpeed's ZenFlow, each with
the step budgets it runs at. ``bench`` runs them; ``bench_profile`` builds engines as they do.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from . import bench_report as report


@dataclass(frozen=True)
class Arm:
    """One system the bench runs at every budget."""

    name: str
    doc: str
    hybrid: dict | str | None    # the hybrid_predict section; None: plain DeepSpeed; "preset": the preset's own
    budgets: tuple[float, ...] | None = None   # None: every budget of the suite
    # Another system's baseline (ZenFlow) tunes its own LR, as plain DeepSpeed's is tuned: swept at the
    # full budget on the first seed around plain's best. The hybrid's arms keep plain's LR, so that a
    # predicted step is never credited with what a better LR would have done.
    own_lr: bool = False
    # With ``hybrid="preset"``: changes to the suite's own section (``with_changes``' keys), so that one
    # of its settings is varied and the rest, as the suite's config has it, kept.
    preset_changes: dict | None = None
    # Changes to the suite's DeepSpeed config for a hybrid arm's runs (``deep_merge``'s: a None
    # removes a section), so that the hybrid runs where a plain arm's config does.
    ds_changes: dict | None = None


# Predicted steps everywhere they are allowed, so the frontier shows what they are worth.
WHOLE = {"enabled": True, "warmup_steps": 50, "full_steps": 4, "min_predict_steps": 2, "max_predict_steps": 2,
         "confidence_threshold": 0.0, "predict_lr_fraction": 1.0, "correction_steps": 0, "check": "next_step",
         "predictor": {"direction": "drift", "drift_beta": 0.95, "step_scale": 1.0, "max_step_scale": 1.0},
         "divergence": {"rel_tolerance": 0.02, "z_threshold": 3.0, "max_loss_ratio": 1.5},
         "dynamics": {"progress_every": 0}}
# Predict steps that take their own gradient: 3 after every real step from step 50 (the study's
# 1 : 3, each worth a real step in loss; they pay where the optimizer step is dear: ZeRO-Offload).
GRADIENT = {"enabled": True, "warmup_steps": 50, "full_steps": 1, "min_predict_steps": 3, "max_predict_steps": 3,
            "confidence_threshold": 0.0, "predict_lr_fraction": 1.0, "correction_steps": 0, "check": "next_step",
            "predictor": {"direction": "gradient"},
            "divergence": {"rel_tolerance": 0.02, "z_threshold": 3.0, "max_loss_ratio": 1.5},
            "dynamics": {"progress_every": 0}}
GROUPS = {"enabled": True, "warmup_steps": 50, "full_steps": 8, "whole_model": False, "predict_lr_fraction": 1.0,
          "predictor": {"direction": "drift", "drift_beta": 0.95},
          "group_predict": {"enabled": True, "refresh_every": 4, "min_gain": 0.05},
          "dynamics": {"progress_every": 0}}


def with_changes(base: dict, **changes: Any) -> dict:
    """A copy of a hybrid_predict section with ``changes`` (``a__b=v`` sets ``a.b``)."""
    out = json.loads(json.dumps(base))
    for key, value in changes.items():
        node = out
        *parents, leaf = key.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


# Budgets: plain DeepSpeed's frontier below the full budget is what the looser targets are read
# from; a hybrid run with 1/3 of its steps predicted has fewer real steps than plain DeepSpeed at
# the same budget, so its arms also run longer budgets (it may reach the target only there).
# Plain DeepSpeed runs those longer budgets too: a longer schedule's curve crosses the full
# budget's final loss before its end, 3-9% sooner than that budget on cpu-small
# (benchmarks/predict_sweep.py's `plain` variant), and without them the hybrid's ratio was
# flattered by 0.05 (docs/predicted-steps.md).
_PLAIN_BUDGETS = (0.75, 0.875, 1.0, 1.25, 1.5, 2.0)   # (2.0: only where a suite lists it)
_HYBRID_BUDGETS = (1.0, 1.25, 1.5)

ARMS: dict[str, Arm] = {a.name: a for a in [
    Arm("baseline", "plain DeepSpeed (`hybrid_predict.enabled: false`), LR-tuned", None, budgets=_PLAIN_BUDGETS),
    Arm("predict", "whole-model drift Predict runs (2 after every 4 real steps from step 50), checked by the "
        "next real step's forward (`check: next_step`)", WHOLE, budgets=_HYBRID_BUDGETS),
    Arm("predict-skip", "its control: the same runs with `predictor.direction: none` (Predict steps advance the "
        "schedule and move nothing)", with_changes(WHOLE, predictor__direction="none"), budgets=(1.0, 1.25)),
    Arm("predict-gradient", "whole-model Predict runs whose steps take their own gradient (`predictor.direction: "
        "gradient`: Adam's step, the second moment held at `betas[1]` 0.999 and updated below 0.99 "
        "(`predictor.gradient_second_moment: auto`), the run's moments handed to the optimizer when "
        "kept; 3 after every real step from step 50), checked by the next real step's forward", GRADIENT,
        budgets=_HYBRID_BUDGETS),
    Arm("predict-gradient-half", "the same, each Predict step's gradient from half of its batch "
        "(`predictor.gradient_batch_fraction: 0.5`: half a real step's forward and backward)",
        with_changes(GRADIENT, predictor__gradient_batch_fraction=0.5), budgets=_HYBRID_BUDGETS),
    # A quarter of the batch, 7 after every real step: grad_step_study's best worth per cost (at its
    # batch 64, 1 : 7, each worth 0.48 +- 0.02 of a real step). Its real steps are 1 in 8, so it may
    # reach plain's final loss only past plain's budget: it runs up to twice that.
    Arm("predict-gradient-quarter", "each Predict step's gradient from a quarter of its batch "
        "(`predictor.gradient_batch_fraction: 0.25`), 7 after every real step from step 50",
        with_changes(GRADIENT, predictor__gradient_batch_fraction=0.25, min_predict_steps=7, max_predict_steps=7),
        budgets=(1.0, 1.5, 2.0)),
    # The same share, 15 after every real step, up to 3x plain's budget: grad_step_study's first setting to
    # reach plain AdamW's final loss (batch 64, 3 seeds, a 3x schedule) in under 0.6x plain's time by the
    # H200's timers (docs/memory.md, "Toward plain's final loss"). Its real steps are 1 in 16. (4x where a
    # suite lists it: on offload-b64 one seed of three ended 0.85% above plain's final loss at 3x.)
    Arm("predict-gradient-quarter-15", "each Predict step's gradient from a quarter of its batch, 15 after every "
        "real step from step 50, up to 3x plain's budget (4x on `offload-b64`)",
        with_changes(GRADIENT, predictor__gradient_batch_fraction=0.25, min_predict_steps=15, max_predict_steps=15),
        budgets=(1.0, 2.0, 3.0, 4.0)),
    # The same with the run's state in half a byte a parameter and no gradient held (what fits 7B under 24 GB):
    # a 4-bit first moment, a factored second, each parameter clipped to its share as its gradient arrives.
    Arm("predict-gradient-quarter-15-int4f", "`predict-gradient-quarter-15` with the run's moments in the compact "
        "state on the device path (`memory.gradient_state_dtype: int4-factored`)",
        with_changes(GRADIENT, predictor__gradient_batch_fraction=0.25, min_predict_steps=15, max_predict_steps=15,
                     memory__offload_predict="device", memory__gradient_state_dtype="int4-factored"),
        budgets=(1.0, 2.0, 3.0, 4.0)),
    Arm("groups", "layer-group Predict chosen by the planner (`group_predict`), no whole-model runs", GROUPS,
        budgets=(1.0,)),
    Arm("groups-pinned", "the lower 2 of 4 layer groups predicted on 3 of every 4 Full steps",
        with_changes(GROUPS, group_predict__pinned=2), budgets=(1.0,)),
    Arm("groups-freeze", "its control: the same steps with the predicted groups frozen (`step_scale: 0`)",
        with_changes(GROUPS, group_predict__pinned=2, group_predict__step_scale=0.0), budgets=(1.0,)),
    Arm("default", "the preset's own `hybrid_predict` section as shipped (the no-argument `ds-hybrid train`)",
        "preset", budgets=(1.0,)),
    # A config whose real steps are a few of its steps (offload-preset's: 1 in 16) reaches plain's final loss
    # only on a longer schedule, as predict-gradient-quarter-15 does: its own section up to 4x.
    Arm("preset-long", "the suite's config's own `hybrid_predict` section, up to 4x plain's budget (for a section "
        "whose real steps are few: `offload-preset`'s, 1 in 16)", "preset", budgets=(1.0, 2.0, 3.0, 4.0)),
    # The same at 1.75 times plain's budget (offload-preset-fp32: a run whose real steps are 1 in 16 and
    # whose Predict steps take half the batch; its 1x run ends above plain's final loss).
    Arm("preset-1.75x", "the suite's config's own `hybrid_predict` section at 1.75 times plain's budget",
        "preset", budgets=(1.75,)),
    # And at 2.25 times: plain's own longer schedules (1.25x, 1.5x) crossed its full budget's final loss a
    # fifth sooner than that budget on this suite (its LR stays higher for longer), so the hybrid gets a
    # longer schedule too, at a budget plain does not run.
    Arm("preset-2.25x", "the suite's config's own `hybrid_predict` section at 2.25 times plain's budget",
        "preset", budgets=(2.25,)),
    # Its Predict steps from a quarter of the batch (offload-preset-fp32: 2 of the 8 micro-batches, a
    # Predict step about 0.2 of a real one on the CPU against the half's 0.33), Adam's second moment
    # updated as the suite has it: at the held one a quarter stalled (offload-preset).
    Arm("preset-1.75x-quarter", "`preset-1.75x` with each Predict step's gradient from a quarter of the batch "
        "(`predictor.gradient_batch_fraction: 0.25`)", "preset", budgets=(1.75,),
        preset_changes={"predictor__gradient_batch_fraction": 0.25}),
    # And without activation checkpointing, as `baseline-no-recompute` runs plain: its real steps recompute
    # nothing either (its Predict steps recompute nothing in either arm: their micro-batch fits).
    Arm("preset-1.75x-no-recompute", "`preset-1.75x` with activation checkpointing off (`activation_checkpointing` "
        "removed), as `baseline-no-recompute` runs plain (its steps priced from its kinds timed on that config, "
        "in the suite's plain steps)", "preset", budgets=(1.75,),
        ds_changes={"activation_checkpointing": None}),
]}


# ZenFlow: plain DeepSpeed with its own asynchronous CPU updates (the offload suite's comparator).
# Its tutorial's settings but for the selection: "auto" means once per epoch of DeepSpeed's own
# data loader, and without one (this loop feeds its batches) DeepSpeed never re-selects; so the
# important columns are re-selected every 100 steps, from a top 10%, with the CPU step in line.
# A 60-step check (gpt2-tiny, seed 1, offload suite's config): the tutorial's settings ended at
# 3.22 in 211 ms/step, these at 3.02 in 151 ms/step (plain ZeRO-Offload 2.79, 172 ms/step).
_ZENFLOW = {"topk_ratio": 0.1, "update_interval": 4, "select_strategy": "step", "select_interval": 100,
            "full_warm_up_rounds": 0, "overlap_step": False}
ARMS["zenflow"] = Arm("zenflow", "DeepSpeed's ZenFlow (`zero_optimization.zenflow`: top 10% of columns updated "
                      "every step, re-selected every 100, the rest every 4 on the CPU)",
                      {"__ds__": {"zero_optimization": {"zenflow": _ZENFLOW}}}, budgets=_PLAIN_BUDGETS, own_lr=True)
# Plain DeepSpeed without activation checkpointing, where the suite's config has it and its micro-batch
# fits without it (the offload-preset suites on the CPU): the same gradients at plain's LR, each backward
# without the forward it recomputes. A gradient Predict step skips that recompute where the memory allows
# (predictor.gradient_checkpointing: auto), so this arm tells the saving of the recompute from the worth of
# the predicted steps. Costed as a kind of its own in the profile, as a DeepSpeed feature's runs are.
ARMS["baseline-no-recompute"] = Arm(
    "baseline-no-recompute", "plain DeepSpeed with activation checkpointing off (`activation_checkpointing` "
    "removed: nothing recomputed in backward; the suite's micro-batch fits without it), at plain's LR",
    {"__ds__": {"activation_checkpointing": None}}, budgets=_PLAIN_BUDGETS)
# ZenFlow as its tutorial recommends it beside a GPU: each CPU step overlapped with the next steps'
# forward and backward (`overlap_step: true`, the CPU step in a process of its own), the offload-gpu
# suite's. On the 2-core CPU that process takes a core from the training one: 120 steps of the
# offload suite's config (gpt2-tiny, seed 1) took 132 ms/step and ended at 2.666 in line, 109 ms/step
# and 2.641 without, so the CPU suites keep the CPU step in line.
ARMS["zenflow-overlap"] = Arm("zenflow-overlap", "DeepSpeed's ZenFlow as `zenflow`, each CPU step overlapped with "
                              "the next steps' forward and backward (its tutorial's `overlap_step: true`)",
                              {"__ds__": {"zero_optimization": {"zenflow": dict(_ZENFLOW, overlap_step=True)}}},
                              budgets=_PLAIN_BUDGETS, own_lr=True)

# A quick run is too short for the arms' warmup: predict early so every path runs.
QUICK_HYBRID = {"warmup_steps": 6}


def deep_merge(base: dict, extra: dict) -> dict:
    """``base`` with ``extra`` laid over it, section by section; a None in ``extra`` removes the key
    (a config whose meaning is a section's presence: ``activation_checkpointing``)."""
    out = dict(base)
    for k, v in extra.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def arm_config(base_cfg: dict, arm: Arm, quick: bool) -> tuple[dict, bool]:
    """The ds_config of an arm's runs and whether they run as plain DeepSpeed (``--baseline``)."""
    cfg = json.loads(json.dumps(base_cfg))
    if arm.hybrid is None:
        return cfg, True
    if arm.ds_changes:
        cfg = deep_merge(cfg, arm.ds_changes)
    if arm.hybrid == "preset":
        section = with_changes(cfg.get("hybrid_predict", {}), **(arm.preset_changes or {}))
    elif report.ds_feature(arm.hybrid):    # a DeepSpeed feature, no hybrid
        cfg = deep_merge(cfg, arm.hybrid["__ds__"])
        gas = cfg.get("gradient_accumulation_steps", 1)
        if (cfg.get("zero_optimization") or {}).get("zenflow") and gas > 1:
            # ZenFlow makes every micro-batch an optimizer step (its update_interval takes the
            # accumulation's place): the suite's batch in one micro-batch, so that its steps see what
            # plain's do (train refuses a ZenFlow config that accumulates).
            cfg["train_micro_batch_size_per_gpu"] = cfg["train_micro_batch_size_per_gpu"] * gas
            cfg["gradient_accumulation_steps"] = 1
        return cfg, True
    else:
        section = json.loads(json.dumps(arm.hybrid))
    if quick:
        section = dict(section, **QUICK_HYBRID)
        if "full_steps" in section:
            section["full_steps"] = min(section["full_steps"], 4)
    cfg["hybrid_predict"] = section
    return cfg, False
