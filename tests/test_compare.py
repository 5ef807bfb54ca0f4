"""ds-hybrid compare: rows from finished runs, configurations grouped over seeds, hybrid paired with baseline."""
import json

import pytest

from ds_hybrid import compare


def fake_run(folder, seed, val, hybrid, seconds=10.0, steps=4):
    folder.mkdir(parents=True)
    predict = 1 if hybrid else 0
    st = {"steps_per_phase": {"warmup": 2, "full": steps - 2 - predict, "predict": predict, "correct": 0},
          "seconds_per_phase": {"warmup": 2.0, "full": seconds - 2.0 - 0.5 * predict, "predict": 0.5 * predict,
                                "correct": 0.0},
          "mean_step_seconds": {"warmup": 1.0, "full": 1.0, "predict": 0.5 if hybrid else None, "correct": None},
          "predict_rolled_back": 0, "predict_accepted": predict, "backward_skipped_pct": 25.0 * predict}
    summary = {"statistics": st, "args": {"seed": seed, "seq_len": 8}, "final_val_loss": val,
               "val_points": [[0, 5.0], [steps, val]], "train_seconds_excluding_eval": seconds,
               "ds_config": {"hybrid_predict": {"enabled": hybrid}, "train_micro_batch_size_per_gpu": 2}}
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "steps.jsonl").write_text("".join(json.dumps({"step_time_s": seconds / steps}) + "\n"
                                                for _ in range(steps)))
    return folder


def test_configurations_are_grouped_over_seeds(tmp_path, capsys):
    runs = []
    for seed, (a, b, c) in zip((1, 2), ((2.0, 2.1, 2.2), (2.2, 2.3, 2.4))):
        runs += [fake_run(tmp_path / f"fp32-s{seed}", seed, a, True), fake_run(tmp_path / f"int8-s{seed}", seed, b, True),
                 fake_run(tmp_path / f"baseline_s{seed}", seed, c, False)]
    rows = [compare.load_run(r) for r in runs]
    groups = {g["config"]: g for g in compare.aggregate(rows)}
    assert set(groups) == {"fp32", "int8", "baseline"}
    assert groups["int8"]["final_val_loss"][0] == pytest.approx(2.2)
    assert groups["baseline"]["hybrid"] is False and groups["fp32"]["runs"] == 2
    assert len(compare.paired(rows)) == 4  # each hybrid run against its seed's baseline
    compare.main([str(r) for r in runs] + ["--json", str(tmp_path / "c.json")])
    out = capsys.readouterr().out
    assert "| int8 | on | 2 | 2.2000 ± 0.1414 |" in out
    assert json.loads((tmp_path / "c.json").read_text())["aggregate"][0]["config"] == "fp32"
    with pytest.raises(SystemExit, match="no summary.json"):
        compare.main([str(tmp_path / "missing")])
