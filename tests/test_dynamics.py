"""The dynamics model's parts on their own: encoder, RSSM, corrector, calibration,
bandit, divergence monitor, the predictor's state, and the offline evaluation."""
import math
import random
import re

import pytest
import torch

from ds_hybrid.config import HybridPredictConfig
from ds_hybrid.dynamics import encoder as enc
from ds_hybrid.dynamics.bandit import LinUCBHorizon, horizon_arms, run_reward
from ds_hybrid.dynamics.calibration import ConfidenceCalibrator
from ds_hybrid.dynamics.corrector import ResidualCorrector
from ds_hybrid.dynamics.divergence import DivergenceMonitor, Level
from ds_hybrid.dynamics.encoder import NUM_FEATURES, Observation, StateEncoder
from ds_hybrid.dynamics.window import window_features
from ds_hybrid.dynamics.predictor import RSSMPredictor
from ds_hybrid.dynamics.rssm import RSSMEnsemble, RSSMShape, sequence_loss


def synthetic_run(n: int = 120, seed: int = 0, noise: float = 0.02) -> list[Observation]:
    """A run with every signal the engine records: decaying noisy loss, a warmup-cosine LR,
    gradient norms, per-group direction sums, Predict runs with verdicts and progress."""
    rng = random.Random(seed)
    out, phase_cycle = [], ["warmup"] * 20 + (["full"] * 6 + ["predict"] * 3 + ["correct"] * 2) * 50
    for t in range(1, n + 1):
        ph = phase_cycle[t - 1]
        loss = 2.0 + 3.0 * math.exp(-t / 40) + rng.gauss(0, noise)
        lr = 1e-3 * min(t / 10, 1.0) * (0.55 + 0.45 * math.cos(math.pi * t / n))
        o = Observation(step=t, phase=ph, loss=loss, lr=lr, total_steps=n, batch_difficulty=4 + rng.random())
        if ph != "predict":
            o.grad_norm = 1.0 + rng.random()
            o.groups = [[0.5 + 0.3 * rng.random(), 1.0, 1.0 + rng.random() * 0.1, 40.0, 0.2 + 0.1 * rng.random(), 1.0 + 0.2 * rng.random(), 100],
                        [0.2 + 0.2 * rng.random(), 1.0, 1.2, 20.0, 1e-3 * 50, 2e-2 * 50, 50]]
            o.predicted_loss = loss + rng.gauss(0, 0.03)
        else:
            idx = (t - 21) % 11 - 6
            o.step_scale, o.horizon, o.predict_index = 0.4, 3, idx
            o.accepted = rng.random() < 0.8
            o.predicted_loss = loss - 0.01
            o.progress = rng.gauss(0.001, 0.002)
        out.append(o)
    return out


# ------------------------------------------------------------------ encoder
def test_feature_table_documents_all_64_features():
    rows = re.findall(r"^\| (\d+)(?:-(\d+))?\s+\|", enc.__doc__, re.M)
    covered = sorted(i for a, b in rows for i in range(int(a), int(b or a) + 1))
    assert covered == list(range(NUM_FEATURES))


def test_every_feature_is_filled_and_normalised():
    e = StateEncoder()
    raws, outs = [], []
    for o in synthetic_run(200):
        outs.append(e.observe(o))
        raws.append(e.raw_features())
    raw = torch.stack(raws[10:])
    dead = [i for i in range(NUM_FEATURES) if float(raw[:, i].std()) == 0.0]
    assert dead == [], f"features never vary on a run with every signal: {dead}"
    z = torch.stack(outs)
    assert z.shape[1] == NUM_FEATURES and z.dtype == torch.float32
    assert torch.isfinite(z).all() and z.abs().max() <= 5.0
    # Running statistics, not raw magnitudes: the loss features are centred near 0.
    assert abs(float(z[50:, 1].mean())) < 1.5


def test_window_features_match_direct_formulas():
    e = StateEncoder()
    for o in synthetic_run(60):
        e.observe(o)
    hist, counts = e.histories()
    f = window_features(hist, counts)
    losses = torch.tensor(list(e.hist[enc.CH_LOSS]), dtype=torch.float64)
    assert f[0] == losses[-1]
    assert torch.isclose(f[2], losses[-8:].mean())
    assert torch.isclose(f[6], losses[-8:].std(unbiased=False))
    x = torch.arange(16, dtype=torch.float64)
    A = torch.stack([torch.ones(16, dtype=torch.float64), x - 7.5, (x - 7.5) ** 2], 1)
    coef = torch.linalg.lstsq(A, losses[-16:].unsqueeze(1)).solution.squeeze(1)
    assert torch.isclose(f[12], coef[1]) and torch.isclose(f[14], coef[2])


def test_encoder_state_round_trip():
    a, b = StateEncoder(), StateEncoder()
    run = synthetic_run(80)
    for o in run[:50]:
        a.observe(o)
    b.load_state_dict(a.state_dict())
    for o in run[50:]:
        assert torch.equal(a.observe(o), b.observe(o))


# ------------------------------------------------------------------ RSSM
def test_rssm_members_differ_and_rollout_uses_the_prior():
    m = RSSMEnsemble(RSSMShape(members=3, deter=32, stoch=8, hidden=16, horizon=4))
    assert not torch.equal(m.W_ih[0], m.W_ih[1]), "members must start from different weights"
    x = torch.randn(3, 2, 5, 64)
    a = torch.randn(3, 2, 5, 3)
    out = m.filter(x, a)
    assert out["loss_mean"].shape == (3, 2, 5, 4) and (out["loss_std"] > 0).all()
    acts = torch.randn(3, 2, 3, 3)
    roll = m.rollout(out["h_last"], out["z_last"], acts)
    h1 = m.step(out["h_last"], out["z_last"], acts[:, :, 0])
    assert torch.allclose(roll["h"][:, :, 0], h1)
    assert torch.allclose(roll["z"][:, :, 0], m.prior(h1)[0])


def test_rssm_learns_a_predictable_residual():
    torch.manual_seed(0)
    s = RSSMShape(members=2, deter=32, stoch=8, hidden=32, horizon=2)
    m = RSSMEnsemble(s)
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    x = torch.randn(2, 8, 6, 64)
    y = x[..., :2].clone()  # the residual is readable from the features
    mask = torch.ones_like(y)
    ys, ms = torch.zeros(2, 8, 6), torch.zeros(2, 8, 6)
    a = torch.zeros(2, 8, 6, 3)
    first = None
    for _ in range(150):
        total, info = sequence_loss(m, x, a, y, mask, ys, ms)
        first = first if first is not None else info["nll_loss"]
        opt.zero_grad()
        total.backward()
        opt.step()
    assert info["nll_loss"] < first - 0.5
    assert info["kl"] >= 1.0  # free nats floor: the KL term is there and bounded below


# ------------------------------------------------------------------ corrector, calibration
def test_corrector_learns_a_bias_and_reports_its_effect():
    c = ResidualCorrector(horizon=2)
    for i in range(200):
        phi = torch.tensor([1.0, 0.3 * math.sin(i), 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
        c.learn_loss(1, phi, float(phi[1]) + 0.5)
    phi = torch.tensor([1.0, 0.1, 0, 0, 0, 0], dtype=torch.float64)
    assert abs(c.correct_loss(1, phi) - 0.6) < 0.02
    eff = c.effect()[0]
    assert eff["mae_corrected"] < eff["mae_rssm"]
    off = ResidualCorrector(horizon=1, enabled=False)
    assert off.correct_loss(1, phi) == pytest.approx(0.1)


def test_confidence_starts_at_zero_and_is_a_monotone_frequency():
    c = ConfidenceCalibrator(bins=5)
    assert c.confidence(0.95) == 0.0 and c.confidence(0.1) == 0.0
    for _ in range(9):
        c.record(0.95, 0.0, True)
    c.record(0.95, 0.0, False)
    assert 0.5 < c.confidence(0.95) < 9 / 11  # a lower bound under the frequency with one prior rejection
    for _ in range(10):
        c.record(0.5, 0.0, True)  # a lower score with a better record is pooled with the higher bin
    assert c.confidence(0.5) <= c.confidence(0.95)
    rows = c.table(edges=(0.0, 0.5, 1.0001))
    assert rows[0]["steps"] == 20 and rows[0]["accepted_share"] == pytest.approx(19 / 20)


# ------------------------------------------------------------------ bandit
def simulate(bandit: LinUCBHorizon, difficulty: float, runs: int, rng: random.Random, max_h: int) -> list[int]:
    """Runs on a constructed trajectory: each Predict step passes verification with
    probability 1 - difficulty; the first rejection rolls the run back."""
    chosen = []
    for _ in range(runs):
        ctx = torch.tensor([1.0, 0.6, difficulty], dtype=torch.float64)
        h = bandit.choose(ctx)
        ok = 0
        while ok < h and rng.random() > difficulty:
            ok += 1
        rolled = 0 if ok == h else ok + 1
        accepted = h if ok == h else 0
        bandit.update(h, ctx, run_reward(accepted, rolled, rho=0.3, excess=0.0, max_horizon=max_h))
        chosen.append(h)
    return chosen


def test_bandit_shortens_when_prediction_gets_harder_and_lengthens_when_easier():
    rng = random.Random(0)
    arms = horizon_arms(8)
    assert arms == [1, 2, 4, 8]
    b = LinUCBHorizon(arms, dim=3, alpha=0.3)
    easy1 = simulate(b, 0.03, 150, rng, 8)
    hard = simulate(b, 0.45, 150, rng, 8)
    easy2 = simulate(b, 0.03, 150, rng, 8)
    mean = lambda xs: sum(xs[-50:]) / 50  # noqa: E731
    assert mean(hard) < mean(easy1) / 2, (mean(easy1), mean(hard))
    assert mean(easy2) > 2 * mean(hard), (mean(hard), mean(easy2))
    sd = b.state_dict()
    b2 = LinUCBHorizon(arms, dim=3, alpha=0.3)
    b2.load_state_dict(sd)
    ctx = torch.tensor([1.0, 0.6, 0.2], dtype=torch.float64)
    assert b2.scores(ctx) == b.scores(ctx)


# ------------------------------------------------------------------ divergence monitor
def test_divergence_levels():
    m = DivergenceMonitor(z_warn=2.0, z_rollback=4.0)
    assert m.check(float("nan")) is Level.ROLLBACK
    assert m.check(1.0, 0.5, 0.1, real=False) is Level.ROLLBACK          # z = 5
    assert m.check(1.0, 0.75, 0.1, real=False) is Level.SHORTEN          # z = 2.5
    assert m.check(1.0, 1.0, 0.1, real=False) is Level.OK
    for _ in range(10):
        m.check(None, grad_norm=1.0)
    assert m.check(None, grad_norm=50.0) is Level.FORCE_FULL
    assert m.check(None, grad_norm=1e-5) is Level.FORCE_FULL
    osc = DivergenceMonitor(osc_window=8)
    lvl = [osc.check(1.0 + (0.3 if i % 2 else -0.3)) for i in range(12)]
    assert lvl[-1] is Level.SHORTEN and osc.reasons.get("oscillation")


# ------------------------------------------------------------------ the predictor
def small_cfg(**dyn) -> HybridPredictConfig:
    d = {"deter": 32, "stoch": 8, "min_observations": 8, "train_every": 4, "window": 8, "batch_windows": 2}
    d.update(dyn)
    return HybridPredictConfig(predictor={"type": "rssm"}, max_predict_steps=4, confidence_threshold=0.5,
                               dynamics=d)


def test_predictor_state_round_trip_gives_identical_decisions():
    run = synthetic_run(120)
    a = RSSMPredictor(small_cfg())
    for o in run[:70]:
        a.observe(o)
    b = RSSMPredictor(small_cfg())
    b.load_state_dict(a.state_dict())
    for o in run[70:]:
        a.observe(o)
        b.observe(o)
        assert a.decide() == b.decide()
        assert a.predict_loss(o.step + 1, 4.5) == b.predict_loss(o.step + 1, 4.5)
        assert a.step_scales(2, 0) == b.step_scales(2, 0)
    assert a.trained_rounds > 0
    for (ka, va), (kb, vb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(va, vb), ka


def test_predictor_explores_before_it_has_evidence_and_scales_per_group():
    p = RSSMPredictor(small_cfg(explore_every=1))
    for o in synthetic_run(60):
        p.observe(o)
    assert p.ready() and p.confidence() == 0.0  # no verified Predict step of its own yet
    predict, horizon = p.decide()
    assert predict and horizon == 1 and p.run["explore"]
    scales = p.step_scales(2, 0)
    assert len(scales) == 2 and scales[0] != scales[1], "layer groups with different projections move differently"


def test_predictor_forecast_error_beats_persistence_on_a_smooth_trend():
    run = synthetic_run(200, noise=0.005)
    p = RSSMPredictor(small_cfg())
    errs, naive = [], []
    for i, o in enumerate(run[:-1]):
        p.observe(o)
        if i > 60:
            pred, std = p.predict_loss(o.step + 1)
            errs.append(abs(pred - run[i + 1].loss))
            naive.append(abs(o.loss - run[i + 1].loss))
            assert std > 0
    assert sum(errs) < sum(naive)


def test_init_from_missing_file_names_the_key(tmp_path):
    with pytest.raises(FileNotFoundError, match="dynamics.init_from"):
        RSSMPredictor(small_cfg(init_from=str(tmp_path / "nope.pt")))


# ------------------------------------------------------------------ offline evaluation
def test_dynamics_eval_end_to_end(tmp_path, capsys):
    from ds_hybrid.dynamics.evaluate import main
    from ds_hybrid.dynamics.trajectory import TrajectoryWriter
    paths = []
    for seed in range(3):
        w = TrajectoryWriter(tmp_path / f"t{seed}.jsonl", meta={"seed": seed})
        for o in synthetic_run(70, seed=seed):
            w.write(o)
        w.close()
        paths.append(str(tmp_path / f"t{seed}.jsonl"))
    out = tmp_path / "eval.json"
    res = main(["--train", *paths[:2], "--test", paths[2], "--epochs", "1", "--json", str(out),
                "--save-predictor", str(tmp_path / "p.pt")])
    rows = res["pooled"]
    assert [r["k"] for r in rows] == list(range(1, 9))
    assert all(r["n"] > 0 and math.isfinite(r["rssm+corrector"]) and math.isfinite(r["best_naive"]) for r in rows)
    assert out.is_file() and (tmp_path / "p.pt").is_file()
    assert "vs best naive" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="held out"):
        main(["--train", paths[0], "--test", paths[0]])


# ------------------------------------------------------------------ batch difficulty
def test_batch_difficulty_tracks_predictability_and_saves_state():
    from ds_hybrid.dynamics.batchstats import BatchDifficulty
    d = BatchDifficulty()
    g = torch.Generator().manual_seed(0)
    pattern = torch.arange(16).repeat(4, 2)  # a repeating byte pattern becomes predictable
    for _ in range(20):
        d.measure([{"input_ids": pattern}])
    easy_ce, n = d.measure([{"input_ids": pattern}])
    hard_ce, m = d.measure([{"input_ids": torch.randint(0, 256, (4, 32), generator=g)}])
    assert n == m == 4 * 31 and easy_ce / n < 0.5 * hard_ce / m
    # The row totals kept as pairs are counted are the rows' sums (counts are small integers
    # plus the smoothing: the running sum and a fresh one agree to rounding).
    torch.testing.assert_close(d.rows, d.counts.sum(1), rtol=1e-12, atol=0)
    grown = BatchDifficulty(vocab=16)
    grown.measure([{"input_ids": pattern}])
    grown.measure([{"input_ids": torch.tensor([[3, 40, 3, 40]])}])   # a token past the table: it grows
    assert grown.vocab == 41 and grown.rows.shape == (41,)
    torch.testing.assert_close(grown.rows, grown.counts.sum(1), rtol=1e-12, atol=0)
    assert d.measure([{"labels": pattern}]) is None  # needs input_ids
    e = BatchDifficulty()
    e.load_state_dict(d.state_dict())
    x = {"input_ids": torch.randint(0, 256, (2, 9), generator=g)}
    assert e.measure([x]) == d.measure([x])
    wide = BatchDifficulty()
    assert wide.measure([{"input_ids": torch.tensor([[5000, 7, 5000]])}]) is not None and not wide.bigram


def test_dynamics_device_cpu_and_auto_resolve_here_and_cuda_names_the_key():
    from ds_hybrid.dynamics.predictor import predictor_device
    assert predictor_device("cpu").type == "cpu"
    assert predictor_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="hybrid_predict.dynamics.device"):
            RSSMPredictor(small_cfg(device="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_predictor_on_gpu_runs_the_kernels_and_forecasts_as_on_cpu():
    # The same observations into a CPU predictor (torch paths) and a GPU one (kernels: cupy):
    # the RSSM step, rollout and window-feature kernels run in observe/decide, and the
    # forecasts agree to float32 rounding (the models train on the same windows and noise).
    from ds_hybrid import kernels
    run = synthetic_run(90)
    cpu = RSSMPredictor(small_cfg())
    gpu = RSSMPredictor(small_cfg(device="cuda").model_copy(update={"kernels": "cupy"}))
    assert gpu.device.type == "cuda" and next(gpu.model.parameters()).is_cuda
    before = dict(kernels.LAUNCHES)
    for o in run:
        cpu.observe(o)
        gpu.observe(o)
    cpu_scales, gpu_scales = cpu._imagined_scales(4), gpu._imagined_scales(4)
    launched = {k: kernels.LAUNCHES[k] - before.get(k, 0) for k in ("rssm_step", "rssm_rollout", "window_features")}
    assert launched["rssm_step"] == len(run) and launched["window_features"] == len(run)
    assert launched["rssm_rollout"] >= 1
    assert gpu.trained_rounds == cpu.trained_rounds > 0
    a, b = cpu.predict_loss(run[-1].step + 1, 4.5), gpu.predict_loss(run[-1].step + 1, 4.5)
    assert a[0] == pytest.approx(b[0], rel=1e-3) and a[1] == pytest.approx(b[1], rel=1e-2)
    assert gpu_scales == pytest.approx(cpu_scales, rel=1e-2, abs=1e-4)
    sd = gpu.state_dict()   # a GPU predictor's checkpoint loads into a CPU one
    assert not sd["h"].is_cuda
    RSSMPredictor(small_cfg()).load_state_dict(sd)
