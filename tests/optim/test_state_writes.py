"""Writes into ``optimizer.state`` reach the state, as in torch (see [Note: writes into
optimizer.state] in src/tierstate/optim/state_view.py).

Found 2026-12-07: ``state["exp_avg"].zero_()`` on state held on NVMe (a copy read on demand)
and any assignment ``state[key] = value`` (state in RAM too) were silently dropped.
"""
from __future__ import annotations

import collections
import gc

import pytest
import torch

import tierstate as ts

PLACES = ["cpu", "nvme", "split"]


def _offload(kind, tmp_path):
    if kind == "cpu":
        return "cpu"
    if kind == "nvme":
        return ts.Offload(nvme=1.0, nvme_dir=str(tmp_path / "nv"))
    return ts.Offload(cpu=0.5, nvme=0.5, nvme_dir=str(tmp_path / "nv"), subgroup_numel=1024)


def _pair(kind, tmp_path, numel=4000):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(numel))
    q = torch.nn.Parameter(p.detach().clone())
    return p, q, ts.AdamW([p], lr=1e-2, offload=_offload(kind, tmp_path)), torch.optim.AdamW([q], lr=1e-2)


def _train(p, q, ours, theirs, steps, edit):
    gen = torch.Generator().manual_seed(1)
    for i in range(steps):
        g = torch.randn(p.shape, generator=gen)
        p.grad, q.grad = g, g.clone()
        if i == 3:
            edit(ours, p)
            edit(theirs, q)
        ours.step()
        theirs.step()


def _assert_matches(p, q, ours, theirs):
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    for key, value in theirs.state[q].items():
        torch.testing.assert_close(ours.state[p][key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("kind", PLACES)
def test_state_written_in_place_through_a_lookup_reaches_the_state(tmp_path, kind) -> None:
    def edit(opt, param):
        opt.state[param]["exp_avg"].zero_()
        opt.state[param]["exp_avg_sq"].mul_(0.5)

    p, q, ours, theirs = _pair(kind, tmp_path)
    _train(p, q, ours, theirs, 7, edit)
    _assert_matches(p, q, ours, theirs)
    ours.close()


@pytest.mark.parametrize("kind", PLACES)
def test_state_assigned_reaches_the_state(tmp_path, kind) -> None:
    def edit(opt, param):
        opt.state[param]["exp_avg"] = torch.zeros_like(param)
        opt.state[param]["step"] = torch.tensor(100.0)

    p, q, ours, theirs = _pair(kind, tmp_path)
    _train(p, q, ours, theirs, 7, edit)
    _assert_matches(p, q, ours, theirs)
    assert float(ours.state[p]["step"]) == float(theirs.state[q]["step"]) == 104.0
    assert float(ours.state_dict()["state"][0]["step"]) == 104.0
    ours.close()


@pytest.mark.parametrize("kind", PLACES)
def test_state_given_back_to_itself_changes_nothing(tmp_path, kind) -> None:
    """What frameworks do to move the state "to" the CPU: every entry assigned as it is."""
    def edit(opt, param):
        st = opt.state[param]
        for key, value in list(st.items()):
            if key != "step":
                st[key] = value.to("cpu")

    p, q, ours, theirs = _pair(kind, tmp_path)
    _train(p, q, ours, theirs, 6, edit)
    _assert_matches(p, q, ours, theirs)
    ours.close()


def test_a_state_assigned_of_another_size_is_refused_by_name() -> None:
    p = torch.nn.Parameter(torch.randn(10, 4))
    opt = ts.AdamW([p])
    p.grad = torch.randn(10, 4)
    opt.step()
    with pytest.raises(ValueError, match=r"optimizer.state\[params\[0\]\]\['exp_avg'\] = a tensor of shape \(3,\)"):
        opt.state[p]["exp_avg"] = torch.zeros(3)


def test_an_unwritten_copy_is_freed_once_dropped_and_a_stale_one_is_let_go(tmp_path) -> None:
    p, _, opt, _ = _pair("nvme", tmp_path)
    p.grad = torch.randn(p.shape)
    opt.step()
    copies = opt._engine.copies
    for _ in range(3):
        float(opt.state[p]["exp_avg"].sum())  # read and dropped: nothing to keep
    gc.collect()
    assert not copies._watched, "copies nobody holds or wrote are still kept"
    held = opt.state[p]["exp_avg_sq"]
    before = held.clone()
    opt.step()  # the copy now shows the state before this step
    held.fill_(123.0)
    opt.step()
    assert not torch.equal(opt.state[p]["exp_avg_sq"], torch.full_like(before, 123.0 * 0.999)), \
        "a copy read before a step was written back over the state after it"
    opt.close()


def test_a_copy_read_before_a_load_is_let_go(tmp_path) -> None:
    p, _, opt, _ = _pair("nvme", tmp_path)
    p.grad = torch.randn(p.shape)
    opt.step()
    saved = opt.state_dict()
    held = opt.state[p]["exp_avg"]
    opt.load_state_dict(saved)
    held.zero_()  # after the load: the copy shows the state before it
    loaded = opt.state[p]["exp_avg"]
    assert torch.equal(loaded, saved["state"][0]["exp_avg"]) and bool(loaded.abs().sum() > 0)
    opt.close()


def _reset(how):
    def edit(opt, param):
        if how == "clear":
            opt.state.clear()
        elif how == "reassign":
            opt.state = collections.defaultdict(dict)
        elif how == "del":
            del opt.state[param]
        else:  # a state of the user's own making
            opt.state[param] = {"step": torch.tensor(2.0), "exp_avg": torch.full_like(param, 0.01),
                                "exp_avg_sq": torch.full_like(param, 1e-4)}
    return edit


@pytest.mark.parametrize("kind", PLACES)
@pytest.mark.parametrize("how", ["clear", "reassign", "del", "assign a dict"])
def test_state_entries_dropped_or_replaced_reset_or_set_the_state(tmp_path, kind, how) -> None:
    """torch code resets optimizer state by dropping ``optimizer.state``'s entries (found
    2026-12-07: the next step raised KeyError 'step') and sets it by assigning a dict."""
    p, q, ours, theirs = _pair(kind, tmp_path)
    _train(p, q, ours, theirs, 7, _reset(how))
    _assert_matches(p, q, ours, theirs)
    assert float(ours.state[p]["step"]) == float(theirs.state[q]["step"])
    ours.close()


def test_state_dropped_resets_the_state_with_the_update_in_backward(tmp_path) -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8)
    ref = torch.nn.Linear(16, 8)
    ref.load_state_dict(lin.state_dict())
    ours = ts.AdamW(lin.parameters(), lr=1e-2, step_in_backward=True)
    theirs = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for i in range(6):
        x = torch.randn(4, 16, generator=gen)
        if i == 3:
            ours.state.clear()
            theirs.state.clear()
        for model, opt in ((lin, ours), (ref, theirs)):
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
    for p, q in zip(lin.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
        assert float(ours.state[p]["step"]) == float(theirs.state[q]["step"]) == 3.0
    ours.close()
