"""Sparse gradients (``nn.Embedding(sparse=True)``), as torch's SGD and Adagrad take them.

torch's SGD and Adagrad update a parameter from a sparse gradient; its Adam/AdamW refuse one
("consider SparseAdam"), its Adagrad refuses one with weight decay, and its SGD fails on one
with weight decay. DeepSpeed's CPU Adagrad is tested on sparse embeddings as well. tierstate
densifies the gradient it reads (rows without a gradient are zeros, which leave those rows'
parameter and state as they were for these two rules), so:

* against torch's sparse path, parameters and state agree within the parity tolerance (torch
  adds uncoalesced duplicate rows one at a time, the dense path sums them first: ~1 ulp);
* against tierstate fed the same gradients as dense tensors, bit for bit, in every mode
  (RAM, NVMe, in backward, clipping, GradScaler, accumulation);
* whatever torch refuses, tierstate refuses, before anything changes.
"""
from __future__ import annotations

import pytest
import torch

import tierstate as ts

TOL = dict(rtol=1e-5, atol=1e-6)
STEPS = 8
VOCAB, DIM = 300, 24


class Model(torch.nn.Module):
    def __init__(self, sparse: bool, dtype=torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, DIM, sparse=sparse).to(dtype)
        self.head = torch.nn.Linear(DIM, 4).to(dtype)

    def forward(self, idx):
        return self.head(self.emb(idx)).float().pow(2).mean()


def _batch(step: int) -> torch.Tensor:
    # repeated rows in a batch: an uncoalesced sparse gradient, as embeddings give
    return torch.randint(0, VOCAB // 3, (6, 5), generator=torch.Generator().manual_seed(step))


def _train(model, opt, steps=STEPS, *, densify=False, accumulate=1, scaler=None):
    """``steps`` steps of ``accumulate`` micro-batches; ``densify``: the sparse gradients are
    given to the step as dense tensors (the reference of the modes)."""
    scale = scaler.scale if scaler is not None else (lambda loss: loss)
    for step in range(steps):
        for micro in range(accumulate):
            scale(model(_batch(step * accumulate + micro))).backward()
        for p in model.parameters() if densify else ():
            if p.grad is not None and p.grad.is_sparse:
                p.grad = p.grad.to_dense()
        (scaler.step if scaler is not None else lambda o: o.step())(opt)
        if scaler is not None:
            scaler.update()
        opt.zero_grad(set_to_none=True)


def _nvme(tmp_path):
    return ts.Offload(cpu=0.0, nvme=1.0, subgroup_numel=1024, buffer_count=2, nvme_dir=tmp_path / "nv")


CASES = {
    "adagrad": (ts.Adagrad, torch.optim.Adagrad, dict(lr=0.1)),
    "adagrad-decay-init-max": (ts.Adagrad, torch.optim.Adagrad,
                               dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1, maximize=True)),
    "sgd": (ts.SGD, torch.optim.SGD, dict(lr=0.1)),
    "sgd-momentum-damp": (ts.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1)),
    "sgd-nesterov-max": (ts.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, maximize=True)),
}


@pytest.mark.parametrize("place", ["cpu", "nvme"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch_sparse_path(tmp_path, case, place):
    ts_cls, torch_cls, kw = CASES[case]
    ref_model, model = Model(sparse=True), Model(sparse=True)
    ref = torch_cls(ref_model.parameters(), **kw)
    opt = ts_cls(model.parameters(), offload="cpu" if place == "cpu" else _nvme(tmp_path), **kw)
    _train(ref_model, ref)
    _train(model, opt)
    saved = opt.state_dict()["state"]  # (opt.state[p] does not list state held on NVMe; it reads it)
    for i, ((name, p), q) in enumerate(zip(ref_model.named_parameters(), model.parameters())):
        torch.testing.assert_close(q, p, **TOL, msg=name)
        theirs, ours = ref.state[p], opt.state[q]
        assert set(theirs) == set(saved.get(i, {})), name
        for key, value in theirs.items():
            value = value.to_dense() if value.is_sparse else value
            torch.testing.assert_close(torch.as_tensor(ours[key]).reshape(value.shape), value, **TOL,
                                       msg=f"{name} {key}")
    opt.close()


MODES = {
    "cpu": dict(),
    "nvme": dict(nvme=True),
    "in-backward": dict(step_in_backward=True),
    "nvme-in-backward": dict(nvme=True, step_in_backward=True),
    "max-grad-norm": dict(max_grad_norm=0.05),
    "accumulate": dict(accumulate=3),
    "scaler": dict(scaler=True),
}


def _build(case: str, mode: dict, nvme_dir, sparse=True):
    ts_cls, _, kw = CASES[case]
    model = Model(sparse=sparse)
    extra = {}
    if mode.get("nvme"):
        extra["offload"] = ts.Offload(cpu=0.0, nvme=1.0, subgroup_numel=1024, buffer_count=2, nvme_dir=nvme_dir)
    if mode.get("step_in_backward"):
        extra["step_in_backward"] = True
    if "max_grad_norm" in mode:
        extra["max_grad_norm"] = mode["max_grad_norm"]
    return model, ts_cls(model.parameters(), **kw, **extra)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", ["adagrad-decay-init-max", "sgd-nesterov-max"])
def test_bit_identical_to_the_same_gradients_given_dense(tmp_path, case, mode):
    """Each mode on sparse gradients against the plain step on the same gradients densified
    (``grad.to_dense()`` assigned before the step)."""
    m = MODES[mode]
    scaler = (lambda: torch.amp.GradScaler("cpu", init_scale=2.0**10)) if m.get("scaler") else (lambda: None)
    model, opt = _build(case, m, tmp_path / "nv")
    ref_model, ref = _build(case, {k: v for k, v in m.items() if k not in ("nvme", "step_in_backward")}, None)
    _train(model, opt, accumulate=m.get("accumulate", 1), scaler=scaler())
    _train(ref_model, ref, accumulate=m.get("accumulate", 1), scaler=scaler(), densify=True)
    for (name, p), q in zip(ref_model.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name
        for key in ref.state[p]:
            assert torch.equal(torch.as_tensor(ref.state[p][key]), torch.as_tensor(opt.state[q][key])), (name, key)
    assert opt.stats().counters.get("skipped_steps", 0) == 0
    opt.close()
    ref.close()


REFUSED = [
    (ts.AdamW, dict(lr=1e-3), r"AdamW does not support sparse gradients.*SparseAdam"),
    (ts.Adam, dict(lr=1e-3), r"Adam does not support sparse gradients.*SparseAdam"),
    (ts.Lion, dict(lr=1e-4), r"Lion does not support sparse gradients"),
    (ts.Adagrad, dict(lr=0.1, weight_decay=0.1), r"weight_decay.*sparse"),
    (ts.SGD, dict(lr=0.1, weight_decay=0.1), r"weight_decay.*sparse"),
    (ts.Adagrad, dict(lr=0.1, eps=0.0), r"eps=0.*sparse"),
]


@pytest.mark.parametrize("step_in_backward", [False, True])
@pytest.mark.parametrize("cls,kw,match", REFUSED, ids=[f"{c.__name__}-{'-'.join(k)}" for c, k, _ in REFUSED])
def test_refused_as_torch_refuses_before_anything_changes(cls, kw, match, step_in_backward):
    model = Model(sparse=True)
    before = [p.detach().clone() for p in model.parameters()]
    opt = cls(model.parameters(), step_in_backward=step_in_backward, **kw)
    state_before = {i: {k: torch.as_tensor(v).clone() for k, v in st.items()}
                    for i, st in opt.state_dict()["state"].items()}
    with pytest.raises(RuntimeError, match=match):
        _train(model, opt, steps=1)
    for p, q in zip(before, model.parameters()):
        assert torch.equal(p, q)
    state_after = opt.state_dict()["state"]
    assert state_after.keys() == state_before.keys()
    for i, st in state_before.items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(state_after[i][k]), v)
    opt.close()


@pytest.mark.parametrize("speculative", [True, False])
def test_refused_in_backward_after_updates_ran_there(speculative):
    """A refused sparse gradient met by a backward that already updated sub-groups: speculative
    updates are rolled back (state and parameters as before the backward); updates that cannot
    be undone are completed for the parameters handed over before it and the step raises, as
    after a non-finite gradient. Either way training goes on."""
    model = Model(sparse=False)
    opt = ts.AdamW(model.parameters(), lr=1e-3, step_in_backward=True,
                   **({"max_grad_norm": 1e6} if speculative else {}))
    _train(model, opt, steps=2)  # the mode now updates during backward
    before = [p.detach().clone() for p in model.parameters()]
    steps = [opt.state[p]["step"].clone() for p in model.parameters()]
    model.emb.sparse = True
    with pytest.raises(RuntimeError, match=r"AdamW does not support sparse gradients") as info:
        model(_batch(10)).backward()
        opt.step()
    emb, *head = list(model.parameters())
    assert torch.equal(emb, before[0]) and torch.equal(opt.state[emb]["step"], steps[0])
    if speculative:
        assert all(torch.equal(p, q) for p, q in zip(head, before[1:]))
        assert all(torch.equal(opt.state[p]["step"], s) for p, s in zip(head, steps[1:]))
    else:
        assert "the others are untouched" in str(info.value)
        assert not any(torch.equal(p, q) for p, q in zip(head, before[1:]))
        assert all(float(opt.state[p]["step"]) == float(s) + 1 for p, s in zip(head, steps[1:]))
    opt.zero_grad()
    model.emb.sparse = False
    _train(model, opt, steps=2)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    opt.close()
