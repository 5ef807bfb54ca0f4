"""Hugging Face ``Trainer`` with Predict steps: ``HybridTrainer``.

``Trainer(args=TrainingArguments(deepspeed=...))`` builds its engine in accelerate's
``Accelerator.prepare`` (``deepspeed.initialize``) and then drives it micro-batch by
micro-batch through ``accelerator.backward`` -> ``engine.backward`` + ``engine.step``.
A ``PredictiveEngine`` decides its phase once per optimizer step, in ``train_step``,
so ``HybridTrainer`` changes three things and leaves the rest of Trainer's loop alone:

* the ``accelerator.prepare`` call that builds the engine goes through
  ``ds_hybrid.initialize`` (so the engine is a ``PredictiveEngine``); the
  ``hybrid_predict`` section is parsed by ds_hybrid when the trainer is built (a typo
  fails there, naming the key) and is kept out of the dict accelerate fills, which
  would reject its ``"auto"`` values (``kernels: auto``) as unfilled placeholders;
* ``training_step`` collects the accumulation cycle's micro-batches (Trainer has
  already fetched them all: ``get_batch_samples``) and, on the last one, runs
  ``engine.train_step`` over all of them: a Predict step runs no backward;
* ``log`` adds the phase and the backward passes skipped to Trainer's log entries.

Checkpoints need nothing here: Trainer saves through ``engine.save_checkpoint`` and
resumes through ``engine.load_checkpoint``, which carry ds_hybrid's state.

Importing this module also makes a plain ``DeepSpeedEngine`` built from a config with
an enabled ``hybrid_predict`` section log that the section is ignored
(``warn_on_plain_engines``): that is how a plain ``Trainer`` given such a config is
caught in a process that imported ds_hybrid.hf. Nothing of ours runs in a process
that never imports it. See docs/hf-trainer.md.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from typing import Any, Mapping

import torch
from transformers import Trainer

from .engine import PredictiveEngine, StepResult
from .engine import initialize as hybrid_initialize
from .config import SECTION, ConfigError, parse_hybrid_config

logger = logging.getLogger(__name__)


class HybridTrainer(Trainer):
    """``transformers.Trainer`` whose DeepSpeed engine is a ``PredictiveEngine``.

    Use it as Trainer, with ``TrainingArguments(deepspeed=<dict or path>)`` holding a
    ``hybrid_predict`` section. ``hybrid_result`` is the last step's ``StepResult`` and
    ``hybrid_engine`` the engine (``None`` before ``train()`` builds it)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._parse_section()
        self._check_rank_count()
        self.hybrid_result: StepResult | None = None
        self._micro_batches: list = []   # the accumulation cycle so far (training_step)

    def train(self, *args: Any, **kwargs: Any):
        self._micro_batches = []   # a cycle cut short by an exception in an earlier train() is not resumed
        return super().train(*args, **kwargs)

    # ------------------------------------------------------------ engine construction
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        prepare = self.accelerator.prepare

        @functools.wraps(prepare)
        def prepare_with_hybrid_engine(*objects: Any, **kwargs: Any):
            # Trainer's one call that builds the engine is a prepare(model, optimizer, ...);
            # a prepare of a data loader only never reaches deepspeed.initialize.
            with _hybrid_initialize(self._ds_config()):
                return prepare(*objects, **kwargs)

        # An attribute of this trainer's own Accelerator: other Accelerators are untouched.
        self.accelerator.prepare = prepare_with_hybrid_engine

    def _ds_config(self) -> dict:
        """The ds_config dict accelerate fills and hands to deepspeed.initialize (Trainer's
        auto-batch-size finder replaces it with a copy, so it is looked up each time)."""
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if plugin is None:
            raise ValueError("HybridTrainer: TrainingArguments.deepspeed is not set; pass a ds_config (a dict or "
                             f"a path to a JSON file) with a '{SECTION}' section, e.g. "
                             "TrainingArguments(deepspeed=ds_config, ...)")
        return plugin.deepspeed_config

    def _parse_section(self) -> None:
        """ds_hybrid's parse of the section (a bad key raises ConfigError naming it), plus the
        Trainer arguments Predict cannot work with, before anything is built."""
        ds_config = self._ds_config()
        cfg = parse_hybrid_config(ds_config)
        if SECTION not in ds_config:
            logger.warning(f"HybridTrainer: the ds_config has no '{SECTION}' section; this run trains as plain "
                           "DeepSpeed (no Predict steps)")
        optim = str(getattr(self.args.optim, "value", self.args.optim))   # an OptimizerNames member
        if cfg.enabled and "optimizer" not in ds_config and "adam" not in optim.lower():
            raise ConfigError(f"TrainingArguments.optim: '{optim}' is not an Adam-family optimizer; "
                              f"Predict steps ({SECTION}.enabled) read and move Adam's moments. Use an adamw_* "
                              "optim, an 'optimizer' section of type AdamW in the ds_config, or set "
                              f"{SECTION}.enabled to false")

    def _check_rank_count(self) -> None:
        """accelerate's DeepSpeed path knows the backend only on an accelerator; with none it
        starts DeepSpeed's gloo group but counts one process, and Trainer would then compute
        the batch size and shard the data as if this rank were alone."""
        if not torch.distributed.is_initialized():
            return
        world = torch.distributed.get_world_size()
        if world != self.accelerator.num_processes:
            raise RuntimeError(f"HybridTrainer: torch.distributed has {world} ranks but accelerate counts "
                               f"{self.accelerator.num_processes} (DeepSpeed on a machine with no GPU). Call "
                               "ds_hybrid.hf.init_cpu_ranks() before building TrainingArguments and pass it "
                               "accelerator_config={'use_configured_state': True} (docs/hf-trainer.md)")

    def set_initial_training_values(self, args, dataloader):
        values = super().set_initial_training_values(args, dataloader)
        _, per_epoch, *_, steps_in_epoch, max_steps = values
        gas = args.gradient_accumulation_steps
        # Trainer ends an epoch whose batch count is not a multiple of gas with a shorter
        # cycle; train_step takes exactly gas micro-batches (one optimizer step of the
        # engine), so such a cycle would fail at the end of the first epoch: say it now.
        if steps_in_epoch % gas and max_steps >= per_epoch:
            raise ValueError(f"HybridTrainer: {steps_in_epoch} batches per epoch on each rank is not a multiple of "
                             f"gradient_accumulation_steps ({gas}), so each epoch would end in a shorter "
                             "accumulation cycle, which a PredictiveEngine step cannot take. Trim the dataset, "
                             "change per_device_train_batch_size or gradient_accumulation_steps, or set max_steps "
                             f"below {per_epoch}")
        return values

    # ------------------------------------------------------------ the step
    @property
    def hybrid_engine(self) -> PredictiveEngine | None:
        wrapped = getattr(self, "model_wrapped", None)
        return wrapped if isinstance(wrapped, PredictiveEngine) else None

    def training_step(self, model: torch.nn.Module, inputs: dict, num_items_in_batch: Any = None) -> torch.Tensor:
        """Collect this micro-batch; on the accumulation cycle's last one run the engine's
        whole optimizer step over all of them.

        Returns what Trainer adds into its logged loss: 0 for a collected micro-batch, the
        step's mean loss over micro-batches and ranks on the last one (a Predict step that
        ran no forward reports the predictor's forecast). Micro-batches weigh equally, as in
        DeepSpeed's own accumulation: ``num_items_in_batch`` (Trainer's token-count
        normalisation across the cycle) is not used, so the loss each forward returns is
        the per-micro-batch mean the predictor also learns from."""
        if not isinstance(model, PredictiveEngine):
            raise TypeError(f"HybridTrainer: Trainer handed training_step a {type(model).__name__}, not the "
                            "PredictiveEngine that accelerate's DeepSpeed prepare builds")
        model.train()
        self._micro_batches.append(self._prepare_inputs(inputs))
        if not self.accelerator.sync_gradients:
            return torch.zeros((), device=self.args.device)
        batches, self._micro_batches = self._micro_batches, []
        gas = model.gradient_accumulation_steps()
        if len(batches) != gas:
            raise ValueError(f"HybridTrainer: an accumulation cycle of {len(batches)} micro-batches; the engine's "
                             f"gradient_accumulation_steps is {gas} (a data loader that ran out mid-cycle?)")

        def loss_fn(engine: PredictiveEngine, batch: dict) -> torch.Tensor:
            with self.compute_loss_context_manager():
                return self.compute_loss(engine, dict(batch))

        result = model.train_step(batches, loss_fn)
        self.hybrid_result = result
        return torch.tensor(_reported_loss(result), device=self.args.device)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Trainer's log entries of training progress (``loss``, and ``train_loss`` at the
        end) get the last step's ``hybrid_phase`` and the run's totals so far."""
        engine = self.hybrid_engine
        if engine is not None and ("loss" in logs or "train_loss" in logs):
            logs = dict(logs, **_hybrid_log_entries(engine, self.hybrid_result))
            if self.hybrid_result is not None and self.hybrid_result.phase == "predict":
                # No DeepSpeed gradient this step (a gradient Predict step's own is private):
                # DeepSpeed's norm is the last real step's.
                logs.pop("grad_norm", None)
        super().log(logs, start_time)


def _reported_loss(result: StepResult) -> float:
    if result.loss is not None:
        return float(result.loss)
    if result.predicted_loss is not None and math.isfinite(result.predicted_loss):
        return float(result.predicted_loss)
    return math.nan   # Trainer's logging_nan_inf_filter stands in the running mean


def _hybrid_log_entries(engine: PredictiveEngine,
                        result: StepResult | None) -> dict[str, Any]:
    stats = engine.statistics()
    out: dict[str, Any] = {
        "predict_steps": stats["predict_steps"],
        "predict_rolled_back": stats["predict_rolled_back"],
        "backward_skipped": stats["backward_skipped"],
        "backward_skipped_pct": round(stats["backward_skipped_pct"], 2),
    }
    if result is not None:
        out["hybrid_phase"] = result.phase
    if "confidence" in stats:
        out["hybrid_confidence"] = round(float(stats["confidence"]), 4)
    return out


@contextlib.contextmanager
def _hybrid_initialize(ds_config: dict):
    """For one ``accelerator.prepare``: the ``hybrid_predict`` section out of the dict that
    accelerate fills (its ``deepspeed_config_process`` rejects any ``"auto"`` it has no value
    for, and the section's ``kernels: auto`` is ours), and ``deepspeed.initialize``, which
    accelerate looks up when it builds the engine, replaced by ``ds_hybrid.initialize`` with
    the section put back. Both are restored when the block ends."""
    import deepspeed

    section = ds_config.pop(SECTION, None)
    original = deepspeed.initialize

    def initialize(**kwargs: Any):
        deepspeed.initialize = original   # ds_hybrid.initialize calls DeepSpeed's own
        config = kwargs.pop("config_params", None)   # accelerate's spelling
        config = dict(kwargs.pop("config", None) if config is None else config)
        if section is not None:
            config[SECTION] = section
        return hybrid_initialize(config=config, **kwargs)

    deepspeed.initialize = initialize
    try:
        yield
    finally:
        deepspeed.initialize = original
        if section is not None:
            ds_config[SECTION] = section


def init_cpu_ranks() -> None:
    """Several DeepSpeed ranks on a machine with no GPU: set up accelerate's process state
    with the gloo backend named, before ``TrainingArguments`` is built (which must then get
    ``accelerator_config={"use_configured_state": True}`` to reuse it). Without a backend
    name accelerate's DeepSpeed path counts one process there (``_check_rank_count``)."""
    from accelerate import PartialState
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"   # what Accelerator sets for a DeepSpeed plugin
    PartialState(backend="gloo")


def warn_on_plain_engines() -> None:
    """Make a plain ``DeepSpeedEngine`` (not a ``PredictiveEngine``) whose config has an
    enabled ``hybrid_predict`` section log a warning on rank 0 that the section is ignored.
    Only a warning is added: the engine is built exactly as before. Idempotent; called when
    this module is imported."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    init = DeepSpeedEngine.__init__
    if getattr(init, "_ds_hybrid_warns", False):
        return

    @functools.wraps(init)
    def init_and_check(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if not isinstance(self, PredictiveEngine) and self.global_rank == 0:
            _warn_if_ignored(getattr(self._config, "_param_dict", {}))

    init_and_check._ds_hybrid_warns = True
    DeepSpeedEngine.__init__ = init_and_check


def _warn_if_ignored(ds_config: Mapping) -> None:
    section = ds_config.get(SECTION)
    if isinstance(section, Mapping) and section.get("enabled", True) is not False:
        logger.warning(f"ds_config has a '{SECTION}' section, but this engine is plain DeepSpeed's "
                       f"DeepSpeedEngine: the section is ignored and no Predict step will run. Build the engine "
                       "with ds_hybrid.initialize, or under Hugging Face Trainer use ds_hybrid.hf.HybridTrainer "
                       "(docs/hf-trainer.md)")


warn_on_plain_engines()
