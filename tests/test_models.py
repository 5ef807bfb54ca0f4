"""Named and JSON-configured models in ds_hybrid.models."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ds_hybrid.models import (MODEL_SPECS, build_model, count_parameters, known_models,
                              model_config)

SEQ_LEN = 32
# 124M and the planner's Llama shapes (1B, 7B, 50B) are checked by config only.
BUILDABLE = [n for n in known_models() if n not in ("gpt2-124m", "llama-1b", "llama-7b", "llama-50b")]


def _forward_loss(model: torch.nn.Module, vocab: int = 256, seq_len: int = SEQ_LEN) -> torch.Tensor:
    torch.manual_seed(0)
    ids = torch.randint(0, vocab, (2, seq_len))
    return model(input_ids=ids, labels=ids).loss


def test_known_models_have_docs() -> None:
    assert set(known_models()) == {"gpt2-tiny", "gpt2-deep", "gpt2-test", "gpt2-124m", "llama-tiny",
                                   "llama-1b", "llama-7b", "llama-50b"}
    assert all(spec.doc for spec in MODEL_SPECS.values())


@pytest.mark.parametrize("name", BUILDABLE)
def test_named_model_forward_finite_loss(name: str) -> None:
    model = build_model(name, vocab_size=256, seq_len=SEQ_LEN)
    assert model.config.vocab_size == 256
    assert model.config.max_position_embeddings == SEQ_LEN
    assert model.config._attn_implementation == "sdpa"
    loss = _forward_loss(model)
    assert loss.ndim == 0 and torch.isfinite(loss)
    # Random init over 256 bytes: loss near ln(256) = 5.55.
    assert 4.5 < loss.item() < 6.5
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_gpt2_sizes_and_no_dropout() -> None:
    cfg = model_config("gpt2-tiny", seq_len=64)
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_positions) == (4, 128, 4, 64)
    assert cfg.attn_pdrop == cfg.resid_pdrop == cfg.embd_pdrop == 0.0
    # GPT-2's special ids (50256) do not fit a byte vocabulary.
    assert cfg.bos_token_id is None and cfg.eos_token_id is None
    test = model_config("gpt2-test")
    assert (test.n_layer, test.n_embd, test.n_head, test.vocab_size) == (2, 32, 2, 256)


def test_gpt2_124m_config_without_weights() -> None:
    cfg = model_config("gpt2-124m")
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head) == (12, 768, 12)
    assert cfg.vocab_size == 50257 and cfg.n_positions == 1024
    assert cfg.bos_token_id == 50256
    assert model_config("gpt2-124m", vocab_size=256).vocab_size == 256


def test_llama_tiny_sizes() -> None:
    cfg = model_config("llama-tiny")
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.intermediate_size, cfg.vocab_size) == (4, 128, 4, 344, 256)


def test_deterministic_init_under_seed() -> None:
    torch.manual_seed(1)
    a = build_model("gpt2-test", seq_len=SEQ_LEN)
    torch.manual_seed(1)
    b = build_model("gpt2-test", seq_len=SEQ_LEN)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_count_parameters_counts_tied_weights_once() -> None:
    model = build_model("gpt2-test", seq_len=SEQ_LEN)
    d, v, L = 32, 256, 2
    # wte + wpe + per layer (2 LayerNorms, c_attn, c_proj, mlp c_fc, c_proj) + ln_f;
    # lm_head is tied to wte.
    per_layer = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    assert count_parameters(model) == v * d + SEQ_LEN * d + L * per_layer + 2 * d
    model.transformer.wte.weight.requires_grad_(False)
    assert count_parameters(model, trainable_only=True) == count_parameters(model) - v * d


def test_overrides_applied_and_misspelt_rejected() -> None:
    assert build_model("gpt2-test", seq_len=SEQ_LEN, n_layer=3).config.n_layer == 3
    with pytest.raises(ValueError, match="n_layr"):
        model_config("gpt2-test", n_layr=3)


def test_unknown_name_lists_known_models() -> None:
    with pytest.raises(ValueError) as exc:
        build_model("gpt3-huge")
    msg = str(exc.value)
    assert "gpt3-huge" in msg
    assert all(name in msg for name in known_models())


def test_json_config_saved_by_transformers(tmp_path: Path) -> None:
    src = build_model("gpt2-test", seq_len=SEQ_LEN)
    src.config.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    model = build_model(str(path), seq_len=SEQ_LEN)
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert count_parameters(model) == count_parameters(src)
    assert torch.isfinite(_forward_loss(model))


def test_json_config_plain_dict_with_model_type(tmp_path: Path) -> None:
    path = tmp_path / "llama.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 32,
                                "num_hidden_layers": 1, "num_attention_heads": 2,
                                "intermediate_size": 64, "max_position_embeddings": 64}))
    model = build_model(str(path), vocab_size=256, seq_len=SEQ_LEN)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.vocab_size == 256 and model.config.hidden_size == 32
    assert torch.isfinite(_forward_loss(model))
    with pytest.raises(ValueError, match="seq_len"):
        model_config(str(path), seq_len=65)


def test_json_config_errors_name_path(tmp_path: Path) -> None:
    missing = tmp_path / "missing.json"
    with pytest.raises(ValueError, match="not found") as exc:
        model_config(str(missing))
    assert str(missing) in str(exc.value)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="model_type") as exc:
        model_config(str(bad))
    assert str(bad) in str(exc.value)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match=str(broken)):
        model_config(str(broken))
