"""step_in_backward=True with clipping, GradScaler and gradient accumulation: bit for bit the plain step.

Updates during backward are speculative (see tierstate.pipeline.backward, [Note: speculative
updates and rollback]): they stand when the plain step would have made the same ones, and are
rolled back otherwise. Every case here trains two copies of the tied-embedding model of
test_step_in_backward.py, one with the plain step and one in-backward, and compares parameters,
every state key and the losses exactly, on the backward thread and on the worker, in host RAM
and on NVMe.
"""
from __future__ import annotations

import math

import pytest
import torch
from test_step_in_backward import SG, WHERE, assert_same_state, loss_of, make_net, offload, run_updates_on

import tierstate as ts


def _opt(net, kind: str, tmp_path, tag: str, in_backward: bool, where: str, **kw):
    opt = ts.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, offload=offload(kind, tmp_path, tag),
                   step_in_backward=in_backward, **kw)
    return run_updates_on(opt, where) if in_backward else opt


def _train(net, opt, steps: int, micro: int = 1, scaler=None, overflow_at: int = -1) -> list[float]:
    gen = torch.Generator().manual_seed(1)
    losses = []
    for i in range(steps):
        for k in range(micro):
            loss = loss_of(net, i * micro + k, gen) / micro
            if i == overflow_at and k == micro - 1:
                loss = loss * math.inf  # every gradient inf: GradScaler must skip and back off
            (scaler.scale(loss) if scaler is not None else loss).backward()
            losses.append(loss.item())
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def _same(nets, opts) -> None:
    for p, q in zip(nets[0].parameters(), nets[1].parameters()):
        assert torch.equal(p, q)
    assert_same_state(*opts)
    assert opts[0].last_grad_norm == opts[1].last_grad_norm


def _pair(kind, tmp_path, where, dtype=torch.float32, **kw):
    nets = [make_net(dtype) for _ in range(2)]
    opts = [_opt(n, kind, tmp_path, f"o{i}", bool(i), where, **kw) for i, n in enumerate(nets)]
    return nets, opts


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("kind", ["cpu", "nvme"])
@pytest.mark.parametrize("max_grad_norm", [0.02, 1e6])
def test_clipping(kind, where, max_grad_norm, tmp_path) -> None:
    nets, opts = _pair(kind, tmp_path, where, max_grad_norm=max_grad_norm)
    losses = [_train(n, o, steps=6) for n, o in zip(nets, opts)]
    assert losses[0] == losses[1]
    _same(nets, opts)
    if max_grad_norm == 0.02:  # the norm is ~0.04 here: clipping active, each speculative step rolled back
        assert opts[0].last_grad_norm > 0.02
        # the first step takes nothing during backward (it learns the passes per step)
        # a rollback at the second step (the first takes nothing during backward), then the next
        # 2 steps hold (no update during backward), then one more try
        assert 1 <= opts[1].rollbacks <= 2
    else:  # never active: every speculative update stands
        assert opts[1].rollbacks == 0
    for o in opts:
        o.close()


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_scaler_with_an_overflow_step(dtype, where, tmp_path) -> None:
    nets, opts = _pair("cpu", tmp_path, where, dtype=dtype, max_grad_norm=1e6)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=3) for _ in range(2)]
    losses = [_train(n, o, steps=8, scaler=s, overflow_at=4) for n, o, s in zip(nets, opts, scalers)]
    assert losses[0] == losses[1]
    _same(nets, opts)
    assert scalers[0].get_scale() == scalers[1].get_scale()
    assert opts[0].skipped_steps == opts[1].skipped_steps == 1
    # rolled back: the second step (its scale was unknown during backward), then steps after a
    # hold when the scale moved (growth every 3 steps, the overflow's backoff); the others stand
    assert 1 <= opts[1].rollbacks < 7
    for o in opts:
        o.close()


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_gradient_accumulation(kind, where, tmp_path) -> None:
    nets, opts = _pair(kind, tmp_path, where)
    losses = [_train(n, o, steps=5, micro=3) for n, o in zip(nets, opts)]
    assert losses[0] == losses[1]
    _same(nets, opts)
    # the first step learns that 3 backward passes make a step; then only the third pass updates;
    # its updates stand except when the side branch (unused in the third micro-batch of odd steps)
    # has a gradient from an earlier pass, which the last pass did not finish
    assert opts[1].rollbacks <= 2
    for o in opts:
        o.close()


def test_unscale_and_clip_grad_norm_by_hand_roll_back(tmp_path) -> None:
    """The AMP recipe: scaler.unscale_(opt) and torch's clip_grad_norm_ change the gradients in
    place after their hooks: the speculative updates used the old values and are rolled back."""
    nets, opts = _pair("cpu", tmp_path, "backward-thread")
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 4) for _ in range(2)]
    gen = [torch.Generator().manual_seed(1) for _ in range(2)]
    for i in range(3):
        for net, opt, scaler, g in zip(nets, opts, scalers, gen):
            scaler.scale(loss_of(net, i, g)).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    _same(nets, opts)
    assert opts[1].rollbacks == 1  # the first step took nothing during backward, the third held
    for o in opts:
        o.close()


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_clip_grad_norm_by_hand_without_a_scaler_is_the_plain_step(kind, where, tmp_path) -> None:
    """torch's clip_grad_norm_ between backward and step(), with neither max_grad_norm nor a
    scaler: the first step sees the gradients change after their hooks, so the updates during
    backward stay speculative (and roll back) from then on. Before, the steps after the first
    updated during backward with the unclipped gradients, without a copy, and silently
    differed from the plain step (every parameter, 0 rollbacks)."""
    nets, opts = _pair(kind, tmp_path, where)
    gens = [torch.Generator().manual_seed(1) for _ in range(2)]
    for i in range(6):
        for net, opt, gen in zip(nets, opts, gens):
            loss_of(net, i, gen).backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.01)  # active: the norm is ~0.04 here
            opt.step()
            opt.zero_grad(set_to_none=True)
    _same(nets, opts)
    assert opts[1].rollbacks >= 1
    for o in opts:
        o.close()


@pytest.mark.parametrize("where", WHERE)
def test_a_gradient_changed_after_an_update_that_cannot_be_undone_is_an_error(where, tmp_path) -> None:
    """A change first made after the steps that learned there was none (clipping switched on
    at step 3): the updates during backward used the gradients as backward left them and kept
    no copy. step() says so, naming the fix, instead of returning as if it were the plain step;
    the steps after it speculate, and are the plain step's again."""
    nets, opts = _pair("cpu", tmp_path, where)
    gen = [torch.Generator().manual_seed(1) for _ in range(2)]
    for i in range(6):
        for j, (net, opt, g) in enumerate(zip(nets, opts, gen)):
            loss_of(net, i, g).backward()
            if i >= 3:
                torch.nn.utils.clip_grad_norm_(net.parameters(), 0.01)
            if j == 1 and i == 3:
                with pytest.raises(RuntimeError, match=r"changed after backward.*max_grad_norm"):
                    opt.step()
                for p, q in zip(nets[0].parameters(), net.parameters()):  # continue from the plain run
                    with torch.no_grad():
                        q.copy_(p)
                opt.load_state_dict(opts[0].state_dict())
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
    _same(nets, opts)
    for o in opts:
        o.close()


def test_state_moves_during_backward_when_clipping_is_inactive(tmp_path) -> None:
    """Speculation is not a deferral: with clipping configured but not active the updates run
    during backward (the cpu_update phase is booked before step() is called)."""
    net = make_net(torch.float32)
    opt = ts.AdamW(net.parameters(), lr=1e-2, max_grad_norm=1e6, offload=ts.Offload(subgroup_numel=SG),
                   step_in_backward=True)
    _train(net, opt, steps=1)
    before = {name: p.detach().clone() for name, p in net.named_parameters()}
    loss_of(net, 5, torch.Generator().manual_seed(3)).backward()
    moved = [name for name, p in net.named_parameters() if not torch.equal(p, before[name])]
    assert "down.weight" in moved
    opt.step()
    assert opt.rollbacks == 0
    opt.close()


def test_more_backward_passes_than_learned_is_refused_with_the_state_rolled_back(tmp_path) -> None:
    nets, opts = _pair("cpu", tmp_path, "backward-thread", max_grad_norm=1e6)
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):  # every micro-batch uses every parameter (even index: the side branch too)
        for o, n in zip(opts, nets):
            loss_of(n, 0, gen).backward()
            loss_of(n, 2, gen).backward()
            o.step()
            o.zero_grad()
    assert opts[1].rollbacks == 0
    before = {name: p.detach().clone() for name, p in nets[1].named_parameters()}
    state = {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in opts[1].state_dict()["state"].items()}
    gen = torch.Generator().manual_seed(7)
    loss_of(nets[1], 0, gen).backward()
    loss_of(nets[1], 2, gen).backward()  # the learned last pass: its updates run
    with pytest.raises(RuntimeError, match="backward pass 3 before step.*rolled back"):
        loss_of(nets[1], 4, gen).backward()
    for name, p in nets[1].named_parameters():
        assert torch.equal(p, before[name]), name
    for k, v in opts[1].state_dict()["state"].items():
        for kk, vv in v.items():
            assert torch.equal(vv, state[k][kk]), (k, kk)
    for o in opts:
        o.close()


def test_rollbacks_back_off_and_counted_in_stats(tmp_path) -> None:
    """Clipping active on every step: rollbacks at steps 2, 4, 7 (holding 1, 2, then 4 steps between)."""
    nets, opts = _pair("cpu", tmp_path, "backward-thread", max_grad_norm=1e-4)
    gen = [torch.Generator().manual_seed(1) for _ in range(2)]
    counted = []
    for i in range(10):
        for net, opt, g in zip(nets, opts, gen):
            loss_of(net, i, g).backward()
            opt.step()
            opt.zero_grad()
        counted.append(opts[1].stats().counters.get("backward_rollbacks", 0))
    _same(nets, opts)
    assert counted == [0, 1, 0, 1, 0, 0, 1, 0, 0, 0]
    assert opts[1].rollbacks == 3
    for o in opts:
        o.close()
