"""Attention paths: SDPA (fused kernels) by default for GPT-2 and Llama, eager on request,
same numbers; the CPU dropout fallback; the attention benchmark's accounting."""
from __future__ import annotations

import json

import pytest
import torch

from ds_hybrid import attn_bench
from ds_hybrid.models import attention_dropout, build_model

LLAMA_SMALL = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2,
               "intermediate_size": 64}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread is as fast, and stays fast when other work shares the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(name: str, attention: str, **over):
    torch.manual_seed(0)
    kw = LLAMA_SMALL if name == "llama-tiny" else {}
    return build_model(name, vocab_size=256, seq_len=64, attention=attention, **{**kw, **over})


def _batch(seq: int = 64):
    ids = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("name", ["gpt2-test", "llama-tiny"])
def test_sdpa_by_default_eager_on_request_same_numbers(name):
    auto, eager = _model(name, "auto"), _model(name, "eager")
    assert auto.config._attn_implementation == "sdpa" and eager.config._attn_implementation == "eager"
    assert _model(name, "sdpa").config._attn_implementation == "sdpa"
    b = _batch()
    la, le = auto(**b).loss, eager(**b).loss
    la.backward()
    le.backward()
    torch.testing.assert_close(la, le, rtol=1e-5, atol=1e-6)
    for (n, pa), (_, pe) in zip(auto.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(pa.grad, pe.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_bad_attention_choice():
    with pytest.raises(ValueError, match="attention must be one of auto, sdpa, eager"):
        build_model("gpt2-test", attention="flash")


def _attention_ops(model) -> list[str]:
    model.train()
    return attn_bench.attention_ops(model, _batch(32), torch.device("cpu"))


def test_cpu_sdpa_uses_the_flash_kernel_and_falls_back_with_dropout():
    """On the CPU, training with attention dropout leaves SDPA's fused kernel for its math path
    (CUDA's flash / memory-efficient kernels implement dropout). The named models have none."""
    assert attention_dropout(_model("gpt2-test", "auto").config) == 0.0
    fused = _attention_ops(_model("gpt2-test", "auto"))
    assert any("flash_attention" in op for op in fused), fused
    dropped = _model("gpt2-test", "auto", attn_pdrop=0.1)
    assert attention_dropout(dropped.config) == 0.1
    math_path = _attention_ops(dropped)
    assert "aten::_scaled_dot_product_attention_math" in math_path and not any("flash" in op for op in math_path)


def test_saved_tensor_accounting_sees_the_attention_matrix():
    """Eager attention saves the T x T probabilities per head and layer; SDPA does not."""
    seq, res = 256, {}
    for impl in ("sdpa", "eager"):
        model = build_model("gpt2-test", vocab_size=256, seq_len=seq, attention=impl)
        counter = attn_bench.SavedTensorBytes({p.untyped_storage().data_ptr() for p in model.parameters()})
        with counter.hooks():
            loss = model(**_batch(seq)).loss
        loss.backward()
        res[impl] = counter.nbytes
    probs = 2 * 2 * seq * seq * 4           # batch 2 x heads 2 x T x T fp32, per layer
    assert res["eager"] - res["sdpa"] >= 2 * probs * 0.9, res      # 2 layers


def test_attn_bench_writes_json(tmp_path, capsys):
    path = tmp_path / "attn.json"
    attn_bench.main(["--models", "gpt2-test", "--seq-lens", "16,32", "--batch", "1", "--repeat", "1",
                     "--device", "cpu", "--threads", "1", "--json", str(path)])
    res = json.loads(path.read_text())
    assert {(r["attention"], r["seq_len"]) for r in res["rows"]} == {(a, s) for a in ("sdpa", "eager")
                                                                     for s in (16, 32)}
    assert all(r["activation_mb"] > 0 and r["peak_mb"] is None for r in res["rows"])
    out = capsys.readouterr().out
    assert "| gpt2-test | 32 |" in out and "gpt2-test sdpa:" in out
