"""offload="auto": the planner's choice at construction, logged with its reason."""
import json
import logging

import pytest
import torch

import tierstate as ts
from tierstate.placement import probe
from tierstate.placement.auto import choose_offload

# What ts.AdamW passes to choose_offload: the state keys its rule allocates.
ADAMW_KEYS = tuple(spec.name for spec in ts.AdamW.rule.state_specs(ts.AdamW.rule.defaults()))


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """This machine's real (quick) rates, measured once for the module (~11 s on 2 cores)."""
    return probe.run_probe([str(tmp_path_factory.mktemp("disk"))], quick=True)


@pytest.fixture
def profile(measured, tmp_path, monkeypatch):
    """A saved profile with this machine's real (quick) rates, where auto looks for it."""
    path = tmp_path / "hw.json"
    probe.save_profile(measured, path)  # writes it, changes nothing
    monkeypatch.setenv("TIERSTATE_PROFILE", str(path))
    monkeypatch.setenv("TIERSTATE_NVME_DIR", str(tmp_path / "nvme"))
    return path


def _params(n=2, numel=1 << 20):
    ps = [torch.nn.Parameter(torch.randn(numel)) for _ in range(n)]
    for p in ps:
        p.grad = torch.randn(numel)
    return ps


def test_auto_picks_host_ram_when_it_fits_and_says_why(profile, caplog):
    with caplog.at_level(logging.INFO, logger="tierstate"):
        opt = ts.AdamW(_params(), offload="auto")
    assert opt.offload.cpu == 1.0 and opt.offload.nvme == 0.0
    msg = " ".join(r.getMessage() for r in caplog.records if "offload='auto'" in r.getMessage())
    assert "chose Offload(gpu=0, cpu=1, nvme=0," in msg and "fits in host RAM" in msg and str(profile) in msg
    assert "device not searched" in msg  # CPU parameters: no device tier
    opt.step()


def test_auto_spills_to_nvme_under_a_small_host_budget(profile, caplog, monkeypatch):
    pytest.importorskip("tierstate.tiers.nvme")
    import psutil
    # 8M params: 64 MiB of moments do not fit in 40 MiB beyond the parameters and gradients;
    # 16 Mi-element sub-groups would make one record hold everything, so auto picks smaller ones.
    monkeypatch.setenv("TIERSTATE_AUTO_HOST_FRACTION", f"{(40 << 20) / psutil.virtual_memory().available:.6f}")
    with caplog.at_level(logging.INFO, logger="tierstate"):
        opt = ts.AdamW(_params(8), offload="auto")
    assert 0.0 < opt.offload.nvme < 1.0 and opt.offload.subgroup_numel < 8 << 20
    msg = " ".join(r.getMessage() for r in caplog.records if "offload='auto'" in r.getMessage())
    assert "goes to NVMe" in msg
    ref = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in opt.param_groups[0]["params"]])
    for p, q in zip(ref.param_groups[0]["params"], opt.param_groups[0]["params"]):
        p.grad = q.grad.clone()
    opt.step()
    ref.step()
    for p, q in zip(ref.param_groups[0]["params"], opt.param_groups[0]["params"]):
        torch.testing.assert_close(q, p)
    opt.close()


def test_auto_keeps_mixed_widths_in_host_ram(profile, monkeypatch):
    """float64 parameters beside narrower ones keep their state in RAM (an NVMe share is
    refused at placement), so auto plans no disk for them: under the budget that sends the
    float32 model above to NVMe it says so, naming the cause (found 2026-12-07: it chose an NVMe
    share, which the placement then refused with a message about an Offload the user never
    wrote); with the budget to hold it, RAM."""
    import psutil
    params = _params(8) + [torch.nn.Parameter(torch.randn(1 << 10, dtype=torch.float64))]
    monkeypatch.setenv("TIERSTATE_AUTO_HOST_FRACTION", f"{(40 << 20) / psutil.virtual_memory().available:.6f}")
    with pytest.raises(ValueError, match=r"(?s)offload='auto' found no placement.*float64 parameters beside narrower "
                                         r"ones keep their state in host RAM"):
        ts.AdamW(params, offload="auto")
    monkeypatch.delenv("TIERSTATE_AUTO_HOST_FRACTION")
    opt = ts.AdamW(params, offload="auto")
    assert opt.offload.cpu == 1.0
    opt.close()


def _host_budget_beyond_params(monkeypatch, nbytes: int) -> None:
    import psutil
    monkeypatch.setenv("TIERSTATE_AUTO_HOST_FRACTION", f"{nbytes / psutil.virtual_memory().available:.6f}")


def test_auto_prices_the_state_keys_it_is_given(profile, monkeypatch):
    """The state per element comes from the caller's keys: AdamW's two moments (64 MiB for 8M
    params) spill out of 40 MiB of host RAM, SGD without momentum (no state) stays in it."""
    _host_budget_beyond_params(monkeypatch, 40 << 20)
    params = _params(8)
    adamw = choose_offload(params, allow_device_tier=False, state_keys=ADAMW_KEYS)
    assert 0.0 < adamw.nvme < 1.0
    stateless = choose_offload(params, allow_device_tier=False, state_keys=())
    assert stateless.cpu == 1.0 and stateless.nvme == 0.0


def test_auto_reads_the_parameters_inside_param_groups(profile, monkeypatch):
    """Param-group dicts (as an optimizer is given them) are priced by their parameters."""
    _host_budget_beyond_params(monkeypatch, 40 << 20)
    params = _params(8)
    flat = choose_offload(params, state_keys=ADAMW_KEYS)
    grouped = choose_offload([{"params": params[:5]}, {"params": params[5:], "lr": 0.1}], state_keys=ADAMW_KEYS)
    assert 0.0 < grouped.nvme < 1.0
    assert grouped.nvme == pytest.approx(flat.nvme, abs=0.02)  # the budget follows the RAM available now
    single = choose_offload([{"params": params[0]}], state_keys=ADAMW_KEYS)  # a lone tensor, as torch allows
    assert single.cpu == 1.0


def test_auto_with_param_groups_spills_as_with_a_flat_list(profile, monkeypatch):
    """ts.AdamW given param-group dicts plans their parameters (it once saw none and chose cpu=1.0),
    with the state keys of every group (amsgrad in one adds max_exp_avg_sq)."""
    _host_budget_beyond_params(monkeypatch, 40 << 20)
    params = _params(8)
    opt = ts.AdamW([{"params": params[:4]}, {"params": params[4:], "amsgrad": True}], offload="auto")
    assert 0.0 < opt.offload.nvme < 1.0
    opt.step()
    opt.close()


def test_auto_without_a_profile_uses_conservative_defaults_and_says_so(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TIERSTATE_PROFILE", str(tmp_path / "none.json"))
    with caplog.at_level(logging.INFO, logger="tierstate"):
        ts.AdamW(_params(1, 1024), offload="auto")
    assert any("conservative defaults" in r.getMessage() and "tierstate probe" in r.getMessage()
               for r in caplog.records)


def test_auto_with_a_broken_profile_warns_and_falls_back(tmp_path, monkeypatch, caplog):
    bad = tmp_path / "hw.json"
    bad.write_text(json.dumps({"schema_version": 99}))
    monkeypatch.setenv("TIERSTATE_PROFILE", str(bad))
    with caplog.at_level(logging.INFO, logger="tierstate"):
        opt = ts.AdamW(_params(1, 1024), offload="auto")
    assert opt.offload.cpu == 1.0
    assert any(r.levelno == logging.WARNING and "schema_version 99" in r.getMessage() for r in caplog.records)


def test_auto_with_no_room_anywhere_is_a_valueerror(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERSTATE_PROFILE", str(tmp_path / "none.json"))
    monkeypatch.setenv("TIERSTATE_AUTO_HOST_FRACTION", "0.0000001")
    monkeypatch.setattr("os.statvfs", lambda p: type("S", (), {"f_bavail": 0, "f_frsize": 4096})())
    with pytest.raises(ValueError, match="no placement"):
        ts.AdamW(_params(1, 1 << 20), offload="auto")


def test_on_cuda_auto_turns_a_plan_with_a_device_part_into_offload_gpu(monkeypatch):
    """The step from the planner's choice to the Offload the optimizer is built with, for a CUDA
    request (this machine has no GPU: the request says where the parameters are)."""
    from tierstate.placement.auto import device_budget, offload_from_plan
    from tierstate.placement.model_spec import ModelSpec
    from tierstate.placement.plan_inputs import GIB, Budgets, Hardware, PlanRequest
    from tierstate.placement.planner import choose

    hw = Hardware(source="test", host_bandwidth=40e9, step_params_per_s=2e9, sumsq_params_per_s=8e9,
                  host_flops=1e12, disk_read=2e9, disk_write=4e9, h2d=20e9, d2h=20e9, device_flops=400e12,
                  device_bandwidth=2e12)
    req = PlanRequest(ModelSpec("m", (1_000_000_000,), source="tensors"), device="cuda", param_dtype="bf16",
                      state_keys=ADAMW_KEYS)
    free = 40 * GIB
    budget = device_budget(free, 2 * 10**9)
    assert budget == free // 2 + 2 * 10**9  # half the free memory is left for activations
    plan = choose(req, hw, Budgets(device=budget, host=200 * GIB), allow_device_tier=True)
    offload = offload_from_plan(plan)
    assert 0 < offload.gpu == plan.placement.gpu and offload.gpu + offload.cpu + offload.nvme == pytest.approx(1.0)
    assert offload.subgroup_numel == plan.request.subgroup_numel
    monkeypatch.setenv("TIERSTATE_AUTO_DEVICE_FRACTION", "0")
    assert device_budget(free, 2 * 10**9) is None  # 0: the device tier is not searched
    monkeypatch.setenv("TIERSTATE_AUTO_DEVICE_FRACTION", "half")
    with pytest.raises(ValueError, match="TIERSTATE_AUTO_DEVICE_FRACTION='half'"):
        device_budget(free, 0)


def _assert_streams_from_nvme_and_says_why(plan, caplog, profile):
    import psutil

    from tierstate.placement.weights_plan import CPU, NVME

    assert NVME in plan.tier_of and CPU not in plan.tier_of
    assert plan.compute_peak_bytes <= psutil.virtual_memory().total
    msg = " ".join(r.getMessage() for r in caplog.records if "offload_weights(offload='auto')" in r.getMessage())
    assert "NVMe" in msg and "window" in msg and str(profile) in msg


def test_auto_weights_larger_than_the_host_budget_stream_from_nvme_and_say_why(profile, caplog, monkeypatch):
    """64 blocks of 64 MiB (4 GiB) against a host budget of 5 % of the available RAM (the
    documented TIERSTATE_AUTO_HOST_FRACTION knob; ~1.1 GiB on a 24 GiB machine): streamed from
    NVMe through a window that fits, never from a 'cpu' home on a CPU. Needs 4 GiB of free
    disk, not a model the size of the RAM."""
    import psutil

    from tierstate.placement.auto import choose_weights

    monkeypatch.setenv("TIERSTATE_AUTO_HOST_FRACTION", "0.05")
    budget = 0.05 * psutil.virtual_memory().available
    assert 64 * (64 << 20) > budget  # the case this test is about
    with caplog.at_level(logging.INFO, logger="tierstate"):
        plan = choose_weights([64 << 20] * 64, 16 << 20, "cpu", activation_bytes=8 << 20,
                              compute_seconds_per_block=0.05)
    _assert_streams_from_nvme_and_says_why(plan, caplog, profile)
    assert plan.compute_peak_bytes <= budget * 1.1  # the available RAM moves a little between reads


def test_auto_weights_on_cpu_stream_a_model_larger_than_ram_and_say_why(profile, caplog):
    """A model 1.25x this machine's RAM, in 256 MiB blocks, with the default budgets: streamed from
    NVMe. Runs where the disk under the NVMe folder can hold it (the plan needs every block on disk)."""
    import os

    import psutil

    from tierstate.placement.auto import choose_weights
    from tierstate.placement.auto import existing_ancestor

    blocks = -(-int(1.25 * psutil.virtual_memory().total) // (256 << 20))
    st = os.statvfs(existing_ancestor(os.environ["TIERSTATE_NVME_DIR"]))
    if st.f_bavail * st.f_frsize < blocks * (256 << 20) * 1.05:
        pytest.skip(f"the disk has {st.f_bavail * st.f_frsize / 2**30:.1f} GiB free; a model 1.25x the RAM "
                    f"needs {blocks / 4:.1f} GiB (the budget-knob test above covers the choice)")
    with caplog.at_level(logging.INFO, logger="tierstate"):
        plan = choose_weights([256 << 20] * blocks, 64 << 20, "cpu", activation_bytes=32 << 20,
                              compute_seconds_per_block=0.05)
    _assert_streams_from_nvme_and_says_why(plan, caplog, profile)


def test_auto_weights_that_fit_stay_resident():
    from tierstate.placement.auto import choose_weights

    plan = choose_weights([1 << 20] * 4, 1 << 20, "cpu")
    assert plan.tier_of == ("resident",) * 4 and plan.window_blocks == 0


def test_auto_weights_refuse_a_bad_device_and_an_impossible_budget(monkeypatch):
    from tierstate.placement.auto import choose_weights

    with pytest.raises(ValueError, match="device='mps'"):
        choose_weights([1 << 20], 0, "mps")
    monkeypatch.setenv("TIERSTATE_AUTO_HOST_FRACTION", "0.000001")
    with pytest.raises(ValueError, match="found no placement.*host RAM"):
        choose_weights([1 << 30] * 4, 0, "cpu")
