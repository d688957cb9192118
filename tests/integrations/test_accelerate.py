"""Accelerate with a tierstate optimizer: accumulation + bf16 training, fp16 loss scaling
with a truthful step_was_skipped, save_state/load_state resuming bit-identically."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("accelerate", reason="accelerate is not installed (pip install tierstate[hf])")
pytest.importorskip("transformers", reason="transformers is not installed (pip install tierstate[hf])")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.tracking import GeneralTracker  # noqa: E402

import tierstate as ts  # noqa: E402
from tierstate.integrations.accelerate import attach, metrics  # noqa: E402
from tiny_lm import TokenStream, assert_bit_identical, assert_runs_match, params_of, tiny_model  # noqa: E402

MICRO_BATCHES = 8
ACCUMULATE = 2


class RecordingTracker(GeneralTracker):
    """An Accelerate tracker (the framework's extension point) that keeps what it is given."""

    name = "recording"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict] = []
        self.expected_norms: list[float] = []   # filled by the training loop, not by Accelerate

    @property
    def tracker(self):
        return self.records

    def store_init_configuration(self, values: dict) -> None:
        pass

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        self.records.append(dict(values))


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    # Accelerator state is a process-wide singleton; each test builds its own Accelerator.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _run(tmp_path, micro_batches=MICRO_BATCHES, save_after=None, resume_from=None, kind="gpt2"):
    tracker = RecordingTracker()
    acc = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=ACCUMULATE, log_with=[tracker],
                      project_dir=str(tmp_path))
    acc.init_trackers("test")
    model = tiny_model(kind)
    opt = ts.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), offload="cpu", max_grad_norm=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 10)
    loader = torch.utils.data.DataLoader(TokenStream(), batch_size=4, shuffle=False)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    attach(acc, opt)
    watch = metrics(opt)
    start = 0
    if resume_from is not None:
        acc.load_state(str(resume_from))
        start = save_after
        loader = acc.skip_first_batches(loader, start)
    losses = []
    for i, batch in enumerate(loader, start=start):
        if i >= micro_batches:
            break
        with acc.accumulate(model):
            loss = model(**batch).loss
            acc.backward(loss)
            if acc.sync_gradients:  # the gradient norm the step is about to see, by torch
                grads = [p.grad.detach().reshape(-1).double() for p in model.parameters() if p.grad is not None]
                tracker.expected_norms.append(float(torch.linalg.vector_norm(torch.cat(grads))))
            opt.step()
            sched.step()
            opt.zero_grad()
        losses.append(loss.item())
        if acc.sync_gradients:
            acc.log({"loss": loss.item(), **watch.collect()}, step=i)
        if save_after is not None and resume_from is None and i + 1 == save_after:
            acc.save_state(str(tmp_path / "state"))
    return acc, model, opt, losses, tracker


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_accumulate_bf16_trains_and_logs(tmp_path, kind):
    acc, model, opt, losses, tracker = _run(tmp_path, micro_batches=16, kind=kind)
    inner = opt.optimizer
    assert isinstance(inner, ts.AdamW)
    assert inner.state[next(model.parameters())]["step"].item() == 16 / ACCUMULATE  # one update per 2 micro-batches
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.3, losses
    assert len(tracker.records) == 16 / ACCUMULATE
    assert all(r["tierstate/step_ms"] > 0 for r in tracker.records)
    # the logged norm is the global norm of the accumulated gradients each update used
    logged = [r["tierstate/grad_norm"] for r in tracker.records]
    assert logged == pytest.approx(tracker.expected_norms, rel=1e-5)


def test_save_state_streams_and_load_state_resumes_bit_identically(tmp_path):
    _, straight_model, straight_opt, _, _ = _run(tmp_path / "a")
    expected = params_of(straight_model)
    _run(tmp_path / "b", save_after=4)
    saved = tmp_path / "b" / "state"
    optimizer_bin = torch.load(saved / "optimizer.bin", weights_only=True)
    assert optimizer_bin["state"] == {}  # only a reference: the state is streamed beside it
    assert (saved / "tierstate_optimizer_0").exists() or (saved / "tierstate_optimizer_0.pt").is_file()

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    _, model, opt, _, _ = _run(tmp_path / "b", save_after=4, resume_from=saved)
    assert_bit_identical(params_of(model), expected)
    a, b = straight_opt.optimizer.state_dict()["state"], opt.state_dict()["state"]
    for i in a:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a[i][key], b[i][key]), (i, key)


def test_full_state_dict_still_loads_into_attached_optimizer(tmp_path):
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 3)
    ref = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    ref.step()
    opt = acc.prepare(ts.AdamW(model.parameters(), lr=0.1))
    attach(acc, opt)
    opt.load_state_dict(ref.state_dict())  # a torch.optim.AdamW state dict, not a reference
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], ref.state_dict()["state"][0]["exp_avg"])


def _scaled_pair(init_scale):
    """(accelerator, prepared tierstate optimizer with a CPU GradScaler, model, twin model, twin optimizer)."""
    acc = Accelerator(cpu=True)
    # Accelerate refuses fp16 on CPU; hand it the CPU GradScaler it would build on a GPU, so
    # that prepare() and backward() take their real loss-scaling paths.
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1000)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    twin = torch.nn.Linear(8, 4)
    twin.load_state_dict(model.state_dict())
    # eps is large so that an update computed from still-scaled gradients differs visibly.
    opt = acc.prepare(ts.AdamW(model.parameters(), lr=0.1, eps=1e-2, weight_decay=0.1))
    twin_opt = ts.AdamW(twin.parameters(), lr=0.1, eps=1e-2, weight_decay=0.1)
    attach(acc, opt)
    return acc, opt, model, twin, twin_opt


def test_fp16_scaler_unscales_before_the_update():
    acc, opt, model, twin, twin_opt = _scaled_pair(init_scale=1024.0)
    x = torch.randn(5, 8)
    for _ in range(3):
        acc.backward(model(x).square().mean())
        opt.step()
        opt.zero_grad()
        assert not opt.step_was_skipped
        twin(x).square().mean().backward()
        twin_opt.step()
        twin_opt.zero_grad()
    # The scale is a power of two, so unscaling is exact and the two runs agree bit for bit.
    assert_bit_identical(params_of(model), params_of(twin))


def test_fp16_overflow_skips_the_step_and_reports_it():
    acc, opt, model, _, _ = _scaled_pair(init_scale=1024.0)
    x = torch.randn(5, 8)
    before = params_of(model)
    acc.backward(model(x).square().mean())
    model.weight.grad[0, 0] = math.inf  # what an fp16 overflow leaves behind
    opt.step()
    opt.zero_grad()
    assert opt.step_was_skipped
    assert_bit_identical(params_of(model), before)
    assert acc.scaler.get_scale() == 512.0  # the scaler saw the overflow and backed off
    acc.backward(model(x).square().mean())
    opt.step()
    assert not opt.step_was_skipped
    assert not torch.equal(model.weight, before["weight"])


def _fp32_run(optimizer_cls, **kw):
    """Gradient accumulation in fp32 with ``optimizer_cls`` (AdamW, no clipping): (losses, model)."""
    acc = Accelerator(cpu=True, mixed_precision="no", gradient_accumulation_steps=ACCUMULATE)
    model = tiny_model("llama")
    opt = optimizer_cls(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 10)
    loader = torch.utils.data.DataLoader(TokenStream(), batch_size=4, shuffle=False)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    if isinstance(opt.optimizer, ts.AdamW):
        attach(acc, opt)
    losses = []
    for i, batch in enumerate(loader):
        if i >= MICRO_BATCHES:
            break
        with acc.accumulate(model):
            loss = model(**batch).loss
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        losses.append(loss.item())
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return losses, model


@pytest.mark.parametrize("isa", ["reference", "native"])
def test_matches_the_same_loop_with_torch_adamw(isa):
    """fp32, same seed, data, accumulation and steps: ts.AdamW and torch.optim.AdamW give the same
    losses and final parameters (bit for bit with the reference kernels; see tiny_lm.RUN_RTOL
    otherwise)."""
    import tierstate.kernels as K

    torch_losses, torch_model = _fp32_run(torch.optim.AdamW)
    with K.use_isa("reference" if isa == "reference" else "auto"):
        losses, model = _fp32_run(ts.AdamW, offload="cpu")
    assert len(losses) == MICRO_BATCHES
    assert_runs_match(losses, torch_losses, params_of(model), params_of(torch_model), exact=isa == "reference")
