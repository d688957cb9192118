"""step_in_backward=True on CUDA: gradients streamed per parameter, updates during backward,
weights uploaded in step(). Bit for bit the plain step's result. Skipped without a GPU."""
from __future__ import annotations

import pytest
import torch

import tierstate as ts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def net(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    # a 4M-element first layer spans several sub-groups of 1 Mi elements
    return torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 256),
                               torch.nn.GELU(), torch.nn.Linear(256, 16)).to("cuda", dtype)


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_step_in_backward_equals_the_plain_step(kind: str, dtype: torch.dtype, tmp_path) -> None:
    models = [net(dtype) for _ in range(2)]
    opts = []
    for i, model in enumerate(models):
        if kind == "cpu":
            offload = ts.Offload(cpu=1.0, subgroup_numel=1 << 20)
        else:
            offload = ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=tmp_path / f"o{i}", subgroup_numel=1 << 20,
                                 buffer_count=3)
        opts.append(ts.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, offload=offload,
                             step_in_backward=bool(i)))
    assert all(o._engine.parts.grads.stream is not None for o in opts), "CUDA parameters stream their gradients"
    gen = torch.Generator().manual_seed(1)
    for _ in range(8):
        x = torch.randn(16, 2048, generator=gen).to("cuda", dtype)
        for model, opt in zip(models, opts):
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    torch.cuda.synchronize()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)
    sa, sb = opts[0].state_dict()["state"], opts[1].state_dict()["state"]
    for index in sa:
        for key in sa[index]:
            assert torch.equal(sa[index][key], sb[index][key]), (index, key)
    for o in opts:
        o.close()
