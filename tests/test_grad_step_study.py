"""benchmarks/grad_step_study.py: Predict steps that take their gradient on the GPU with the optimizer state frozen
at the last real step. Tiny runs (36 steps of GPT-2 0.84M at 4 x 64 bytes) check the study's mechanics; its numbers
are in docs/results/grad-step-study.json."""
import json

import pytest
import torch

from bench_scripts import load

SHAPE = dict(batch=4, seq_len=64)


@pytest.fixture(scope="module")
def study():
    return load("grad_step_study")


def test_real_steps_counts_the_steps_before_start_and_F_of_every_F_plus_H(study):
    assert study.real_steps(600, 1, 1, 50) == 325
    assert study.real_steps(600, 1, 3, 50) == 50 + 137     # a run starts at step 50; the last is cut to 2
    assert study.real_steps(10, 4, 2, 10) == 10            # no Predict run before the end


def test_a_run_whose_predict_runs_never_start_is_plain_adamw_bit_for_bit(study):
    torch.set_num_threads(2)
    plain = study.train(1, 2e-3, 36, None, **SHAPE)
    never = study.train(1, 2e-3, 36, "adam-carry", 1, 1, start=36, **SHAPE)
    assert never["val_loss"] == plain["val_loss"]
    assert (plain["mode"], plain["F"], plain["H"]) == ("plain", 0, 0)


def test_predict_steps_count_and_each_mode_moves_the_weights_its_own_way(study):
    """From step 30 on, one real step then three Predict steps: 30 real steps, a run of 3, one real step, and a
    run cut to 2 by the end. ``skip`` moves nothing in
    its Predict steps (the same as plain AdamW on the stretched schedule would be with those steps missing);
    the gradient modes differ from it and from each other: ``adam-carry`` hands the run's first moment back to
    the optimizer, ``adam-local`` drops it, ``rms`` has none."""
    runs = {m: study.train(1, 2e-3, 36, m, 1, 3, start=30, **SHAPE)
            for m in ("skip", "drift", "rms", "adam-local", "adam-carry")}
    for r in runs.values():
        assert (r["real_steps"], r["predicted_steps"]) == (31, 5) == (study.real_steps(36, 1, 3, 30), 5)
    vals = {m: r["val_loss"] for m, r in runs.items()}
    assert len(set(vals.values())) == len(vals)
    # the same run twice: the same loss (seeded data, seeded rounding)
    assert study.train(1, 2e-3, 36, "adam-carry", 1, 3, start=30, **SHAPE)["val_loss"] == vals["adam-carry"]


def test_sixteen_bit_predict_weights_round_stochastically_and_the_masters_catch_up(study):
    g = torch.Generator().manual_seed(0)
    x = torch.full((100_000,), 1.0 + 2 ** -10)               # an eighth of a bf16 ulp above 1
    for sign in (1, -1):
        y = study.stochastic_bf16(sign * x, g).float()
        assert set(y.abs().unique().tolist()) == {1.0, 1.0 + 2 ** -7}
        assert y.mean().item() == pytest.approx(sign * (1.0 + 2 ** -10), abs=2e-5)   # unbiased
    exact = study.train(1, 2e-3, 36, "adam-carry", 1, 3, start=30, **SHAPE)
    sixteen = study.train(1, 2e-3, 36, "adam-carry", 1, 3, start=30, weights="bf16-sr", state_dtype="bf16",
                          **SHAPE)
    assert sixteen["weights"] == "bf16-sr" and sixteen["val_loss"] != exact["val_loss"]
    assert sixteen["val_loss"] == pytest.approx(exact["val_loss"], rel=0.02)


@pytest.mark.parametrize("name, below", [
    ("gpt2-test", ("transformer.h.0.", "transformer.wpe")),       # the token embedding is tied to the head
    ("llama-tiny", ("model.layers.0.", "model.layers.1.", "model.layers.2.", "model.embed_tokens")),
])
def test_a_cut_backward_reaches_the_top_blocks_the_final_norm_and_the_head_only(study, name, below):
    """``--top-blocks 1``: with the switch on, the blocks below the cut and the embeddings get no gradient
    (GPT-2's token embedding, tied to the head, gets the head's); off, every parameter gets one."""
    from ds_hybrid.models import build_model
    model = build_model(name, vocab_size=256, seq_len=16)
    switch = study.cut_backward(model, 1)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    for on in (True, False):
        model.zero_grad(set_to_none=True)
        switch[0] = on
        model(input_ids=ids, labels=ids).loss.backward()
        missing = {n for n, p in model.named_parameters() if p.grad is None}
        assert missing == ({n for n, _ in model.named_parameters() if n.startswith(below)} if on else set())
    with pytest.raises(ValueError, match="--top-blocks"):
        study.cut_backward(model, 0)


def test_predict_steps_cut_at_the_top_blocks_move_less_and_say_so(study):
    """A cut run differs from the whole one, ``still`` from ``coast``, and the row names its cut."""
    whole = study.train(1, 2e-3, 36, "adam-carry", 1, 3, start=30, **SHAPE)
    still = study.train(1, 2e-3, 36, "adam-carry", 1, 3, start=30, top_blocks=2, **SHAPE)
    coast = study.train(1, 2e-3, 36, "adam-carry", 1, 3, start=30, top_blocks=2, lower="coast",
                        cut_clip="last-real", **SHAPE)
    assert len({whole["val_loss"], still["val_loss"], coast["val_loss"]}) == 3
    assert (still["top_blocks"], still["lower"], still["cut_clip"]) == (2, "still", "own")
    assert (whole["top_blocks"], whole["lower"], whole["cut_clip"]) == (None, None, None)
    assert study.run_key(coast) == study.job_key((1, 2e-3, 36, "adam-carry", 1, 3, 30),
                                                 dict(top_blocks=2, lower="coast", cut_clip="last-real"))



@pytest.mark.parametrize("argv, says", [
    (["--lower", "coast"], "give --top-blocks too"),
    (["--top-blocks", "5"], "1 to 4 for this model (got 5) (--model gpt2-tiny)"),
])
def test_a_cut_the_model_cannot_take_is_refused_before_any_run(study, capsys, argv, says):
    with pytest.raises(SystemExit):
        study.main(argv + ["--seeds", "1", "--json", "/nonexistent/never-written.json"])
    assert says in capsys.readouterr().err


def test_steps_worth_reads_a_loss_on_the_plain_curve(study):
    curve = [(100, 3.0), (200, 2.0), (400, 1.5)]
    assert study.steps_worth(2.5, curve) == (150.0, "")
    assert study.steps_worth(1.75, curve) == (300.0, "")
    assert study.steps_worth(3.5, curve) == (None, "below")
    assert study.steps_worth(1.0, curve) == (None, "above")


def test_the_study_reports_step_worth_and_reuses_plain_runs(study, tmp_path, capsys):
    """End to end at 36 steps: the table places each hybrid on the plain curve; a second study with
    ``--reuse`` runs only what the first did not (no plain AdamW again); a bad schedule or a JSON of another setup
    is refused naming the flag."""
    out = tmp_path / "g.json"
    common = ["--steps", "36", "--start", "30", "--seeds", "1", "--schedules", "1:3", "--batch", "4",
              "--seq-len", "64", "--jobs", "1", "--threads", "2", "--plain-steps", "0.9", "1.0"]
    res = study.main([*common, "--modes", "skip", "adam-carry", "--json", str(out)])
    # the hybrid's real-step count, 0.9 and 1.0 of the schedule
    assert sorted(r["steps"] for r in res["rows"] if r["mode"] == "plain") == [31, 32, 36]
    saved = json.loads(out.read_text())
    assert saved["complete"] and {a["mode"] for a in saved["summary"]} == {"skip", "adam-carry"}
    for a in saved["summary"]:
        if a["step_worth"] is not None:   # on the curve: worth = (n_eq - real) / predicted
            rows = [r for r in saved["rows"] if r["mode"] == a["mode"]]
            n_eq = rows[0]["plain_steps_worth"]
            assert a["step_worth"] == pytest.approx((n_eq - rows[0]["real_steps"]) / rows[0]["predicted_steps"])
    again = study.main([*common, "--modes", "skip", "adam-local", "--reuse", str(out),
                        "--json", str(tmp_path / "h.json")])
    fresh = [r for r in again["rows"] if r not in res["rows"]]
    assert [r["mode"] for r in fresh] == ["adam-local"] and len(again["rows"]) == len(res["rows"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        study.main([*common, "--schedules", "1-3"])
    assert "--schedules" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        study.main([*common, "--lr", "1e-3", "--reuse", str(out)])
    assert "--reuse" in capsys.readouterr().err


def test_a_curve_along_the_run_changes_nothing_in_it_and_counts_each_kind_of_step(study):
    """``eval_every``: the validation loss every 4 steps from step 28 on, each point with the real and Predict
    steps taken so far (30 real steps, then a run of 3 at once and one after every real step); the run ends
    where it would have
    without the curve, float for float, its last point being the one before its final loss."""
    torch.set_num_threads(2)
    bare = study.train(1, 2e-3, 36, "adam-carry", 1, 3, start=30, **SHAPE)
    curved = study.train(1, 2e-3, 36, "adam-carry", 1, 3, start=30, eval_every=4, eval_from=28, **SHAPE)
    assert curved["val_loss"] == bare["val_loss"] and bare["curve"] is None
    assert [(p["step"], p["real"], p["predicted"]) for p in curved["curve"]] == [(28, 28, 0), (32, 30, 2)]
    assert all(p["val"] > 0 for p in curved["curve"])
    plain = study.train(1, 2e-3, 36, None, eval_every=12, **SHAPE)
    assert [(p["step"], p["real"], p["predicted"]) for p in plain["curve"]] == [(12, 12, 0), (24, 24, 0)]


def test_the_time_to_a_target_is_where_a_curve_first_reaches_it(study):
    """Linear between the point before and the first at or below the target, the cost likewise; a run that
    never reaches it has no time; a hybrid's cost prices its real and Predict steps apart."""
    assert study.first_reach([(10, 10, 3.0), (20, 20, 2.0), (30, 30, 1.0)], 1.5) == (25.0, 25.0)
    assert study.first_reach([(10, 10, 3.0), (20, 20, 2.0)], 1.5) is None
    assert study.first_reach([(10, 10, 1.0), (20, 20, 0.5)], 1.5) == (10, 10)   # already there at its first point
    row = {"steps": 40, "real_steps": 10, "predicted_steps": 30, "val_loss": 1.0,
           "curve": [{"step": 20, "real": 5, "predicted": 15, "val": 2.0}]}
    assert study.run_points(row, 1.0, 0.1) == [(20, 5 + 1.5, 2.0), (40, 10 + 3.0, 1.0)]
    assert study.first_reach(study.run_points(row, 1.0, 0.1), 1.5) == (30.0, pytest.approx(9.75))


def test_the_study_reads_each_hybrids_time_to_plains_final_loss_over_every_plain_run(study, tmp_path, capsys):
    """End to end at 36 steps with ``--target-steps``: plain's time to its own final loss after 32 steps is the
    shortest over its runs (the 36-step schedule's curve may cross it first, never later than 32), the hybrid's
    is priced by ``--predict-cost``; a target with no plain run of its length, or a cost with no target, is
    refused naming the flag."""
    common = ["--steps", "36", "--start", "30", "--seeds", "1", "--schedules", "1:3", "--batch", "4",
              "--seq-len", "64", "--jobs", "1", "--threads", "2", "--modes", "adam-carry"]
    res = study.main([*common, "--plain-steps", "0.8888888888888888", "1.0", "--eval-every", "2", "--eval-from", "20",
                      "--target-steps", "32", "--predict-cost", "0", "0.5", "--json", str(tmp_path / "t.json")])
    plain = {r["steps"]: r for r in res["rows"] if r["mode"] == "plain"}
    target = plain[32]["val_loss"]
    (agg,) = res["time_to_target"]
    (seed,) = agg["seeds"]
    assert seed["target"] == target and seed["plain_steps"] <= 32
    expect = min(x[1] for x in (study.first_reach(study.run_points(r), target) for r in plain.values()) if x)
    assert seed["plain_steps"] == pytest.approx(expect)
    if seed["step"] is not None:   # priced: c = 0 counts the real steps only
        assert seed["ratio"]["0"] == pytest.approx(seed["real"] / seed["plain_steps"])
        assert seed["ratio"]["0.5"] == pytest.approx((seed["real"] + 0.5 * seed["predicted"]) / seed["plain_steps"])
    assert "seeds reaching plain's final loss at 32 steps" in res["time_to_target_markdown"]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        study.main([*common, "--target-steps", "33", "--json", "/nonexistent/never-written.json"])
    assert "--target-steps 33: no plain run of that length" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        study.main([*common, "--predict-cost", "0.1", "--json", "/nonexistent/never-written.json"])
    assert "give --target-steps too" in capsys.readouterr().err


@pytest.mark.parametrize("stage,offload", [(1, None), (2, None), (2, "cpu"), (3, None), (3, "cpu")])
def test_a_private_backward_through_the_module_leaves_deepspeeds_gradient_path_alone(stage, offload):
    """What a gradient Predict step on the GPU would rest on: on ZeRO 1-3 (optimizer offloaded or not; on ZeRO 3
    the parameters too), a forward through ``engine.module`` and ``torch.autograd.grad`` give the step's full
    16-bit gradient on the device while DeepSpeed's reduction hooks, its offload copies and its counters never run: an engine that
    takes such a backward between its real steps trains bit for bit as one that does not. (Through the engine's
    own forward, DeepSpeed 0.19.8 queues its backward epilogue on any backward, ``autograd.grad`` included.)"""
    from engine_utils import Batches, ds_config, full_params, make_engine
    cfg = ds_config(stage, bf16=True, offload_opt=offload, offload_param=offload if stage == 3 else None)
    a, b = make_engine(cfg, plain=True), make_engine(cfg, plain=True)
    ba, bb, extra = Batches(1), Batches(1), Batches(7)
    for step in range(3):
        if step:
            params = [p for p in b.module.parameters() if p.requires_grad]
            grads = torch.autograd.grad(b.module(**extra.micro()).loss, params)
            assert all(p.grad is None for p in params)
            assert all(g.dtype == torch.bfloat16 and g.shape == getattr(p, "ds_shape", p.shape)
                       for g, p in zip(grads, params))
            assert all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
        for eng, batches in ((a, ba), (b, bb)):
            eng.backward(eng(**batches.micro()).loss)
            eng.step()
    assert a.global_steps == b.global_steps == 3
    assert all(torch.equal(x, y) for x, y in zip(full_params(a), full_params(b)))


def test_predict_steps_in_the_cpu_window_take_their_gradient_without_the_real_update_and_say_so(study):
    """``--window``: a run whose Predict runs never start keeps plain AdamW bit for bit (the window's bookkeeping
    moves nothing); with runs, the stale gradients and the moments from before the real step change the loss,
    the guessed cover changes it again, all three stay near the synchronous run, and each row names its window."""
    plain = study.train(1, 2e-3, 36, None, **SHAPE)
    never = study.train(1, 2e-3, 36, "adam-carry", 1, 3, start=36, window=2, **SHAPE)
    assert never["val_loss"] == plain["val_loss"]
    sync = study.train(1, 2e-3, 36, "adam-carry", 1, 3, start=30, **SHAPE)
    stale = study.train(1, 2e-3, 36, "adam-carry", 1, 3, start=30, window=2, **SHAPE)
    cover = study.train(1, 2e-3, 36, "adam-carry", 1, 3, start=30, window=2, window_cover="last", **SHAPE)
    assert len({sync["val_loss"], stale["val_loss"], cover["val_loss"]}) == 3
    for r in (stale, cover):   # (36 steps: a check that nothing broke, not a measurement)
        assert r["val_loss"] == pytest.approx(sync["val_loss"], rel=0.1)
    assert (stale["window"], stale["window_cover"]) == (2, "none")
    assert (sync["window"], sync["window_cover"]) == (None, None)
    assert study.run_key(cover) == study.job_key((1, 2e-3, 36, "adam-carry", 1, 3, 30),
                                                 dict(window=2, window_cover="last"))
    assert study.run_key(cover) != study.run_key(stale) != study.run_key(sync)


def test_a_run_from_the_moment_before_the_real_step_hands_back_the_one_it_would_have_had_from_after(study):
    """``--window``'s carry: the run's gradients over the moment before the real step, rebased onto the moment
    after it, are the same gradients taken over the moment after it (to fp32 rounding)."""
    gen = torch.Generator().manual_seed(0)
    before, grads = torch.randn(1000, generator=gen), [torch.randn(1000, generator=gen) for _ in range(4)]
    after = study.BETAS[0] * before + (1 - study.BETAS[0]) * grads[0]   # the real step's update of m
    run_before, run_after = before.clone(), after.clone()
    for g in grads[1:]:
        run_before.mul_(study.BETAS[0]).add_(g, alpha=1 - study.BETAS[0])
        run_after.mul_(study.BETAS[0]).add_(g, alpha=1 - study.BETAS[0])
    assert torch.allclose(study.rebased_first_moment(run_before, before, after, 3), run_after, rtol=0, atol=1e-6)
    assert not torch.allclose(run_before, run_after, rtol=0, atol=1e-3)


def test_a_predict_step_from_a_share_of_its_batch_takes_its_first_sequences_and_consumes_it_whole(study, monkeypatch):
    """``--gradient-fraction``: each gradient Predict step's forward sees the first ``round(F x batch)`` sequences
    of its batch, real steps see all of it, and the stream moves a whole batch a step either way (every forward's
    first sequence is the whole-batch run's). The share changes the loss; 1.0 is the study's default run."""
    seen: list[tuple[int, tuple]] = []
    real_setup = study.setup

    def setup(*a, **k):
        net, params, opt, stream, val = real_setup(*a, **k)
        net.register_forward_pre_hook(
            lambda m, args, kwargs: seen.append((kwargs["input_ids"].shape[0], tuple(kwargs["input_ids"][0, :16].tolist()))),
            with_kwargs=True)
        return net, params, opt, stream, val

    monkeypatch.setattr(study, "setup", setup)
    runs = {}
    for fraction in (1.0, 0.5):
        seen.clear()
        runs[fraction] = study.train(1, 2e-3, 36, "adam-carry", 1, 3, start=30, gradient_fraction=fraction, **SHAPE)
        runs[fraction]["seen"] = seen[:36]   # (the validation forwards after them hold 16 sequences)
    # 30 real steps, a run of 3, a real step, a run cut to 2 by the end
    assert [n for n, _ in runs[0.5]["seen"]] == [4] * 30 + [2, 2, 2, 4, 2, 2]
    assert [n for n, _ in runs[1.0]["seen"]] == [4] * 36
    assert [first for _, first in runs[0.5]["seen"]] == [first for _, first in runs[1.0]["seen"]]
    assert runs[0.5]["val_loss"] != runs[1.0]["val_loss"]
    assert (runs[0.5]["gradient_fraction"], runs[1.0]["gradient_fraction"]) == (0.5, 1.0)
    monkeypatch.undo()
    assert study.train(1, 2e-3, 36, "adam-carry", 1, 3, start=30, **SHAPE)["val_loss"] == runs[1.0]["val_loss"]
    assert study.run_key(runs[0.5]) == study.job_key((1, 2e-3, 36, "adam-carry", 1, 3, 30), dict(gradient_fraction=0.5))
    assert study.run_key(runs[0.5]) != study.run_key(runs[1.0])


def test_a_share_of_the_lr_moves_a_predict_step_that_share_of_adams_step(study, monkeypatch):
    """``--gradient-lr-scale``: a gradient Predict step moves each weight by that share of Adam's step and its
    decay; real steps take the whole LR. 30 real steps, then one Predict step at step 30, the last: against the
    ``skip`` run (the weights before that step), half the LR moves the weights half as far as the whole."""
    final = {}
    real_setup = study.setup

    def setup(*a, **k):
        out = real_setup(*a, **k)
        final["params"] = out[1]
        return out

    monkeypatch.setattr(study, "setup", setup)
    runs, weights = {}, {}
    for mode, scale in (("skip", 1.0), ("adam-carry", 1.0), ("adam-carry", 0.5)):
        runs[mode, scale] = study.train(1, 2e-3, 31, mode, 30, 1, start=30, gradient_lr_scale=scale, **SHAPE)
        weights[mode, scale] = torch.cat([p.detach().flatten() for p in final["params"]])
    before = weights["skip", 1.0]
    whole, half = weights["adam-carry", 1.0] - before, weights["adam-carry", 0.5] - before
    assert float(whole.abs().max()) > 1e-4
    torch.testing.assert_close(half, 0.5 * whole, rtol=1e-3, atol=1e-6)   # (fp32 rounding of w - w0)
    assert runs["adam-carry", 0.5]["gradient_lr_scale"] == 0.5 and runs["skip", 1.0]["gradient_lr_scale"] == 1.0
    assert study.run_key(runs["adam-carry", 0.5]) == study.job_key((1, 2e-3, 31, "adam-carry", 30, 1, 30),
                                                                   dict(gradient_lr_scale=0.5))
    assert study.run_key(runs["adam-carry", 0.5]) != study.run_key(runs["adam-carry", 1.0])


def test_the_predict_steps_first_moment_decays_by_its_own_beta1(study):
    """``--gradient-beta1``: AdamW's 0.9 given is the default run bit for bit; another decay moves the weights
    elsewhere and the runs are told apart."""
    kw = dict(start=30, **SHAPE)
    default = study.train(1, 2e-3, 36, "adam-carry", 1, 3, **kw)
    same = study.train(1, 2e-3, 36, "adam-carry", 1, 3, gradient_beta1=0.9, **kw)
    slow = study.train(1, 2e-3, 36, "adam-carry", 1, 3, gradient_beta1=0.99, **kw)
    assert same["val_loss"] == default["val_loss"] and slow["val_loss"] != default["val_loss"]
    assert slow["gradient_beta1"] == 0.99 and study.run_key(slow) != study.run_key(default)
    assert study.run_key(slow) == study.job_key((1, 2e-3, 36, "adam-carry", 1, 3, 30), dict(gradient_beta1=0.99))


def test_a_factored_second_moment_is_exact_for_an_outer_product_and_a_vector(study):
    """``--state-dtype int8-factored``: a matrix's ``sqrt(v)`` from its row and column means alone, exact where
    ``v`` is a rank-one outer product (Adafactor's fit), close otherwise; a vector's exactly."""
    r, c = torch.rand(6, 1) + 0.1, torch.rand(1, 5) + 0.1
    torch.testing.assert_close(study.factored_rms(r * c), (r * c).sqrt())
    v = torch.rand(7)
    assert torch.equal(study.factored_rms(v), v.sqrt())
    noisy = (r * c) * (1 + 0.05 * torch.rand(6, 5))
    err = (study.factored_rms(noisy) / noisy.sqrt() - 1).abs().max()
    assert 0 < float(err) < 0.05


def test_a_four_bit_first_moment_holds_15_levels_a_block_unbiased(study):
    """``--state-dtype int4-factored``: each block of 256 values keeps its absmax exactly and the rest on 15 levels
    of it, rounded stochastically so that the mean over draws is the value; a run with it differs from int8's."""
    g = torch.Generator().manual_seed(0)
    m = torch.randn(3, 300, generator=g)
    q = study.held_int4(m, g)
    assert q.shape == m.shape
    blocks = torch.nn.functional.pad(q.flatten(), (0, 124)).view(-1, 256)
    mb = torch.nn.functional.pad(m.flatten(), (0, 124)).view(-1, 256)
    scale = mb.abs().amax(dim=1, keepdim=True) / 7
    levels = blocks / scale
    torch.testing.assert_close(levels, levels.round(), atol=1e-5, rtol=0)
    assert float(levels.abs().max()) <= 7 + 1e-5
    torch.testing.assert_close(blocks.abs().amax(dim=1), mb.abs().amax(dim=1))
    mean = torch.stack([study.held_int4(m, g) for _ in range(400)]).mean(0)
    assert float((mean - m).abs().max()) < 0.1 * float(m.abs().max())
    kw = dict(start=30, **SHAPE)
    four = study.train(1, 2e-3, 36, "adam-carry", 1, 3, state_dtype="int4-factored", **kw)
    eight = study.train(1, 2e-3, 36, "adam-carry", 1, 3, state_dtype="int8-factored", **kw)
    assert four["val_loss"] != eight["val_loss"] and study.run_key(four) != study.run_key(eight)


def test_an_int8_factored_state_and_a_streamed_clip_each_move_a_run_their_own_way(study, monkeypatch):
    """The 7B state (``m`` in int8 stochastic-rounded blocks, ``v`` factored) and the clips a streamed update can
    use (the last real step's factor, the previous Predict step's, per parameter) each change the run, stay within
    a few percent of the exact one in loss, are the same on a rerun, and are told apart by their keys. The int8
    state is what the run holds: each Predict step's ``m`` goes through ``CompactBuffer`` int8 (checked by
    counting its stores)."""
    kw = dict(start=30, **SHAPE)
    exact = study.train(1, 2e-3, 36, "adam-carry", 1, 3, **kw)
    stores = []
    real_store = study.CompactBuffer.store

    def store(self, values, *a, **k):
        stores.append((self.dtype, values.numel()))
        return real_store(self, values, *a, **k)

    monkeypatch.setattr(study.CompactBuffer, "store", store)
    compact = study.train(1, 2e-3, 36, "adam-carry", 1, 3, state_dtype="int8-factored", **kw)
    n_params = sum(p.numel() for p in study.build_model("gpt2-tiny", vocab_size=256, seq_len=64).parameters())
    # two Predict runs (3 steps, then 2): each stores the optimizer's m once, then once a step
    assert {d for d, _ in stores} == {"int8"} and sum(n for _, n in stores) == (2 + 5) * n_params
    monkeypatch.undo()
    again = study.train(1, 2e-3, 36, "adam-carry", 1, 3, state_dtype="int8-factored", **kw)
    clipped = study.train(1, 2e-3, 36, "adam-carry", 1, 3, predict_clip="last-real", **kw)
    previous = study.train(1, 2e-3, 36, "adam-carry", 1, 3, predict_clip="previous", **kw)
    tensor = study.train(1, 2e-3, 36, "adam-carry", 1, 3, predict_clip="tensor", **kw)
    # (a run's first shares from the second moment, as the engine's compact state takes them)
    tensor_v = study.train(1, 2e-3, 36, "adam-carry", 1, 3, predict_clip="tensor-v", **kw)
    runs = (exact, compact, clipped, previous, tensor, tensor_v)
    assert again["val_loss"] == compact["val_loss"]
    assert len({r["val_loss"] for r in runs}) == 6
    for r in runs[1:]:
        assert r["val_loss"] == pytest.approx(exact["val_loss"], rel=0.03)
    assert clipped["predict_clip"] == "last-real" and compact["state_dtype"] == "int8-factored"
    assert study.run_key(previous) == study.job_key((1, 2e-3, 36, "adam-carry", 1, 3, 30),
                                                    dict(predict_clip="previous"))
    assert len({study.run_key(r) for r in runs}) == 6
    # from a share of the batch the noise scale pairs each share step with the real one: from the second share
    # step on, the expected norm's factor is not the last real step's
    share = dict(gradient_fraction=0.5, **kw)
    assert (study.train(1, 2e-3, 36, "adam-carry", 1, 3, predict_clip="expected", **share)["val_loss"]
            != study.train(1, 2e-3, 36, "adam-carry", 1, 3, predict_clip="last-real", **share)["val_loss"])


def test_the_compact_cover_of_a_real_step_is_adamws_step_where_nothing_is_held(study):
    """``--real-cover compact``'s step: with a first moment held as it is and a vector (whose factored second
    moment is exact), the weights and moments it leaves are AdamW's own step's; a matrix's step takes the
    factored second moment of the optimizer's stepped one."""
    torch.manual_seed(0)
    p, w = torch.nn.Parameter(torch.randn(300)), torch.nn.Parameter(torch.randn(20, 30))
    opt = torch.optim.AdamW([p, w], lr=2e-3, betas=study.BETAS, eps=study.EPS, weight_decay=study.WEIGHT_DECAY)
    for last in (False, True):   # (the second step is the one covered)
        p.grad, w.grad = torch.randn(300) * 0.03, torch.randn(20, 30) * 0.03
        if last:
            before = [p.detach().clone(), w.detach().clone()]
            m_pre = [opt.state[x]["exp_avg"].clone() for x in (p, w)]
        opt.step()
    v_post = [opt.state[x]["exp_avg_sq"] for x in (p, w)]
    cov = study.cover_step([p, w], before, m_pre, v_post, 2, 2e-3, lambda i, m: m)
    assert cov["k"] == 2
    assert torch.allclose(cov["weights"][0], p.detach(), rtol=0, atol=1e-7)
    # (to fp32 rounding: torch's AdamW lerps the moments)
    assert torch.allclose(cov["m"][0], opt.state[p]["exp_avg"], rtol=0, atol=1e-8)
    assert torch.equal(cov["v"][1], v_post[1])
    bc1, bc2 = 1 - study.BETAS[0] ** 2, 1 - study.BETAS[1] ** 2
    want = before[1] * (1 - 2e-3 * study.WEIGHT_DECAY) - 2e-3 * (cov["m"][1] / bc1) / (
        study.factored_rms(v_post[1] / bc2) + study.EPS)
    assert torch.allclose(cov["weights"][1], want, rtol=0, atol=1e-7)
    assert not torch.allclose(cov["weights"][1], w.detach(), rtol=0, atol=1e-6)   # (not AdamW's own)


def test_a_real_step_covered_in_the_compact_state_moves_the_run_its_own_way_and_says_so(study):
    """``--real-cover compact``: no run, no cover (plain AdamW bit for bit); with runs the cover changes the loss,
    stays near the uncovered run, is the same on a rerun, and is told apart by its key."""
    plain = study.train(1, 2e-3, 36, None, **SHAPE)
    kw = dict(state_dtype="int4-factored", weights="bf16-sr", predict_clip="tensor-v", **SHAPE)
    never = study.train(1, 2e-3, 36, "adam-carry", 1, 3, start=36, real_cover="compact", **kw)
    assert never["val_loss"] == plain["val_loss"]
    base = study.train(1, 2e-3, 36, "adam-carry", 1, 3, start=26, **kw)
    cover = study.train(1, 2e-3, 36, "adam-carry", 1, 3, start=26, real_cover="compact", **kw)
    assert cover["val_loss"] != base["val_loss"]
    assert cover["val_loss"] == pytest.approx(base["val_loss"], rel=0.03)   # (36 steps: nothing broke)
    assert study.train(1, 2e-3, 36, "adam-carry", 1, 3, start=26, real_cover="compact", **kw)["val_loss"] \
        == cover["val_loss"]
    assert (cover["real_cover"], base["real_cover"], plain["real_cover"]) == ("compact", "none", "none")
    assert study.run_key(cover) == study.job_key((1, 2e-3, 36, "adam-carry", 1, 3, 26), dict(real_cover="compact", **kw))
    assert study.run_key(cover) != study.run_key(base)


@pytest.mark.parametrize("argv, says", [
    (["--real-cover", "compact"], "--real-cover compact: --modes among adam-local, adam-carry"),
    (["--real-cover", "compact", "--modes", "adam-carry", "--state-dtype", "int4-factored", "--window", "1"],
     "--real-cover with --window or --top-blocks"),
    (["--window-cover", "last"], "give --window too"),
    (["--predict-clip", "last-real", "--modes", "drift"], "--predict-clip: the Predict steps must take a gradient"),
    (["--predict-clip", "last-real", "--top-blocks", "2"], "--predict-clip with --top-blocks"),
    (["--window", "-1"], "--window: 0 or more"),
    (["--window", "2", "--modes", "skip", "adam-carry"], "--window: the Predict steps must take a gradient"),
    (["--window", "2", "--top-blocks", "2"], "--window and --top-blocks"),
    (["--gradient-fraction", "0"], "--gradient-fraction: above 0"),
    (["--gradient-fraction", "0.5", "--modes", "skip", "adam-carry"], "--gradient-fraction: the Predict steps must"),
    (["--gradient-lr-scale", "0"], "--gradient-lr-scale: above 0"),
    (["--gradient-lr-scale", "0.7", "--modes", "drift"], "--gradient-lr-scale: the Predict steps must"),
    (["--gradient-beta1", "1"], "--gradient-beta1: from 0 to below 1"),
    (["--gradient-beta1", "0.99", "--modes", "rms"], "--gradient-beta1: the Predict steps must keep"),
    (["--gradient-beta1", "0.99", "--modes", "adam-carry", "--window", "1"], "--gradient-beta1 and --window"),
])
def test_a_setting_the_study_cannot_run_is_refused_before_any_run(study, capsys, argv, says):
    with pytest.raises(SystemExit):
        study.main(argv + ["--seeds", "1", "--json", "/nonexistent/never-written.json"])
    assert says in capsys.readouterr().err
