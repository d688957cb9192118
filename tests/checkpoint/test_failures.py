"""Damaged checkpoints, wrong optimizers and a full disk: clear errors, nothing half-done."""
from __future__ import annotations

import errno
import os
import subprocess
import uuid

import pytest
import torch

import tierstate as ts
from tierstate.checkpoint import CorruptCheckpointError, load_optimizer, read_manifest, save_optimizer

import ckpt_workload as wl


def _trained(mode, tmp_path, tag, steps=2, **kw):
    model, opt = wl.build(mode, hidden=64, nvme_dir=str(tmp_path / f"nvme-{tag}"), **kw)
    for step in range(steps):
        wl.train_step(model, opt, step)
    return model, opt


@pytest.fixture
def saved(tmp_path):
    model, opt = _trained("cpu", tmp_path, "src")
    man = save_optimizer(opt, tmp_path / "ckpt", shard_bytes=30_000)
    assert len(man["shards"]) >= 3
    return tmp_path / "ckpt", man


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_flipped_byte_in_any_shard_is_named_and_nothing_loads(tmp_path, saved, mode):
    ckpt, man = saved
    model, opt = _trained(mode, tmp_path, "dst", steps=1)
    before = wl.snapshot(opt)
    for shard in man["shards"]:
        path = ckpt / shard["file"]
        original = path.read_bytes()
        # one byte in the header, one in the data region (a state or parameter value)
        for where in (17, shard["data_offset"] + (len(original) - shard["data_offset"]) // 2):
            damaged = bytearray(original)
            damaged[where] ^= 0x10
            path.write_bytes(bytes(damaged))
            with pytest.raises(CorruptCheckpointError) as info:
                load_optimizer(opt, ckpt)
            msg = str(info.value)
            assert shard["file"] in msg and shard["checksum"]["value"] in msg and "crc32" in msg
            assert info.value.filename == str(path) and info.value.errno == errno.EIO
            wl.assert_same_snapshot(before, wl.snapshot(opt))
        path.write_bytes(original)
    load_optimizer(opt, ckpt)  # undamaged again: loads
    with pytest.raises(AssertionError):
        wl.assert_same_snapshot(before, wl.snapshot(opt))
    opt.close()


def test_truncated_or_missing_shard_is_named(tmp_path, saved):
    ckpt, man = saved
    model, opt = _trained("cpu", tmp_path, "dst", steps=1)
    before = wl.snapshot(opt)
    shard = man["shards"][-1]
    path = ckpt / shard["file"]
    original = path.read_bytes()
    path.write_bytes(original[: len(original) - 100])
    with pytest.raises(CorruptCheckpointError, match="truncated") as info:
        load_optimizer(opt, ckpt)
    assert shard["file"] in str(info.value) and shard["checksum"]["value"] in str(info.value)
    os.unlink(path)
    with pytest.raises(FileNotFoundError) as info:
        load_optimizer(opt, ckpt)
    assert info.value.filename == str(path)
    (ckpt / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="no checkpoint here"):
        load_optimizer(opt, ckpt)
    (ckpt / "manifest.json").write_text('{"format": "tierstate-optimizer-checkpoint", "vers')
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        load_optimizer(opt, ckpt)
    wl.assert_same_snapshot(before, wl.snapshot(opt))


def test_mismatching_model_or_optimizer_names_the_first_difference(tmp_path, saved):
    ckpt, _ = saved
    torch.manual_seed(0)
    # the second layer has a different width: parameter 2 is the first to differ
    other = torch.nn.Sequential(torch.nn.Linear(wl.IN, 64), torch.nn.GELU(), torch.nn.Linear(64, 65),
                                torch.nn.GELU(), torch.nn.Linear(65, 8))
    opt = ts.AdamW(other.parameters())
    before = wl.snapshot(opt)
    with pytest.raises(ValueError, match=r"parameter 2 \(group 0\) has shape \(64, 64\) dtype float32 in the "
                                         r"checkpoint, shape \(65, 64\) dtype float32 here"):
        load_optimizer(opt, ckpt)
    wl.assert_same_snapshot(before, wl.snapshot(opt))

    model = wl.build("cpu", hidden=64)[0].to(torch.bfloat16)
    bf16 = ts.AdamW(model.parameters())
    x, y = wl.batch(0)
    torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
    bf16.step()  # with state (and masters) to keep
    before = wl.snapshot(bf16)
    with pytest.raises(ValueError, match=r"parameter 0 .* dtype float32 in the checkpoint, .* dtype bfloat16 here"):
        load_optimizer(bf16, ckpt)
    wl.assert_same_snapshot(before, wl.snapshot(bf16))

    model = wl.build("cpu", hidden=64)[0]
    sgd = ts.SGD(model.parameters(), momentum=0.9)
    wl.train_step(model, sgd, 0)
    before = wl.snapshot(sgd)
    with pytest.raises(ValueError, match="holds the state of a AdamW optimizer; this one is a SGD"):
        load_optimizer(sgd, ckpt)
    wl.assert_same_snapshot(before, wl.snapshot(sgd))

    # AdamW with amsgrad keeps max_exp_avg_sq: a checkpoint of one must say so
    model, opt = _trained("cpu", tmp_path, "ams", amsgrad=True)
    save_optimizer(opt, tmp_path / "ams")
    manifest = read_manifest(tmp_path / "ams")
    assert "max_exp_avg_sq" in manifest["params"][0]["state"]
    model2, plain = _trained("cpu", tmp_path, "plain", steps=1)
    before = wl.digest(model2, plain)
    load_optimizer(plain, tmp_path / "ams")  # hyper-parameters come along: amsgrad=True now
    assert plain.param_groups[0]["amsgrad"] is True
    assert wl.digest(model2, plain) == wl.digest(model, opt) != before


def _mount_tmpfs(where, size: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("the disk-full test mounts a small tmpfs, which needs root")
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", f"ts-ckpt-{uuid.uuid4().hex[:8]}", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"could not mount a tmpfs for the disk-full test: {done.stderr.strip()}")


def test_disk_full_during_save_keeps_the_previous_checkpoint(tmp_path):
    disk = tmp_path / "small"
    _mount_tmpfs(disk, "8m")
    try:
        # hidden=512: ~0.4 M parameters, 4.7 MiB per checkpoint: one fits in 8 MiB, two do not
        model, opt = wl.build("cpu", hidden=512)
        wl.train_step(model, opt, 0)
        ckpt = disk / "ckpt"
        first = save_optimizer(opt, ckpt, extra={"step": 1}, shard_bytes=1 << 20)
        assert sum(s["bytes"] for s in first["shards"]) > 4 << 20
        files_before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
        wl.train_step(model, opt, 1)
        with pytest.raises(OSError) as info:
            save_optimizer(opt, ckpt, extra={"step": 2}, shard_bytes=1 << 20)
        err = info.value
        assert err.errno == errno.ENOSPC and isinstance(err, ts.io.DiskFullError)
        assert err.filename.startswith(str(ckpt)) and ".partial" in err.filename
        assert "left as it was" in "".join(getattr(err, "__notes__", []))
        # the previous checkpoint is intact, and the failed save left nothing behind
        assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == files_before
        model2, opt2 = wl.build("cpu", hidden=512)
        assert load_optimizer(opt2, ckpt) == {"step": 1}
        # training goes on; once there is room the next save succeeds
        wl.train_step(model, opt, 2)
        (disk / "ballast").write_bytes(b"")  # the tmpfs is writable again after the failure
        other = tmp_path / "roomy"
        save_optimizer(opt, other, extra={"step": 3})
        model3, opt3 = wl.build("cpu", hidden=512)
        load_optimizer(opt3, other)
        assert wl.digest(model3, opt3) == wl.digest(model, opt)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_torch_optimizer_with_state_not_shaped_like_its_parameter_is_refused_at_save(tmp_path):
    """torch.optim.ASGD keeps 0-d 'eta' and 'mu' next to parameter-shaped 'ax'; the format
    stores state shaped like the parameter, so the save must refuse before writing anything
    (it used to write shards whose headers did not match their bytes)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.ASGD(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match=r"state 'eta' of parameter 0 has shape \(\) dtype torch.float32, "
                                         r"the parameter \(4, 8\)"):
        save_optimizer(opt, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
