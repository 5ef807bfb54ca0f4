"""Hugging Face causal LMs by name, randomly initialised (never downloads weights).

A name is one of ``MODEL_SPECS`` or a path to a JSON file holding a transformers
config (a saved ``config.json`` or any dict with a ``model_type`` key).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

# GPT-2 dropout keys: zeroed so a step's loss depends only on weights and batch,
# which the loss predictor and the rollback check rely on.
_GPT2_NO_DROPOUT = {"attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0}


@dataclass(frozen=True)
class ModelSpec:
    """A named model size: a transformers ``model_type`` and its config values."""

    model_type: str
    doc: str
    config: dict[str, Any] = field(default_factory=dict)
    vocab_size: int = 256      # used when build_model gets vocab_size=None
    seq_len: int = 128         # used when build_model gets seq_len=None


MODEL_SPECS: dict[str, ModelSpec] = {
    "gpt2-tiny": ModelSpec(
        "gpt2",
        "GPT-2, 4 layers, width 128, 4 heads (~0.8M parameters at vocab 256): "
        "the default, small enough for CPU runs.",
        {"n_layer": 4, "n_embd": 128, "n_head": 4, **_GPT2_NO_DROPOUT},
    ),
    "gpt2-deep": ModelSpec(
        "gpt2",
        "GPT-2, 8 layers, width 128, 4 heads (~1.6M parameters at vocab 256): gpt2-tiny twice as "
        "deep, for the layer-group Predict runs on CPU.",
        {"n_layer": 8, "n_embd": 128, "n_head": 4, **_GPT2_NO_DROPOUT},
    ),
    "gpt2-test": ModelSpec(
        "gpt2",
        "GPT-2, 2 layers, width 32, 2 heads (~38K parameters at vocab 256 and "
        "seq_len 128): for unit tests.",
        {"n_layer": 2, "n_embd": 32, "n_head": 2, **_GPT2_NO_DROPOUT},
    ),
    "gpt2-124m": ModelSpec(
        "gpt2",
        "GPT-2 small: 12 layers, width 768, 12 heads, vocabulary 50257, 1024 "
        "positions (124M parameters); for GPU runs.",
        {"n_layer": 12, "n_embd": 768, "n_head": 12, **_GPT2_NO_DROPOUT},
        vocab_size=50257, seq_len=1024,
    ),
    "llama-tiny": ModelSpec(
        "llama",
        "Llama, 4 layers, hidden 128, 4 heads, MLP 344 (~0.9M parameters at vocab "
        "256): a RoPE / RMSNorm / SwiGLU architecture at the size of gpt2-tiny.",
        {"num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 4, "intermediate_size": 344},
    ),
    # Shapes for `ds-hybrid plan` (counted on the meta device); building one on a CPU takes
    # 4 bytes per parameter of host memory.
    "llama-1b": ModelSpec(
        "llama",
        "Llama, 22 layers, hidden 2048, 32 heads (4 key/value), MLP 5632, vocabulary 32000 "
        "(TinyLlama's shape, 1.1B parameters).",
        {"num_hidden_layers": 22, "hidden_size": 2048, "num_attention_heads": 32,
         "num_key_value_heads": 4, "intermediate_size": 5632},
        vocab_size=32000, seq_len=2048,
    ),
    "llama-7b": ModelSpec(
        "llama",
        "Llama, 32 layers, hidden 4096, 32 heads, MLP 11008, vocabulary 32000 (Llama-2-7B's "
        "shape, 6.7B parameters).",
        {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
         "num_key_value_heads": 32, "intermediate_size": 11008},
        vocab_size=32000, seq_len=4096,
    ),
    "llama-50b": ModelSpec(
        "llama",
        "Llama, 64 layers, hidden 8192, 64 heads (8 key/value), MLP 24576, vocabulary 32000 "
        "(48.8B parameters): the ZeRO-Infinity planning case.",
        {"num_hidden_layers": 64, "hidden_size": 8192, "num_attention_heads": 64,
         "num_key_value_heads": 8, "intermediate_size": 24576},
        vocab_size=32000, seq_len=4096,
    ),
}


def known_models() -> list[str]:
    """The names ``build_model`` accepts besides a JSON config path."""
    return sorted(MODEL_SPECS)


def _fit_special_tokens(kwargs: dict[str, Any], defaults: PretrainedConfig) -> None:
    # GPT-2's bos/eos id 50256 does not exist in a 256-byte vocabulary; byte-level
    # training uses no special tokens, so ids outside the vocabulary become None
    # (set before the config is built, which warns about out-of-vocabulary ids).
    vocab = kwargs.get("vocab_size", getattr(defaults, "vocab_size", None))
    if not isinstance(vocab, int):
        return
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        tok = kwargs.get(key, getattr(defaults, key, None))
        if isinstance(tok, int) and tok >= vocab:
            kwargs[key] = None


def _check_overrides(overrides: dict[str, Any], defaults: PretrainedConfig, name: str) -> None:
    # transformers configs accept any keyword silently; check here so a misspelt
    # override fails instead of being ignored.
    unknown = sorted(k for k in overrides if not hasattr(defaults, k))
    if unknown:
        raise ValueError(f"model {name!r}: unknown config keys {unknown} for "
                         f"{type(defaults).__name__}")


def _read_config_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"model config JSON not found: {path}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read model config JSON {path}: {exc}") from exc
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise ValueError(f"model config JSON {path} must be an object with a "
                         f"'model_type' key (as in a transformers config.json)")
    return raw


def _is_json_path(name: str) -> bool:
    return name.endswith(".json") or os.sep in name or "/" in name


def model_config(name: str = "gpt2-tiny", vocab_size: int | None = None,
                 seq_len: int | None = None, **overrides: Any) -> PretrainedConfig:
    """The transformers config ``build_model`` would use, without building weights.

    For a named spec, ``vocab_size`` / ``seq_len`` of ``None`` keep the spec's
    values (256 / 128, or 50257 / 1024 for gpt2-124m); given, they set the
    vocabulary and the position count. For a JSON file, ``vocab_size`` replaces
    the file's and ``seq_len`` is checked against its ``max_position_embeddings``.
    ``overrides`` are config attributes applied last (e.g. ``n_layer=6``).
    """
    if name in MODEL_SPECS:
        spec = MODEL_SPECS[name]
        model_type = spec.model_type
        kwargs: dict[str, Any] = {
            **spec.config,
            "vocab_size": spec.vocab_size if vocab_size is None else vocab_size,
            # Through the attribute map this sets n_positions for GPT-2.
            "max_position_embeddings": spec.seq_len if seq_len is None else seq_len,
        }
    elif _is_json_path(name):
        path = Path(name)
        kwargs = _read_config_json(path)
        model_type = kwargs.pop("model_type")
        if vocab_size is not None:
            kwargs["vocab_size"] = vocab_size
    else:
        raise ValueError(f"unknown model {name!r}; known models: "
                         f"{', '.join(known_models())}, or a path to a transformers "
                         f"config JSON file")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"model {name!r}: unknown transformers model_type {model_type!r}")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"model {name!r}: model_type {model_type!r} is not a causal language model "
                         f"(transformers has no AutoModelForCausalLM for it); ds_hybrid trains causal LMs "
                         f"such as gpt2 or llama (an encoder-decoder or encoder model goes through "
                         f"ds_hybrid.initialize in your own script)")
    defaults = CONFIG_MAPPING[model_type]()
    _check_overrides(overrides, defaults, name)
    # No KV cache: training and evaluation never generate.
    kwargs = {**kwargs, "use_cache": False, **overrides}
    _fit_special_tokens(kwargs, defaults)
    config = AutoConfig.for_model(model_type, **kwargs)
    positions = getattr(config, "max_position_embeddings", None)
    if seq_len is not None and isinstance(positions, int) and positions < seq_len:
        raise ValueError(f"model {name!r}: max_position_embeddings {positions} "
                         f"< seq_len {seq_len}")
    return config


ATTENTION_CHOICES = ("auto", "sdpa", "eager")
# Attention-probability dropout keys of the supported configs (GPT-2, Llama).
_ATTN_DROPOUT_KEYS = ("attn_pdrop", "attention_dropout")


def attention_dropout(config: PretrainedConfig) -> float:
    """The attention-probability dropout a config trains with (0.0 when it has none)."""
    return max([float(getattr(config, k, 0.0) or 0.0) for k in _ATTN_DROPOUT_KEYS])


def build_model(name: str = "gpt2-tiny", vocab_size: int | None = None,
                seq_len: int | None = None, attention: str = "auto", **overrides: Any) -> torch.nn.Module:
    """A randomly initialised causal LM (``AutoModelForCausalLM.from_config``).

    Arguments as in ``model_config``. Deterministic under ``torch.manual_seed``.
    ``attention``: ``sdpa`` runs PyTorch's ``scaled_dot_product_attention``, which
    dispatches to fused kernels (flash or memory-efficient on CUDA, flash on the CPU)
    that never hold the T x T attention matrix; ``eager`` is transformers' reference
    path that does; ``auto`` (default) is ``sdpa`` where the architecture has it (GPT-2
    and Llama do), else the model's default. The CPU's fused kernel has no dropout:
    with attention dropout > 0 in training, CPU SDPA runs its unfused math path (CUDA's
    flash and memory-efficient kernels implement dropout). The named models train
    without dropout. DeepSpeed's transformer kernel (``DeepSpeedTransformerLayer``)
    replaces BERT-style encoder layers only, so it has no place in these causal LMs.
    """
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_CHOICES)} (got {attention!r})")
    config = model_config(name, vocab_size, seq_len, **overrides)
    if attention != "auto":
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    else:
        try:
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        except (ValueError, ImportError):
            # Architectures without an SDPA path (possible for JSON configs) use their default.
            model = AutoModelForCausalLM.from_config(config)
    if getattr(model, "loss_type", "") is None:
        # transformers infers the loss from the class name, which fails for
        # GPT2LMHeadModel, then warns and falls back to the causal-LM loss; name it
        # up front so the first forward does not log a misleading warning.
        model.loss_type = "ForCausalLM"
    return model


def count_parameters(model: torch.nn.Module, trainable_only: bool = False) -> int:
    """Number of parameter elements; tied weights (GPT-2's embedding / head) count once; a
    parameter partitioned by ``zero.Init`` by its full size (``ds_numel``)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()
               if p.requires_grad or not trainable_only)


BLOCK_LIST_NAMES = ("h", "layers", "blocks", "block", "layer")


def block_list(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's transformer blocks in forward order (GPT-2's ``transformer.h``, Llama's
    ``model.layers``, ...): the ``ModuleList`` named one of ``BLOCK_LIST_NAMES`` with the most
    parameters, or None when the model has none."""
    found = [m for name, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and len(m) > 0 and name.rsplit(".", 1)[-1] in BLOCK_LIST_NAMES]
    if not found:
        return None
    return max(found, key=lambda m: sum(p.numel() for p in m.parameters()))


def layer_groups(model: torch.nn.Module, groups: int = 4) -> list[dict]:
    """Optimizer param groups by depth: embeddings, ``groups - 2`` contiguous bands of
    transformer blocks, and everything after the blocks (final norm, head).

    Each becomes one flat master partition under ZeRO 1/2 and one entry of the
    per-group statistics, so Predict steps can move layers by different amounts, and
    layer-group Predict steps can leave the lower groups out of the backward pass.
    An input embedding tied to the output head (GPT-2's ``wte``) is in the ``head``
    group: it is trained through the head whenever the head is. Groups carry a
    ``name``; empty ones are dropped.
    """
    import re
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = {id(out_emb.weight)} if out_emb is not None and getattr(out_emb, "weight", None) is not None else set()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    blocks = sorted({int(m.group(1)) for n, _ in named for m in [re.search(r"\.(?:h|layers)\.(\d+)\.", n)] if m})
    bands = max(groups - 2, 1)
    out: dict[str, list] = {}
    for n, p in named:
        m = re.search(r"\.(?:h|layers)\.(\d+)\.", n)
        if m and blocks:
            pos = blocks.index(int(m.group(1)))
            key = f"blocks_{pos * bands // len(blocks)}"
        elif id(p) in tied:
            key = "head"
        elif any(k in n for k in ("wte", "wpe", "embed_tokens")):
            key = "embeddings"
        else:
            key = "head"
        out.setdefault(key, []).append(p)
    order = ["embeddings"] + [f"blocks_{i}" for i in range(bands)] + ["head"]
    return [{"params": out[k], "name": k} for k in order if k in out]
