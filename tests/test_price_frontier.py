"""benchmarks/price_frontier.py: a bench suite's frontier ratios with its step kinds priced at given
costs, by the bench's own rule (ds_hybrid.frontier). Hand-made curves; its numbers are in
docs/results/offload-b64-priced-*.json."""
import pytest

from bench_scripts import load


@pytest.fixture(scope="module")
def pf():
    return load("price_frontier")


def _run(points, kinds):
    return {"val_points": points, "step_kinds": kinds, "final_val_loss": points[-1][1]}


def _rows():
    # plain: 4 steps to 1.0 at its full budget; its 1.25x run reaches 1.0 at step 3 (shortest: 3 plain steps)
    plain = {"1": _run([(0, 3.0), (2, 2.0), (4, 1.0)], ["plain"] * 4),
             "1.25": _run([(0, 3.0), (3, 1.0), (5, 0.8)], ["plain"] * 5)}
    # hybrid: 1 real then 3 Predict steps, twice (the second real step's check rejected the run: a forward again);
    # it reaches 1.0 at its 8th step, 2 real and 6 Predict by then
    kinds = ["real"] + ["predict_gradient_f0.25"] * 3 + ["real+forward"] + ["predict_gradient_f0.25"] * 3
    hybrid = {"3": _run([(0, 3.0), (4, 2.0), (8, 1.0)], kinds)}
    return {"baseline": {"1": plain}, "arm": {"1": hybrid}}


def test_each_kind_of_step_costs_its_price_and_the_frontier_rule_scores_the_runs(pf):
    out = pf.price(_rows(), {"plain": 1.0, "real": 1.0, "predict_gradient_f0.25": 0.1, "forward": 0.5})
    target = out["arm"]["per_seed"]["1"]["target"]
    # the hybrid's 8 steps: 2 real (2.0) + 6 Predict (0.6) + one rejected check's forward (0.5) = 3.1,
    # over plain's shortest time to its own final loss: 3 steps of its 1.25x run
    assert target["time"] == pytest.approx(3.1) and target["baseline_time"] == pytest.approx(3.0)
    assert target["ratio"] == pytest.approx(3.1 / 3.0)
    assert target["steps"] == {"step": 8, "real": 2, "predicted": 6}
    # +1%: crossed between the points, interpolated on the priced curve, as the bench does
    plus = out["arm"]["per_seed"]["1"]["target+1%"]
    assert plus["time"] < target["time"] and plus["steps"]["step"] == 8
    agg = out["arm"]["aggregate"]["target"]
    assert agg["reached"] == 1 and agg["seeds"] == 1 and agg["mean"] == pytest.approx(3.1 / 3.0)
    # cheaper Predict steps, a lower ratio: the curves are the same, only the prices move
    cheap = pf.price(_rows(), {"plain": 1.0, "real": 1.0, "predict_gradient_f0.25": 0.0, "forward": 0.0})
    assert cheap["arm"]["per_seed"]["1"]["target"]["ratio"] == pytest.approx(2.0 / 3.0)


def test_a_step_kind_without_a_price_is_refused_naming_it(pf):
    with pytest.raises(SystemExit, match="no price for the step kind 'predict_gradient_f0.25'"):
        pf.price(_rows(), {"plain": 1.0, "real": 1.0, "forward": 0.5})
    with pytest.raises(SystemExit, match="no price for the step kind 'forward'"):
        pf.price(_rows(), {"plain": 1.0, "real": 1.0, "predict_gradient_f0.25": 0.1})


@pytest.mark.parametrize("argv, says", [
    (["--cost", "real"], "give KIND=COST"),
    (["--cost", "real=fast"], "COST a number"),
    (["--cost", "real=-1"], "COST >= 0"),
    (["--cost", "real=1"], "no result.json"),
])
def test_bad_flags_and_a_directory_without_a_result_are_refused(pf, tmp_path, argv, says):
    with pytest.raises(SystemExit, match=says):
        pf.main([str(tmp_path), *argv])
