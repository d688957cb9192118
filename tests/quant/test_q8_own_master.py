"""A bf16 host parameter under a bf16 master (``master_dtype="bf16_kahan"`` or ``"bf16_sr"``) is
its own master: the fused kernel updates it in place, no copy of it is stored (2 B/param less
in RAM, in every NVMe record and in checkpoints), and ``bf16_kahan`` keeps only its int16
compensation beside it. These tests hold the layout to its contract: the same steps as the
kernel on a separate master (tests/quant/test_q8_optimizer_parity.py), rollbacks that restore
the parameter, loads of masters saved beside other parameters, and the parameter's own value
honoured as the master, as torch does for fp32."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tierstate as ts
from _q8_common import make_params, q8_offload, raw_bytes
from _q8_common import train as _train
from tierstate.checkpoint.compressed import full_state_dict
from tierstate.kernels import quant as Q


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(300, 64), torch.nn.GELU(), torch.nn.Linear(64, 5)).bfloat16()


@pytest.mark.parametrize("master", ["bf16_kahan", "bf16_sr"])
def test_no_master_copy_is_stored(master, tmp_path):
    params = make_params()
    opt = ts.AdamW(params, lr=1e-2, offload=q8_offload(tmp_path, master, nvme=0.0))
    _train(opt, params, 3)
    assert "master" not in opt.state_store.dtypes
    assert ("master.comp" in opt.state_store.dtypes) == (master == "bf16_kahan")
    for p in params:
        assert "master" not in opt.state[p]
    # host RAM holds codes, scales and (bf16_kahan) the compensation: 4.03 or 2.03 B per element
    # of the block-aligned layout (each parameter starts on a 256-value block)
    total = sum(-(-p.numel() // 256) * 256 for p in params)
    assert opt.state_store.layout.total == total
    per_param = {"bf16_kahan": 4.03125, "bf16_sr": 2.03125}[master]
    assert opt.tier_bytes() == {"host": total * per_param}
    opt.close()


@pytest.mark.parametrize("master", ["bf16_kahan", "bf16_sr"])
@pytest.mark.parametrize("mode", ["clip", "scaler"])
def test_rollback_during_backward_restores_the_parameter(master, mode, tmp_path):
    """The update during backward is speculative under clipping and a GradScaler; rolled back,
    it must restore the parameter too, since the parameter is now the master itself."""
    runs = []
    for in_backward in (False, True):
        model = _model()
        kw = dict(max_grad_norm=1e-3) if mode == "clip" else {}  # active every step: every speculation rolls back
        opt = ts.AdamW(model.parameters(), lr=1e-2, step_in_backward=in_backward, offload=ts.Offload(
            cpu=0.5, nvme=0.5, nvme_dir=str(tmp_path / f"{in_backward}"), moment_dtype="q8", master_dtype=master,
            subgroup_numel=4096), **kw)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=2) if mode == "scaler" else None
        gen = torch.Generator().manual_seed(1)
        for step in range(6):
            x = torch.randn(8, 300, generator=gen).bfloat16()
            loss = model(x).float().pow(2).mean()
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                # step 3 overflows: the scaler skips it and backs off, every speculation of it rolls back
                scaler.scale(loss * (float("inf") if step == 3 else 1.0)).backward()
                scaler.step(opt)
                scaler.update()
            opt.zero_grad(set_to_none=True)
        runs.append(([raw_bytes(p.detach()) for p in model.parameters()], opt.state_dict(), opt.rollbacks))
        opt.close()
    (pa, sa, _), (pb, sb, rollbacks) = runs
    assert rollbacks > 0  # the speculative path was taken and undone
    assert pa == pb
    for i in sa["state"]:
        assert sorted(sa["state"][i]) == sorted(sb["state"][i])
        for k, v in sa["state"][i].items():
            assert torch.equal(v, sb["state"][i][k]), (i, k)


def test_the_parameter_is_the_master_it_starts_from(tmp_path):
    """A value written into the parameter between steps is where the next update starts (as for
    fp32 parameters in torch): a stored master would have overwritten it."""
    params = make_params()
    opt = ts.AdamW(params, lr=1e-2, offload=q8_offload(tmp_path, "bf16_sr", nvme=0.5))
    _train(opt, params, 2)
    with torch.no_grad():
        params[0].fill_(0.5)
    params[0].grad = torch.zeros_like(params[0])
    for p in params[1:]:
        p.grad = None
    opt.step()  # zero gradient: only the moments' decay moves it, never back to the old values
    assert bool(((params[0].float() - 0.5).abs() < 0.05).all())
    opt.close()


def test_a_master_saved_beside_fp32_parameters_loads_into_bf16_ones(tmp_path):
    """fp32 parameters under bf16_kahan keep a bf16 master + compensation; their state dict
    loads into the same model cast to bf16 (each weight rounded to nearest even: the bf16
    master), which keeps the compensation: the fp32 weight arrives whole."""
    src = make_params(torch.float32)
    a = ts.AdamW(src, lr=1e-2, offload=q8_offload(tmp_path / "a", "bf16_kahan", nvme=0.5))
    _train(a, src, 3)
    saved = a.state_dict()
    assert saved["state"][0]["master"].dtype == torch.bfloat16
    dst = [torch.nn.Parameter(p.detach().bfloat16()) for p in src]
    b = ts.AdamW(dst, lr=1e-2, offload=q8_offload(tmp_path / "b", "bf16_kahan", nvme=0.5))
    b.load_state_dict(saved)  # the same format, part for part: no conversion
    full = full_state_dict(b)
    for i, (p, q) in enumerate(zip(src, dst)):
        st = saved["state"][i]
        assert raw_bytes(q.detach()) == raw_bytes(st["master"])
        assert torch.equal(b.state_dict()["state"][i]["master.comp"], st["master.comp"])
        assert torch.equal(full["state"][i]["master"], p.detach())  # the fp32 weight, to the bit
    a.close(), b.close()


def test_a_checkpoint_without_compensation_zeroes_it(tmp_path):
    """A bf16_sr checkpoint (no compensation) loaded into a bf16_kahan optimizer that has trained:
    the parameter is the master exactly, so its compensation must be 0, not last run's."""
    params = make_params()
    sr = ts.AdamW(params, lr=1e-2, offload=q8_offload(tmp_path / "s", "bf16_sr", nvme=0.5))
    _train(sr, params, 2)
    ts.save_optimizer(sr, tmp_path / "ckpt")
    params2 = make_params(seed=5)
    kahan = ts.AdamW(params2, lr=1e-2, offload=q8_offload(tmp_path / "k", "bf16_kahan", nvme=0.5))
    _train(kahan, params2, 3)
    assert any(bool((kahan.state_dict()["state"][i]["master.comp"] != 0).any()) for i in range(3))
    ts.load_optimizer(kahan, tmp_path / "ckpt")
    for i, (p, q) in enumerate(zip(params, params2)):
        assert torch.equal(p, q)
        assert not bool((kahan.state_dict()["state"][i]["master.comp"] != 0).any())
    sr.close(), kahan.close()


def test_a_full_state_dict_converts_into_the_parameters_compensation(tmp_path):
    """Full-precision state (an fp32 master beside bf16 parameters) loaded into bf16_kahan: the
    master's fp32 value becomes the parameter plus its compensation, to 24 significant bits."""
    params = make_params()
    full = ts.AdamW(params, lr=1e-2, offload=ts.Offload(cpu=1.0))
    _train(full, params, 3)
    sd = full.state_dict()
    q = ts.AdamW(params, lr=1e-2, offload=q8_offload(tmp_path, "bf16_kahan", nvme=0.0))
    with pytest.warns(UserWarning, match="converted"):
        q.load_state_dict(sd)
    fsd = full_state_dict(q)
    for i, p in enumerate(params):
        w = sd["state"][i]["master"].reshape(-1)
        got = fsd["state"][i]["master"].reshape(-1)
        assert bool(((got - w).abs() <= w.abs() * 2.0**-23).all())
        assert torch.equal(Q.kahan_value(p.detach().reshape(-1), q.state_dict()["state"][i]["master.comp"].reshape(-1)),
                           got)
    full.close(), q.close()


def test_a_checkpoint_that_stored_the_master_of_bf16_parameters_loads(tmp_path):
    """Checkpoints written before bf16 parameters became their own master (tierstate at
    ce7208c, 2026-12-02: 8-bit moments, bf16_kahan, bf16 parameters, half on NVMe) hold
    a ``master`` beside each parameter: it loads into the parameter, the compensation and the
    moments as they are, byte for byte."""
    import glob
    import shutil

    from safetensors import safe_open

    ckpt = tmp_path / "ckpt"
    shutil.copytree(Path(__file__).parent / "data" / "kahan_stored_master_2026-12-02", ckpt)
    saved = safe_open(glob.glob(str(ckpt / "*.safetensors"))[0], "pt")
    params = make_params(seed=42)  # other values: the checkpoint's replace them
    opt = ts.AdamW(params, lr=1e-2, offload=q8_offload(tmp_path / "nvme", "bf16_kahan", nvme=0.5))
    ts.load_optimizer(opt, ckpt)
    sd = opt.state_dict()
    for i, p in enumerate(params):
        assert raw_bytes(p.detach()) == raw_bytes(saved.get_tensor(f"param.{i}"))
        assert raw_bytes(p.detach()) == raw_bytes(saved.get_tensor(f"state.{i}.master"))  # the same value
        assert "master" not in sd["state"][i]
        for key in ("exp_avg.codes", "exp_avg.scale", "exp_avg_sq.codes", "exp_avg_sq.scale", "master.comp"):
            assert raw_bytes(sd["state"][i][key]) == raw_bytes(saved.get_tensor(f"state.{i}.{key}")), (i, key)
        assert int(sd["state"][i]["step"]) == 3
    _train(opt, params, 1)
    opt.close()


@pytest.mark.parametrize("master", ["bf16_kahan", "bf16_sr"])
@pytest.mark.parametrize("in_backward", [False, True])
def test_streamed_bf16_weights_are_their_own_master_bit_for_bit(master, in_backward, tmp_path, tiny_llama):
    """Weights streamed per block (ts.offload_weights, NVMe) are updated in their block's host
    image: there the bf16 image is the master. 6 steps equal the same model with resident
    weights, every parameter and state part, the update after backward and during it."""
    runs = []
    for streamed in (False, True):
        model = tiny_llama(layers=3).bfloat16()
        ws = ts.offload_weights(model, "nvme", nvme_dir=tmp_path / f"w{streamed}") if streamed else None
        opt = ts.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, step_in_backward=in_backward,
                       offload=q8_offload(tmp_path / f"s{streamed}", master, nvme=0.5))
        gen = torch.Generator().manual_seed(3)
        for _ in range(6):
            ids = torch.randint(0, 128, (2, 12), generator=gen)
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        values = {n: (ws.read_param(p) if ws is not None and ts.weights.streamed(p) is not None
                      else p.detach().clone()) for n, p in model.named_parameters()}
        runs.append((values, opt.state_dict()))
        opt.close()
        if ws is not None:
            ws.close()
    (want, sd_want), (got, sd_got) = runs
    assert [n for n in want if raw_bytes(want[n]) != raw_bytes(got[n])] == []
    for i, st in sd_want["state"].items():
        assert "master" not in st and sorted(st) == sorted(sd_got["state"][i])
        for k, v in st.items():
            assert torch.equal(v, sd_got["state"][i][k]), (i, k)

