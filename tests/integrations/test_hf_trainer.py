"""HF Trainer with a tierstate optimizer: loss falls, checkpoints stream our state and
resume bit-identically, our metrics reach Trainer's log history."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install tierstate[hf])")
pytest.importorskip("accelerate", reason="accelerate is not installed (pip install tierstate[hf])")

from transformers import Trainer, TrainingArguments  # noqa: E402

import tierstate as ts  # noqa: E402
from tierstate.integrations.hf import TierstateCallback, TierstateTrainer  # noqa: E402
from tiny_lm import TokenStream, assert_bit_identical, assert_runs_match, params_of, tiny_model  # noqa: E402

STEPS = 6


def _args(out, **kw) -> TrainingArguments:
    base = dict(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=8, learning_rate=1e-2,
                lr_scheduler_type="linear", logging_steps=1, save_strategy="no", report_to=[],
                use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True, max_grad_norm=0.0)
    base.update(kw)
    return TrainingArguments(**base)


# Trainer passes its learning_rate only to optimizers it builds itself: ours gets lr here.
OPT = (ts.AdamW, {"lr": 1e-2, "offload": "cpu", "max_grad_norm": 1.0, "betas": (0.9, 0.95)})


def _trainer(cls, out, kind="gpt2", **kw):
    return cls(model=tiny_model(kind), args=_args(out, **kw), train_dataset=TokenStream(), optimizer_cls_and_kwargs=OPT)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_trainer_trains_and_logs_our_metrics(tmp_path, kind):
    trainer = _trainer(TierstateTrainer, tmp_path, kind)
    trainer.train()
    assert isinstance(trainer.optimizer.optimizer, ts.AdamW)  # Trainer wraps it in AcceleratedOptimizer
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == STEPS
    assert losses[-1] < losses[0] - 0.3, losses
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert all(h["tierstate/step_ms"] > 0 for h in logged)
    assert all(h["tierstate/grad_norm"] > 0 for h in logged)
    assert logged[-1]["tierstate/state_gib_host"] > 0
    assert logged[-1]["tierstate/skipped_steps"] == 0


def test_callback_alone_reaches_log_history(tmp_path):
    trainer = _trainer(Trainer, tmp_path)
    callback = TierstateCallback.install(trainer)
    assert trainer.callback_handler.callbacks[0] is callback
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert all("tierstate/step_ms" in h and "tierstate/grad_norm" in h for h in logged)


def test_checkpoint_streams_state_and_resumes_bit_identically(tmp_path):
    straight = _trainer(TierstateTrainer, tmp_path / "straight")
    straight.train()
    expected = params_of(straight.model)

    first = _trainer(TierstateTrainer, tmp_path / "resumed", save_strategy="steps", save_steps=3)
    first.train()
    ckpt = tmp_path / "resumed" / "checkpoint-3"
    names = set(os.listdir(ckpt))
    assert "optimizer.pt" not in names  # no single pickled optimizer file
    assert names & {"tierstate_optimizer", "tierstate_optimizer.pt"}, names

    # A fresh process would start here: new model, new optimizer, state from the checkpoint.
    second = _trainer(TierstateTrainer, tmp_path / "resumed", save_strategy="no")
    second.train(resume_from_checkpoint=str(ckpt))
    assert second.state.global_step == STEPS
    assert_bit_identical(params_of(second.model), expected)
    # The optimizer's state continues too, not only the weights.
    sd_a, sd_b = straight.optimizer.state_dict()["state"], second.optimizer.state_dict()["state"]
    for i in sd_a:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sd_a[i][key], sd_b[i][key]), (i, key)


@pytest.mark.parametrize("isa", ["reference", "native"])
def test_matches_the_same_trainer_run_with_torch_adamw(tmp_path, isa):
    """fp32, same seed, data and steps: our AdamW and torch.optim.AdamW give the same losses and
    final parameters (bit for bit with the reference kernels; see tiny_lm.RUN_RTOL otherwise)."""
    import tierstate.kernels as K

    hyper = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    torch_run = Trainer(model=tiny_model("llama"), args=_args(tmp_path / "torch", lr_scheduler_type="linear"),
                        train_dataset=TokenStream(), optimizer_cls_and_kwargs=(torch.optim.AdamW, hyper))
    torch_run.train()
    with K.use_isa("reference" if isa == "reference" else "auto"):
        ours = TierstateTrainer(model=tiny_model("llama"), args=_args(tmp_path / "ours", lr_scheduler_type="linear"),
                                train_dataset=TokenStream(),
                                optimizer_cls_and_kwargs=(ts.AdamW, {**hyper, "offload": "cpu"}))
        ours.train()
    assert isinstance(ours.optimizer.optimizer, ts.AdamW)
    assert isinstance(torch_run.optimizer.optimizer, torch.optim.AdamW)
    losses = [h["loss"] for h in ours.state.log_history if "loss" in h]
    torch_losses = [h["loss"] for h in torch_run.state.log_history if "loss" in h]
    assert len(losses) == STEPS
    assert_runs_match(losses, torch_losses, params_of(ours.model), params_of(torch_run.model), exact=isa == "reference")


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("cls", [TierstateTrainer, Trainer], ids=["mixin", "callback"])
def test_a_trainer_clip_that_would_find_no_gradient_is_warned_about(tmp_path, keep, cls):
    """Trainer's max_grad_norm clips param.grad; the gradient stream (the default on CUDA, here
    Offload(grad_streaming=True) on the CPU) releases it during backward, so Trainer's clip would
    silently clip nothing: the mixin and the callback say so at the start, naming the fix. With
    keep_device_grads=True param.grad is kept and the clip works: no warning."""
    import warnings

    opt = (ts.AdamW, {"lr": 1e-2, "offload": ts.Offload(grad_streaming=True, keep_device_grads=keep)})
    trainer = cls(model=tiny_model("gpt2"), args=_args(tmp_path, max_steps=1, max_grad_norm=1.0),
                  train_dataset=TokenStream(), optimizer_cls_and_kwargs=opt)
    if cls is Trainer:
        TierstateCallback.install(trainer)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.train()
    ours = [w for w in seen if "clips nothing" in str(w.message)]
    assert bool(ours) == (not keep)
    if ours:
        assert "max_grad_norm=1.0" in str(ours[0].message) and "TrainingArguments.max_grad_norm" in str(ours[0].message)
    assert trainer.optimizer.optimizer.releases_param_grads == (not keep)
