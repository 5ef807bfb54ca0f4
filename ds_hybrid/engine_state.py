"""What a ``PredictiveEngine`` saves beside DeepSpeed's checkpoint, and how it takes it back.

``save_checkpoint`` / ``load_checkpoint`` wrap DeepSpeed's own (written atomically and checked
against a manifest: ``checkpoint.py``) after the engine's background work has settled. The state
itself comes in two parts: ``hybrid_state_dict``, which every rank shares (phase controller,
predictor, pending Predict steps, statistics) and which travels in DeepSpeed's ``client_state``;
and ``rank_state_dict``, this rank's own (RNG, the rollback snapshot in the middle of a Predict
run, the drift velocity, the gradient run's first moment, the device path's held velocity), so
that a run saved in the middle of a Predict run resumes bit for bit.
"""
from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

import torch

from . import checkpoint as ckpt
from . import zero_access as za
from .device_predict import DevicePredict

logger = logging.getLogger(__name__)


class EngineState:
    """``PredictiveEngine``'s checkpoint methods (a mixin ahead of ``DeepSpeedEngine``, whose own
    ``save_checkpoint`` / ``load_checkpoint`` its ``super()`` calls reach)."""

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False):
        """DeepSpeed's checkpoint plus ds_hybrid's state, published atomically: written
        into ``save_dir/.staging-<tag>``, renamed to ``save_dir/<tag>`` when complete,
        and only then named in ``save_dir/latest``. Collective. See ``ds_hybrid/checkpoint.py``."""
        self._wait_fold()     # the velocity is saved
        self._wait_commit()
        if self._gradient is not None:
            self._gradient.behind.wait()   # (memory.cpu_step_behind: the masters and moments are saved)
        parked = self._parking is not None and self._parking.parked
        if parked:  # DeepSpeed saves the optimizer state from where it normally lives
            self._parking.unpark(wait=True)
        try:
            ckpt.save_atomic(self, super().save_checkpoint, save_dir, tag, dict(client_state or {}), save_latest,
                             exclude_frozen_parameters)
        finally:
            if parked:
                self._parking.park()
        return True

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None, verify=True):
        """DeepSpeed's load (``tag=None``: the one ``latest`` names) after checking the files
        against the checkpoint's manifest (sizes and content digests), then ds_hybrid's shared and
        per-rank state. Returns ``(load_path, client_state)``; ``(None, None)`` when there is no
        ``latest``. Raises ``CheckpointError`` naming the file for a truncated, corrupt or
        mismatched checkpoint, or one with no manifest. ``verify=False`` (ds_hybrid's addition):
        skip the content digests and load a folder with no manifest (a plain DeepSpeed
        checkpoint), with a warning."""
        kwargs = dict(load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
                      load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                      custom_load_fn=custom_load_fn)
        self._wait_fold()   # before the loaded masters, moments and velocity replace what it works on
        if self._gradient is not None:
            self._gradient.behind.wait()   # (memory.cpu_step_behind: a step of the masters being replaced)
        if self._parking is not None:
            self._parking.unpark(wait=True)  # the loaded moments replace these; on the device until the next run
        return ckpt.load_verified(self, super().load_checkpoint, load_dir, tag, kwargs, verify=verify)

    def hybrid_state_dict(self) -> dict:
        """State every rank shares (it goes into DeepSpeed's ``client_state``): the phase
        controller, the predictor, the pending Predict steps, the statistics, and
        ``micro_steps``, which DeepSpeed does not save."""
        sd = {"format": ckpt.FORMAT_VERSION, "enabled": self.hybrid_config.enabled,
              "stats": asdict(self._stats), "micro_steps": int(self.micro_steps)}
        if self.hybrid_config.enabled:
            sd.update(controller=self.controller.state_dict(), predictor=self.predictor.state_dict(),
                      pending=self._pending, verifications=self._verifications, max_lr=self._max_lr,
                      progress_log=list(self.progress_log), next_groups=self._next_groups,
                      check_groups=None if self._check_groups is None else sorted(self._check_groups),
                      check_run=self._check_run,
                      planner=None if self._planner is None else self._planner.state_dict(),
                      difficulty=None if self._difficulty is None else self._difficulty.state_dict(),
                      judge=None if self._judge is None else self._judge.state_dict(),
                      judge_stopped=self._judge_stopped, noise=self._noise.state_dict(),
                      device_predict=None if self._device_predict is None else self._device_predict.state_dict())
        return sd

    def load_hybrid_state_dict(self, sd: dict | None, source: Any = "checkpoint") -> None:
        """Restore ``hybrid_state_dict()``. Without one (a plain DeepSpeed checkpoint) the
        phase cycle starts again from Warmup, with a warning."""
        if sd is None:
            logger.warning(f"{source}: no ds_hybrid state in this checkpoint; the phase cycle restarts from Warmup")
            return
        self._stats = type(self._stats)(**{k: (dict(v) if isinstance(v, dict) else v) for k, v in sd["stats"].items()})
        self.micro_steps = sd["micro_steps"]
        if not self.hybrid_config.enabled:
            return
        if not sd["enabled"]:
            logger.warning(f"{source}: saved with hybrid_predict disabled; the phase cycle starts from Warmup")
            return
        self.controller.load_state_dict(sd["controller"])
        self.predictor.load_state_dict(sd["predictor"])
        self._pending = sd["pending"]
        self._verifications = sd.get("verifications", 0)
        self._max_lr = sd.get("max_lr", 0.0)
        self.progress_log = [tuple(x) for x in sd.get("progress_log", [])]
        self._next_groups = int(sd.get("next_groups", 0)) if self._planner is not None else 0
        pending = sd.get("check_groups")
        self._check_groups = frozenset(pending) if pending is not None else None
        self._check_run = bool(sd.get("check_run", False))
        if self._planner is not None and sd.get("planner") is not None:
            self._planner.load_state_dict(sd["planner"])
        if self._difficulty is not None and sd.get("difficulty") is not None:
            self._difficulty.load_state_dict(sd["difficulty"])
        if self._judge is not None and sd.get("judge") is not None:
            self._judge.load_state_dict(sd["judge"])
        self._judge_stopped = bool(sd.get("judge_stopped", False))
        if sd.get("noise") is not None:   # (checkpoints before it: the estimate starts over, as it did)
            self._noise.load_state_dict(sd["noise"])
        self._saved_device_run = sd.get("device_predict")   # applied with the rank state (it needs the velocity)

    def rank_state_dict(self) -> dict:
        """This rank's own state: its RNG states and, in the middle of a Predict run, the
        rollback snapshot (its shard of the masters at the last good point)."""
        return {"format": ckpt.FORMAT_VERSION, "rank": int(self.global_rank), "world_size": int(self.dp_world_size),
                "rng": ckpt.rng_state(), "snapshot": self._snapshot_to_save(),
                "velocity": self._velocity.state_dict() if self._velocity is not None else None,
                # memory.fold_overlap: the last fold's sums, which the next real step observes
                "fold": self._folds.state_dict() if self._folds is not None else None,
                # direction: gradient: the Predict run's own first moment on this rank's partitions
                "gradient": self._gradient.state_dict() if self._gradient is not None else None,
                # memory.fold_during_run: the velocity copy the pending run moves along
                "held_velocity": (self._device_predict.held_state_dict() if self._device_predict is not None
                                  else None)}

    def load_rank_state_dict(self, sd: dict | None, source: Any = "checkpoint") -> None:
        """Restore ``rank_state_dict()``. None (a universal checkpoint, another world size):
        a snapshot still needed is retaken from the loaded masters, with a warning."""
        if sd is not None:
            ckpt.set_rng_state(sd["rng"])
        if self.hybrid_config.enabled and self._velocity is not None:
            saved_v = None if sd is None else sd.get("velocity")
            if saved_v is not None:
                self._velocity.load_state_dict(saved_v, self._masters)
            else:
                logger.warning(f"{source}: no drift velocity for this rank in the checkpoint; it is rebuilt from "
                               "the next real steps")
            if self._folds is not None:
                self._folds.load_state_dict(None if sd is None else sd.get("fold"))
        if self.hybrid_config.enabled and self._gradient is not None:
            why = self._gradient.load_state_dict(None if sd is None else sd.get("gradient"))
            if why is not None:
                logger.warning(f"{source}: saved in the middle of a gradient Predict run, which cannot be taken up "
                               f"as it was: {why}")
        if self.hybrid_config.enabled and self._load_device_run(sd, source):
            return
        if not self.hybrid_config.enabled or not self._snapshot_needed():
            return
        saved = None if sd is None else sd.get("snapshot")
        za.capture_weights(self._masters, self._snapshot)  # allocates the buffers on the right device
        shapes = [tuple(b.shape) for b in self._snapshot.buffers]
        if saved is not None and [tuple(b.shape) for b in saved] == shapes:
            for buf, value in zip(self._snapshot.buffers, saved):
                buf.copy_(value)
            return
        logger.warning(f"{source}: saved in the middle of a Predict run, but this rank's rollback snapshot does "
                       f"not apply here; the loaded weights become the last good point ({self._pending} unverified "
                       "Predict steps can no longer be rolled back)")

    def _load_device_run(self, sd: dict | None, source: Any) -> bool:
        """A Predict run saved or loaded on the device path (``memory.offload_predict``). The
        loaded masters are its last good point; True when nothing else is left to restore."""
        saved, self._saved_device_run = self._saved_device_run, None
        pending = (saved or {}).get("pending") or []
        held = None if sd is None else sd.get("held_velocity")
        if self._device_predict is not None:
            self._device_predict.load_state_dict(saved, held, self._velocity)
            if pending:   # the 16-bit copies from the masters, then the run's updates again
                self._device_predict.replay(self._velocity)
            elif sd is not None and sd.get("snapshot") is not None:
                logger.warning(f"{source}: saved in the middle of a host-path Predict run; on the device path the "
                               f"loaded weights become the last good point ({self._pending} unverified Predict "
                               "steps can no longer be rolled back)")
            return True
        if not pending:
            return False
        # Saved by a device-side run, loaded on the host path: the masters are the rollback
        # snapshot, then they take the run, which is where the host path would hold them.
        run = DevicePredict(self._masters, backend=self.hybrid_config.kernels)
        run.host_kernel = self._host_kernel
        run.load_state_dict(saved, held, self._velocity)
        rest = run.pending[run.verified:]
        run.pending = run.pending[:run.verified]
        run.commit(self._velocity)   # its verified steps: the last good point
        za.capture_weights(self._masters, self._snapshot)
        run.pending = rest
        run.commit(self._velocity)
        self._masters.lp_current = False
        self._masters.propagate()
        return True


    def _snapshot_to_save(self) -> list[torch.Tensor] | None:
        if not (self.hybrid_config.enabled and self._snapshot_needed() and self._snapshot.holds == "weights"):
            return None
        return [b.detach().to("cpu", copy=True) for b in self._snapshot.buffers]
