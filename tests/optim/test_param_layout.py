"""Parameters whose memory is not laid out row-major: a transposed weight, a channels_last
convolution, a gradient with other strides than its parameter's.

torch's optimizers take any dense parameter. tierstate updates a parameter in place through
a flat view of its memory (its own master) or writes the new weights into it that way, so a
parameter that is not contiguous (dense, or a slice with gaps between its elements, such as
``torch.randn(10, 5, 2)[..., 0]`` in torch's own ``test_forloop_goes_right_direction``) is
given contiguous storage once, at construction (its values, the Parameter object, its name
and hooks stay; a warning names it), as a parameter is moved onto huge pages. One whose memory
another tensor shares (a view the user keeps, the tensor it was sliced from) or that overlaps
itself (an expanded tensor) cannot be moved without the other tensor missing the updates, and
is refused by name.
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


GRAD_LAYOUTS = {
    "transposed": lambda: torch.randn(8, 6).t(),  # strides (1, 6)
    "sliced": lambda: torch.randn(6, 8, 2)[..., 0],  # strides (16, 2): gaps between the elements
    "expanded": lambda: torch.randn(1, 8).expand(6, 8),  # strides (0, 1): one row read six times
}


@pytest.mark.parametrize("placement", ["cpu", "nvme"])
@pytest.mark.parametrize("layout", GRAD_LAYOUTS)
def test_gradient_with_other_strides_than_its_parameter(tmp_path, layout, placement) -> None:
    """A gradient assigned by hand may be laid out unlike its parameter; torch's optimizers
    read it as it is (found 2026-12-07: a sliced one failed with "grad_sumsq: grad must be
    contiguous")."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(6, 8))
    q = torch.nn.Parameter(p.detach().clone())
    offload = "cpu" if placement == "cpu" else ts.Offload(nvme=1.0, nvme_dir=tmp_path)
    ours = ts.AdamW([p], lr=1e-2, offload=offload, max_grad_norm=1.0)
    ref = torch.optim.AdamW([q], lr=1e-2, foreach=False)
    for step in range(8):
        g = GRAD_LAYOUTS[layout]()
        p.grad, q.grad = g, g.clone()
        torch.nn.utils.clip_grad_norm_([q], 1.0)
        ours.step()
        ref.step()
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"], rtol=1e-5, atol=1e-7)
    ours.close()


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


def test_sliced_parameter_trains_as_a_contiguous_one() -> None:
    """A slice with gaps between its elements, nothing else on its storage (torch's
    test_forloop_goes_right_direction builds its non-contiguous parameters so): given
    contiguous memory with the warning, then bit for bit as the same values row-major."""
    torch.manual_seed(0)
    sliced = torch.nn.Parameter(torch.randn(10, 5, 2)[..., 0])  # strides (10, 2)
    flat = torch.nn.Parameter(sliced.detach().clone())
    with pytest.warns(UserWarning, match=r"params\[0\] \(shape \(10, 5\), strides \(10, 2\)\)"):
        ours = ts.AdamW([sliced], lr=1e-2)
    assert sliced.is_contiguous() and torch.equal(sliced.detach(), flat.detach())
    twin = ts.AdamW([flat], lr=1e-2)
    for _ in range(8):
        g = torch.randn(10, 5)
        sliced.grad, flat.grad = g, g.clone()
        ours.step()
        twin.step()
    assert torch.equal(sliced.detach(), flat.detach())
    assert torch.equal(ours.state[sliced]["exp_avg_sq"], twin.state[flat]["exp_avg_sq"])


def test_sliced_parameter_whose_base_is_kept_is_refused() -> None:
    base = torch.randn(10, 5, 2)
    sliced = torch.nn.Parameter(base[..., 0])  # base keeps seeing this memory
    with pytest.raises(ValueError, match=r"params\[0\] \(shape \(10, 5\), strides \(10, 2\)\) is not contiguous.*"
                                         r"shares its memory.*contiguous\(\)"):
        ts.AdamW([sliced], lr=1e-3)
    assert sliced.data_ptr() == base.data_ptr(), "nothing may change on refusal"


TORCH_OPTIMS = {"Adam": ts.Adam, "AdamW": ts.AdamW, "SGD": ts.SGD, "Adagrad": ts.Adagrad}


def _torch_inputs(name: str) -> tuple[list, list]:
    """torch's optim_db entry of ``name``: its CPU inputs (fresh objects: a tensor lr is changed
    in place by the schedulers) with each foreach switch, and its scheduler inputs."""
    from torch.testing._internal.common_optimizers import (
        _get_optim_inputs_including_global_cliquey_kwargs, optim_db)

    info = next(i for i in optim_db if i.optim_cls.__name__ == name)
    inputs = _get_optim_inputs_including_global_cliquey_kwargs("cpu", torch.float32, info,
                                                               skip=("differentiable", "fused"))
    return inputs, info.scheduler_inputs


def _right_direction_cases():
    try:
        import expecttest  # noqa: F401 - torch's optim_db imports it
    except ImportError:
        return [pytest.param(None, 0, marks=pytest.mark.skip(reason="pip install 'tierstate[test]' (expecttest)"))]
    return [pytest.param(name, i, id=f"{name}-{oi.desc}")
            for name in TORCH_OPTIMS for i, oi in enumerate(_torch_inputs(name)[0])]


@pytest.mark.parametrize("with_lrsched", [False, True])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("name, index", _right_direction_cases())
def test_forloop_goes_right_direction(name, index, contiguous, with_lrsched) -> None:
    """torch's own test_forloop_goes_right_direction, on tierstate's optimizer of the same name:
    every CPU optim_db input (with each foreach switch), parameters contiguous or sliced with
    gaps, without LR schedulers and with each of the entry's scheduler lists; after 20 steps
    the loss is lower (higher with maximize) than before."""
    for schedulers_of in (_torch_inputs(name)[1] if with_lrsched else [None]):
        kwargs = _torch_inputs(name)[0][index].kwargs  # fresh for each scheduler list, as torch's test
        torch.manual_seed(0)
        if contiguous:
            weight, bias = torch.nn.Parameter(torch.randn(10, 5)), torch.nn.Parameter(torch.randn(10))
        else:
            weight = torch.nn.Parameter(torch.randn(10, 5, 2)[..., 0])
            bias = torch.nn.Parameter(torch.randn(10, 2)[..., 0])
        inpt = torch.randn(5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the sliced parameters' "not contiguous"
            optimizer = TORCH_OPTIMS[name]([weight, bias], **kwargs)
        schedulers = [make(optimizer) for make in (schedulers_of or [])]

        def closure():
            optimizer.zero_grad()
            loss = (weight.mv(inpt) + bias).pow(2).sum()
            loss.backward()
            return loss

        initial = closure().item()
        for _ in range(20):
            loss = closure()
            optimizer.step()
            for scheduler in schedulers:
                if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                    scheduler.step(loss)
                else:
                    scheduler.step()
        final = closure().item()
        if kwargs.get("maximize", False):
            assert final > initial
        else:
            assert final < initial
