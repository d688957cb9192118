"""Checkpoints of compressed state: shards keep the compressed parts, a round trip is exact
to the byte on every tier, and a checkpoint of the other format is refused with the fix."""
from __future__ import annotations

import json

import pytest
import torch

import tierstate as ts
from _q8_common import assert_same_state_then_same_steps, make_params, q8_offload as _offload, raw_bytes
from _q8_common import train as _train
from tierstate.kernels import quant as Q


def _params(dtype=torch.bfloat16):
    return make_params(dtype, seed=11)


@pytest.mark.parametrize("master", Q.MASTER_MODES)
@pytest.mark.parametrize("tiers", [(0.0, 1.0), (1.0, 0.5)], ids=["cpu-to-nvme", "nvme-to-split"])
def test_checkpoint_round_trip_is_exact_and_compressed(master, tiers, tmp_path):
    params = _params()
    opt = ts.AdamW(params, lr=1e-2, offload=_offload(tmp_path / "a", master, tiers[0]))
    _train(opt, params, 3)
    ts.save_optimizer(opt, tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    rec = manifest["params"][0]
    assert rec["quant_block"] == 256
    assert rec["state"]["exp_avg.codes"] == "uint8" and rec["state"]["exp_avg_sq.scale"] == "float32"
    # bf16 parameters are their own bf16 master: no copy of them in the shards, only the compensation
    masters = {"fp32": {"master": "float32"}, "bf16_kahan": {"master.comp": "int16"}, "bf16_sr": {}}[master]
    assert {k: v for k, v in rec["state"].items() if k.startswith("master")} == masters
    assert manifest["tensors"]["state.0.exp_avg.scale"]["shape"] == [Q.n_blocks(37 * 300, 256)]
    shard_bytes = sum(p.stat().st_size for p in (tmp_path / "ckpt").glob("*.safetensors"))
    n = sum(p.numel() for p in params)
    per_param = {"fp32": 6, "bf16_kahan": 4, "bf16_sr": 2}[master]
    assert shard_bytes < n * (per_param + 0.1) + 64 * 1024  # compressed in the shards, not expanded

    params2 = _params()
    opt2 = ts.AdamW(params2, lr=1e-2, offload=_offload(tmp_path / "b", master, tiers[1]))
    ts.load_optimizer(opt2, tmp_path / "ckpt")
    assert_same_state_then_same_steps(opt, params, opt2, params2, seed=4)
    opt.close(), opt2.close()


def test_checkpoint_of_other_format_is_refused_with_the_fix(tmp_path):
    params = _params()
    q = ts.AdamW(params, lr=1e-2, offload=_offload(tmp_path / "q", "bf16_kahan", 0.0))
    _train(q, params, 2)
    ts.save_optimizer(q, tmp_path / "qckpt")
    full = ts.AdamW(_params(), lr=1e-2, offload=ts.Offload(cpu=1.0))
    before = full.state_dict()
    with pytest.raises(ValueError, match=r"state is compressed, this optimizer keeps .*load_state_dict"):
        ts.load_optimizer(full, tmp_path / "qckpt")
    assert full.state_dict()["state"] == before["state"] == {}
    sr = ts.AdamW(_params(), lr=1e-2, offload=_offload(tmp_path / "s", "bf16_sr", 0.0))
    with pytest.raises(ValueError, match=r"compressed with a int16 'master.comp'"):
        ts.load_optimizer(sr, tmp_path / "qckpt")
    torch_opt = torch.optim.AdamW(_params(), lr=1e-2)
    with pytest.raises(ValueError, match="full_state_dict"):
        ts.load_optimizer(torch_opt, tmp_path / "qckpt")
    for o in (q, full, sr):
        o.close()


def test_damaged_manifest_part_is_refused(tmp_path):
    from tierstate.checkpoint.durable import CorruptCheckpointError
    from tierstate.checkpoint.manifest import check_manifest

    params = _params()
    q = ts.AdamW(params, lr=1e-2, offload=_offload(tmp_path / "q", "fp32", 0.0))
    _train(q, params, 1)
    ts.save_optimizer(q, tmp_path / "ck")
    m = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    m.pop("manifest_checksum")
    m["params"][0]["state"]["exp_avg.codes"] = "float32"
    with pytest.raises(CorruptCheckpointError, match=r"a '.codes' part is uint8"):
        check_manifest(m, "manifest.json", with_checksum=False)
    m = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    m.pop("manifest_checksum")
    del m["params"][1]["quant_block"]
    with pytest.raises(CorruptCheckpointError, match="no 'quant_block'"):
        check_manifest(m, "manifest.json", with_checksum=False)
    q.close()


@pytest.mark.parametrize("maps", Q.MAP_FAMILIES)
def test_mmap_state_dict_and_dcp_round_trip(maps, tmp_path):
    """A file-backed state dict of NVMe compressed state (per-block scales included) equals
    state_dict(), and DCP saves and loads it back byte for byte, in both map families."""
    import torch.distributed.checkpoint as dcp

    from tierstate.checkpoint import mmap_state_dict

    params = _params()
    opt = ts.AdamW(params, lr=1e-2, offload=_offload(tmp_path / "n", "bf16_sr", 1.0, maps=maps))
    _train(opt, params, 2)
    sd = opt.state_dict()
    mapped = mmap_state_dict(opt, tmp_path / "scratch")
    for i in sd["state"]:
        for key, value in sd["state"][i].items():
            assert torch.equal(value, mapped["state"][i][key]), (i, key)
    assert f"exp_avg.{Q.CODES_PART[maps]}" in sd["state"][0]
    dcp.save(sd, checkpoint_id=str(tmp_path / "dcp"))
    target = mmap_state_dict(opt, tmp_path / "scratch2", host_views=False)
    for st in target["state"].values():
        for key, value in st.items():
            if key != "step":
                value.zero_()
    dcp.load(target, checkpoint_id=str(tmp_path / "dcp"))
    for i in sd["state"]:
        for key, value in sd["state"][i].items():
            assert raw_bytes(value) == raw_bytes(target["state"][i][key]), (i, key)
    opt.close()
