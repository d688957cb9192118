"""Parameters whose memory is not laid out row-major: a transposed weight, a channels_last
convolution, a gradient with other strides than its parameter's.

torch's optimizers take any dense parameter. tierstate updates a parameter in place through
a flat view of its memory (its own master) or writes the new weights into it that way, so a
parameter that is dense but not contiguous is given contiguous storage once, at
construction (its values, the Parameter object, its name and hooks stay; a warning names
it), as a parameter is moved onto huge pages. One whose memory another tensor shares (a
view the user keeps) or that overlaps itself (an expanded tensor) cannot be moved without
the other tensor missing the updates, and is refused by name.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import tierstate as ts


class ConvNet(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.head = torch.nn.Linear(8, 4)
        # a weight kept transposed, as some checkpoints' converters leave it
        self.proj = torch.nn.Parameter(torch.randn(4, 8).t())  # strides (1, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x).mean(dim=(2, 3))
        return self.head(h) + h @ self.proj


def _nets(dtype: torch.dtype) -> tuple[ConvNet, ConvNet]:
    nets = []
    for _ in range(2):
        net = ConvNet(0).to(dtype).to(memory_format=torch.channels_last)
        nets.append(net)
    assert not nets[0].conv.weight.is_contiguous() and not nets[0].proj.is_contiguous()
    return nets[0], nets[1]


def _train(net: ConvNet, opt, steps: int = 8) -> None:
    gen = torch.Generator().manual_seed(3)
    dtype = net.head.weight.dtype
    for _ in range(steps):
        x = torch.randn(2, 3, 6, 6, generator=gen).to(dtype).to(memory_format=torch.channels_last)
        opt.zero_grad(set_to_none=True)
        net(x).float().square().mean().backward()
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("placement", ["cpu", "nvme"])
def test_non_contiguous_parameters_train_as_contiguous_ones(tmp_path, placement, dtype) -> None:
    """Bit for bit as the same model with contiguous parameters, and (fp32) as torch's AdamW."""
    ours_net, ref_net = _nets(dtype)
    flat_net = ConvNet(0).to(dtype)  # the same values, row-major
    flat_net.proj.data = flat_net.proj.data.contiguous()
    assert all(p.is_contiguous() for p in flat_net.parameters())
    params = list(ours_net.parameters())
    before = [p.detach().clone() for p in params]

    def offload(name):
        return "cpu" if placement == "cpu" else ts.Offload(nvme=1.0, nvme_dir=tmp_path / name, subgroup_numel=1024)

    with pytest.warns(UserWarning, match=r"2 parameters were not contiguous: params\[0\] \(shape \(8, 4\), strides \(1, 8\)\), "
                                         r"params\[1\] \(shape \(8, 3, 3, 3\), strides \(27, 1, 9, 3\)\)") as caught:
        ours = ts.AdamW(ours_net.parameters(), lr=1e-2, weight_decay=0.1, offload=offload("ours"))
    ours_warning = [w for w in caught if "not contiguous" in str(w.message)]
    assert [w.filename for w in ours_warning] == [__file__], "the warning names the line that built the optimizer"
    assert [p is q for p, q in zip(params, ours_net.parameters())] == [True] * len(params)
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before)), "values must not change"
    assert all(p.is_contiguous() for p in params)
    flat = ts.AdamW(flat_net.parameters(), lr=1e-2, weight_decay=0.1, offload=offload("flat"))
    _train(ours_net, ours)
    _train(flat_net, flat)
    for (name, p), q in zip(ours_net.named_parameters(), flat_net.parameters()):
        assert torch.equal(p.detach(), q.detach()), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ours.state[p][key], flat.state[q][key]), f"{name} {key}"
    if dtype == torch.float32:
        ref = torch.optim.AdamW(ref_net.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
        _train(ref_net, ref)
        for (name, p), q in zip(ours_net.named_parameters(), ref_net.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(ours.state[p][key], ref.state[q][key], rtol=1e-5, atol=1e-6,
                                           msg=f"{name} {key}")
    ours.close()
    flat.close()


def test_gradient_with_other_strides_than_its_parameter() -> None:
    """A gradient assigned by hand may be laid out unlike its parameter."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(6, 8))
    q = torch.nn.Parameter(p.detach().clone())
    ours = ts.AdamW([p], lr=1e-2, offload="cpu")
    ref = torch.optim.AdamW([q], lr=1e-2, foreach=False)
    for step in range(8):
        g = torch.randn(8, 6).t()  # strides (1, 6)
        p.grad, q.grad = g, g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"], rtol=1e-5, atol=1e-7)


def test_non_contiguous_parameter_sharing_memory_is_refused() -> None:
    base = torch.randn(8, 6)
    shared = torch.nn.Parameter(base.t())  # base keeps seeing this memory
    other = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match=r"params\[1\] \(shape \(6, 8\), strides \(1, 6\)\) is not contiguous.*"
                                         r"shares its memory.*contiguous\(\)"):
        ts.AdamW([other, shared], lr=1e-3, offload="cpu")
    assert not shared.is_contiguous() and shared.data_ptr() == base.data_ptr(), "nothing may change on refusal"


def test_expanded_parameter_is_refused() -> None:
    p = torch.nn.Parameter(torch.randn(1, 6).expand(4, 6))
    with pytest.raises(ValueError, match=r"params\[0\] \(shape \(4, 6\), strides \(0, 1\)\).*overlap"):
        ts.SGD([p], lr=1e-3, offload="cpu")


def test_contiguous_parameters_are_left_alone() -> None:
    net = torch.nn.Linear(4, 4)
    ptrs = [p.data_ptr() for p in net.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ts.SGD(net.parameters(), lr=1e-3, offload="cpu")
    assert [p.data_ptr() for p in net.parameters()] == ptrs
