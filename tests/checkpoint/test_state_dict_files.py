"""opt.state_dict() of NVMe state larger than RAM: file-backed tensors, same values."""
from __future__ import annotations

import pytest
import torch

import tierstate as ts


def build(tmp_path, moment_dtype=torch.float32):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8)).bfloat16()
    opt = ts.AdamW(net.parameters(), lr=1e-2, offload=ts.Offload(
        cpu=0.0, nvme=1.0, nvme_dir=tmp_path / "nv", subgroup_numel=2048, buffer_count=2, moment_dtype=moment_dtype))
    return net, opt


def train(net, opt, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        net(torch.randn(16, 64, generator=gen).bfloat16()).float().pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
def test_file_backed_state_dict_equals_the_materialised_one_and_resumes(tmp_path, moment_dtype) -> None:
    net, opt = build(tmp_path, moment_dtype)
    train(net, opt, 3, seed=1)
    opt.state_dict_mmap = False
    plain = opt.state_dict()
    opt.state_dict_mmap = True
    mapped = opt.state_dict()
    assert plain.keys() == mapped.keys() and plain["state"].keys() == mapped["state"].keys()
    for i, st in plain["state"].items():
        assert st.keys() == mapped["state"][i].keys()
        for key, value in st.items():
            assert torch.equal(value, mapped["state"][i][key]), f"{i}/{key}"
            if key != "step" and value.numel():
                # backed by a mapping of an unlinked file, not by anonymous memory
                assert mapped["state"][i][key].untyped_storage().filename is not None
    assert not any((tmp_path / "nv" / "state-dict").iterdir()), "scratch files must be unlinked"
    # a CPU-mode optimizer resumes from it exactly like the NVMe one goes on
    net2 = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8)).bfloat16()
    net2.load_state_dict(net.state_dict())
    opt2 = ts.AdamW(net2.parameters(), lr=1e-2, offload=ts.Offload(moment_dtype=moment_dtype))
    opt2.load_state_dict(mapped)
    train(net, opt, 2, seed=2)
    train(net2, opt2, 2, seed=2)
    for a, b in zip(net.parameters(), net2.parameters()):
        assert torch.equal(a, b)
    opt.close()
