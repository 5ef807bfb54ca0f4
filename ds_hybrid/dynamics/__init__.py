"""The dynamics model behind ``predictor.type: rssm``.

| module | job |
|---|---|
| ``encoder.py`` | 64 features of the training state, normalised online |
| ``window.py`` | features 0-38: statistics over windows of history (the reference of ``kernels/encoder.cu``) |
| ``rssm.py`` | GRU + Gaussian-latent RSSM ensemble with loss and step-scale heads |
| ``corrector.py`` | online residual regression on the forecasts |
| ``calibration.py`` | confidence as an observed acceptance frequency |
| ``bandit.py`` | LinUCB choice of the Predict-run length |
| ``divergence.py`` | levels and actions from loss z-scores, gradient norms, NaN/Inf, oscillation |
| ``batchstats.py`` | a batch's difficulty (bigram cross-entropy), known before its forward |
| ``predictor.py`` | ``RSSMPredictor``: all of the above behind the engine's predictor interface |
| ``trajectory.py`` | recording observations to JSONL and reading them back |
| ``evaluate.py`` | ``ds-hybrid dynamics-eval``: offline forecast error against naive predictors |
"""
