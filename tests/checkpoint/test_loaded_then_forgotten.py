"""A state written by a streaming load, then forgotten by a load_state_dict without it, starts
from its init values at its next step (as torch's does), not from the values the first load wrote."""
from __future__ import annotations

import pytest
import torch

import tierstate as ts


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))


def _step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(4, 8, generator=g)).square().sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_state_loaded_by_stream_then_forgotten_restarts_from_init(tmp_path, offload):
    kw = {"nvme_dir": tmp_path / "nv"} if offload == "nvme" else {}
    src_model = _model(0)
    src = ts.AdamW(src_model.parameters(), lr=1e-2, offload=offload, **kw)
    for i in range(3):
        _step(src_model, src, i)
    ts.save_optimizer(src, tmp_path / "ckpt")
    sd_partial = src.state_dict()
    sd_partial = {"param_groups": sd_partial["param_groups"],
                  "state": {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in sd_partial["state"].items() if k != 0}}
    src.close()

    model = _model(1)
    kw2 = {"nvme_dir": tmp_path / "nv2"} if offload == "nvme" else {}
    opt = ts.AdamW(model.parameters(), lr=1e-2, offload=offload, **kw2)
    ts.load_optimizer(opt, tmp_path / "ckpt")  # every state, written through the tiers
    opt.load_state_dict(sd_partial)  # parameter 0 has no state now

    ref_model = _model(1)
    ref_model.load_state_dict(model.state_dict())  # load_optimizer restored the saved weights too
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    ref.load_state_dict(sd_partial)
    for i in range(3, 5):
        _step(model, opt, i)
        _step(ref_model, ref, i)
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(opt.state_dict()["state"][0][key], ref.state_dict()["state"][0][key])
    torch.testing.assert_close(model[0].weight, ref_model[0].weight)
    opt.close()
