"""ds_hybrid: predictive training on DeepSpeed.

``ds_hybrid.initialize`` is ``deepspeed.initialize`` returning a
``PredictiveEngine``, whose ``train_step`` cycles Warmup -> Full -> Predict ->
Correct; Predict steps move the weights without a backward pass.
"""
from .config import ConfigError, HybridPredictConfig, parse_hybrid_config
from .engine import PredictiveEngine, StepResult, initialize
from .phases import Phase

__all__ = ["initialize", "PredictiveEngine", "StepResult", "Phase", "HybridPredictConfig",
           "parse_hybrid_config", "ConfigError"]
__version__ = "0.1.0"
