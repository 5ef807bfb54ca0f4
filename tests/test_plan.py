"""The memory planner: sizes, flags, model counts, the arithmetic against DeepSpeed and autograd, the pick."""
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ds_hybrid.arguments import InputError, parse_size, resolve_config
from ds_hybrid.memory import planner as pl
from ds_hybrid.models import build_model, count_parameters

GB, GiB = 10 ** 9, 2 ** 30
VELOCITY_INT8 = pl.VELOCITY_BYTES["int8"]


# ------------------------------------------------------------ sizes and flags
@pytest.mark.parametrize("text, expected", [
    ("24GB", 24 * GB), ("24GiB", 24 * GiB), ("24G", 24 * GiB), ("500G", 500 * GiB), ("1.5TB", 1.5e12),
    ("512MiB", 512 * 2 ** 20), ("128 gb", 128 * GB), ("25769803776", 25769803776), (1024, 1024), ("0", 0)])
def test_parse_size(text, expected):
    assert parse_size(text, "--gpu-mem") == int(expected)


@pytest.mark.parametrize("text", ["24XB", "GB", "", "-3GB", "24 G B", "nan"])
def test_parse_size_errors_name_the_flag(text):
    with pytest.raises(InputError, match="--cpu-mem"):
        parse_size(text, "--cpu-mem")


@pytest.mark.parametrize("argv, flag", [
    (["--model", "gpt2-tiny", "--gpu-mem", "lots", "--cpu-mem", "64GB"], "--gpu-mem"),
    (["--model", "gpt2-tiny", "--gpu-mem", "24GB", "--cpu-mem", "64XB"], "--cpu-mem"),
    (["--model", "gpt2-tiny", "--gpu-mem", "24GB", "--cpu-mem", "64GB", "--nvme", "huge"], "--nvme"),
    (["--gpu-mem", "24GB", "--cpu-mem", "64GB"], "--model"),
    (["--model", "gpt2-tiny", "--cpu-mem", "64GB"], "--gpu-mem"),
    (["--model", "gpt2-tiny", "--gpu-mem", "24GB"], "--cpu-mem"),
    (["--model", "no-such-model", "--gpu-mem", "24GB", "--cpu-mem", "64GB"], "--model"),
    (["--model", "gpt2-tiny", "--gpu-mem", "24GB", "--cpu-mem", "64GB", "--gpus", "0"], "--gpus"),
    (["--model", "gpt2-tiny", "--gpu-mem", "24GB", "--cpu-mem", "64GB", "--seq-len", "4096"], "--seq-len"),
    (["--model", "gpt2-tiny", "--gpu-mem", "24GB", "--cpu-mem", "64GB", "--presets", "nope"], "--presets"),
])
def test_cli_errors_name_the_flag(argv, flag):
    with pytest.raises(SystemExit, match=flag):
        pl.main(argv)


# ------------------------------------------------------------ the model
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_meta_device_counts_match_a_real_model(name):
    shape = pl.model_shape(name, vocab_size=256)
    assert shape.params == count_parameters(build_model(name, vocab_size=256))


@pytest.mark.parametrize("name, billions", [("llama-1b", 1.10), ("llama-7b", 6.74), ("llama-50b", 48.8)])
def test_big_shapes_have_their_advertised_size(name, billions):
    shape = pl.model_shape(name)
    assert shape.params / 1e9 == pytest.approx(billions, rel=0.01)
    assert shape.family == "llama" and shape.vocab == 32000


# ------------------------------------------------------------ the arithmetic
def saved_activation_bytes(name, batch, seq, checkpointing=False):
    """What autograd really keeps for backward after one forward (parameters excluded)."""
    torch.manual_seed(0)
    model = build_model(name, vocab_size=256, seq_len=seq)
    model.train()
    if checkpointing:
        model.activation_checkpointing_enable()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    ids = torch.randint(0, 256, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids).loss
    return sum(seen.values())


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_formula_matches_autograd(name, checkpointing):
    shape = pl.model_shape(name, vocab_size=256)
    act = pl.activation_bytes(shape, seq_len=64, micro_batch=4, lp_bytes=4, checkpointing=checkpointing)
    measured = saved_activation_bytes(name, 4, 64, checkpointing)
    assert act["layers"] + act["head"] == pytest.approx(measured, rel=0.05)


def spec(stage=2, opt="none", param="none", bf16=True, ac=False, **hybrid):
    cfg, _ = resolve_config("tiny-cpu")
    zero = {"stage": stage}
    if opt != "none":
        zero["offload_optimizer"] = {"device": opt, "nvme_path": "/local_nvme"}
    if param != "none":
        zero["offload_param"] = {"device": param, "nvme_path": "/local_nvme"}
    cfg["zero_optimization"] = zero
    cfg["bf16"] = {"enabled": bf16}
    if ac:
        cfg["activation_checkpointing"] = {}
    cfg["hybrid_predict"].update(hybrid)
    return pl.preset_spec(cfg, f"z{stage}-{opt}-{param}")


@pytest.fixture(scope="module")
def llama7b():
    return pl.model_shape("llama-7b")


def test_deepspeed_estimators_give_the_gpu_states_and_its_counted_buffers_the_host_ones(llama7b):
    """GPU: DeepSpeed's estimators. Host under offload_optimizer: cpu: DeepSpeed's buffers as
    counted (18 bytes a parameter of the partition, 20 with ZeRO 3's offload_param), its
    estimator's figure (with the 1.5x) named beside them."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    P = llama7b.params
    items = pl.model_states(llama7b, spec(2, "cpu"), gpus=2, nodes=1)
    cpu, gpu = estimate_zero2_model_states_mem_needs(P, 2, 1, cpu_offload=True)
    assert [(i.where, i.bytes) for i in items] == [("gpu", gpu), ("cpu", 18 * P)]
    assert items[1].source == "deepspeed 0.19.8 (counted)" and pl.fmt_bytes(cpu) in items[1].what
    items = pl.model_states(llama7b, spec(3, "cpu", "cpu"), gpus=1, nodes=1)
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(P, llama7b.largest_module_params, 1, 1,
                                                        cpu_offload=True, cpu_offload_params=True, zero_init=False)
    assert [i.bytes for i in items] == [gpu, 20 * P]
    assert [i.bytes for i in pl.model_states(llama7b, spec(3, "cpu"), gpus=1, nodes=1)][1] == 18 * P
    # 8 GPUs a node, 2 nodes, built under zero.Init: each rank's partition, 8 of them in a node's memory
    assert pl.model_states(llama7b, spec(3, "cpu", "cpu"), gpus=8, nodes=2, zero_init=True)[1].bytes == \
        pytest.approx(20 * P * 8 / 16)
    # built whole in each of 8 processes first: that build (x1.5, as DeepSpeed counts it) is the peak
    assert pl.model_states(llama7b, spec(2, "cpu"), gpus=8, nodes=1)[1].bytes == pytest.approx(4 * P * 8 * 1.5)


def test_the_counted_host_bytes_are_the_measured_ones():
    """The planner's bytes per parameter are what benchmarks/offload_host_layout.py counted
    (docs/results/offload-host-layout.json): ZeRO 2 and ZeRO 3 without offload_param 18, with it 20,
    at one micro-batch a step; at 16, ZeRO 2's accumulation buffers add the 16-bit weights' 2."""
    rows = json.loads((Path(__file__).resolve().parents[1] / "docs/results/offload-host-layout.json").read_text())["rows"]
    counted = {(r["layout"], r.get("gas", 1)): r["summary"]["host_bytes_per_param"] for r in rows if not r["hybrid"]}
    one = {"z2-offload": pl.DS_OFFLOAD_HOST_BYTES, "z3-offload": pl.DS_OFFLOAD_HOST_BYTES,
           "z3-offload-param": pl.DS_OFFLOAD_HOST_BYTES + pl.DS_OFFLOAD_PARAM_HOST_BYTES}
    assert {k: v for (k, gas), v in counted.items() if gas == 1} == one
    assert {k: v for (k, gas), v in counted.items() if gas == 16} == {**one, "z2-offload": one["z2-offload"] + 2}


def test_zero_infinitys_host_and_drive_bytes_are_the_counted_ones(llama7b):
    """Under offload_optimizer: nvme the planner counts what benchmarks/offload_host_layout.py
    counted (docs/results/offload-host-layout-nvme.json): in host memory the 16-bit gradient
    partitions and the 16-bit weights (2 + 2 bytes a parameter, whether the weights are on NVMe
    too, below max_in_cpu, or not) and buffer_count fp32 swap buffers of the largest sub-group;
    on the drive the masters, moments and fp32 gradients (16 bytes a parameter), 2 more with the
    weights there. At llama-7b on 7b-24gb-nvme, with the setup's one sub-group gradient."""
    saved = json.loads((Path(__file__).resolve().parents[1] / "docs/results/offload-host-layout-nvme.json").read_text())
    plain = {r["layout"]: r for r in saved["rows"] if not r["hybrid"]}
    opt, both = plain["z3-nvme-optimizer"], plain["z3-nvme"]
    assert opt["summary"]["host_bytes_per_param"] == both["summary"]["host_bytes_per_param"] == 2 + 2
    assert opt["summary"]["optimizer_swap_bytes_over_largest_sub_group"] == 4 * opt["optimizer_buffer_count"]
    assert len(opt["sub_group_numels"]) > 1   # (several sub-groups: the buffers follow the largest)
    assert opt["summary"]["nvme_bytes_per_param"] == pytest.approx(16, abs=0.05)
    assert both["summary"]["nvme_bytes_per_param"] == pytest.approx(16 + 2, abs=0.1)
    (preset,) = pl.load_presets(["7b-24gb-nvme"])
    P = llama7b.params
    largest = max(n for g in llama7b.param_groups for n in pl._sub_groups(g, preset.sub_group_size))
    items = pl.model_states(llama7b, preset, 1, 1, zero_init=True)
    assert [i.bytes for i in items if i.where == "nvme"] == [16 * P]
    assert [i.bytes for i in items if i.where == "cpu"] == [(2 + 2) * P + 4 * largest * (preset.optimizer_buffer_count + 1)]
    # the 16-bit gradient partitions stay in host memory with the weights on NVMe too
    (fifty,) = pl.load_presets(["50b-24gb-nvme"])
    cpu = [i.bytes for i in pl.model_states(llama7b, fifty, 1, 1, zero_init=True) if i.where == "cpu"]
    assert cpu[0] > 2 * P + 2 * fifty.param_max_in_cpu


def test_the_predict_steps_host_buffer_for_partitions_on_nvme_follows_deepspeeds_max_in_cpu():
    """With offload_param: nvme the drift step on the device path reads each swapped sub-group's
    16-bit partition into one host buffer as long as the largest (zero_access.SwappedShards, either direction):
    the planner counts it for the sub-groups DeepSpeed 0.19.8 leaves no host slice (each param
    group gets what is left of max_in_cpu; a sub-group keeps a slice only where it ends inside it)."""
    shape = replace(pl.model_shape("llama-tiny"), group_tensors=((300, 300, 500), (400, 400)))
    base = replace(spec(3, "nvme", "nvme"), sub_group_size=500, param_max_in_cpu=0)
    # sub-groups: (600, 500) and (800): all swapped with max_in_cpu 0
    assert pl._sub_groups([300, 300, 500], 500) == [600, 500] and pl.swapped_sub_groups(shape, base) == [600, 500, 800]
    # the first group's room 700 holds the first sub-group (it ends at 600), not the second (at 1100)
    assert pl.swapped_sub_groups(shape, replace(base, param_max_in_cpu=700)) == [500, 800]
    # the first group whole (1100), the second gets 1300 - 1100 = 200: its 800 is swapped
    assert pl.swapped_sub_groups(shape, replace(base, param_max_in_cpu=1300)) == [800]
    assert pl.swapped_sub_groups(shape, replace(base, param_max_in_cpu=1900)) == []
    # two ranks: sub-groups of each rank's partition (150 + 150 + 250 is one: 550)
    assert pl.swapped_sub_groups(shape, base, W=2) == [550, 400]
    assert pl.swapped_sub_groups(shape, replace(base, offload_param="cpu")) == []

    (fifty,) = pl.load_presets(["50b-24gb-nvme"])
    big = pl.model_shape("llama-50b")
    est = pl.estimate(big, fifty, seq_len=2048)
    (buf,) = [i for i in est.items if "partition on NVMe" in i.what]
    largest = max(n for g in big.param_groups for n in pl._sub_groups(g, fifty.sub_group_size))
    # (the final norm and the untied 32000 x 8192 head close one sub-group)
    assert buf.where == "cpu" and buf.bytes == 2 * largest == 2 * (8192 + 32000 * 8192)
    # none without the hybrid, on the host path (its snapshot instead), or with the weights in host memory
    for other in (replace(fifty, hybrid_enabled=False), replace(fifty, offload_predict="host"),
                  replace(fifty, offload_param="cpu")):
        assert not [i for i in pl.estimate(big, other, seq_len=2048).items if "partition on NVMe" in i.what]


def test_a_freed_velocity_copy_counts_only_beyond_a_real_steps_activations(llama7b):
    """memory.free_velocity_copy (7b-24gb-z2): the GPU copy of the int8 velocity is counted only
    where it exceeds what a real step's buckets and activations need, since the two never
    coexist; kept, it is counted whole."""
    import dataclasses
    (free,) = pl.load_presets(["7b-24gb-z2"])
    assert free.free_velocity_copy and free.stage == 2 and free.offload_optimizer == "cpu"
    kept = dataclasses.replace(free, free_velocity_copy=False)
    a, b = (pl.estimate(llama7b, s, seq_len=2048) for s in (free, kept))
    copy_a = [i for i in a.items if "velocity copy" in i.what]
    copy_b = [i for i in b.items if "velocity copy" in i.what]
    real = sum(i.bytes for i in a.items if i.what.startswith(("gradient reduction bucket", "activations:",
                                                                "backward working set")))
    assert copy_b[0].bytes == pytest.approx(VELOCITY_INT8 * llama7b.params)
    assert copy_a[0].bytes == pytest.approx(copy_b[0].bytes - real)
    assert a.gpu_bytes < b.gpu_bytes and a.cpu_bytes == b.cpu_bytes
    # ZeRO 3 with offload_param: the shards are in host memory, so no GPU copy is counted at all
    (z3,) = pl.load_presets(["7b-24gb"])
    assert not [i for i in pl.estimate(llama7b, z3, seq_len=2048).items if "velocity copy" in i.what]


def test_7b_fits_a_24gb_gpu_and_a_125gib_host_only_with_zero_2():
    """The counted host bytes: 7b-24gb (ZeRO 3, parameters offloaded too) needs more than the
    lent GPU machine's 125 GiB; 7b-24gb-z2 fits it, the weights and a Predict run's velocity copy
    on the GPU, where torch pins its big blocks at their own size (--pinned-round-mb 64 on a torch
    that can). Where torch rounds every pinned block up to a power of two (2.11, on the lent
    machine) its pinned buffers do not fit, and with DeepSpeed's pinning off they do."""
    shape = pl.model_shape("llama-7b")
    presets = pl.load_presets(["7b-24gb", "7b-24gb-z2"])
    plan = pl.make_plan(shape, presets, 24 * GB, 125 * GiB, seq_len=2048, pinned_round_mb=64)
    fits = {e.preset: e.fits for e in plan.estimates}
    assert fits == {"7b-24gb": False, "7b-24gb-z2": True} and plan.picked == "7b-24gb-z2"
    rounded = pl.make_plan(shape, presets, 24 * GB, 125 * GiB, seq_len=2048, pinned_round_mb=0)
    assert rounded.picked is None
    z2 = next(p for p in presets if p.name == "7b-24gb-z2")
    pageable = replace(z2, pin_memory=False)
    assert pl.make_plan(shape, [pageable], 24 * GB, 125 * GiB, seq_len=2048, pinned_round_mb=0).picked == z2.name


def test_our_counting_agrees_with_deepspeeds_formula_where_both_apply(llama7b):
    # ZeRO 2, 16-bit, no offload: DeepSpeed's 2P + 18P/N; the fp32 branch counts the same terms at 4 bytes.
    P = llama7b.params
    ds_gpu = pl.model_states(llama7b, spec(2), gpus=4, nodes=1)[0].bytes
    assert ds_gpu == 2 * P + int(18 * P / 4)
    fp32 = pl.model_states(llama7b, spec(2, bf16=False), gpus=4, nodes=1)[0].bytes
    assert fp32 == pytest.approx(4 * P + (4 + 4 + 4 + 8) * P / 4)


@pytest.mark.parametrize("gpus", [1, 8])
def test_more_offload_means_less_gpu_and_more_cpu_memory(llama7b, gpus):
    ladder = [spec(3), spec(3, "cpu"), spec(3, "cpu", "cpu"), spec(3, "nvme", "nvme")]
    ests = [pl.estimate(llama7b, s, gpus=gpus, seq_len=2048, micro_batch=1) for s in ladder]
    gpu = [e.gpu_bytes for e in ests]
    assert gpu[0] > gpu[1] > gpu[2] >= gpu[3], [g / GiB for g in gpu]
    # Host memory never shrinks with more offload; building the fp32 model in each of 8 processes
    # (no zero.Init) can outweigh the offloaded states, as in DeepSpeed's estimator. (Apart from
    # the rounding of the hybrid's pinned velocity, which is pinned only where the 16-bit shards
    # are on the GPU: not with offload_param.)
    unpinned = [e.cpu_bytes - sum(i.bytes for i in e.items if i.what.startswith("pinned-memory rounding"))
                for e in ests]
    assert unpinned[2] >= unpinned[1] > unpinned[0]
    zi = [pl.estimate(llama7b, s, gpus=gpus, seq_len=2048, micro_batch=1, zero_init=True) for s in ladder[:3]]
    assert zi[2].cpu_bytes > zi[1].cpu_bytes > zi[0].cpu_bytes
    assert ests[-1].nvme_bytes > 0 and all(e.nvme_bytes == 0 for e in ests[:-1])
    assert ests[-1].cpu_bytes < ests[2].cpu_bytes   # NVMe takes the states out of host memory
    z2 = [pl.estimate(llama7b, s, gpus=gpus, seq_len=2048, micro_batch=1) for s in (spec(2), spec(2, "cpu"))]
    assert z2[0].gpu_bytes > z2[1].gpu_bytes and z2[0].cpu_bytes < z2[1].cpu_bytes
    # More partitioning: on 8 GPUs ZeRO 3 needs less per GPU than ZeRO 2 (on 1 GPU there is nothing to split).
    if gpus == 8:
        assert ests[0].gpu_bytes < z2[0].gpu_bytes


def test_activations_scale_with_the_batch_and_shrink_with_checkpointing(llama7b):
    a1 = pl.activation_bytes(llama7b, 2048, 1, 2, False)
    a4 = pl.activation_bytes(llama7b, 2048, 4, 2, False)
    assert a4["layers"] == pytest.approx(4 * a1["layers"])
    ac = pl.activation_bytes(llama7b, 2048, 1, 2, True)
    assert ac["layers"] * 10 < a1["layers"]
    assert pl.estimate(llama7b, spec(3, "cpu", "cpu", ac=True), seq_len=2048).gpu_bytes < \
        pl.estimate(llama7b, spec(3, "cpu", "cpu"), seq_len=2048).gpu_bytes


def test_the_snapshot_is_four_bytes_per_parameter_of_the_partition_where_configured(llama7b):
    P = llama7b.params
    on_gpu = pl.estimate(llama7b, spec(3), gpus=8, seq_len=1024, micro_batch=1)
    assert on_gpu.snapshot_where == "gpu" and on_gpu.snapshot_bytes == pytest.approx(4 * P / 8)
    on_cpu = pl.estimate(llama7b, spec(3, snapshot_device="cpu"), gpus=8, seq_len=1024, micro_batch=1)
    assert on_cpu.snapshot_where == "cpu" and on_cpu.snapshot_bytes == pytest.approx(4 * P)  # 8 ranks per node
    assert on_gpu.gpu_bytes - on_cpu.gpu_bytes == pytest.approx(4 * P / 8 * (1 + pl.GPU_FRAGMENTATION))
    off = pl.estimate(llama7b, spec(3, enabled=False), gpus=8, seq_len=1024, micro_batch=1)
    assert off.snapshot_bytes == 0 and off.gpu_bytes < on_gpu.gpu_bytes


def test_more_gpus_means_less_memory_per_gpu(llama7b):
    one = pl.estimate(llama7b, spec(3), gpus=1, seq_len=1024, micro_batch=1)
    eight = pl.estimate(llama7b, spec(3), gpus=8, seq_len=1024, micro_batch=1)
    assert eight.gpu_bytes < one.gpu_bytes / 4


# ------------------------------------------------------------ the plan
def test_plan_picks_the_fastest_preset_that_fits(tmp_path, capsys):
    plan = pl.main(["--model", "llama-1b", "--gpu-mem", "16GB", "--cpu-mem", "64GB", "--json",
                    str(tmp_path / "plan.json")])
    assert plan.picked == "1b-16gb"
    fits = {e.preset: e.fits for e in plan.estimates}
    assert not fits["tiny-cpu"] and not fits["gpt2-124m"]      # ZeRO 1 without offload: not on 16 GB
    assert not fits["50b-24gb-nvme"]                            # no --nvme
    printed = capsys.readouterr().out
    assert "| 1b-16gb |" in printed and "picked: 1b-16gb" in printed
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["picked"] == "1b-16gb" and len(saved["estimates"]) == len(plan.estimates)


def test_plan_for_7b_on_a_24gb_gpu_needs_nvme_or_more_host_memory():
    shape = pl.model_shape("llama-7b")
    presets = pl.load_presets()
    assert pl.make_plan(shape, presets, 24 * GB, 128 * GB).picked is None
    # with NVMe, the optimizer on it and the 16-bit weights in host memory (less offload than 50b-24gb-nvme's)
    assert pl.make_plan(shape, presets, 24 * GB, 128 * GB, nvme=500 * GB).picked == "7b-24gb-nvme"
    assert pl.make_plan(shape, [p for p in presets if p.name != "7b-24gb-nvme"], 24 * GB, 128 * GB,
                        nvme=500 * GB).picked == "50b-24gb-nvme"
    # a 64 GiB host: ZeRO-Infinity or nothing
    assert pl.make_plan(shape, presets, 24 * GB, 64 * GiB).picked is None
    assert pl.make_plan(shape, presets, 24 * GB, 64 * GiB, nvme=256 * GB).picked == "7b-24gb-nvme"
    assert pl.make_plan(shape, presets, 24 * GB, 512 * GB).picked == "7b-24gb-z2"
    assert pl.make_plan(shape, [p for p in presets if p.name != "7b-24gb-z2"], 24 * GB, 512 * GB).picked == "7b-24gb"


def test_plan_with_room_to_spare_picks_no_offload():
    shape = pl.model_shape("gpt2-tiny")
    plan = pl.make_plan(shape, pl.load_presets(), 80 * GB, 512 * GB, nvme=2 * 10 ** 12)
    assert plan.picked == "gpt2-124m"   # ZeRO 1 bf16: nothing offloaded, 16-bit before fp32
    assert all(e.fits for e in plan.estimates)


# ------------------------------------------------------------ against a measured run
def test_cpu_estimate_is_within_20_percent_of_a_measured_run(tmp_path):
    """gpt2-tiny trained 4 steps on DeepSpeed's CPU accelerator: estimate vs peak RSS above the
    pre-model baseline (the engine-overhead constant was measured on gpt2-test, not this model)."""
    (row,) = pl.validate_cpu(["gpt2-tiny"], steps=4, seq_len=128, micro_batch=8, out_dir=tmp_path)
    assert 0.8 <= row["ratio"] <= 1.2, row
    assert row["measured_bytes"] > 50 * 2 ** 20


def test_device_side_predict_drops_the_host_snapshot_and_adds_a_gpu_velocity_copy():
    """Under offload_optimizer on a GPU the offload presets take the device path
    (memory.offload_predict auto) with the fold read back from the optimizer state: no fp32
    snapshot in host memory, and the int8 velocity's copy beside the 16-bit shards on the GPU.
    On the CPU accelerator (host path) and with fold_source: snapshot the snapshot stays."""
    import dataclasses
    shape = pl.model_shape("llama-1b")
    (one,) = pl.load_presets(["1b-16gb"])
    gpu = pl.estimate(shape, one, accelerator="cuda")
    names = [i.what for i in gpu.items]
    assert gpu.snapshot_bytes == 0 and not any("snapshot" in n for n in names)
    copy = [i for i in gpu.items if "copy beside the 16-bit shards" in i.what]
    host_v = [i for i in gpu.items if i.what.startswith("drift velocity (")]
    assert len(copy) == 1 and copy[0].where == "gpu" and copy[0].bytes == pytest.approx(host_v[0].bytes)
    cpu = pl.estimate(shape, one, accelerator="cpu")
    assert cpu.snapshot_bytes > 0 and not any("copy beside" in i.what for i in cpu.items)
    kept = pl.estimate(shape, dataclasses.replace(one, fold_source="snapshot"), accelerator="cuda")
    assert kept.snapshot_bytes == cpu.snapshot_bytes and kept.cpu_bytes > gpu.cpu_bytes


def test_gradient_predict_on_the_offload_preset_counts_its_moments_and_gradient_on_the_gpu():
    """predictor.direction: gradient on 1b-16gb (ZeRO 2, offload, bf16) beside a GPU: the device
    path (no snapshot), its bf16 moment copies (2 x 2 bytes a parameter) and the private gradient
    (16-bit, plus an fp32 sum with the preset's accumulation) on the GPU, no drift velocity; on the
    host path (offload_predict: host) the snapshot and an fp32 first moment in host memory instead."""
    import dataclasses
    shape = pl.model_shape("llama-1b")
    (one,) = pl.load_presets(["1b-16gb"])
    grad = dataclasses.replace(one, gradient=True, velocity_bytes_per_value=0.0)
    P = shape.params
    est = pl.estimate(shape, grad, accelerator="cuda")
    items = {i.what: i for i in est.items}
    moments = [i for n, i in items.items() if "Adam moments beside the 16-bit shards" in n]
    own = [i for n, i in items.items() if n.startswith("gradient Predict step's own gradient")]
    assert est.snapshot_bytes == 0 and len(moments) == 1 and moments[0].where == "gpu"
    assert moments[0].bytes == pytest.approx(4 * P)
    assert own[0].where == "gpu" and own[0].bytes == pytest.approx((2 + 2) * P)   # gradient_accumulation 8: a bf16 sum
    assert not any("velocity" in n for n in items)
    host = pl.estimate(shape, dataclasses.replace(grad, offload_predict="host"), accelerator="cuda")
    first = [i for i in host.items if i.what.startswith("gradient Predict run's first moment")]
    assert host.snapshot_bytes > 0 and first[0].where == "cpu" and first[0].bytes == pytest.approx(4 * P)
    assert host.gpu_bytes < est.gpu_bytes and host.cpu_bytes > est.cpu_bytes
    # the section parses into the spec
    ds, _ = resolve_config("1b-16gb")
    ds["hybrid_predict"]["predictor"]["direction"] = "gradient"
    spec = pl.preset_spec(ds, "1b-grad")
    assert spec.gradient and spec.velocity_bytes_per_value == 0.0 and spec.device_predict("cuda")


def test_a_compact_gradient_state_holds_no_whole_gradient_and_a_byte_or_half_a_parameter_of_state():
    """memory.gradient_state_dtype: int8-factored / int4-factored on 7b-24gb-z2 beside a GPU (``--set``
    as ds-hybrid train takes it): one parameter's gradient at a time, the run's state 1 or 0.5 bytes a
    parameter and a scale per 256 values, on the GPU; at 7B under 24 GB the 4-bit state fits the cap
    and the int8 one does not (the planner's assumed 10% fragmentation and 1 GiB of context)."""
    shape = pl.model_shape("llama-7b", vocab_size=256)
    P = shape.params
    fits = {}
    for dtype, per in (("int8-factored", 1.0), ("int4-factored", 0.5)):
        (spec,) = pl.load_presets(["7b-24gb-z2"], ["predictor.direction=gradient",
                                                   f"memory.gradient_state_dtype={dtype}"])
        assert spec.name == "7b-24gb-z2+set" and spec.compact_gradient_state and spec.device_predict("cuda")
        est = pl.estimate(shape, spec, accelerator="cuda", seq_len=2048)
        items = {i.what: i for i in est.items}
        state = [i for n, i in items.items() if "first moment and factored second" in n]
        own = [i for n, i in items.items() if n.startswith("gradient Predict step's own gradient")]
        assert len(state) == 1 and state[0].where == "gpu" and state[0].bytes == pytest.approx((per + 4 / 256) * P)
        assert len(own) == 1 and own[0].bytes == pytest.approx(2 * shape.largest_module_params)
        assert not any("Adam moments beside" in n or "velocity" in n for n in items)
        fits[dtype] = pl.make_plan(shape, [spec], 24 * GB, 128 * GiB, seq_len=2048, pinned_round_mb=64).picked
    assert fits == {"int8-factored": None, "int4-factored": "7b-24gb-z2+set"}
    with pytest.raises(pl.PlanError, match="7b-24gb-z2: --set: hybrid_predict.memory.gradient_state_dtype"):
        pl.load_presets(["7b-24gb-z2"], ["memory.gradient_state_dtype=int9"])


def test_a_compact_state_the_engine_refuses_fits_nothing_and_the_plan_says_why():
    """The planner marks what the engine would refuse at its start (config.compact_state_refusal, the
    engine's own rule), whatever its bytes: the 4-bit state that fits 7B under 24 GB, on the host path,
    is not picked, and the reason names the keys; with the CPU step behind the run it is (the cover
    works in the compact state)."""
    shape = pl.model_shape("llama-7b", vocab_size=256)
    picked = {}
    for change in ("memory.offload_predict=host", "memory.cpu_step_behind=true"):
        (spec,) = pl.load_presets(["7b-24gb-z2"], ["predictor.direction=gradient",
                                                   "memory.gradient_state_dtype=int4-factored", change])
        plan = pl.make_plan(shape, [spec], 24 * GB, 1024 * GiB, seq_len=2048, pinned_round_mb=64)
        (est,) = plan.estimates
        picked[change] = plan.picked
        if change.startswith("memory.offload_predict"):
            assert not est.fits
            assert any(r.startswith("the engine refuses it: hybrid_predict.memory.gradient_state_dtype: int4-factored, "
                                    "but ") and "resolved to host" in r for r in est.reasons)
    assert picked == {"memory.offload_predict=host": None, "memory.cpu_step_behind=true": "7b-24gb-z2+set"}


def test_the_gradient_direction_fits_every_preset_with_its_state_where_the_engine_keeps_it(tmp_path, capsys):
    """``ds-hybrid plan --set predictor.direction=gradient`` over all presets: 50b-24gb-nvme (the
    16-bit weights on NVMe too) is no longer refused; at llama-50b its gradient step on the device
    path counts the run's moments beside the partitions in host memory and the one host buffer
    each partition on NVMe passes through, as the drift step does, and in 4 bits it needs less
    host memory than the drift step's int8 velocity."""
    plan = pl.main(["--model", "llama-7b", "--gpu-mem", "24GB", "--cpu-mem", "1024GB", "--nvme", "2TB",
                    "--set", "predictor.direction=gradient", "--json", str(tmp_path / "plan.json")])
    by_name = {e.preset: e for e in plan.estimates}
    assert set(by_name) == {f"{p.name}+set" for p in pl.load_presets()}
    assert by_name["50b-24gb-nvme+set"].fits and by_name["50b-24gb-nvme+set"].reasons == []
    assert plan.picked is not None and "| 50b-24gb-nvme+set |" in capsys.readouterr().out
    big = pl.model_shape("llama-50b")
    (drift,) = pl.load_presets(["50b-24gb-nvme"])
    (grad,) = pl.load_presets(["50b-24gb-nvme"], ["predictor.direction=gradient",
                                                  "memory.gradient_state_dtype=int4-factored"])
    assert grad.gradient and grad.device_predict("cuda") and not grad.shards_on_gpu("cuda")
    d, g = (pl.estimate(big, p, seq_len=2048, zero_init=True) for p in (drift, grad))
    (moments,) = [i for i in g.items if "compact first moment" in i.what]
    assert moments.where == "cpu" and [i.bytes for i in g.items if "partition on NVMe" in i.what] == \
        [i.bytes for i in d.items if "partition on NVMe" in i.what]
    assert g.cpu_bytes < d.cpu_bytes and g.snapshot_bytes == d.snapshot_bytes == 0


def test_gradient_predict_on_zero_3_holds_no_whole_gradient_and_keeps_its_state_beside_the_host_shards():
    """predictor.direction: gradient on 7b-24gb (ZeRO 3, optimizer and parameters offloaded to the
    host): the private gradient on the GPU is one parameter's at a time, and this rank's share of
    it is summed in host memory beside the 16-bit partitions, where the run's first moment is
    copied (fp32: the second moment is read where it lies); no snapshot on the device path."""
    import dataclasses
    shape = pl.model_shape("llama-7b")
    (one,) = pl.load_presets(["7b-24gb"])
    grad = dataclasses.replace(one, gradient=True, velocity_bytes_per_value=0.0)
    P = shape.params
    est = pl.estimate(shape, grad, accelerator="cuda")
    items = {i.what: i for i in est.items}
    own = [i for n, i in items.items() if n.startswith("gradient Predict step's own gradient")]
    share = [i for n, i in items.items() if n.startswith("gradient Predict step's gradient share")]
    moments = [i for n, i in items.items() if "Adam moments beside the 16-bit shards" in n]
    assert own[0].where == "gpu" and own[0].bytes == pytest.approx(2 * shape.largest_module_params)
    assert share[0].where == "cpu" and share[0].bytes == pytest.approx(4 * P)
    assert moments[0].where == "cpu" and moments[0].bytes == pytest.approx(4 * P)
    assert est.snapshot_bytes == 0 and grad.device_predict("cuda")
    host = pl.estimate(shape, dataclasses.replace(grad, offload_predict="host"), accelerator="cuda")
    assert host.snapshot_bytes == pytest.approx(4 * P) and host.cpu_bytes > est.cpu_bytes


def _host_layout_module():
    """benchmarks/offload_host_layout.py, imported from its file (benchmarks/ is not a package)."""
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "offload_host_layout.py"
    found = importlib.util.spec_from_file_location("offload_host_layout", path)
    mod = importlib.util.module_from_spec(found)
    found.loader.exec_module(mod)
    return mod


def test_the_host_layout_benchmark_counts_deepspeeds_buffers(tmp_path):
    """benchmarks/offload_host_layout.py on a one-layer Llama: ZeRO 3 with the parameters offloaded
    keeps 20 bytes a parameter in host memory, the hybrid adds its int8 velocity (no snapshot on
    the device path), and the JSON holds the table."""
    mod = _host_layout_module()
    out = tmp_path / "layout.json"
    assert mod.main(["--layouts", "z3-offload-param", "--hidden", "128", "--layers", "1", "--steps", "3",
                     "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    plain, hybrid = (r["summary"] for r in saved["rows"])
    assert plain["host_bytes_per_param"] == hybrid["host_bytes_per_param"] == 20
    assert plain["hybrid_host_bytes_per_param"] == 0
    assert hybrid["hybrid_host_bytes_per_param"] == pytest.approx(VELOCITY_INT8, rel=0.01)
    assert "| z3-offload-param | 1 | hybrid | 20.0 |" in saved["table"]


@pytest.mark.skipif(not __import__("engine_utils").aio_available(),
                    reason="DeepSpeed's async_io op cannot be built here (libaio missing)")
def test_the_host_layout_benchmark_counts_zero_infinitys_buffers(tmp_path):
    """benchmarks/offload_host_layout.py on ZeRO-Infinity's layout (optimizer on NVMe, 16-bit
    weights in host memory), a two-layer Llama in sub-groups of 300K elements: 4 bytes a parameter
    in host memory (16-bit gradient partitions and weights), 4 fp32 swap buffers of the largest
    sub-group, no sub-group's gradient held after the steps, about 16 bytes a parameter on the
    drive (the sub-groups under 1 MiB stay in memory), and its swap folder removed."""
    mod = _host_layout_module()
    out = tmp_path / "layout.json"
    assert mod.main(["--layouts", "z3-nvme-optimizer", "--no-hybrid", "--hidden", "128", "--layers", "2",
                     "--steps", "2", "--sub-group-size", "300000", "--swap-dir", str(tmp_path),
                     "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    s = row["summary"]
    assert s["host_bytes_per_param"] == 4.0 and s["optimizer_swap_bytes_over_largest_sub_group"] == 16.0
    # (DeepSpeed rounds the buffers up to its I/O alignment, 256 fp32 values)
    assert s["swap_buffer_bytes"] == 16 * 256 * -(-s["largest_sub_group"] // 256) and len(row["sub_group_numels"]) > 1
    assert "fp32 gradient of one swapped sub-group (initialize_optimizer_states' gradient_buffer)" not in row["buffers"]
    assert 15 < s["nvme_bytes_per_param"] <= 16
    assert not list(tmp_path.glob("host-layout-swap-*"))


def test_zero2_offload_keeps_a_16bit_accumulation_buffer_per_parameter_with_accumulation(tmp_path):
    """With gradient_accumulation_steps > 1, ZeRO 2 under offload_optimizer: cpu keeps a 16-bit
    buffer per parameter tensor in host memory (DeepSpeed's accumulated_grads_in_cpu): 20 bytes
    a parameter counted, not 18; the planner counts the same 2 bytes a parameter."""
    mod = _host_layout_module()
    out = tmp_path / "layout.json"
    assert mod.main(["--layouts", "z2-offload", "--no-hybrid", "--gas", "1", "2", "--hidden", "128",
                     "--layers", "1", "--steps", "2", "--json", str(out)]) == 0
    one, two = json.loads(out.read_text())["rows"]
    key = "16-bit gradient accumulation per parameter (accumulated_grads_in_cpu)"
    assert (one["gas"], two["gas"]) == (1, 2) and key not in one["buffers"]
    assert two["buffers"][key] == 2 * two["params"]
    assert (one["summary"]["host_bytes_per_param"], two["summary"]["host_bytes_per_param"]) == (18.0, 20.0)
    shape = pl.model_shape("llama-7b")
    assert spec(2, "cpu").gradient_accumulation == 1
    assert not [i for i in pl.estimate(shape, spec(2, "cpu"), seq_len=2048).items if "accumulation buffer" in i.what]
    many = replace(spec(2, "cpu"), gradient_accumulation=16)
    (acc,) = [i for i in pl.estimate(shape, many, seq_len=2048).items if "accumulation buffer" in i.what]
    assert acc.where == "cpu" and acc.bytes == 2 * shape.params


def test_plan_for_run_checks_this_runs_estimate_against_the_machine(tmp_path):
    """ds-hybrid train's pre-flight: the estimate for its config and model, over the machine's GPU
    or host memory or not (on the CPU accelerator the host figure is per process, checked times
    the processes on the node); MemTotal read from /proc/meminfo, None where it cannot be."""
    ds, _ = resolve_config("7b-24gb-z2")
    fits = pl.plan_for_run(ds, "llama-7b", 2048, False, "cuda", 24 * GB, 125 * GiB, pinned_round_mb=64)
    assert fits.fits and fits.cpu_bytes == pytest.approx(117.9 * GiB, rel=0.01)   # the model as trained: vocab 256
    over = pl.plan_for_run(ds, "llama-7b", 2048, False, "cuda", 16 * GB, 100 * GiB)
    assert not over.fits and [r.split()[0] for r in over.reasons] == ["GPU", "CPU"]
    ds, _ = resolve_config("tiny-cpu")
    one = pl.plan_for_run(ds, "gpt2-tiny", 128, False, "cpu", None, None)
    assert one.fits and one.gpu_bytes == 0
    limit = one.cpu_bytes * 1.5   # one process fits, two do not
    assert pl.plan_for_run(ds, "gpt2-tiny", 128, False, "cpu", None, limit).fits
    assert not pl.plan_for_run(ds, "gpt2-tiny", 128, False, "cpu", None, limit, gpus=2).fits
    (tmp_path / "meminfo").write_text("MemTotal:       131072000 kB\nMemFree:  1 kB\n")
    assert pl.host_memory_bytes(tmp_path / "meminfo") == 131072000 * 1024
    assert pl.host_memory_bytes(tmp_path / "missing") is None
