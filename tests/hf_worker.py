"""HybridTrainer runs for tests/test_hf.py: tiny models, datasets, ds_configs, and a run
that trains, saves mid-way, and resumes from that checkpoint in a second trainer.

As a script it is one rank of a multi-rank test (started by tests/spawn.py with RANK /
WORLD_SIZE / MASTER_PORT set): it does ``train_and_resume`` and writes what it saw to
``<out>/rank{r}.json`` before printing ``RANK{r} DONE``.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
from pathlib import Path

import torch
import transformers

from ds_hybrid.hf import HybridTrainer, init_cpu_ranks
from engine_utils import EAGER

SEQ = 16
MICRO = 4
# EAGER's quick Predict runs, with an "auto" inside the section: accelerate rejects any
# "auto" it cannot fill, so this also checks that the section is kept out of its way.
HYBRID = dict(EAGER, kernels="auto")


def tiny_model(name: str, seed: int = 0) -> torch.nn.Module:
    """2 layers, width 64, byte vocabulary, no dropout (a resumed run must match an uninterrupted one)."""
    torch.manual_seed(seed)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if name == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    if name == "t5":
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=256, d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0))
    raise ValueError(f"unknown tiny model {name!r}")


def dataset(name: str, n: int = 256) -> list[dict]:
    """``n`` examples of a low-entropy byte stream, as each model's task wants them:
    next token (gpt2), 15% masked tokens (bert, label -100 elsewhere), reversal (t5)."""
    g = torch.Generator().manual_seed(1)
    data = torch.randint(1, 48, (n * SEQ,), generator=g)
    out = []
    for i in range(n):
        x = data[i * SEQ:(i + 1) * SEQ]
        if name == "gpt2":
            out.append({"input_ids": x, "labels": x.clone()})
        elif name == "bert":
            masked = torch.rand(SEQ, generator=g) < 0.15
            masked[0] = True
            out.append({"input_ids": torch.where(masked, torch.full_like(x, 255), x),
                        "attention_mask": torch.ones_like(x), "labels": torch.where(masked, x, -100)})
        else:
            out.append({"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.flip(0)})
    return out


def ds_config(stage: int = 2, hybrid: dict | None = None) -> dict:
    """A ds_config as Hugging Face users write one: Trainer fills every "auto"."""
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "train_batch_size": "auto", "gradient_clipping": "auto", "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
           "zero_optimization": {"stage": stage}}
    cfg["hybrid_predict"] = copy.deepcopy(HYBRID if hybrid is None else hybrid)
    return cfg


def training_args(out: Path, ds: dict, gas: int, steps: int, save_steps: int | None = None,
                  **extra) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=str(out), deepspeed=ds, per_device_train_batch_size=MICRO, gradient_accumulation_steps=gas,
        max_steps=steps, learning_rate=3e-3, weight_decay=0.01, logging_steps=1, report_to=[], disable_tqdm=True,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, seed=0,
        accelerator_config={"use_configured_state": _configured()}, **extra)


def _configured() -> bool:
    """Reuse ``init_cpu_ranks``'s process state where it was set up; a second trainer in the same
    process then needs a fresh AcceleratorState (its DeepSpeed plugin is per Accelerator)."""
    from accelerate import PartialState
    from accelerate.state import AcceleratorState
    if PartialState._shared_state == {} or os.environ.get("WORLD_SIZE", "1") == "1":
        return False
    AcceleratorState._reset_state()
    return True


class StepRecorder(transformers.TrainerCallback):
    """The phase of every step, and the engine's state when Trainer saves and when a resumed
    run starts (after Trainer's load, before its first step)."""

    def __init__(self):
        self.trainer: HybridTrainer | None = None
        self.phases: list[str] = []
        self.at_save: dict | None = None
        self.at_start: dict | None = None

    def _state(self) -> dict:
        engine = self.trainer.hybrid_engine
        sd = engine.hybrid_state_dict()
        return {"global_steps": int(engine.global_steps), "controller": sd.get("controller"),
                "stats": sd["stats"], "micro_steps": sd["micro_steps"]}

    def on_train_begin(self, args, state, control, **kwargs):
        if isinstance(self.trainer, HybridTrainer):
            self.at_start = self._state()

    def on_step_end(self, args, state, control, **kwargs):
        if isinstance(self.trainer, HybridTrainer):
            self.phases.append(self.trainer.hybrid_result.phase)

    def on_save(self, args, state, control, **kwargs):
        if isinstance(self.trainer, HybridTrainer) and self.at_save is None:
            self.at_save = self._state()


def fit(name: str, args: transformers.TrainingArguments, resume: str | None = None,
        trainer_cls: type = HybridTrainer) -> tuple[transformers.Trainer, StepRecorder]:
    rec = StepRecorder()
    trainer = trainer_cls(model=tiny_model(name), args=args, train_dataset=dataset(name),
                          data_collator=transformers.default_data_collator, callbacks=[rec])
    rec.trainer = trainer
    trainer.train(resume_from_checkpoint=resume)
    return trainer, rec


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter, gathered first on ZeRO 3 (a rank holds a shard of each)."""
    import deepspeed
    params = dict(model.named_parameters())
    h = hashlib.sha256()
    with deepspeed.zero.GatheredParameters(list(params.values())):
        for name in sorted(params):
            h.update(name.encode())
            h.update(params[name].detach().cpu().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def train_and_resume(name: str, out: Path, stage: int, gas: int, steps: int, save_step: int) -> dict:
    """Run A: ``steps`` steps, saving at ``save_step``; run B: a new trainer resumed from
    that checkpoint, to ``steps``. What each saw, for the test to compare."""
    a, rec_a = fit(name, training_args(out / "a", ds_config(stage), gas, steps, save_steps=save_step))
    b, rec_b = fit(name, training_args(out / "b", ds_config(stage), gas, steps),
                   resume=str(out / "a" / f"checkpoint-{save_step}"))
    return {"phases": rec_a.phases, "resumed_phases": rec_b.phases, "at_save": rec_a.at_save,
            "resumed_start": rec_b.at_start, "global_step": [a.state.global_step, b.state.global_step],
            "engine_steps": [int(a.hybrid_engine.global_steps), int(b.hybrid_engine.global_steps)],
            "stats": [a.hybrid_engine.statistics()["predict_steps"], b.hybrid_engine.statistics()["predict_steps"]],
            "backward_skipped": [a.hybrid_engine.statistics()["backward_skipped"],
                                 b.hybrid_engine.statistics()["backward_skipped"]],
            "digest": [weights_digest(a.model), weights_digest(b.model)],
            "logged_phases": [h.get("hybrid_phase") for h in a.state.log_history if "loss" in h]}


def main() -> None:
    from accelerate import PartialState

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--gas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-step", type=int, default=6)
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    rank = int(os.environ["RANK"])
    out = Path(cli.out)
    init_cpu_ranks()
    report = train_and_resume(cli.model, out, cli.stage, cli.gas, cli.steps, cli.save_step)
    report["world"] = int(torch.distributed.get_world_size())
    report["num_processes"] = int(PartialState().num_processes)
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    print(f"RANK{rank} DONE", flush=True)


if __name__ == "__main__":
    main()
