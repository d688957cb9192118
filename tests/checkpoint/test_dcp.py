"""torch.distributed.checkpoint with tierstate optimizers (one process, no process group)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from tierstate.checkpoint import mmap_state_dict

import ckpt_workload as wl


@pytest.mark.parametrize("save_mode,load_mode", [
    ("cpu", "nvme"),
    ("nvme", "nvme"),
    ("nvme", "cpu"),
])
def test_dcp_save_load_resumes_bit_identically(tmp_path, save_mode, load_mode):
    model, opt = wl.build(save_mode, hidden=64, nvme_dir=str(tmp_path / "nv-a"))
    for step in range(3):
        wl.train_step(model, opt, step)
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=str(tmp_path / "dcp"))

    model2, opt2 = wl.build(load_mode, hidden=64, nvme_dir=str(tmp_path / "nv-b"))
    weights_before = [p.detach().clone() for p in model2.parameters()]
    state = {"model": model2.state_dict(), "optim": get_optimizer_state_dict(model2, opt2)}
    # DCP initialised the empty state with a zero-gradient step at lr=0: weights unchanged
    assert all(torch.equal(a, b) for a, b in zip(weights_before, model2.parameters()))
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    model2.load_state_dict(state["model"])
    set_optimizer_state_dict(model2, opt2, state["optim"])
    assert wl.digest(model2, opt2) == wl.digest(model, opt)
    for step in range(3, 5):
        wl.train_step(model, opt, step)
        wl.train_step(model2, opt2, step)
    assert wl.digest(model2, opt2) == wl.digest(model, opt)
    opt.close()
    opt2.close()


def test_dcp_on_an_empty_state_streams_no_sub_group(tmp_path):
    """DCP's _init_optim_state steps an empty optimizer with zero gradients at lr 0; the
    outcome (state at init, step 1) is known, so nothing may be read from or written to disk."""
    model, opt = wl.build("nvme", hidden=64, nvme_dir=str(tmp_path / "nv"))
    sd = get_optimizer_state_dict(model, opt)
    stats = opt.stats().as_dict()
    assert stats["bytes"].get("nvme/read", 0) == 0 and stats["bytes"].get("nvme/write", 0) == 0
    assert stats["phases"].get("cpu_update", 0.0) == 0.0
    steps = [float(st["step"]) for st in sd["state"].values()]
    assert steps and all(v == 1.0 for v in steps)  # as torch.optim.AdamW after the same fake step
    opt.close()


def test_load_state_dict_of_its_own_state_dict_keeps_the_state():
    model, opt = wl.build("cpu", hidden=64)
    wl.train_step(model, opt, 0)
    before = wl.digest(model, opt)
    opt.load_state_dict(opt.state_dict())
    assert wl.digest(model, opt) == before


def test_mmap_state_dict_goes_through_dcp(tmp_path):
    model, opt = wl.build("nvme", hidden=64, nvme_dir=str(tmp_path / "nv-a"))
    for step in range(2):
        wl.train_step(model, opt, step)
    dcp.save({"optim": mmap_state_dict(opt, tmp_path / "scratch")}, checkpoint_id=str(tmp_path / "dcp"))
    # an optimizer of the same structure, one step in, gives dcp.load file-backed tensors to fill in place
    model3, opt3 = wl.build("nvme", hidden=64, nvme_dir=str(tmp_path / "nv-c"))
    wl.train_step(model3, opt3, 0)
    target = {"optim": mmap_state_dict(opt3, tmp_path / "scratch2")}
    dcp.load(target, checkpoint_id=str(tmp_path / "dcp"))
    model2, opt2 = wl.build("cpu", hidden=64)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(target["optim"])
    assert wl.digest(model2, opt2) == wl.digest(model, opt)
    opt.close()
    opt3.close()


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_failed_dcp_load_into_copies_leaves_the_optimizer_as_it_was(tmp_path, mode):
    """dcp.load writes into the tensors it is given, one after the other; a damaged file fails
    it half way. Into mmap_state_dict(host_views=False) the live state is untouched; the
    intact checkpoint then loads through the same dict."""
    model, opt = wl.build("cpu", hidden=64)
    for step in range(3):
        wl.train_step(model, opt, step)
    dcp.save({"optim": mmap_state_dict(opt, tmp_path / "s0")}, checkpoint_id=str(tmp_path / "dcp"))
    data = next(p for p in (tmp_path / "dcp").iterdir() if p.suffix == ".distcp")
    intact = data.read_bytes()
    data.write_bytes(intact[: len(intact) // 2])

    model2, opt2 = wl.build(mode, hidden=64, nvme_dir=str(tmp_path / "nv"))
    wl.train_step(model2, opt2, 0)
    before = wl.snapshot(opt2)
    target = {"optim": mmap_state_dict(opt2, tmp_path / "s1", host_views=False)}
    with pytest.raises(BaseException) as info:  # DCP's CheckpointException is a BaseException
        dcp.load(target, checkpoint_id=str(tmp_path / "dcp"))
    assert "corrupted" in str(info.value) or "CheckpointException" in type(info.value).__name__
    wl.assert_same_snapshot(before, wl.snapshot(opt2))

    data.write_bytes(intact)
    target = {"optim": mmap_state_dict(opt2, tmp_path / "s2", host_views=False)}
    dcp.load(target, checkpoint_id=str(tmp_path / "dcp"))
    wl.assert_same_snapshot(before, wl.snapshot(opt2))  # still untouched: only the copies were filled
    opt2.load_state_dict(target["optim"])
    model2.load_state_dict(model.state_dict())
    assert wl.digest(model2, opt2) == wl.digest(model, opt)
    opt2.close()
