"""``ds_hybrid.initialize`` takes what ``deepspeed.initialize`` takes (issue 16's parity list): ds_config
files in hjson, duplicate keys rejected, base64 strings, ``config_params`` and the deprecated
``args.deepscale_config``; a plain ``python script.py`` with no launcher; and a Predict config with no
optimizer fails saying what to pass."""
import argparse
import base64
import json

import pytest
from engine_utils import EAGER, ds_config

import ds_hybrid
from ds_hybrid.engine import PredictiveEngine, load_ds_config
from ds_hybrid.models import build_model


def test_hjson_files_and_base64_strings_load_as_deepspeed_reads_them(tmp_path):
    cfg = ds_config(stage=1, hybrid=EAGER)
    f = tmp_path / "ds.hjson"
    f.write_text("# a comment, as hjson allows\n" + json.dumps(cfg, indent=1).replace('"steps_per_print": ',
                                                                                     '// note\n"steps_per_print": '))
    assert load_ds_config(f) == cfg
    plain = tmp_path / "ds.json"
    plain.write_text(json.dumps(cfg))
    # A JSON file reads as JSON (hjson would make 1.0 the int 1; the hybrid_predict section is strictly typed).
    assert type(load_ds_config(plain)["gradient_clipping"]) is float
    encoded = base64.urlsafe_b64encode(json.dumps(cfg).encode()).decode()
    assert load_ds_config(encoded) == cfg


def test_duplicate_keys_and_bad_files_name_the_file(tmp_path):
    f = tmp_path / "dup.json"
    f.write_text('{"train_micro_batch_size_per_gpu": 2, "train_micro_batch_size_per_gpu": 4}')
    with pytest.raises(ValueError, match=rf"{f}.*Duplicate keys.*train_micro_batch_size_per_gpu"):
        load_ds_config(f)
    with pytest.raises(FileNotFoundError, match="ds_config file not found: .*nope.json"):
        load_ds_config(tmp_path / "nope.json")


def _model():
    return build_model("gpt2-test", vocab_size=256, seq_len=16)


def test_config_params_and_deepscale_config_are_accepted(tmp_path):
    cfg = ds_config(stage=1, hybrid=EAGER)
    m = _model()
    engine, *_ = ds_hybrid.initialize(model=m, model_parameters=m.parameters(), config_params=cfg)
    assert isinstance(engine, PredictiveEngine) and engine.hybrid_config.enabled
    f = tmp_path / "ds.json"
    f.write_text(json.dumps(cfg))
    args = argparse.Namespace(deepscale_config=str(f), deepspeed_config=None, local_rank=0)
    m = _model()
    engine, *_ = ds_hybrid.initialize(args=args, model=m, model_parameters=m.parameters())
    assert engine.hybrid_config.enabled and args.deepscale_config is None


def test_predict_without_an_optimizer_says_what_to_pass():
    from ds_hybrid.config import ConfigError
    cfg = ds_config(stage=1, hybrid=EAGER)
    del cfg["optimizer"]
    m = _model()
    with pytest.raises(ConfigError, match=r"no 'optimizer' section and initialize\(\) got no optimizer="):
        ds_hybrid.initialize(model=m, model_parameters=m.parameters(), config=cfg)


@pytest.mark.slow
def test_a_script_without_a_launcher_runs_as_rank_0_of_1(tmp_path):
    import os
    import subprocess
    import sys
    script = tmp_path / "my_script.py"
    script.write_text(
        "import ds_hybrid\n"
        "from ds_hybrid.models import build_model\n"
        "m = build_model('gpt2-test', vocab_size=256, seq_len=16)\n"
        "cfg = {'train_micro_batch_size_per_gpu': 2, 'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-3}},\n"
        "       'hybrid_predict': {'warmup_steps': 2}}\n"
        "engine, *_ = ds_hybrid.initialize(model=m, model_parameters=m.parameters(), config=cfg)\n"
        "print('WORLD', engine.world_size, type(engine).__name__)\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "WORLD 1 PredictiveEngine" in out.stdout
