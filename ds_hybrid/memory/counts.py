"""What a model holds, counted: its shape from a built transformers model, the activations a
micro-batch keeps for its backward, the host's memory. The planner's arithmetic (``planner.py``)
and the engine's (``grad_recompute.py``) read these; nothing here imports above ``ds_hybrid.memory``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs to know about a model; counted on the meta device (no weights)."""

    name: str
    family: str                # "gpt2" (LayerNorm, GELU MLP) or "llama" (RMSNorm, RoPE, SwiGLU)
    params: int                # unique parameters (tied weights once)
    largest_module_params: int # DeepSpeed's largest_layer_params: the biggest single module's own
    block_params: int          # one transformer block
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int
    default_seq_len: int
    activation: str
    # Every trainable tensor's size by optimizer param group, as ``ds-hybrid train --layer-groups``
    # makes the groups (one group, in the model's order, where the caller names none; tied weights
    # once): DeepSpeed flattens each group into its own buffers and keeps some per tensor.
    group_tensors: tuple[tuple[int, ...], ...] = ()

    @property
    def param_groups(self) -> tuple[tuple[int, ...], ...]:
        """``group_tensors``, or one group of one tensor of ``params`` where a shape was made
        without them."""
        return self.group_tensors or ((self.params,),)

    @property
    def tensor_numels(self) -> tuple[int, ...]:
        return tuple(n for g in self.param_groups for n in g)

    @property
    def group_numels(self) -> tuple[int, ...]:
        return tuple(sum(g) for g in self.param_groups)


def shape_of(model: Any, name: str, default_seq_len: int | None = None,
             group_tensors: tuple[tuple[int, ...], ...] | None = None) -> ModelShape:
    """Counts for a built transformers model (on the meta device or not) from its ``config``:
    the planner's for a named model, the engine's for the module it trains
    (``ds_hybrid/grad_recompute.py``). ``group_tensors``: the optimizer's param groups' tensor
    sizes (default: one group of every parameter). AttributeError where it has no such config."""
    from torch import nn

    config = model.config
    tensors = tuple(int(p.numel()) for p in model.parameters() if p.requires_grad)
    params = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    layers = int(config.num_hidden_layers)
    blocks = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == layers]
    block = max((sum(p.numel() for p in b.parameters()) for b in blocks[0]), default=0) if blocks else 0
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    model_type = config.model_type
    family = "gpt2" if model_type in ("gpt2", "gpt_neo", "gpt_bigcode", "opt", "gptj") else "llama"
    inter = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    act = str(getattr(config, "activation_function", None) or getattr(config, "hidden_act", "silu"))
    positions = int(getattr(config, "max_position_embeddings", 0) or getattr(config, "n_positions", 0) or 2048)
    return ModelShape(name=name, family=family, params=params, largest_module_params=largest,
                      block_params=block, layers=layers, hidden=hidden, heads=heads,
                      kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
                      intermediate=int(inter), vocab=int(config.vocab_size), max_positions=positions,
                      default_seq_len=default_seq_len or min(positions, 2048), activation=act,
                      group_tensors=tuple(tuple(g) for g in group_tensors) if group_tensors else (tensors,))


def layer_activation_elements(shape: ModelShape, lp_bytes: int) -> float:
    """Elements (in the training precision) that one transformer block saves for backward per
    token, counted from the eager transformers implementations with SDPA attention (flash /
    memory-efficient kernels: no sequence x sequence score matrix is kept).

    GPT-2: LayerNorm inputs and outputs (4), q, k, v (3), the attention output and its
    re-laid-out copy (2): 9 x hidden; the MLP's fc output, the tanh-GELU's intermediates
    (tanh, 1 + tanh, x / 2) and its output: 5 x intermediate (2 for a fused GELU).
    Llama: each RMSNorm keeps its input, the normalised value and its scaled output (3; 4 in
    16-bit, where the input is upcast to fp32), attention keeps the rotated q and the
    attention output (2; RoPE keeps only cos / sin, the output's re-layout is a view) and
    the rotated k and v at the key/value width (SDPA's native grouped-query path); SwiGLU
    keeps gate, up, silu(gate) and their product: 4 x intermediate. Checked against
    ``torch.autograd.graph.saved_tensors_hooks`` in tests/test_plan.py.
    """
    h, inter = shape.hidden, shape.intermediate
    if shape.family == "gpt2":
        i_terms = 5 if shape.activation in ("gelu_new", "gelu_pytorch_tanh_python", "gelu_python") else 2
        return 9 * h + i_terms * inter
    kv_ratio = shape.kv_heads / shape.heads
    norm = 3 if lp_bytes == 4 else 4
    return 2 * norm * h + (2 + 2 * kv_ratio) * h + 4 * inter


def activation_bytes(shape: ModelShape, seq_len: int, micro_batch: int, lp_bytes: int,
                     checkpointing: bool) -> dict[str, float]:
    """Activation memory of one micro-batch at its peak (the start of backward), in bytes.

    ``layers``: what the blocks keep (all of each block, or with checkpointing only each
    block's input); ``head``: the final norm and the loss (cross-entropy keeps fp32
    log-probabilities over the vocabulary); ``working``: the largest transient of the backward
    pass, either the loss's (fp32 gradient in and out of log-softmax, plus the 16-bit logits'
    gradient) or one block's (its recomputed activations with checkpointing, plus its
    gradients in flight).
    """
    tokens = seq_len * micro_batch
    block = layer_activation_elements(shape, lp_bytes) * tokens * lp_bytes
    block_grads = (3 * shape.hidden + 2 * shape.intermediate) * tokens * lp_bytes
    if checkpointing:
        layers = shape.layers * shape.hidden * tokens * lp_bytes
        block_working = block + block_grads
    else:
        layers = shape.layers * block
        block_working = block_grads
    norm_units = 2 if shape.family == "gpt2" else (3 if lp_bytes == 4 else 4)
    head = norm_units * shape.hidden * tokens * lp_bytes + shape.vocab * tokens * 4
    loss_working = shape.vocab * tokens * (8 + (lp_bytes if lp_bytes == 2 else 0))
    return {"layers": layers, "head": head, "working": max(loss_working, block_working)}


def host_memory_bytes(meminfo: str | Path = "/proc/meminfo", key: str = "MemTotal") -> int | None:
    """The machine's memory (``MemTotal``; ``MemAvailable``: what can be had now without swapping),
    or None where the kernel does not say (not Linux)."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
