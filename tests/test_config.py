"""The hybrid_predict section: typed, validated, errors name the key, all before training."""
import json
from pathlib import Path

import pytest

import ds_hybrid
from ds_hybrid.config import ConfigError, HybridPredictConfig, parse_hybrid_config, reference_markdown
from engine_utils import ds_config

README = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


@pytest.mark.parametrize("section, key", [
    ({"warmup_stepz": 3}, "hybrid_predict.warmup_stepz"),
    ({"warmup_steps": 0}, "hybrid_predict.warmup_steps"),
    ({"warmup_steps": 2.5}, "hybrid_predict.warmup_steps"),
    ({"enabled": "yes"}, "hybrid_predict.enabled"),
    ({"confidence_threshold": 1.5}, "hybrid_predict.confidence_threshold"),
    ({"verify_every": 0}, "hybrid_predict.verify_every"),
    ({"snapshot_device": "gpu"}, "hybrid_predict.snapshot_device"),
    ({"divergence": {"z_threshold": -1}}, "hybrid_predict.divergence.z_threshold"),
    ({"divergence": {"max_loss_ratio": 1.0}}, "hybrid_predict.divergence.max_loss_ratio"),
    ({"divergence": {"tolerance": 0.1}}, "hybrid_predict.divergence.tolerance"),
    ({"predictor": {"type": "lstm"}}, "hybrid_predict.predictor.type"),
    ({"predictor": {"step_scale": 0}}, "hybrid_predict.predictor.step_scale"),
    ({"min_predict_steps": 5, "max_predict_steps": 2}, "min_predict_steps"),
    ({"predictor": {"direction": "gradient", "gradient_lr_scale": 0}}, "hybrid_predict.predictor.gradient_lr_scale"),
    ({"predictor": {"gradient_lr_scale": 0.5}}, "predictor.gradient_lr_scale"),
])
def test_bad_section_names_the_key(section, key):
    with pytest.raises(ConfigError) as err:
        parse_hybrid_config({"hybrid_predict": section})
    assert key in str(err.value)


def test_section_must_be_an_object():
    with pytest.raises(ConfigError, match="hybrid_predict: expected an object"):
        parse_hybrid_config({"hybrid_predict": [1, 2]})


def test_missing_section_is_disabled_and_defaults_are_valid():
    assert parse_hybrid_config({}).enabled is False
    cfg = parse_hybrid_config({"hybrid_predict": {}})
    assert cfg.enabled and cfg == HybridPredictConfig()


def test_non_adam_optimizer_is_rejected_only_when_enabled():
    with pytest.raises(ConfigError, match="optimizer.type"):
        parse_hybrid_config({"hybrid_predict": {}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    parse_hybrid_config({"hybrid_predict": {"enabled": False}, "optimizer": {"type": "SGD"}})


def test_initialize_fails_before_building_anything(monkeypatch):
    """A bad key fails in ds_hybrid.initialize before DeepSpeed builds an engine."""
    import deepspeed

    def never(*a, **k):
        raise AssertionError("deepspeed.initialize was reached")

    monkeypatch.setattr(deepspeed, "initialize", never)
    with pytest.raises(ConfigError, match="hybrid_predict.max_predict_stepz"):
        ds_hybrid.initialize(model=object(), config=ds_config(hybrid={"max_predict_stepz": 4}))


def test_config_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        ds_hybrid.initialize(model=object(), config=str(bad))
    with pytest.raises(FileNotFoundError, match="missing.json"):
        ds_hybrid.initialize(model=object(), config=str(tmp_path / "missing.json"))


def test_presets_parse_with_deepspeed_and_our_section():
    from deepspeed.runtime.config import DeepSpeedConfig
    presets = sorted((Path(__file__).resolve().parent.parent / "ds_configs").glob("*.json"))
    assert presets
    for path in presets:
        cfg = json.loads(path.read_text())
        parse_hybrid_config(cfg)
        ds = DeepSpeedConfig(dict(cfg))
        assert ds.train_batch_size == ds.train_micro_batch_size_per_gpu * ds.gradient_accumulation_steps, path


def test_readme_reference_is_generated_from_the_code():
    """docs/configuration.md's hybrid_predict table is reference_markdown(): the docs cannot drift."""
    assert reference_markdown() in README.read_text()
