"""A run that does not predict says why (issue 16): settings that keep Predict from ever running
are said before the first step, each reason for a "no" at a decision is said once and its steps
counted, and a misspelled section name gets a "did you mean"."""
import logging

from engine_utils import EAGER, Batches, ds_config, make_engine

from ds_hybrid.config import parse_hybrid_config


def _warnings(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def test_a_constant_lr_with_an_lr_gate_is_said_before_training_and_counted(caplog):
    cfg = ds_config(stage=1, hybrid=dict(EAGER, predict_lr_fraction=0.6))
    del cfg["scheduler"]   # a constant LR
    with caplog.at_level(logging.WARNING):
        engine = make_engine(cfg)
        assert "predict_lr_fraction is 0.6" in _warnings(caplog) and "never decays" in _warnings(caplog)
        b = Batches()
        for _ in range(12):
            r = engine.train_step(b.step())
            assert r.phase != "predict"
    held = engine.statistics()["held_back"]
    assert held.get("lr_gate", 0) >= 2 * EAGER["full_steps"]
    assert sum("no Predict run at step" in r.getMessage() for r in caplog.records) == 1, "said once"


def test_low_confidence_is_said_once_and_counted(caplog):
    engine = make_engine(ds_config(stage=1, hybrid=dict(EAGER, confidence_threshold=1.0)))
    b = Batches()
    with caplog.at_level(logging.WARNING):
        for _ in range(14):
            engine.train_step(b.step())
    assert engine.statistics()["held_back"].get("predictor", 0) >= 2 * EAGER["full_steps"]
    msgs = [r.getMessage() for r in caplog.records if "no Predict run" in r.getMessage()]
    assert len(msgs) == 1 and "confidence" in msgs[0]


def test_warmup_longer_than_the_schedule_is_said(caplog):
    cfg = ds_config(stage=1, hybrid=dict(EAGER, warmup_steps=50))
    cfg["scheduler"] = {"type": "WarmupCosineLR", "params": {"total_num_steps": 40, "warmup_num_steps": 4}}
    with caplog.at_level(logging.WARNING):
        make_engine(cfg)
    assert "warmup_steps (50) is not shorter than the schedule's total_num_steps (40)" in _warnings(caplog)


def test_a_misspelled_section_gets_a_did_you_mean(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = parse_hybrid_config({"train_micro_batch_size_per_gpu": 1, "hybrid_predicts": {"enabled": True}})
    assert not cfg.enabled
    assert "did you mean 'hybrid_predict'" in _warnings(caplog)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        parse_hybrid_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {}})
    assert "did you mean" not in _warnings(caplog)


def test_the_run_summary_counts_skipped_backward_passes_and_held_back_steps():
    from ds_hybrid.train import format_summary
    st = {"steps_per_phase": {"full": 10, "predict": 2}, "mean_step_seconds": {"full": 0.1, "predict": 0.001},
          "seconds_per_phase": {"full": 1.0, "predict": 0.002}, "predict_accepted": 2, "predict_rolled_back": 0,
          "verifications": 1, "backward_skipped": 2, "backward_passes": 10, "backward_skipped_pct": 16.7,
          "partial_backward": 4, "partial_backward_share": 0.49, "held_back": {"lr_gate": 24, "predictor": 8},
          "idle_steps": 3}
    text = format_summary({"statistics": st, "final_val_loss": 1.5, "val_points": [[12, 1.5]],
                           "train_seconds_excluding_eval": 1.0})
    assert "backward passes skipped: 2 of 12 (16.7%); partial: 4 (left out 49%" in text
    assert "Predict held back: 24 steps by the LR gate (predict_lr_fraction), 8 steps by the predictor" in text
    assert "real steps without the predictor's bookkeeping (lazy_bookkeeping): 3" in text


def test_the_run_summary_says_what_a_share_step_was_worth_and_cost():
    """A gradient Predict run from a share of the batch: the summary gives the noise scale against the
    share, the worth the noise-scale model projects (a guide, said so) and the step's cost over a Full
    step's; nothing before a pair."""
    from ds_hybrid.train import format_summary, share_line
    noise = {"run_share_worth": 0.29, "run_b_noise_samples": 140.2, "batch_samples": 32, "share_samples": 8,
             "pairs": 1101, "share_step_cost": 0.17}
    line = share_line(noise)
    assert line == ("gradient Predict steps from 8 of 32 sequences, gradient noise scale 140 sequences over the run: "
                    "by the noise-scale model each worth 0.29 of a real step (a guide: it assumes an LR suited to "
                    "the share), at 0.17 of a Full step's time")
    st = {"steps_per_phase": {"full": 3, "predict": 30}, "mean_step_seconds": {"full": 0.4, "predict": 0.076},
          "seconds_per_phase": {"full": 1.2, "predict": 2.3}, "predict_accepted": 30, "predict_rolled_back": 0,
          "verifications": 2, "backward_skipped": 0, "backward_passes": 264, "backward_skipped_pct": 0.0,
          "gradient_noise_scale": noise}
    text = format_summary({"statistics": st, "final_val_loss": 2.6, "val_points": [[33, 2.6]],
                           "train_seconds_excluding_eval": 3.5})
    assert line in text.splitlines()
    # no Full step timed yet: no cost; the noise past estimating: said so; no pair yet: no line
    assert share_line(dict(noise, share_step_cost=None)).endswith("(a guide: it assumes an LR suited to the share)")
    assert "gradient noise scale past estimating (the noise swamps the signal) over the run" in \
        share_line(dict(noise, run_b_noise_samples=None))
    # a trace estimated at or below 0 (the estimator's 0 sequences, worth 1.0): no noise figure, no worth
    zero = share_line(dict(noise, run_b_noise_samples=0.0, run_share_worth=1.0))
    assert "noise scale not measured" in zero and "no worth by the noise-scale model" in zero
    assert "1.00" not in zero and zero.endswith("at 0.17 of a Full step's time")
    assert share_line(dict(noise, pairs=0)) is None and share_line(None) is None
    assert share_line(dict(noise, run_share_worth=None)) is None
