"""DeepSpeed parity (issue 16): the calls a DeepSpeed script makes give the same results through
``ds_hybrid.initialize`` as through ``deepspeed.initialize`` (0.19.8), with the ``hybrid_predict``
section absent, disabled and enabled. Each test runs the same calls on both engines, built from the same
seed, and compares what comes back. The deliberate differences are in docs/deepspeed-parity.md.

| call | compared | modes | test |
|---|---|---|---|
| ``initialize(config=...)``: dict, JSON file, hjson file, base64 string | the dict each reads | - | ``test_every_config_spelling_reads_the_same_dict`` |
| ``initialize(config_params=..., args=...)``, ``args.deepspeed_config``, ``args.deepscale_config`` | engine's config, ``args`` afterwards | enabled | ``test_config_params_and_args_leave_the_same_state`` |
| ``initialize(optimizer=callable, lr_scheduler=callable, training_data=, collate_fn=)`` | the 4 return values' types, loader batches, a step's loss and LR | all | ``test_client_optimizer_scheduler_and_data_loader`` |
| ``initialize`` return values with the config's optimizer and scheduler | types of the 4 items, optimizer and scheduler identity with the engine's | all | ``test_a_deepspeed_training_loop_gives_the_same_results`` |
| ``engine(**batch)``, ``engine.backward``, ``engine.step`` | losses, ``backward``'s return, weights bit for bit | all | ``test_a_deepspeed_training_loop_gives_the_same_results`` |
| ``is_gradient_accumulation_boundary``, ``was_step_applied``, ``get_lr``, ``get_global_grad_norm`` | after every micro-step | all | ``test_a_deepspeed_training_loop_gives_the_same_results`` |
| ``global_steps``, ``global_samples``, ``micro_steps``, ``skipped_steps`` | after every micro-step | all | ``test_a_deepspeed_training_loop_gives_the_same_results`` |
| ``train_batch_size()``, ``train_micro_batch_size_per_gpu()``, ``gradient_accumulation_steps()``, ``zero_optimization_stage()``, ``gradient_clipping()``, ``bfloat16_enabled()``, ``fp16_enabled()``, ``optimizer_name()``, ``scheduler_name()`` | values | all | ``test_a_deepspeed_training_loop_gives_the_same_results`` |
| ``engine.train_step`` (ds_hybrid's) against the loop above | loss, LR, counters, weights bit for bit (enabled: Warmup steps) | all | ``test_train_step_is_the_deepspeed_loop`` |
| ``eval()``, ``train()``, ``zero_grad()`` | return values, ``module.training``, an eval loss, gradients cleared | all | ``test_eval_train_and_zero_grad`` |
| monitor: ``csv_monitor`` and ``tensorboard`` sections | CSV files' names and contents, TensorBoard scalars (ds_hybrid adds ``Hybrid/*`` through ``train_step`` when enabled) | all | ``test_monitor_writes_the_same_files`` |
| ``save_checkpoint`` / ``load_checkpoint`` | return values, file names (ds_hybrid adds its manifest and per-rank file), ``latest``, each checkpoint loaded into the other engine kind, a step after it, ``(None, None)`` for an empty folder | all | ``test_checkpoints_name_the_same_files_and_load_across`` |
| bad ds_config values | the exception type DeepSpeed raises | all | ``test_bad_config_values_raise_what_deepspeed_raises`` |
| bad ``initialize`` arguments: no config, two configs, no model, a missing file, a config of the wrong type, duplicate keys | the exception type | - | ``test_bad_arguments_raise_what_deepspeed_raises`` |
| no optimizer: ``backward`` | DeepSpeed's ``AssertionError``; enabled: ``initialize`` says what to pass | all | ``test_no_optimizer`` |
| deliberate differences | non-Adam optimizer with Predict, ``hybrid_engine`` | - | ``test_documented_differences`` |
| a plain ``python script.py`` (no launcher) with ``distributed_port=`` | runs as rank 0 of 1 on that port | enabled | ``test_a_script_without_a_launcher_runs_as_rank_0_of_1`` |
"""
import argparse
import base64
import copy
import csv
import json
from pathlib import Path

import deepspeed
import pytest
import torch
from engine_utils import EAGER, SEQ, Batches, ds_config, full_params

import ds_hybrid
from ds_hybrid.ds_config import load_ds_config
from ds_hybrid.engine import PredictiveEngine
from ds_hybrid.models import build_model

MODES = {"absent": None, "disabled": {"enabled": False}, "enabled": EAGER}
GAS = 2
# What a getter-only script reads from the engine.
GETTERS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
           "zero_optimization_stage", "gradient_clipping", "bfloat16_enabled", "fp16_enabled", "optimizer_name",
           "scheduler_name")
# Files ds_hybrid's checkpoint adds to DeepSpeed's, per tag folder (content digests, rank state).
CHECKPOINT_ADDITIONS = {"hybrid_manifest.json", "hybrid_rank0.pt"}


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return build_model("gpt2-test", vocab_size=256, seq_len=SEQ)


def _without_section(cfg: dict) -> dict:
    """The config plain DeepSpeed gets: the same, with no hybrid_predict section."""
    return {k: v for k, v in cfg.items() if k != "hybrid_predict"}


def _init(init, cfg: dict, seed: int = 0, **kwargs) -> tuple:
    m = _model(seed)
    params = kwargs.pop("model_parameters", m.parameters())
    return init(model=m, model_parameters=params, config=copy.deepcopy(cfg), **kwargs)


def _pair(mode: str, seed: int = 0, **extra) -> tuple[tuple, tuple]:
    """``deepspeed.initialize``'s and ``ds_hybrid.initialize``'s 4-tuples for the same run."""
    cfg = ds_config(stage=1, gas=GAS, hybrid=MODES[mode], **extra)
    return _init(deepspeed.initialize, _without_section(cfg), seed), _init(ds_hybrid.initialize, cfg, seed)


def _num(x):
    return None if x is None else float(x)


def _deepspeed_loop(engine, steps: int, seed: int = 1) -> list[dict]:
    """A DeepSpeed script's loop (forward, backward, step per micro-batch) and what every call returned."""
    torch.manual_seed(seed)
    batches = Batches(seed)
    trace = []
    for _ in range(steps):
        for mb in batches.step(GAS):
            boundary = engine.is_gradient_accumulation_boundary()
            loss = engine(**mb).loss
            scaled = engine.backward(loss)
            engine.step()
            trace.append({"loss": loss.item(), "backward": scaled.item(), "boundary": boundary,
                          "applied": engine.was_step_applied(), "lr": engine.get_lr(),
                          "grad_norm": _num(engine.get_global_grad_norm()), "global_steps": engine.global_steps,
                          "global_samples": engine.global_samples, "micro_steps": engine.micro_steps,
                          "skipped_steps": engine.skipped_steps})
    return trace


def _assert_same_weights(a, b) -> None:
    for x, y in zip(full_params(a), full_params(b), strict=True):
        assert torch.equal(x, y)


def _types(items: tuple) -> list:
    return [type(x) for x in items]


# --------------------------------------------------------------------------- initialize's arguments

def test_every_config_spelling_reads_the_same_dict(tmp_path):
    cfg = ds_config(stage=1, hybrid=EAGER)
    hjson_file = tmp_path / "ds.hjson"
    hjson_file.write_text("# a comment, as hjson allows\n" + json.dumps(cfg, indent=1).replace(
        '"steps_per_print": ', '// note\n"steps_per_print": '))
    json_file = tmp_path / "ds.json"
    json_file.write_text(json.dumps(cfg))
    encoded = base64.urlsafe_b64encode(json.dumps(cfg).encode()).decode()
    for spelling in (cfg, str(json_file), str(hjson_file), encoded):
        assert load_ds_config(spelling) == deepspeed.load_ds_config(spelling) == cfg
    # A JSON file reads as JSON (hjson would make 1.0 the int 1; the hybrid_predict section is strictly typed).
    assert type(load_ds_config(str(json_file))["gradient_clipping"]) is float


def test_config_params_and_args_leave_the_same_state(tmp_path):
    cfg = ds_config(stage=1, hybrid=EAGER)
    f = tmp_path / "ds.json"
    f.write_text(json.dumps(cfg))
    plain_file = tmp_path / "plain.json"
    plain_file.write_text(json.dumps(_without_section(cfg)))
    for key in ("deepspeed_config", "deepscale_config"):
        unset = {"deepspeed_config": None, "deepscale_config": None, "local_rank": 0}
        ours_args = argparse.Namespace(**dict(unset, **{key: str(f)}))
        plain_args = argparse.Namespace(**dict(unset, **{key: str(plain_file)}))
        m, p = _model(), _model()
        ours = ds_hybrid.initialize(args=ours_args, model=m, model_parameters=m.parameters())[0]
        plain = deepspeed.initialize(args=plain_args, model=p, model_parameters=p.parameters())[0]
        assert isinstance(ours, PredictiveEngine) and ours.hybrid_config.enabled
        # deepspeed.initialize leaves args.deepspeed_config naming the file (and moves deepscale_config there)
        assert vars(ours_args) == dict(vars(plain_args), deepspeed_config=str(f)), key
        assert [getattr(ours, g)() for g in GETTERS] == [getattr(plain, g)() for g in GETTERS]
    m, p = _model(), _model()
    ours = ds_hybrid.initialize(model=m, model_parameters=m.parameters(), config_params=cfg)[0]
    plain = deepspeed.initialize(model=p, model_parameters=p.parameters(), config_params=_without_section(cfg))[0]
    assert ours.hybrid_config.enabled
    assert _without_section(ours.config) == plain.config


@pytest.mark.parametrize("mode", MODES)
def test_client_optimizer_scheduler_and_data_loader(mode):
    """optimizer= and lr_scheduler= as callables, training_data= with collate_fn=: the same objects back."""
    cfg = {k: v for k, v in ds_config(stage=1, hybrid=MODES[mode]).items() if k not in ("optimizer", "scheduler")}
    rows = torch.randint(0, 48, (16, SEQ), generator=torch.Generator().manual_seed(3))
    data = torch.utils.data.TensorDataset(rows)

    def collate(samples):
        x = torch.stack([s[0] for s in samples])
        return {"input_ids": x, "labels": x.clone()}

    def build(init, config):
        return _init(init, config, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
                     lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
                     training_data=data, collate_fn=collate)

    plain, ours = build(deepspeed.initialize, _without_section(cfg)), build(ds_hybrid.initialize, cfg)
    assert _types(ours)[1:] == _types(plain)[1:] and isinstance(ours[0], type(plain[0]))
    assert ours[1] is ours[0].optimizer and ours[3] is ours[0].lr_scheduler
    assert len(ours[2]) == len(plain[2])
    losses = []
    for engine, _, loader, scheduler in (plain, ours):
        # DeepSpeed's loader forks 2 worker processes per device; late in the suite the test
        # process is large enough that a fork can fail (ENOMEM): load in-process, both alike.
        loader.num_local_io_workers = 0
        batch = next(iter(loader))
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append((batch["input_ids"], loss.item(), engine.get_lr(), scheduler.get_last_lr()))
    (x0, *rest0), (x1, *rest1) = losses
    assert torch.equal(x0, x1) and rest0 == rest1
    assert rest0[1] == [5e-4]   # StepLR stepped once: the client scheduler is the one stepped
    _assert_same_weights(plain[0], ours[0])


# --------------------------------------------------------------------------- the training loop

@pytest.mark.parametrize("mode", MODES)
def test_a_deepspeed_training_loop_gives_the_same_results(mode):
    plain, ours = _pair(mode)
    assert _types(ours)[1:] == _types(plain)[1:] and type(plain[0]) is deepspeed.DeepSpeedEngine
    assert type(ours[0]) is PredictiveEngine and ours[2] is None and plain[2] is None
    assert ours[1] is ours[0].optimizer and ours[3] is ours[0].lr_scheduler
    trace = _deepspeed_loop(plain[0], 3)
    assert _deepspeed_loop(ours[0], 3) == trace
    assert [t["boundary"] for t in trace] == [False, True] * 3 and trace[-1]["global_steps"] == 3
    _assert_same_weights(plain[0], ours[0])
    assert [getattr(ours[0], g)() for g in GETTERS] == [getattr(plain[0], g)() for g in GETTERS]
    if mode == "enabled":
        assert ours[0].phase.value == "warmup"   # phases advance only through train_step


@pytest.mark.parametrize("mode", MODES)
def test_train_step_is_the_deepspeed_loop(mode):
    """``train_step`` is one optimizer step of the loop above; enabled, its Warmup steps are plain steps."""
    (plain, *_), (ours, *_) = _pair(mode)
    trace = _deepspeed_loop(plain, 3)
    torch.manual_seed(1)
    batches = Batches(1)
    results = [ours.train_step(batches.step(GAS)) for _ in range(3)]
    assert [r.phase for r in results] == ["warmup" if mode == "enabled" else "full"] * 3
    boundaries = trace[GAS - 1::GAS]
    for i, (r, t) in enumerate(zip(results, boundaries, strict=True)):
        losses = [x["loss"] for x in trace[i * GAS:(i + 1) * GAS]]
        assert r.loss == sum(losses) / len(losses)
        assert (r.step, r.lr, r.skipped, r.backward_ran) == (t["global_steps"], t["lr"][0], False, True)
    assert (ours.global_steps, ours.global_samples, ours.micro_steps, ours.skipped_steps) == \
        (plain.global_steps, plain.global_samples, plain.micro_steps, plain.skipped_steps)
    _assert_same_weights(plain, ours)


@pytest.mark.parametrize("mode", MODES)
def test_eval_train_and_zero_grad(mode):
    seen = []
    for engine, *_ in _pair(mode):
        batch = Batches(2).micro()
        out = [engine.eval(), engine.module.training]
        with torch.no_grad():
            out.append(engine(**batch).loss.item())
        out += [engine.train(), engine.module.training]
        engine.backward(engine(**batch).loss)     # mid-accumulation: ZeRO 1 keeps p.grad until the boundary
        out.append(sum(p.grad is not None for p in engine.module.parameters()))
        out += [engine.zero_grad(), sum(p.grad is not None for p in engine.module.parameters())]
        seen.append(out)
    assert seen[0] == seen[1]
    assert seen[0][:2] == [None, False] and seen[0][3:5] == [None, True] and seen[0][5] > 0 and seen[0][-1] == 0


# --------------------------------------------------------------------------- files written

def _csv_files(folder: Path) -> dict[str, list]:
    return {p.name: list(csv.reader(p.read_text().splitlines())) for p in sorted(folder.rglob("*.csv"))}


def _tensorboard_scalars(folder: Path) -> dict[str, list]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    (events,) = folder.rglob("events.out.tfevents.*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize("mode", MODES)
def test_monitor_writes_the_same_files(mode, tmp_path):
    pytest.importorskip("tensorboard")

    def monitors(name):
        return dict(csv_monitor={"enabled": True, "output_path": str(tmp_path / name / "csv"), "job_name": "job"},
                    tensorboard={"enabled": True, "output_path": str(tmp_path / name / "tb"), "job_name": "job"})

    cfg = ds_config(stage=1, gas=GAS, hybrid=MODES[mode], **monitors("ours"))
    plain = _init(deepspeed.initialize, _without_section(ds_config(stage=1, gas=GAS, **monitors("plain"))))[0]
    ours = _init(ds_hybrid.initialize, cfg)[0]
    _deepspeed_loop(plain, 2)
    _deepspeed_loop(ours, 2)
    assert _csv_files(tmp_path / "ours" / "csv") == _csv_files(tmp_path / "plain" / "csv")
    assert _tensorboard_scalars(tmp_path / "ours" / "tb") == _tensorboard_scalars(tmp_path / "plain" / "tb")
    assert list(_csv_files(tmp_path / "plain" / "csv")) == ["Train_Samples_lr.csv"]
    # Then train_step on ours, the loop on plain: ds_hybrid adds its Hybrid/* scalars when enabled, nothing else.
    _deepspeed_loop(plain, 2, seed=2)
    torch.manual_seed(2)
    batches = Batches(2)
    for _ in range(2):
        ours.train_step(batches.step(GAS))
    plain_csv, ours_csv = _csv_files(tmp_path / "plain" / "csv"), _csv_files(tmp_path / "ours" / "csv")
    added = set(ours_csv) - set(plain_csv)
    assert set(plain_csv) <= set(ours_csv)
    # (Hybrid/predicted_loss is written once the predictor has a finite forecast: not in these Warmup steps.)
    assert added - {"Hybrid_predicted_loss.csv"} == ({"Hybrid_phase.csv", "Hybrid_confidence.csv", "Hybrid_loss.csv",
                                                     "Hybrid_step_time_s.csv", "Hybrid_backward_skipped_pct.csv"}
                                                    if mode == "enabled" else set())
    assert {k: v for k, v in ours_csv.items() if k in plain_csv} == plain_csv
    plain_tb, ours_tb = _tensorboard_scalars(tmp_path / "plain" / "tb"), _tensorboard_scalars(tmp_path / "ours" / "tb")
    assert {k: v for k, v in ours_tb.items() if not k.startswith("Hybrid/")} == plain_tb
    assert {"Hybrid/" + n[len("Hybrid_"):-len(".csv")] for n in added} == {k for k in ours_tb if k.startswith("Hybrid/")}


def _listing(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("mode", MODES)
def test_checkpoints_name_the_same_files_and_load_across(mode, tmp_path):
    (plain, *_), (ours, *_) = _pair(mode)
    _deepspeed_loop(plain, 2)
    _deepspeed_loop(ours, 2)
    plain_dir, ours_dir = tmp_path / "plain", tmp_path / "ours"
    assert plain.save_checkpoint(plain_dir, client_state={"epoch": 3}) is True
    assert ours.save_checkpoint(ours_dir, client_state={"epoch": 3}) is True
    assert (ours_dir / "latest").read_text() == (plain_dir / "latest").read_text() == "global_step2"
    assert _listing(ours_dir) == _listing(plain_dir) | {f"global_step2/{n}" for n in CHECKPOINT_ADDITIONS}
    # Each checkpoint loads into the other engine kind (a DeepSpeed one has no manifest: verify=False).
    (fresh_plain, *_), (fresh_ours, *_) = _pair(mode, seed=5)
    path_p, state_p = fresh_plain.load_checkpoint(ours_dir)
    path_o, state_o = fresh_ours.load_checkpoint(plain_dir, verify=False)
    assert Path(path_p).relative_to(ours_dir) == Path(path_o).relative_to(plain_dir)
    assert state_p["epoch"] == state_o["epoch"] == 3 and set(state_p) - set(state_o) == {"ds_hybrid"}
    for engine in (fresh_plain, fresh_ours):
        _assert_same_weights(plain, engine)
        assert (engine.global_steps, engine.global_samples, engine.get_lr()) == \
            (plain.global_steps, plain.global_samples, plain.get_lr())
    assert _deepspeed_loop(fresh_ours, 1, seed=4) == _deepspeed_loop(fresh_plain, 1, seed=4)
    _assert_same_weights(fresh_plain, fresh_ours)
    assert fresh_plain.load_checkpoint(tmp_path / "empty") == fresh_ours.load_checkpoint(tmp_path / "empty") \
        == (None, None)


# --------------------------------------------------------------------------- errors

def _error(call) -> BaseException | None:
    try:
        call()
    except Exception as err:   # noqa: BLE001 - the type is what is compared
        return err
    return None


BAD_CONFIGS = {
    "zero_optimization.stage": {"zero_optimization": {"stage": 7}},
    "train_batch_size": {"train_batch_size": 7},
    "optimizer.type": {"optimizer": {"type": "NoSuchOptimizer", "params": {"lr": 1e-3}}},
    "scheduler.type": {"scheduler": {"type": "NoSuchSchedule", "params": {}}},
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("key", BAD_CONFIGS)
def test_bad_config_values_raise_what_deepspeed_raises(key, mode):
    cfg = dict(ds_config(stage=1, hybrid=MODES[mode]), **BAD_CONFIGS[key])
    plain_err = _error(lambda: _init(deepspeed.initialize, _without_section(cfg)))
    ours_err = _error(lambda: _init(ds_hybrid.initialize, cfg))
    assert plain_err is not None
    if key == "optimizer.type" and mode == "enabled":   # documented: Predict checks the type first
        assert isinstance(ours_err, ds_hybrid.ConfigError) and "optimizer.type: 'NoSuchOptimizer'" in str(ours_err)
        return
    assert type(ours_err) is type(plain_err), (plain_err, ours_err)
    assert str(ours_err) == str(plain_err)   # DeepSpeed's own message reaches the user


def test_bad_arguments_raise_what_deepspeed_raises(tmp_path):
    cfg = ds_config(stage=1)
    f = tmp_path / "ds.json"
    f.write_text(json.dumps(cfg))
    dup = tmp_path / "dup.json"
    dup.write_text('{"train_micro_batch_size_per_gpu": 2, "train_micro_batch_size_per_gpu": 4}')
    cases = {
        "no config": dict(config=None),
        "config= and args.deepspeed_config": dict(config=cfg, args=argparse.Namespace(deepspeed_config=str(f))),
        "args.deepscale_config and args.deepspeed_config": dict(
            config=None, args=argparse.Namespace(deepspeed_config=str(f), deepscale_config=str(f))),
        "no model": dict(config=cfg, model=None),
        "a missing file": dict(config=str(tmp_path / "nope.json")),
        "a config of the wrong type": dict(config=[("train_micro_batch_size_per_gpu", 4)]),
        "duplicate keys": dict(config=str(dup)),
    }
    for name, kwargs in cases.items():
        errors = []
        for init in (deepspeed.initialize, ds_hybrid.initialize):
            kw = copy.deepcopy(kwargs)
            model = kw.pop("model", _model())
            errors.append(_error(lambda: init(model=model, **kw)))
        plain_err, ours_err = errors
        assert plain_err is not None and isinstance(ours_err, type(plain_err)), (name, plain_err, ours_err)
        if name == "a missing file":
            assert isinstance(ours_err, FileNotFoundError) and "nope.json" in str(ours_err)
        if name == "no config":
            assert isinstance(ours_err, ValueError) and "config=" in str(ours_err)
        if name == "duplicate keys":
            assert "dup.json" in str(ours_err) and "train_micro_batch_size_per_gpu" in str(ours_err)


@pytest.mark.parametrize("mode", MODES)
def test_no_optimizer(mode):
    """DeepSpeed builds an engine without an optimizer and refuses ``backward``; with Predict enabled
    ds_hybrid refuses at ``initialize``, saying what to pass (Predict reads the Adam moments)."""
    from ds_hybrid.config import ConfigError
    cfg = {k: v for k, v in ds_config(stage=0, hybrid=MODES[mode]).items() if k not in ("optimizer", "scheduler")}
    plain, opt, _, sched = _init(deepspeed.initialize, _without_section(cfg))
    assert opt is None and sched is None
    plain_err = _error(lambda: plain.backward(plain(**Batches().micro()).loss))
    assert isinstance(plain_err, AssertionError) and "optimizer" in str(plain_err)
    if mode == "enabled":
        with pytest.raises(ConfigError, match=r"no 'optimizer' section and initialize\(\) got no optimizer="):
            _init(ds_hybrid.initialize, cfg)
        return
    ours, opt, _, sched = _init(ds_hybrid.initialize, cfg)
    assert opt is None and sched is None
    ours_err = _error(lambda: ours.backward(ours(**Batches().micro()).loss))
    assert type(ours_err) is type(plain_err) and str(ours_err) == str(plain_err)


def test_documented_differences():
    """docs/deepspeed-parity.md: what ds_hybrid refuses that DeepSpeed accepts."""
    cfg = ds_config(stage=1, hybrid=EAGER, optimizer={"type": "SGD", "params": {"lr": 1e-2}})
    with pytest.raises(ds_hybrid.ConfigError, match="optimizer.type: 'SGD' is not an Adam-family optimizer"):
        _init(ds_hybrid.initialize, cfg)
    del cfg["optimizer"], cfg["scheduler"]
    cfg["zero_allow_untested_optimizer"] = True
    with pytest.raises(ds_hybrid.ConfigError, match="hybrid_predict: optimizer SGD keeps no Adam moments"):
        _init(ds_hybrid.initialize, cfg, optimizer=lambda params: torch.optim.SGD(params, lr=1e-2))
    with pytest.raises(ValueError, match="hybrid_engine section cannot be combined"):
        _init(ds_hybrid.initialize, ds_config(stage=1, hybrid_engine={"enabled": True}))
    zenflow = ds_config(stage=2, hybrid=EAGER)
    zenflow["zero_optimization"].update(offload_optimizer={"device": "cpu"}, zenflow={"topk_ratio": 0.1})
    with pytest.raises(ds_hybrid.ConfigError, match="zero_optimization.zenflow: .* hybrid_predict"):
        _init(ds_hybrid.initialize, zenflow)


def test_zenflow_takes_one_batch_per_step():
    """ZenFlow sets gradient_accumulation_steps to its update_interval, but every micro-step is an
    optimizer step (a selective update, an LR scheduler step): ``train_step`` takes one batch and
    trains exactly as DeepSpeed's own loop, one forward/backward/step per batch."""
    cfg = ds_config(stage=2, offload_opt="cpu", hybrid={"enabled": False})
    cfg["zero_optimization"]["zenflow"] = {"topk_ratio": 0.1, "update_interval": 4, "select_strategy": "step",
                                           "select_interval": 4, "full_warm_up_rounds": 0, "overlap_step": False}
    plain, *_ = _init(deepspeed.initialize, _without_section(cfg))
    ours, *_ = _init(ds_hybrid.initialize, cfg)
    assert ours.gradient_accumulation_steps() == 4 and ours.batches_per_step() == 1
    with pytest.raises(ValueError, match="got 4 micro-batches"):
        ours.train_step(Batches().step(4))
    a, b, before = Batches(), Batches(), full_params(ours)
    for _ in range(6):
        ours.train_step(a.micro())
        batch = b.micro()
        plain.backward(plain(**batch).loss)
        plain.step()
    assert ours.get_lr() == plain.get_lr() and ours.get_lr()[0] > 0
    for p, q in zip(full_params(ours), full_params(plain)):
        assert torch.equal(p, q)
    assert not all(torch.equal(p, q) for p, q in zip(before, full_params(ours)))   # ZenFlow's updates landed
    assert ours.statistics()["backward_passes"] == 6


# --------------------------------------------------------------------------- no launcher

@pytest.mark.slow
def test_a_script_without_a_launcher_runs_as_rank_0_of_1(tmp_path):
    import os
    import subprocess
    import sys

    from conftest import free_port
    port = free_port()
    script = tmp_path / "my_script.py"
    script.write_text(
        "import os\n"
        "import ds_hybrid\n"
        "from ds_hybrid.models import build_model\n"
        "m = build_model('gpt2-test', vocab_size=256, seq_len=16)\n"
        "cfg = {'train_micro_batch_size_per_gpu': 2, 'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-3}},\n"
        "       'hybrid_predict': {'warmup_steps': 2}}\n"
        f"engine, *_ = ds_hybrid.initialize(model=m, model_parameters=m.parameters(), config=cfg, "
        f"distributed_port={port})\n"
        "print('WORLD', engine.world_size, type(engine).__name__, os.environ['MASTER_PORT'])\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"WORLD 1 PredictiveEngine {port}" in out.stdout   # on the port asked for, as DeepSpeed's discovery
