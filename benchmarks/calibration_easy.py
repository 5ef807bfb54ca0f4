"""Calibration of the RSSM confidence in a regime where prediction is easy: the unit tests'
2-layer GPT-2 on a low-entropy byte stream (48 symbols), ZeRO 1, 400 steps, threshold 0.5."""
import json, sys
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent / "tests"))
import conftest  # noqa: F401  (single-rank env)
from engine_utils import Batches, ds_config, make_engine

hy = {"warmup_steps": 10, "full_steps": 4, "min_predict_steps": 1, "max_predict_steps": 4,
      "confidence_threshold": 0.5, "correction_steps": 1,
      "predictor": {"type": "rssm"}, "dynamics": {"min_observations": 8, "train_every": 4}}
for seed in (1, 2, 3):
    e = make_engine(ds_config(stage=1, hybrid=hy), seed=seed)
    b = Batches(seed=seed)
    for _ in range(400):
        e.train_step(b.step())
    st = e.statistics()
    d = st.pop("predictor_details")
    print(json.dumps({"seed": seed, "predict_pct": st["predict_steps"] / 4, "accepted": st["predict_accepted"],
                      "rolled_back": st["predict_rolled_back"], "progress_mean": st["progress_mean"],
                      "progress_positive_share": st["progress_positive_share"], "explored": d["explored_runs"],
                      "calibration": d["calibration"], "bandit_pulls": d["bandit_pulls"], "kappa": d["kappa"]}))
