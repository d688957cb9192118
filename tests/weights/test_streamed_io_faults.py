"""A failed read or write of a streamed block at a random point of a training step.

Each seed trains a 6-layer GPT-2 whose blocks stream from NVMe (no read ahead, so every use
reads or writes), plain or with ``step_in_backward``, and fails the n-th read or write of its
second step once with EIO. The step either raises before changing anything (a failure in
forward or backward) or completes and raises at its end (a write-back failing while the
optimizer updates the weights: until 2026-12-07 it stopped half way); either way the error is
an ``OSError`` naming the file, and the next step trains as a run that took the step, or did
not, bit for bit.
"""
from __future__ import annotations

import errno
import sys
import random

import pytest
import torch

import tierstate as ts
from tierstate.io.faults import fail_nth
from tierstate.weights import streamed

from _models import batches, offload, twin


def _train(model, opt, ids) -> None:
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def _values(model, ws) -> list[torch.Tensor]:
    return [ws.read_param(p) if streamed(p) is not None else p.detach() for p in model.parameters()]


@pytest.mark.parametrize("seed", range(12))
def test_a_failed_block_read_or_write_leaves_a_whole_step_or_none(seed: int, tmp_path) -> None:
    r = random.Random(seed)
    op, nth, backward = r.choice(["read", "write"]), r.randint(1, 6), r.random() < 0.5
    data = batches(3, seed=seed)
    without, model = twin("gpt2", n_layer=6, n_embd=16)
    with_step, _ = twin("gpt2", n_layer=6, n_embd=16)
    ws = offload(model, "nvme", nvme_dir=tmp_path / "w", prefetch=0)
    opts = [ts.AdamW(m.parameters(), lr=1e-2, offload="cpu", step_in_backward=backward)
            for m in (model, without, with_step)]
    opt = opts[0]
    for m, o in zip((model, without, with_step), opts):
        _train(m, o, data[0])
    _train(with_step, opts[2], data[1])
    with fail_nth(op, nth, errno.EIO, path_contains=str(tmp_path / "w")) as plan:
        try:
            _train(model, opt, data[1])
        except OSError as exc:
            assert exc.errno == errno.EIO and str(tmp_path / "w") in str(exc), exc
            opt.zero_grad()
    assert plan.fired == 1, "no failure injected: the step reads and writes fewer records than assumed"
    for m, o in zip((model, without, with_step), opts):
        _train(m, o, data[2])
    got = _values(model, ws)
    as_without = all(torch.equal(a.detach(), b) for a, b in zip(without.parameters(), got))
    as_with = all(torch.equal(a.detach(), b) for a, b in zip(with_step.parameters(), got))
    assert as_without or as_with, f"seed {seed}: {op} #{nth}, backward={backward}: half a step"
    for o in opts:
        o.close()
    ws.close()


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes (add_note) are Python 3.11's")
def test_two_failed_writes_in_one_step_are_both_named(tmp_path) -> None:
    """A step whose optimizer-state write and streamed-weight write both fail (two folders,
    as on two disks) raised the first error alone: the second path was never named, though
    its records waited in RAM too. Now the error raised carries the other as a note."""
    data = batches(2)
    _, model = twin("gpt2", n_layer=3, n_embd=16)
    ws = offload(model, "nvme", nvme_dir=tmp_path / "weights", prefetch=0)
    opt = ts.AdamW(model.parameters(), lr=1e-2, offload=ts.Offload(nvme=1.0, nvme_dir=tmp_path / "state",
                                                                    subgroup_numel=4096, buffer_count=2))
    _train(model, opt, data[0])
    with fail_nth("write", 1, errno.EIO, path_contains=str(tmp_path / "weights"), times=100) as w_plan, \
            fail_nth("write", 1, errno.ENOSPC, path_contains=str(tmp_path / "state"), times=100) as s_plan:
        with pytest.raises(OSError) as info:
            _train(model, opt, data[1])
    assert w_plan.fired and s_plan.fired, (w_plan.fired, s_plan.fired)
    told = str(info.value) + "\n".join(getattr(info.value, "__notes__", []))
    assert str(tmp_path / "weights") in told and str(tmp_path / "state") in told, told
    opt.zero_grad()
    _train(model, opt, data[1])  # the disks work again: the kept records are written, training goes on
    opt.close()
    ws.close()
