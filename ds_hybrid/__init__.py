"""ds_hybrid: predictive training on DeepSpeed.

``ds_hybrid.initialize`` is ``deepspeed.initialize`` returning a
``PredictiveEngine``, whose ``train_step`` cycles Warmup -> Full -> Predict ->
Correct; Predict steps move the weights without a backward pass.

The names below load on first use, so ``import ds_hybrid`` (and ``ds-hybrid
--help`` or ``compare``) does not import DeepSpeed or torch.
"""
from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "initialize": "engine", "PredictiveEngine": "engine", "StepResult": "engine",
    "Phase": "phases",
    "HybridPredictConfig": "config", "parse_hybrid_config": "config", "ConfigError": "config",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ds_hybrid' has no attribute {name!r}")
