"""Edited or damaged manifests: every one refused by name, the live optimizer bit-identical.

Each mutation is applied twice: as is (the manifest's own checksum no longer matches: a
CorruptCheckpointError naming manifest.json) and "resealed", with the checksum recomputed
the way the format defines it, as a buggy writer or a careful hand edit would leave it;
then the structural checks, the optimizer fit and the shard headers must catch it.
"""
from __future__ import annotations

import copy
import errno
import json
import zlib

import pytest
import torch

from tierstate.checkpoint import CorruptCheckpointError, load_optimizer, save_optimizer
from tierstate.tiers import StateLife

import ckpt_workload as wl

CORRUPT = CorruptCheckpointError


def seal(manifest: dict) -> dict:
    """The manifest with ``manifest_checksum`` recomputed: crc32 of its canonical JSON
    (keys sorted, no spaces) without that field (the format's definition, written out here
    independently of the implementation)."""
    body = {k: v for k, v in manifest.items() if k != "manifest_checksum"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return {**body, "manifest_checksum": {"algorithm": "crc32", "value": f"{zlib.crc32(canonical):08x}"}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("manifest")
    model, opt = wl.build("cpu", hidden=64)
    for step in range(2):
        wl.train_step(model, opt, step)
    man = save_optimizer(opt, tmp / "ckpt", shard_bytes=30_000)
    assert len(man["shards"]) >= 3
    original = (tmp / "ckpt" / "manifest.json").read_bytes()
    return tmp / "ckpt", json.loads(original), original, wl.digest(model, opt)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A live NVMe-tier optimizer one step in: state on disk, in the pool and published."""
    tmp = tmp_path_factory.mktemp("target")
    model, opt = wl.build("nvme", hidden=64, nvme_dir=str(tmp / "nv"))
    wl.train_step(model, opt, 0)
    yield model, opt
    opt.close()


def _same_size_pair(man: dict) -> tuple[str, str]:
    """Two state tensors in one shard, of one size (their bytes differ)."""
    by_place = {}
    for name, e in man["tensors"].items():
        b, en = e["data_offsets"]
        by_place.setdefault((e["shard"], en - b), []).append(name)
    for names in by_place.values():
        states = sorted(n for n in names if n.startswith("state."))
        if len(states) >= 2:
            return states[0], states[1]
    raise AssertionError("no two equal-size tensors share a shard")


def _bitflip(bit):
    def mutate(m):
        e = m["tensors"]["state.0.exp_avg"]
        e["data_offsets"] = [e["data_offsets"][0] ^ (1 << bit), e["data_offsets"][1] ^ (1 << bit)]
    return mutate


def _swap(m):
    a, b = _same_size_pair(m)
    m["tensors"][a]["data_offsets"], m["tensors"][b]["data_offsets"] = \
        m["tensors"][b]["data_offsets"], m["tensors"][a]["data_offsets"]


def _shift(delta):
    def mutate(m):
        a, _ = _same_size_pair(m)
        m["tensors"][a]["data_offsets"] = [o + delta for o in m["tensors"][a]["data_offsets"]]
    return mutate


def _set(path, value):
    """Set manifest[path...] = value (a path of keys/indices)."""
    def mutate(m):
        node = m
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return mutate


def _delete(path):
    def mutate(m):
        node = m
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
    return mutate


def _uninitialize_everywhere(m):
    # a consistent edit of the manifest alone: only the shard headers still know the truth
    rec = m["params"][0]
    rec["initialized"], rec["step"], keys = False, None, rec["state"]
    rec["state"] = {}
    for key in keys:
        del m["tensors"][f"state.0.{key}"]


def _dtype_everywhere(m):
    m["params"][1]["state"]["exp_avg"] = "bfloat16"
    m["tensors"]["state.1.exp_avg"]["dtype"] = "bfloat16"
    b, _ = m["tensors"]["state.1.exp_avg"]["data_offsets"]
    m["tensors"]["state.1.exp_avg"]["data_offsets"] = [b, b + 64 * 2]  # consistent with the new dtype


def _drop_last_shard(m):
    m["shards"].pop()


def _drop_last_param(m):
    m["params"].pop()


def _drop_from_group(m):
    m["param_groups"][0]["params"].pop()


def _swap_param_records(m):
    m["params"][0]["index"], m["params"][1]["index"] = 1, 0


# (id, mutation, exception, regex the message must match)
MUTATIONS = [
    # dtypes
    ("state-dtype", _set(["tensors", "state.0.exp_avg", "dtype"], "bfloat16"), CORRUPT, r"state\.0\.exp_avg.*dtype"),
    ("state-dtype-consistent", _dtype_everywhere, CORRUPT, r"state\.1\.exp_avg"),
    ("state-dtype-unknown", _set(["tensors", "state.0.exp_avg", "dtype"], "float33"), CORRUPT, r"float33"),
    ("param-dtype-record", _set(["params", 0, "dtype"], "float16"), CORRUPT, r"param\.0.*dtype|parameter 0.*dtype"),
    ("state-dtype-int", _set(["params", 0, "state", "exp_avg"], "int32"), CORRUPT, r"exp_avg"),
    # offsets
    ("offsets-swapped", _swap, CORRUPT, r"data_offsets"),
    ("offsets-shifted-4", _shift(4), CORRUPT, r"data_offsets"),
    ("offsets-shifted-minus-4", _shift(-4), CORRUPT, r"data_offsets"),
    ("offset-bitflip-low", _bitflip(1), CORRUPT, r"data_offsets"),
    ("offset-bitflip-high", _bitflip(20), CORRUPT, r"data_offsets"),
    ("offsets-reversed", lambda m: m["tensors"]["state.0.exp_avg"].update(
        data_offsets=m["tensors"]["state.0.exp_avg"]["data_offsets"][::-1]), CORRUPT, r"data_offsets"),
    ("offsets-not-ints", _set(["tensors", "state.0.exp_avg", "data_offsets"], ["0", "4"]), CORRUPT, r"data_offsets"),
    ("offsets-three", _set(["tensors", "state.0.exp_avg", "data_offsets"], [0, 4, 8]), CORRUPT, r"data_offsets"),
    ("shard-data-offset", _set(["shards", 0, "data_offset"], 4100), CORRUPT, r"data_offset"),
    ("shard-bytes", _set(["shards", 0, "bytes"], 10), CORRUPT, r"bytes"),
    # shapes
    ("state-shape", _set(["tensors", "state.0.exp_avg", "shape"], [256, 64]), CORRUPT, r"state\.0\.exp_avg.*shape"),
    ("param-shape-record", _set(["params", 0, "shape"], [256, 64]), CORRUPT, r"shape"),
    ("shape-negative", _set(["tensors", "state.1.exp_avg", "shape"], [-64]), CORRUPT, r"shape"),
    # shards
    ("shard-index-out-of-range", _set(["tensors", "state.0.exp_avg", "shard"], 99), CORRUPT, r"shard"),
    ("shard-index-negative", _set(["tensors", "state.0.exp_avg", "shard"], -1), CORRUPT, r"shard"),
    ("shard-index-string", _set(["tensors", "state.0.exp_avg", "shard"], "0"), CORRUPT, r"shard"),
    ("shard-missing-from-list", _drop_last_shard, CORRUPT, r"shard"),
    ("shard-file-outside", _set(["shards", 0, "file"], "../elsewhere.safetensors"), CORRUPT, r"file"),
    ("shard-checksum-algorithm", _set(["shards", 0, "checksum", "algorithm"], "md5"), CORRUPT, r"md5"),
    ("shard-checksum-value", _set(["shards", 0, "checksum", "value"], 12345), CORRUPT, r"checksum"),
    # keys
    ("extra-top-level-key", _set(["surprise"], 1), CORRUPT, r"surprise"),
    ("extra-tensor-entry-key", _set(["tensors", "state.0.exp_avg", "stride"], [1]), CORRUPT, r"stride"),
    ("extra-param-record-key", _set(["params", 0, "grad"], None), CORRUPT, r"grad"),
    ("extra-tensor", lambda m: m["tensors"].update({"state.0.bogus": dict(m["tensors"]["state.0.exp_avg"])}),
     CORRUPT, r"state\.0\.bogus"),
    ("tensor-bad-name", lambda m: m["tensors"].update({"weights": m["tensors"].pop("state.0.exp_avg")}),
     CORRUPT, r"weights"),
    ("missing-tensor", _delete(["tensors", "state.2.exp_avg_sq"]), CORRUPT, r"state\.2\.exp_avg_sq"),
    ("missing-top-level-key", _delete(["tensors"]), CORRUPT, r"tensors"),
    ("missing-record-field", _delete(["params", 0, "step"]), CORRUPT, r"step"),
    # types
    ("params-not-list", _set(["params"], {"0": {}}), CORRUPT, r"params"),
    ("step-string", _set(["params", 0, "step"], "2"), CORRUPT, r"step"),
    ("step-fraction", _set(["params", 0, "step"], 1.5), CORRUPT, r"step"),
    ("step-negative", _set(["params", 0, "step"], -2.0), CORRUPT, r"step"),
    ("step-nan", _set(["params", 0, "step"], float("nan")), CORRUPT, r"step"),
    ("step-missing-for-adamw", _set(["params", 0, "step"], None), CORRUPT, r"step"),
    ("step-count-bool", _set(["step_count"], True), CORRUPT, r"step_count"),
    ("skipped-steps-negative", _set(["skipped_steps"], -1), CORRUPT, r"skipped_steps"),
    ("has-params-string", _set(["has_params"], "yes"), CORRUPT, r"has_params"),
    ("group-index-string", _set(["params", 0, "group"], "0"), CORRUPT, r"group"),
    ("group-index-out-of-range", _set(["params", 0, "group"], 3), CORRUPT, r"group"),
    ("param-records-swapped", _swap_param_records, CORRUPT, r"index"),
    # hyper-parameters: the rule's own validation, before anything is applied
    ("lr-negative", _set(["param_groups", 0, "lr"], -1), ValueError,
     r"param_groups\[0\].*Invalid learning rate: -1 \(lr must"),
    ("lr-string", _set(["param_groups", 0, "lr"], "abc"), TypeError, r"param_groups\[0\].*lr.*abc"),
    ("lr-nan", _set(["param_groups", 0, "lr"], float("nan")), ValueError, r"param_groups\[0\].*lr"),
    ("betas-out-of-range", _set(["param_groups", 0, "betas"], [1.5, 0.95]), ValueError,
     r"param_groups\[0\].*betas\[0\]"),
    ("betas-three", _set(["param_groups", 0, "betas"], [0.9, 0.95, 0.99]), ValueError, r"param_groups\[0\].*betas"),
    ("eps-negative", _set(["param_groups", 0, "eps"], -1e-8), ValueError, r"param_groups\[0\].*eps"),
    ("weight-decay-negative", _set(["param_groups", 0, "weight_decay"], -0.1), ValueError,
     r"param_groups\[0\].*weight_decay"),
    ("hyper-parameter-missing", _delete(["param_groups", 0, "eps"]), ValueError, r"param_groups\[0\].*'eps'"),
    ("lr-bad-tensor", _set(["param_groups", 0, "lr"], {"__tensor__": "x", "dtype": "float32"}), CORRUPT,
     r"param_groups\[0\].*lr"),
    ("group-params-not-ints", _set(["param_groups", 0, "params"], ["a"]), CORRUPT, r"param_groups"),
    # initialized flag and counts
    ("initialized-false", _set(["params", 0, "initialized"], False), CORRUPT, r"initialized"),
    ("initialized-string", _set(["params", 0, "initialized"], "true"), CORRUPT, r"initialized"),
    ("uninitialized-consistently", _uninitialize_everywhere, CORRUPT, r"state\.0\."),
    ("param-count", _drop_last_param, CORRUPT, r"param"),
    ("group-param-count", _drop_from_group, CORRUPT, r"param_groups"),
    # format
    ("version", _set(["version"], 99), ValueError, r"version 99"),
    ("optimizer-class", _set(["optimizer"], "SGD"), ValueError, r"SGD"),
]


def _write(ckpt, manifest: dict) -> None:
    (ckpt / "manifest.json").write_text(json.dumps(manifest, indent=1))


@pytest.mark.parametrize("name,mutate,exc,pattern", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_manifest_mutation_is_refused_by_name_and_changes_nothing(saved, target, name, mutate, exc, pattern):
    ckpt, manifest, original, _ = saved
    model, opt = target
    before = wl.snapshot(opt)
    mutated = copy.deepcopy(manifest)
    mutate(mutated)
    assert mutated != manifest, "the mutation changed nothing"
    try:
        # as is: the manifest's own checksum catches it first
        _write(ckpt, mutated)
        with pytest.raises(CORRUPT, match="manifest checksum") as info:
            load_optimizer(opt, ckpt)
        assert info.value.filename == str(ckpt / "manifest.json") and info.value.errno == errno.EIO
        wl.assert_same_snapshot(before, wl.snapshot(opt))
        # resealed: the structural checks, the optimizer fit or the shard headers catch it
        _write(ckpt, seal(mutated))
        with pytest.raises(exc, match=pattern) as info:
            load_optimizer(opt, ckpt)
        if exc is CORRUPT:
            assert str(ckpt) in info.value.filename and info.value.errno == errno.EIO
        else:
            assert str(ckpt / "manifest.json") in str(info.value)
        wl.assert_same_snapshot(before, wl.snapshot(opt))
    finally:
        (ckpt / "manifest.json").write_bytes(original)


def test_untouched_manifest_loads_and_next_step_works(saved, tmp_path):
    ckpt, _, _, digest = saved
    model, opt = wl.build("nvme", hidden=64, nvme_dir=str(tmp_path / "nv"))
    wl.train_step(model, opt, 0)
    load_optimizer(opt, ckpt)
    assert wl.digest(model, opt) == digest
    load_optimizer(opt, ckpt)  # again: torch's load_state_dict added 'differentiable' to opt.defaults
    assert wl.digest(model, opt) == digest
    wl.train_step(model, opt, 2)
    opt.close()


def test_truncated_or_unsealed_manifest_is_refused(saved, target):
    ckpt, manifest, original, _ = saved
    model, opt = target
    before = wl.snapshot(opt)
    try:
        for body, pattern in ((original[: len(original) // 2], "not valid JSON"),
                              (original[:-2], "not valid JSON"),
                              (json.dumps({k: v for k, v in manifest.items() if k != "manifest_checksum"}).encode(),
                               "manifest_checksum")):
            (ckpt / "manifest.json").write_bytes(body)
            with pytest.raises(CORRUPT, match=pattern) as info:
                load_optimizer(opt, ckpt)
            assert info.value.filename == str(ckpt / "manifest.json")
            wl.assert_same_snapshot(before, wl.snapshot(opt))
    finally:
        (ckpt / "manifest.json").write_bytes(original)


def test_refused_hyper_parameters_leave_a_cpu_optimizer_stepping(saved, tmp_path):
    """The reported sequence: lr=-1 raised, but param_groups kept it and the state was gone,
    so the next step died with KeyError: 'step'."""
    ckpt, manifest, original, _ = saved
    model, opt = wl.build("cpu", hidden=64)
    wl.train_step(model, opt, 0)
    before = wl.snapshot(opt)
    try:
        for value in (-1, [1.5, 0.9], "abc"):
            key = "betas" if isinstance(value, list) else "lr"
            _write(ckpt, seal({**manifest, "param_groups": [{**manifest["param_groups"][0], key: value}]}))
            with pytest.raises((ValueError, TypeError)):
                load_optimizer(opt, ckpt)
            wl.assert_same_snapshot(before, wl.snapshot(opt))
            assert opt.param_groups[0]["lr"] == 1e-3
    finally:
        (ckpt / "manifest.json").write_bytes(original)
    wl.train_step(model, opt, 1)  # no KeyError: the state is there


def test_torch_optimizer_target_is_also_left_untouched(saved):
    """A plain torch.optim.AdamW as the target: refused the same way, nothing applied."""
    ckpt, manifest, original, _ = saved
    torch.manual_seed(0)
    model = wl.build("cpu", hidden=64)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    wl.train_step(model, opt, 0)
    before = wl.snapshot(opt)
    try:
        for mutate in (_swap, _set(["param_groups", 0, "lr"], -1), _bitflip(3)):
            m = copy.deepcopy(manifest)
            mutate(m)
            _write(ckpt, seal(m))
            with pytest.raises((ValueError, OSError)):
                load_optimizer(opt, ckpt)
            wl.assert_same_snapshot(before, wl.snapshot(opt))
    finally:
        (ckpt / "manifest.json").write_bytes(original)
    load_optimizer(opt, ckpt)
    assert opt.state_dict()["state"][0]["step"] == 2


def test_snapshot_helper_sees_every_part_change(tmp_path):
    """The helper the refusal tests rely on must notice a change anywhere it claims to look."""
    model, opt = wl.build("nvme", hidden=64, nvme_dir=str(tmp_path / "nv"))
    wl.train_step(model, opt, 0)
    before = wl.snapshot(opt)
    wl.assert_same_snapshot(before, wl.snapshot(opt))
    s = opt.state_store.slots[2]
    changes = [
        lambda: opt.param_groups[0].__setitem__("lr", 2e-3),
        lambda: opt.param_groups[0].__setitem__("betas", [0.9, 0.95]),  # a list, not a tuple
        lambda: setattr(opt, "skipped_steps", 1),
        lambda: setattr(s, "step", s.step + 1),
        lambda: setattr(s, "life", StateLife.FORGOTTEN),
        lambda: model[0].bias.data.view(-1)[3].add_(1.0),
        lambda: opt.state_store.write(s, "exp_avg", opt.state_store.read_flat(s, "exp_avg").add(1e-3)),  # NVMe tier
    ]
    for n, change in enumerate(changes):
        change()  # the lambdas read model/opt/s at call time: each acts on a fresh optimizer
        with pytest.raises(AssertionError):
            wl.assert_same_snapshot(before, wl.snapshot(opt))
        opt.close()
        model, opt = wl.build("nvme", hidden=64, nvme_dir=str(tmp_path / f"nv{n}"))
        wl.train_step(model, opt, 0)
        before = wl.snapshot(opt)
        s = opt.state_store.slots[2]
    opt.close()


def test_version_1_manifest_without_checksum_still_loads(saved, tmp_path):
    """Checkpoints written before the manifest had its own checksum (format version 1)."""
    ckpt, manifest, original, digest = saved
    old = {k: v for k, v in manifest.items() if k != "manifest_checksum"}
    old["version"] = 1
    try:
        _write(ckpt, old)
        model, opt = wl.build("cpu", hidden=64)
        load_optimizer(opt, ckpt)
        assert wl.digest(model, opt) == digest
        # every other check still runs on them
        _write(ckpt, {**old, "params": old["params"][:-1]})
        before = wl.snapshot(opt)
        with pytest.raises(CORRUPT, match="param_groups hold"):
            load_optimizer(opt, ckpt)
        wl.assert_same_snapshot(before, wl.snapshot(opt))
    finally:
        (ckpt / "manifest.json").write_bytes(original)
