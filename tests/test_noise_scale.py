"""The gradient noise scale (noise_scale.py): estimated from a share step's squared gradient norm
paired with the real step's before it, and what it projects a share step to be worth; and the
engine feeding it the norms it already has (statistics: gradient_noise_scale)."""
import pytest
import torch

from ds_hybrid.noise_scale import NoiseScale
from ds_hybrid.phases import Phase
from engine_utils import EAGER, MICRO, Batches, ds_config, make_engine


def _noisy_norms(true: torch.Tensor, sigma: float, samples: int, gen: torch.Generator) -> float:
    """|g|^2 of the mean of ``samples`` per-sequence gradients ``true + sigma * N(0, I)``."""
    g = true + sigma * torch.randn(true.shape, generator=gen, dtype=torch.float64) / samples ** 0.5
    return float(g.square().sum())


def test_it_recovers_a_known_noise_scale_and_projects_the_worth_of_a_share_step():
    """Per-sequence gradients ``G + sigma z`` in d dimensions: tr(Sigma) = d sigma^2 and
    B_noise = d sigma^2 / |G|^2 = 32 sequences here, while |G|^2 falls tenfold over the run (as
    a gradient's does) and real steps come 1 in 8."""
    gen = torch.Generator().manual_seed(0)
    d, sigma, big, small = 4000, 0.05, 64, 16
    ns = NoiseScale(decay=0.995, max_age=8)
    for step in range(4000):
        scale = 10 ** (-step / 4000)     # |G| shrinks: the pairing keeps the estimate unbiased
        true = torch.full((d,), sigma / 32 ** 0.5 * scale, dtype=torch.float64)   # |G|^2 = d sigma^2 / 32
        s = sigma * scale                # tr(Sigma) falls alike: B_noise stays 32
        if step % 8 == 0:
            ns.observe(_noisy_norms(true, s, big, gen), big, True, step)
        else:
            ns.observe(_noisy_norms(true, s, small, gen), small, False, step)
    assert ns.pairs == 3500 and ns.real_observed == 500
    assert ns.b_noise() == pytest.approx(32, rel=0.1)
    assert ns.b_noise(run=True) == pytest.approx(32, rel=0.05)   # (over every pair: steadier)
    x, f = 32 / big, small / big
    assert ns.share_worth() == pytest.approx((1 + x) / (1 + x / f), rel=0.05)
    summary = ns.summary()
    assert summary["batch_samples"] == big and summary["share_samples"] == small


def test_a_share_steps_squared_norm_is_expected_from_the_last_real_steps_and_the_trace():
    """Before a share step's backward (what a clip streamed through it must use): ``|G|^2 + tr(Sigma) / small``,
    from the last real step's squared norm and the pairs' trace; None before a pair."""
    gen = torch.Generator().manual_seed(1)
    d, sigma, big, small = 4000, 0.05, 64, 8
    true = torch.full((d,), sigma / 32 ** 0.5, dtype=torch.float64)   # B_noise 32 sequences
    ns = NoiseScale(decay=0.99, max_age=8)
    assert ns.expected_share_sq() is None
    for step in range(1600):
        real = step % 8 == 0
        ns.observe(_noisy_norms(true, sigma, big if real else small, gen), big if real else small, real, step)
    expected = sigma ** 2 * d * (1 / 32 + 1 / small)
    assert ns.expected_share_sq() == pytest.approx(expected, rel=0.05)


def test_the_worth_is_the_share_where_noise_swamps_the_signal_and_none_before_a_pair():
    ns = NoiseScale()
    ns.observe(1.0, 16, False, 0)       # no real step before it: no pair
    assert ns.share_worth() is None and ns.b_noise() is None and ns.pairs == 0
    ns.observe(1.0, 64, True, 1)
    ns.observe(1.0, 16, False, 2)       # the same norm at both sizes: |G|^2 = 1, no noise
    assert ns.b_noise() == 0.0 and ns.share_worth() == pytest.approx(1.0)
    ns = NoiseScale()
    ns.observe(1.0, 64, True, 1)
    ns.observe(8.0, 16, False, 2)       # |G|^2 estimated below 0: all noise
    assert ns.b_noise() is None and ns.share_worth() == pytest.approx(16 / 64)


def test_a_stale_real_step_or_a_new_batch_size_pairs_nothing():
    ns = NoiseScale(max_age=4)
    ns.observe(1.0, 64, True, 0)
    ns.observe(2.0, 16, False, 5)       # five steps after the real one: too old to pair
    assert ns.pairs == 0
    ns.observe(1.0, 64, True, 6)
    ns.observe(2.0, 16, False, 7)
    assert ns.pairs == 1
    ns.observe(2.0, 32, False, 8)       # a new share size starts over
    assert ns.pairs == 1 and ns.small == 32
    ns.observe(1.0, 128, True, 9)       # ... and a new batch size, the old real step forgotten
    assert ns.pairs == 0 and ns.big == 128
    ns.observe(float("nan"), 32, False, 10)   # a NaN norm is no observation
    ns.observe(3.0, 128, False, 11)           # nor a "share" as big as the batch
    assert ns.pairs == 0


def test_the_engine_pairs_each_share_steps_norm_with_the_last_real_steps_deepspeed_norm():
    """ZeRO 2 under ZeRO-Offload, 2 micro-batches a step, each gradient Predict step from the
    first (``gradient_batch_fraction`` 0.5): the real steps' squared norms are DeepSpeed's own
    (get_global_grad_norm) over 2 x MICRO sequences, the share steps' the private gradient's over
    MICRO, and the statistics carry the estimate and the Predict step's cost."""
    hybrid = dict(EAGER, check="next_step", predictor={"direction": "gradient", "gradient_batch_fraction": 0.5})
    engine = make_engine(ds_config(stage=2, offload_opt="cpu", gas=2, hybrid=hybrid))
    seen = []
    observe = engine._noise.observe
    engine._noise.observe = lambda sq, n, real, step: (seen.append((sq, n, real, step)), observe(sq, n, real, step))
    batches, real_norms, share_norms = Batches(), [], []
    for _ in range(14):
        phase = engine.phase
        r = engine.train_step(batches.step(2))
        if r.skipped:
            continue
        if phase is Phase.PREDICT:
            share_norms.append(engine._gradient.last_sq)
        else:
            real_norms.append(float(engine.get_global_grad_norm()) ** 2)
    assert share_norms and real_norms
    assert [s[0] for s in seen if s[2]] == pytest.approx(real_norms, rel=1e-9)
    assert [s[0] for s in seen if not s[2]] == share_norms
    assert {s[1] for s in seen if s[2]} == {2 * MICRO} and {s[1] for s in seen if not s[2]} == {MICRO}
    st = engine.statistics()["gradient_noise_scale"]
    assert st["pairs"] == len(share_norms) and st["batch_samples"] == 2 * MICRO and st["share_samples"] == MICRO
    assert 0.5 <= st["share_worth"] <= 1.0 and 0.5 <= st["run_share_worth"] <= 1.0
    assert st["share_step_cost"] > 0 and st["worth_per_cost"] == pytest.approx(st["share_worth"] / st["share_step_cost"])


def test_a_resumed_run_goes_on_from_the_same_pairs(tmp_path):
    """The estimate travels in the checkpoint: saved in the middle of a gradient run under
    ZeRO-Offload and resumed in a fresh engine, the same steps give the same estimate, float for
    float, as the run never interrupted (before, a resume started it over from no pairs)."""
    hybrid = dict(EAGER, check="next_step", predictor={"direction": "gradient", "gradient_batch_fraction": 0.5})

    def build():
        return make_engine(ds_config(stage=2, offload_opt="cpu", gas=2, hybrid=hybrid))
    keys = ("b_noise_samples", "share_worth", "run_b_noise_samples", "run_share_worth", "batch_samples",
            "share_samples", "real_observed", "pairs")
    engine, batches = build(), Batches()
    for _ in range(10):
        engine.train_step(batches.step(2))
    assert engine._noise.pairs > 0
    engine.save_checkpoint(tmp_path, "mid")
    consumed = engine.global_steps
    for _ in range(6):
        engine.train_step(batches.step(2))
    want = engine.statistics()["gradient_noise_scale"]
    resumed, replay = build(), Batches()
    resumed.load_checkpoint(tmp_path, "mid")
    for _ in range(consumed):
        replay.step(2)
    for _ in range(6):
        resumed.train_step(replay.step(2))
    got = resumed.statistics()["gradient_noise_scale"]
    assert want["pairs"] > 0 and {k: got[k] for k in keys} == {k: want[k] for k in keys}


def test_its_state_round_trips_and_observes_on_alike():
    a = NoiseScale(decay=0.9, max_age=8)
    for step, (sq, n, real) in enumerate([(1.0, 64, True), (2.0, 16, False), (1.8, 16, False), (0.9, 64, True)]):
        a.observe(sq, n, real, step)
    b = NoiseScale()
    b.load_state_dict(a.state_dict())
    for x in (a, b):
        x.observe(1.7, 16, False, 4)
    assert b.summary() == a.summary() and b.pairs == 3


def test_the_estimate_reaches_deepspeeds_monitor(tmp_path):
    """With a monitor on, each step after the first pair writes the projected worth and B_noise
    (the CSV monitor here): the last row is the run's figure at its last step."""
    hybrid = dict(EAGER, check="next_step", predictor={"direction": "gradient", "gradient_batch_fraction": 0.5})
    cfg = ds_config(stage=2, offload_opt="cpu", gas=2, hybrid=hybrid,
                    csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "j"})
    engine, batches = make_engine(cfg), Batches()
    for _ in range(12):
        engine.train_step(batches.step(2))
    files = {p.name: p for p in tmp_path.rglob("*.csv")}
    rows = {name: files[f"Hybrid_{name}.csv"].read_text().strip().splitlines()[1:]
            for name in ("share_worth", "gradient_noise_scale")}
    assert engine._noise.pairs > 0 and rows["share_worth"]
    assert float(rows["share_worth"][-1].split(",")[1]) == pytest.approx(engine._noise.share_worth())
    assert float(rows["gradient_noise_scale"][-1].split(",")[1]) == pytest.approx(engine._noise.b_noise())
    assert int(rows["share_worth"][-1].split(",")[0]) == engine.global_samples
