"""The crash sweep removes only what tierstate can prove it made, and what the nvme_dir
argument may be (relative paths, files, pseudo-filesystems, repeats, read-only mounts)."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

import tierstate as ts
from tierstate.placement import TierKind

IMPORT_ROOT = Path(ts.__file__).resolve().parents[1]
CHILD = Path(__file__).with_name("nvme_child.py")
MARKER = "tierstate-run.json"


def _optimizer(nvme_dir, numel: int = 5000):
    params = [torch.nn.Parameter(torch.randn(numel))]
    return ts.AdamW(params, offload=ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=nvme_dir, subgroup_numel=1024,
                                               buffer_count=2))


def _crash(where: str, env_root: Path | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(IMPORT_ROOT))
    if env_root is not None:
        env["TIERSTATE_NVME_DIR"] = str(env_root)
    proc = subprocess.run([sys.executable, str(CHILD), "crash", where], stdout=subprocess.PIPE, text=True, env=env,
                          timeout=120)
    assert proc.returncode == -9
    return json.loads(proc.stdout.splitlines()[0])


def _age(path: Path, seconds: float = 3600) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records]


# -- the sweep ------------------------------------------------------------------------------
def test_user_folders_named_run_under_the_default_root_are_left(nvme_root, caplog):
    nvme_root.mkdir(parents=True)
    mine = nvme_root / "run-2024-ablation"
    mine.mkdir()
    (mine / "results.csv").write_text("epoch,loss\n1,2.5\n")
    (mine / "tierstate.lock").touch()
    (mine / "tierstate.pid").write_text("999999\n")  # an old-style leftover proves nothing either
    _age(mine)
    with caplog.at_level(logging.WARNING, logger="tierstate"):
        _optimizer(None).close()
    assert (mine / "results.csv").read_text() == "epoch,loss\n1,2.5\n"
    assert any(str(mine) in m and "left" in m for m in _messages(caplog)), _messages(caplog)


def test_explicit_folder_keeps_user_files_after_a_crash(tmp_path, caplog):
    folder = tmp_path / "mine"
    folder.mkdir()
    keep = {"state-dict-epoch3.pt": b"weights", "state-0.bin": b"user bin", "tierstate.pid": b"1\n", "keep.txt": b"x"}
    for name, data in keep.items():
        (folder / name).write_bytes(data)
    info = _crash(str(folder))
    assert all(Path(f).exists() for f in info["files"])
    with caplog.at_level(logging.WARNING, logger="tierstate"):
        opt = _optimizer(folder)
    assert not any(Path(f).exists() for f in info["files"]), "the crashed run's own files go"
    assert any("removing" in m and str(folder) in m and f"pid {info['pid']}" in m for m in _messages(caplog))
    opt.close()
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == keep, "only the run's own files go"


def _forge(folder: Path, **fields) -> dict:
    """A marker as a crashed run of this host would have left it, with ``fields`` changed."""
    from tierstate.tiers import rundir

    marker = rundir.new_marker(folder, made_dirs=[str(folder)])
    marker["files"] += ["state-x-0.bin"]
    marker.update(fields)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "state-x-0.bin").write_bytes(b"\0" * 8192)
    (folder / rundir.LOCK_NAME).touch()
    (folder / MARKER).write_text(json.dumps(marker))
    return marker


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_stale_marker_of_a_dead_pid_is_removed_and_only_its_files(nvme_root, caplog):
    stale = nvme_root / "run-1-aaaa"
    _forge(stale, pid=_dead_pid())
    (stale / "notes.txt").write_text("someone put this here")
    with caplog.at_level(logging.WARNING, logger="tierstate"):
        _optimizer(None).close()
    assert sorted(p.name for p in stale.iterdir()) == ["notes.txt"]
    assert any("removing" in m and str(stale) in m for m in _messages(caplog))


def test_reused_pid_is_seen_through_by_its_start_time(nvme_root, caplog):
    stale = nvme_root / "run-2-bbbb"
    _forge(stale, pid=os.getppid(), start_time=1)  # a live pid, but not the process that wrote the marker
    with caplog.at_level(logging.WARNING, logger="tierstate"):
        _optimizer(None).close()
    assert not stale.exists()


def test_live_owner_with_free_lock_is_left(nvme_root, caplog):
    from tierstate.tiers import rundir

    stale = nvme_root / "run-3-cccc"
    _forge(stale, pid=os.getppid(), start_time=rundir.process_start_time(os.getppid()))
    with caplog.at_level(logging.WARNING, logger="tierstate"):
        _optimizer(None).close()
    assert (stale / "state-x-0.bin").exists()
    assert any(str(stale) in m and "alive" in m for m in _messages(caplog))


def test_marker_of_another_host_is_never_removed(nvme_root, caplog):
    stale = nvme_root / "run-4-dddd"
    _forge(stale, host="some-other-node", pid=_dead_pid())
    with caplog.at_level(logging.WARNING, logger="tierstate"):
        _optimizer(None).close()
    assert (stale / "state-x-0.bin").exists()
    assert any(str(stale) in m and "some-other-node" in m for m in _messages(caplog))


def test_marker_from_a_previous_boot_is_removed(nvme_root):
    stale = nvme_root / "run-5-eeee"
    _forge(stale, boot_id=str(uuid.uuid4()), pid=os.getpid())  # our own pid, in another boot
    _optimizer(None).close()
    assert not stale.exists()


@pytest.mark.parametrize("bad", ["../escape.bin", "/etc/hostname", "sub/x.bin", ".."])
def test_marker_listing_paths_outside_its_folder_is_refused(nvme_root, tmp_path, bad, caplog):
    outside = tmp_path / "escape.bin"
    outside.write_bytes(b"precious")
    stale = nvme_root / "run-6-ffff"
    m = _forge(stale, pid=_dead_pid())
    m["files"].append(bad)
    (stale / MARKER).write_text(json.dumps(m))
    with caplog.at_level(logging.WARNING, logger="tierstate"):
        _optimizer(None).close()
    assert outside.read_bytes() == b"precious" and Path("/etc/hostname").exists()
    assert (stale / "state-x-0.bin").exists(), "a marker that names anything outside its folder proves nothing"
    assert any(str(stale) in m and "left" in m for m in _messages(caplog))


def test_listed_symlink_is_not_followed(nvme_root, tmp_path):
    target = tmp_path / "precious.bin"
    target.write_bytes(b"precious")
    stale = nvme_root / "run-7-abab"
    m = _forge(stale, pid=_dead_pid())
    m["files"].append("link.bin")
    (stale / "link.bin").symlink_to(target)
    (stale / MARKER).write_text(json.dumps(m))
    _optimizer(None).close()
    assert target.read_bytes() == b"precious"
    assert (stale / "link.bin").is_symlink(), "tierstate never makes links: a listed one is left"


def test_garbage_marker_is_left(nvme_root, caplog):
    stale = nvme_root / "run-8-cdcd"
    stale.mkdir(parents=True)
    (stale / MARKER).write_text("{not json")
    (stale / "state-0.bin").write_bytes(b"x")
    _age(stale)
    with caplog.at_level(logging.WARNING, logger="tierstate"):
        _optimizer(None).close()
    assert (stale / "state-0.bin").exists()
    assert any(str(stale) in m for m in _messages(caplog))


def test_crash_in_a_folder_with_new_parents_removes_them_next_time(tmp_path):
    folder = tmp_path / "a" / "b" / "c"
    info = _crash(str(folder))
    assert Path(info["files"][0]).exists()
    _optimizer(folder).close()
    assert not (tmp_path / "a").exists(), "the folders the crashed run made are the next run's to remove"


# -- the nvme_dir argument ------------------------------------------------------------------
def test_relative_nvme_dir_survives_chdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    opt = _optimizer("scratch")
    tier = opt.tiers[TierKind.NVME]
    files = tier.files
    assert all(f.is_absolute() for f in files) and all(f.is_absolute() for f in tier.folders)
    decoy = tmp_path / "elsewhere"
    (decoy / "scratch").mkdir(parents=True)
    for f in (tmp_path / "scratch").iterdir():  # same names in the new working directory
        (decoy / "scratch" / f.name).write_text("not tierstate's")
    monkeypatch.chdir(decoy)
    opt.close()
    assert not (tmp_path / "scratch").exists(), "close() removed the files it made, where it made them"
    assert all(p.read_text() == "not tierstate's" for p in (decoy / "scratch").iterdir())
    assert len(list((decoy / "scratch").iterdir())) >= 2


def test_relative_env_root_survives_chdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TIERSTATE_NVME_DIR", "rel-root")
    opt = _optimizer(None)
    folder = opt.tiers[TierKind.NVME].folders[0]
    assert folder.is_absolute() and folder.parent == tmp_path / "rel-root"
    monkeypatch.chdir("/")
    opt.close()
    assert not folder.exists()


def test_nvme_dir_that_is_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match=r"nvme_dir.*is a file.*pass a folder") as err:
        _optimizer(f)
    assert err.value.filename == str(f) and f.read_text() == "x"


def test_nvme_dir_proc(tmp_path):
    with pytest.raises(OSError, match=r"nvme_dir=/proc.*cannot create files.*pass Offload\(nvme_dir=") as err:
        _optimizer("/proc")
    assert err.value.errno is not None and err.value.filename is not None


def test_nvme_dir_listed_twice(tmp_path):
    d = tmp_path / "D"
    with pytest.raises(ValueError, match=r"nvme_dir.*lists .*D.* twice.*one folder per drive"):
        _optimizer([d, d])
    with pytest.raises(ValueError, match=r"twice"):
        _optimizer([str(d), str(tmp_path / "x" / ".." / "D")])
    assert not d.exists(), "refused before anything is made"
    d.mkdir()
    (tmp_path / "L").symlink_to(d, target_is_directory=True)
    with pytest.raises(ValueError, match=r"twice.*the same folder once resolved"):
        _optimizer([d, tmp_path / "L"])


@pytest.mark.parametrize("bad, match", [([], r"nvme_dir=\[\]"), ("", r"nvme_dir=''.*empty"),
                                        (123, r"nvme_dir=123.*a folder"), ([None], r"nvme_dir.*None")])
def test_nvme_dir_bad_values(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=bad)


def test_nvme_dir_with_missing_parents_is_made_and_removed(tmp_path):
    folder = tmp_path / "p" / "q" / "r"
    opt = _optimizer(folder)
    opt.param_groups[0]["params"][0].grad = torch.randn(5000)
    opt.step()
    assert folder.is_dir()
    opt.close()
    assert not (tmp_path / "p").exists(), "every folder the run made is removed when left empty"


def test_nvme_dir_on_tmpfs_works(tmp_path):
    """tmpfs takes O_DIRECT since Linux 6.6; before, the files fall back to buffered I/O and
    the tier says so (tier.direct False, one log line). Either way the run works."""
    base = Path("/dev/shm")
    if not base.is_dir():
        pytest.skip("no /dev/shm")
    folder = base / f"tierstate-test-{uuid.uuid4().hex[:8]}"
    params = [torch.nn.Parameter(torch.randn(5000))]
    ref = [torch.nn.Parameter(params[0].detach().clone())]
    opt = ts.AdamW(params, offload=ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=folder, subgroup_numel=1024, buffer_count=2))
    cpu = ts.AdamW(ref, offload="cpu")
    try:
        for _ in range(3):
            g = torch.randn(5000)
            params[0].grad, ref[0].grad = g.clone(), g.clone()
            opt.step()
            cpu.step()
        assert torch.equal(params[0], ref[0])
        try:
            fd = os.open(folder / "probe", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
            os.close(fd)
            direct = True
        except OSError:
            direct = False
        os.unlink(folder / "probe")
        assert opt.tiers[TierKind.NVME].direct == direct
    finally:
        opt.close()
    assert not folder.exists()


@pytest.fixture
def ro_mount(tmp_path):
    mnt = tmp_path / f"ro-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)], capture_output=True,
                         text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {res.stderr.strip() or res.returncode}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_read_only_nvme_dir(ro_mount):
    with pytest.raises(OSError, match=r"nvme_dir=.*cannot create files.*Read-only.*pass Offload\(nvme_dir=") as err:
        _optimizer(ro_mount)
    assert err.value.errno == 30
    with pytest.raises(OSError, match=r"cannot create the NVMe-tier folder.*Read-only") as err:
        _optimizer(ro_mount / "sub")
    assert err.value.errno == 30
