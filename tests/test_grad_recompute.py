"""``predictor.gradient_checkpointing``: a gradient Predict step's own backward recomputes the
model's checkpointed blocks or not (``ds_hybrid/grad_recompute.py``); the same gradient either way,
and ``auto`` decides from the measured peak and the planner's count of the blocks' activations."""
import pytest
import torch

import ds_hybrid.grad_recompute as gr
from ds_hybrid.config import ConfigError, parse_hybrid_config
from ds_hybrid.memory.planner import activation_bytes, model_shape
from ds_hybrid.phases import Phase
from engine_utils import EAGER, MICRO, SEQ, Batches, ds_config, full_params, make_engine

GRAD = dict(EAGER, check="next_step", correction_steps=0, min_predict_steps=3, max_predict_steps=3)
SETUPS = {"z2-offload-host": dict(stage=2, offload_opt="cpu"),
          "z2-offload-device": dict(stage=2, offload_opt="cpu", device=True),
          "z3-offload-device": dict(stage=3, offload_opt="cpu", offload_param="cpu", device=True)}


def _engine(setup: dict, checkpointing, checkpointed: bool = True):
    setup = dict(setup)
    memory = {"offload_predict": "device"} if setup.pop("device", False) else {}
    hybrid = dict(GRAD, predictor={"direction": "gradient", "gradient_checkpointing": checkpointing}, memory=memory)
    engine = make_engine(ds_config(hybrid=hybrid, **setup))
    if checkpointed:
        engine.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return engine


def _count_block_forwards(engine) -> dict:
    """Runs of the first block's MLP, by the phase of the step that made them (a recompute runs
    the block's forward inside transformers' checkpoint wrapper, where module hooks do not fire)."""
    seen = {"predict": 0, "real": 0}
    mlp = engine.module.transformer.h[0].mlp
    forward = mlp.forward

    def counted(*args, **kwargs):
        seen["predict" if engine.phase is Phase.PREDICT else "real"] += 1
        return forward(*args, **kwargs)
    mlp.forward = counted
    return seen


@pytest.mark.parametrize("name", list(SETUPS))
def test_a_predict_step_without_the_recompute_runs_each_block_once_and_moves_the_same_bits(name):
    """``true`` against ``false``, ZeRO 2 and 3 under offload_optimizer, host and device path: a
    gradient Predict step's backward runs each checkpointed block's forward again with ``true``
    and not with ``false`` (real steps recompute in both), and the two engines take the same
    steps to the same weights, bit for bit."""
    on, off = _engine(SETUPS[name], True), _engine(SETUPS[name], False)
    seen_on, seen_off = _count_block_forwards(on), _count_block_forwards(off)
    a, b = Batches(), Batches()
    predict_steps = 0
    for _ in range(12):
        ra, rb = on.train_step(a.step()), off.train_step(b.step())
        assert (ra.phase, ra.loss, ra.accepted) == (rb.phase, rb.loss, rb.accepted)
        predict_steps += ra.phase == "predict"
    assert predict_steps >= 3
    for x, y in zip(full_params(on), full_params(off)):
        assert torch.equal(x, y)
    # a Predict step: the check's forward is not in the Predict phase (check: next_step), so each
    # of its forwards is the private one: twice a step with the recompute, once without
    assert seen_on["predict"] == 2 * predict_steps and seen_off["predict"] == predict_steps
    assert seen_on["real"] == seen_off["real"], "real steps recompute as before"
    assert on.statistics()["gradient_recompute"]["steps"] == {"recomputed": predict_steps, "plain": 0}
    assert off.statistics()["gradient_recompute"]["steps"] == {"recomputed": 0, "plain": predict_steps}


def test_auto_measures_once_with_the_runs_moments_held_then_keeps_the_activations_where_they_fit():
    """``auto`` on a CPU with room: the run's first step (its moments not yet copied) recomputes
    without deciding, the second measures, and every later step runs plainly; the decision
    holds the planner's count for this micro-batch and the host's limit; the weights are those
    of ``true``."""
    ref, auto = _engine(SETUPS["z2-offload-device"], True), _engine(SETUPS["z2-offload-device"], "auto")
    a, b = Batches(), Batches()
    for _ in range(12):
        ra, rb = ref.train_step(a.step()), auto.train_step(b.step())
        assert (ra.phase, ra.loss) == (rb.phase, rb.loss)
    for x, y in zip(full_params(ref), full_params(auto)):
        assert torch.equal(x, y)
    st = auto.statistics()["gradient_recompute"]
    assert st["setting"] == "auto" and st["steps"]["recomputed"] == 2 and st["steps"]["plain"] >= 1
    tokens = MICRO * SEQ
    (d,) = st["decisions"]
    assert d["tokens"] == tokens and d["plain"] is True and st["fits_up_to_tokens"] == tokens
    plain, ckpt = (activation_bytes(model_shape("gpt2-test", vocab_size=256), tokens, 1, 4, c) for c in (False, True))
    assert d["extra_activation_bytes"] == pytest.approx(plain["layers"] - ckpt["layers"] + plain["working"])
    assert d["need_bytes"] == d["extra_activation_bytes"] and d["peak_bytes"] is None
    assert d["limit_bytes"] > d["need_bytes"] > 0 and d["device"] == "cpu"


def test_auto_without_room_keeps_recomputing_and_does_not_measure_that_size_again(monkeypatch):
    monkeypatch.setattr(gr, "limit_bytes", lambda device, local_ranks: 1000.0)
    auto = _engine(SETUPS["z2-offload-device"], "auto")
    batches = Batches()
    steps = sum(auto.train_step(batches.step()).phase == "predict" for _ in range(12))
    st = auto.statistics()["gradient_recompute"]
    assert st["steps"] == {"recomputed": steps, "plain": 0}
    assert [d["plain"] for d in st["decisions"]] == [False] and st["too_big_from_tokens"] == MICRO * SEQ


class _Rank:
    """Another rank's answers, as the engine's element-wise maximum over ranks would give them."""

    def __init__(self, tokens: float, no_room: bool):
        self.tokens, self.no_room, self.calls = tokens, no_room, []

    def __call__(self, values: list[float]) -> list[float]:
        self.calls.append(values)
        other = self.tokens if len(self.calls) % 2 else float(self.no_room)
        return [max(values[0], other)]


def _checkpointed_model():
    from ds_hybrid.models import build_model
    net = build_model("gpt2-test", vocab_size=256, seq_len=SEQ)
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return net


def _batch(seqs: int) -> list:
    x = torch.randint(0, 48, (seqs, SEQ))
    return [{"input_ids": x, "labels": x}]


def test_auto_takes_the_largest_micro_batch_of_any_rank_and_the_answer_of_the_rank_with_least_room():
    net = _checkpointed_model()
    rec = gr.Recompute("auto", net, _Rank(tokens=4 * SEQ, no_room=True))
    with rec.scope(_batch(2)):
        assert gr.checkpointed_layers(net), "measured checkpointed"
    (d,) = rec.decisions
    assert d["tokens"] == 4 * SEQ and d["plain"] is False, "the other rank's size and answer"
    rec = gr.Recompute("auto", net, _Rank(tokens=0, no_room=False))
    for seqs, plain in [(2, False), (2, True), (1, True), (4, False)]:
        with rec.scope(_batch(seqs)):
            assert (not gr.checkpointed_layers(net)) is plain
    assert [d["tokens"] for d in rec.decisions] == [2 * SEQ, 4 * SEQ], "a larger micro-batch is measured again"
    assert gr.checkpointed_layers(net), "the flags are back after each step"


def test_a_step_that_fails_decides_nothing_and_leaves_the_flags_on():
    net = _checkpointed_model()
    rec = gr.Recompute(False, net, lambda v: v)
    with pytest.raises(RuntimeError, match="boom"):
        with rec.scope(_batch(1)):
            raise RuntimeError("boom")
    assert gr.checkpointed_layers(net)
    rec = gr.Recompute("auto", net, lambda v: v)
    with pytest.raises(RuntimeError, match="boom"):
        with rec.scope(_batch(1)):
            raise RuntimeError("boom")
    assert rec.decisions == [] and rec.fits_up_to == 0


def test_a_model_without_checkpointing_or_without_a_config_to_count_from():
    engine = _engine(SETUPS["z2-offload-host"], "auto", checkpointed=False)
    batches = Batches()
    for _ in range(8):
        engine.train_step(batches.step())
    st = engine.statistics()["gradient_recompute"]
    assert st["steps"] == {"recomputed": 0, "plain": 0} and st["decisions"] == []

    class Bare(torch.nn.Module):   # a checkpointed block, but no transformers config
        def __init__(self):
            super().__init__()
            self.block = torch.nn.Linear(4, 4)
            self.block.gradient_checkpointing = True
    bare = Bare()
    rec = gr.Recompute("auto", bare, lambda v: v)
    with rec.scope(_batch(1)):
        pass
    assert rec.decisions[0]["extra_activation_bytes"] is None and rec.decisions[0]["plain"] is False


@pytest.mark.parametrize("value", ["sometimes", 2])
def test_a_bad_setting_is_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match="gradient_checkpointing"):
        parse_hybrid_config({"hybrid_predict": {"enabled": True, "predictor": {"gradient_checkpointing": value}}})


def test_on_a_gpu_a_plain_step_needs_its_twins_forward_end_plus_the_activations_or_its_peak(monkeypatch):
    """The GPU rule, by its arithmetic (the measured figures given): the blocks' activations go on
    what the checkpointed twin held at the end of its forward, or the twin's peak where higher."""
    net = _checkpointed_model()
    extra = gr.extra_activation_bytes(net, 2 * SEQ)
    monkeypatch.setattr(gr, "limit_bytes", lambda device, local_ranks: 10_000.0 + extra)
    cuda = torch.device("cuda")
    for forward_end, peak, plain in [(9_000.0, 9_500.0, True), (11_000.0, 9_500.0, False),
                                     (1_000.0, 10_000.0 + extra, True), (1_000.0, 10_001.0 + extra, False)]:
        rec = gr.Recompute("auto", net, lambda v: v)
        rec._decide(2 * SEQ, cuda, forward_end, peak)
        (d,) = rec.decisions
        assert d["plain"] is plain and d["need_bytes"] == max(peak, forward_end + extra)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_auto_reads_the_forwards_end_and_the_peak_and_runs_the_next_step_plainly():
    net = _checkpointed_model().cuda()
    rec = gr.Recompute("auto", net, lambda v: v)
    x = torch.randint(0, 48, (2, SEQ), device="cuda")
    for step in range(2):
        torch.cuda.reset_peak_memory_stats()
        with rec.scope([{"input_ids": x, "labels": x}]):
            assert bool(gr.checkpointed_layers(net)) is (step == 0)
            torch.autograd.grad(net(input_ids=x, labels=x).loss, list(net.parameters()))
    (d,) = rec.decisions
    assert d["plain"] is True and d["device"] == "cuda"
    assert 0 < d["forward_end_bytes"] <= d["peak_bytes"] <= d["need_bytes"] < d["limit_bytes"]
    assert rec.steps == {"recomputed": 1, "plain": 1}


def test_a_torch_that_cannot_say_the_gpu_cap_leaves_the_limit_unknown(monkeypatch):
    """Without ``get_per_process_memory_fraction`` a ``--gpu-mem-cap`` would go unseen: no limit, so
    ``auto`` keeps recomputing rather than count the whole device."""
    monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction", raising=False)
    assert gr.limit_bytes(torch.device("cuda"), 1) is None
    net = _checkpointed_model()
    rec = gr.Recompute("auto", net, lambda v: v)
    monkeypatch.setattr(gr, "extra_activation_bytes", lambda module, tokens: 1.0)
    rec._decide(2 * SEQ, torch.device("cuda"), 1.0, 1.0)
    assert rec.decisions[0]["plain"] is False and rec.decisions[0]["limit_bytes"] is None
