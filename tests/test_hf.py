"""Hugging Face Trainer with Predict steps (ds_hybrid.hf.HybridTrainer): Predict steps run
inside Trainer's loop with gradient accumulation and no backward, Trainer's logs carry the
phase and the skipped backward passes, Trainer's save/resume restores the hybrid state
exactly, on 1 and 2 gloo ranks; a typo in the section fails naming the key; a plain Trainer
given the section says it is ignored."""
import logging
import os

import pytest

pytest.importorskip("accelerate")

import torch  # noqa: E402
import transformers  # noqa: E402

import hf_worker as hw  # noqa: E402
from ds_hybrid import ConfigError  # noqa: E402
from ds_hybrid.engine import PredictiveEngine  # noqa: E402
from ds_hybrid.hf import HybridTrainer  # noqa: E402
from engine_utils import BackwardCounter  # noqa: E402
from spawn import run_ranks  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_hf_state():
    """Trainer leaves process-wide state behind: accelerate's DeepSpeed switch in the
    environment and its shared state, and transformers' weak reference to the ds_config
    (which from_pretrained consults). Other tests must not inherit them."""
    saved = os.environ.get("ACCELERATE_USE_DEEPSPEED")
    yield
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    AcceleratorState._reset_state()
    unset_hf_deepspeed_config()
    if saved is None:
        os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    else:
        os.environ["ACCELERATE_USE_DEEPSPEED"] = saved


def check_resumed(r: dict, steps: int, save_step: int) -> None:
    """A run resumed from Trainer's checkpoint continues exactly as the uninterrupted one."""
    assert r["at_save"]["controller"]["phase"] == "predict" and r["at_save"]["controller"]["predict_index"] > 0, \
        "the checkpoint should fall inside a Predict run (its rollback snapshot must survive too)"
    saved, loaded = r["at_save"], r["resumed_start"]
    assert loaded["global_steps"] == saved["global_steps"] == save_step
    assert loaded["controller"] == saved["controller"]
    assert loaded["micro_steps"] == saved["micro_steps"]
    for key in ("steps", "backward_passes", "backward_skipped", "predict_accepted", "verifications"):
        assert loaded["stats"][key] == saved["stats"][key], key
    assert r["resumed_phases"] == r["phases"][save_step:]
    assert r["global_step"] == r["engine_steps"] == [steps, steps]
    assert r["stats"][0] == r["stats"][1] > 0 and r["backward_skipped"][0] == r["backward_skipped"][1]
    assert r["digest"][0] == r["digest"][1], "resumed weights differ from the uninterrupted run's"


def test_gpt2_predicts_inside_trainers_loop_and_logs_it(tmp_path, monkeypatch):
    gas, steps = 2, 12
    counter = BackwardCounter(monkeypatch)
    trainer, rec = hw.fit("gpt2", hw.training_args(tmp_path, hw.ds_config(stage=2), gas, steps))
    engine = trainer.hybrid_engine
    assert isinstance(engine, PredictiveEngine)
    stats = engine.statistics()
    predicted = stats["predict_steps"]
    assert predicted > 0 and "predict" in rec.phases
    # A Predict step runs no backward for any of its micro-batches; every real step runs gas.
    assert stats["backward_skipped"] == gas * predicted
    assert counter.calls == stats["backward_passes"] == gas * (steps - predicted)
    assert trainer.state.global_step == engine.global_steps == steps
    assert engine.micro_steps == gas * steps

    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["hybrid_phase"] for h in logged] == rec.phases
    assert [h["predict_steps"] for h in logged] == [rec.phases[:i + 1].count("predict") for i in range(steps)]
    assert logged[-1]["backward_skipped"] == stats["backward_skipped"]
    assert all("grad_norm" not in h for h in logged if h["hybrid_phase"] == "predict"), "no gradient, no norm"
    assert all("grad_norm" in h for h in logged if h["hybrid_phase"] != "predict")
    assert all(h["loss"] > 0 for h in logged)
    assert trainer.state.log_history[-1]["backward_skipped"] == stats["backward_skipped"]   # the train summary
    # The section went back into the ds_config after accelerate filled it (kernels: auto included).
    assert trainer.accelerator.state.deepspeed_plugin.deepspeed_config["hybrid_predict"] == hw.HYBRID


def test_bert_mlm_predicts_with_gradient_accumulation_on_zero1(tmp_path):
    trainer, rec = hw.fit("bert", hw.training_args(tmp_path, hw.ds_config(stage=1), gas=3, steps=10))
    stats = trainer.hybrid_engine.statistics()
    assert stats["predict_steps"] > 0 and stats["backward_skipped"] == 3 * stats["predict_steps"]
    assert trainer.hybrid_engine.zero_optimization_stage() == 1
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 10 and losses[-1] < losses[0]


def test_resume_from_trainers_checkpoint_restores_step_and_phase_state(tmp_path):
    check_resumed(hw.train_and_resume("gpt2", tmp_path, stage=2, gas=2, steps=12, save_step=6), 12, 6)


@pytest.mark.slow
@pytest.mark.parametrize("model,stage", [("gpt2", 3), ("t5", 1)])
def test_two_gloo_ranks_agree_and_resume(tmp_path, model, stage):
    ranks = run_ranks("hf_worker.py", ["--model", model, "--stage", str(stage)], 2, tmp_path, timeout=240)
    for r in ranks:
        assert r["world"] == r["num_processes"] == 2
        check_resumed(r, 12, 6)
    assert ranks[0]["phases"] == ranks[1]["phases"]
    assert ranks[0]["digest"] == ranks[1]["digest"], "weights differ between ranks"


def test_a_typo_in_the_section_fails_naming_the_key(tmp_path, caplog):
    ds = hw.ds_config(hybrid=dict(hw.HYBRID, warmup_stpes=3))
    with pytest.raises(ConfigError, match=r"hybrid_predict\.warmup_stpes"):
        HybridTrainer(model=hw.tiny_model("gpt2"), args=hw.training_args(tmp_path, ds, 1, 2),
                      train_dataset=hw.dataset("gpt2"))
    ds = hw.ds_config(hybrid=dict(hw.HYBRID, verify_every="often"))
    with pytest.raises(ConfigError, match=r"hybrid_predict\.verify_every"):
        HybridTrainer(model=hw.tiny_model("gpt2"), args=hw.training_args(tmp_path, ds, 1, 2),
                      train_dataset=hw.dataset("gpt2"))
    ds = hw.ds_config()
    ds["hybrid_predicts"] = ds.pop("hybrid_predict")
    with caplog.at_level(logging.WARNING):
        HybridTrainer(model=hw.tiny_model("gpt2"), args=hw.training_args(tmp_path, ds, 1, 2),
                      train_dataset=hw.dataset("gpt2"))
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "did you mean 'hybrid_predict'" in said and "trains as plain DeepSpeed" in said


def test_bad_trainer_arguments_fail_naming_the_flag(tmp_path, monkeypatch):
    # (First: an Accelerator with a DeepSpeed plugin leaves ACCELERATE_USE_DEEPSPEED set in the
    # process, and later TrainingArguments then turn DeepSpeed on by themselves.)
    plain = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match=r"TrainingArguments\.deepspeed is not set"):
        HybridTrainer(model=hw.tiny_model("gpt2"), args=plain, train_dataset=hw.dataset("gpt2"))
    ds = hw.ds_config()
    del ds["optimizer"]
    with pytest.raises(ConfigError, match=r"TrainingArguments\.optim: 'sgd'"):
        HybridTrainer(model=hw.tiny_model("gpt2"), args=hw.training_args(tmp_path, ds, 1, 2, optim="sgd"),
                      train_dataset=hw.dataset("gpt2"))
    # Two ranks that accelerate counts as one (no GPU, no init_cpu_ranks): the batch size and the
    # data shards would be wrong, so the trainer refuses, saying what to call.
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    with pytest.raises(RuntimeError, match=r"torch\.distributed has 2 ranks but accelerate counts 1.*init_cpu_ranks"):
        HybridTrainer(model=hw.tiny_model("gpt2"), args=hw.training_args(tmp_path, hw.ds_config(), 1, 2),
                      train_dataset=hw.dataset("gpt2"))
    monkeypatch.undo()
    # 30 batches of 4 per epoch do not split into cycles of 4: the last cycle would be short.
    trainer = HybridTrainer(model=hw.tiny_model("gpt2"), args=hw.training_args(tmp_path, hw.ds_config(), 4, -1),
                            train_dataset=hw.dataset("gpt2", n=120))
    with pytest.raises(ValueError, match=r"not a multiple of gradient_accumulation_steps \(4\)"):
        trainer.train()


def test_a_plain_trainer_given_the_section_warns_that_it_is_ignored(tmp_path, caplog):
    hybrid = {k: v for k, v in hw.HYBRID.items() if k != "kernels"}   # plain accelerate rejects "auto" there
    args = hw.training_args(tmp_path, hw.ds_config(hybrid=hybrid), 1, 1)
    with caplog.at_level(logging.WARNING, logger="ds_hybrid.hf"):
        trainer = transformers.Trainer(model=hw.tiny_model("gpt2"), args=args, train_dataset=hw.dataset("gpt2"))
        trainer.train()
    assert not isinstance(trainer.model_wrapped, PredictiveEngine)
    ignored = [r.getMessage() for r in caplog.records if "section is ignored" in r.getMessage()]
    assert len(ignored) == 1 and "HybridTrainer" in ignored[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ds_hybrid.hf"):
        hw.fit("gpt2", hw.training_args(tmp_path, hw.ds_config(hybrid=hybrid), 1, 1))
        hw.fit("gpt2", hw.training_args(tmp_path, hw.ds_config(hybrid=dict(hybrid, enabled=False)), 1, 1),
               trainer_cls=transformers.Trainer)
    assert not [r for r in caplog.records if "section is ignored" in r.getMessage()], \
        "no warning for HybridTrainer, nor for a disabled section"
