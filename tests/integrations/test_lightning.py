"""Lightning with a tierstate optimizer: configure_optimizers with a scheduler, clipping
through max_grad_norm, metrics in the logs, checkpoint resume bit-identical."""
from __future__ import annotations

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="lightning is not installed (pip install tierstate[lightning])")
pytest.importorskip("transformers", reason="transformers is not installed (pip install tierstate[hf])")

import tierstate as ts  # noqa: E402
from tierstate.integrations.lightning import TierstateMetrics  # noqa: E402
from tiny_lm import TokenStream, assert_bit_identical, assert_runs_match, params_of, tiny_model  # noqa: E402

# 12 sequences in batches of 4: 3 steps per epoch, so the checkpoint at step 3 ends an epoch.
SEQUENCES, BATCH, STEPS = 12, 4, 6


class TinyLM(pl.LightningModule):
    def __init__(self, kind: str = "gpt2") -> None:
        super().__init__()
        self.model = tiny_model(kind)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.losses.append(loss.item())
        self.log("loss", loss, on_step=True, batch_size=BATCH)
        return loss

    def configure_optimizers(self):
        opt = ts.AdamW(self.parameters(), lr=1e-2, betas=(0.9, 0.95), offload="cpu", max_grad_norm=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 10)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(TokenStream(SEQUENCES), batch_size=BATCH, shuffle=False)


def _trainer(tmp_path, **kw):
    base = dict(accelerator="cpu", devices=1, max_steps=STEPS, precision="bf16-mixed", logger=False,
                enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                log_every_n_steps=1, default_root_dir=str(tmp_path), callbacks=[TierstateMetrics()])
    base.update(kw)
    return pl.Trainer(**base)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_fit_trains_clips_and_logs_our_metrics(tmp_path, kind):
    module = TinyLM(kind)
    trainer = _trainer(tmp_path)
    trainer.fit(module)
    opt = trainer.optimizers[0]
    assert isinstance(opt, ts.AdamW)
    assert opt.state[next(module.parameters())]["step"].item() == STEPS
    assert module.losses[-1] < module.losses[0] - 0.3, module.losses
    logged = trainer.logged_metrics
    assert logged["tierstate/step_ms"] > 0 and logged["tierstate/grad_norm"] > 0
    # The scheduler stepped per optimizer step: lr = 1e-2 * (1 - 6/10).
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.4)


def test_gradient_clip_val_is_refused_and_we_point_to_max_grad_norm(tmp_path):
    # Lightning's mixed-precision plugin refuses to clip for optimizers that unscale inside
    # step(); our callback says what to use instead before that happens.
    trainer = _trainer(tmp_path, max_steps=1, gradient_clip_val=1.0)
    with pytest.warns(UserWarning, match="max_grad_norm"), \
            pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        trainer.fit(TinyLM())


def test_checkpoint_resume_is_bit_identical(tmp_path):
    every3 = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    straight = TinyLM()
    _trainer(tmp_path, enable_checkpointing=True, callbacks=[TierstateMetrics(), every3]).fit(straight)
    expected = params_of(straight)
    ckpt = next(p for p in (tmp_path / "ckpt").iterdir() if "step=3" in p.name)

    resumed = TinyLM(kind="gpt2")
    trainer = _trainer(tmp_path)
    trainer.fit(resumed, ckpt_path=str(ckpt))
    assert trainer.global_step == STEPS
    assert_bit_identical(params_of(resumed), expected)


class AdamWLM(TinyLM):
    """The module above in fp32 with a plain AdamW (no clipping), ours or torch's."""

    def __init__(self, optimizer_cls, **kw) -> None:
        super().__init__("llama")
        self.optimizer_cls, self.kw = optimizer_cls, kw

    def configure_optimizers(self):
        opt = self.optimizer_cls(self.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **self.kw)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 10)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@pytest.mark.parametrize("isa", ["reference", "native"])
def test_matches_the_same_fit_with_torch_adamw(tmp_path, isa):
    """fp32 (precision="32-true"), same seed, data and steps: ts.AdamW and torch.optim.AdamW give
    the same losses and final parameters (bit for bit with the reference kernels; see
    tiny_lm.RUN_RTOL otherwise)."""
    import tierstate.kernels as K

    torch_module = AdamWLM(torch.optim.AdamW)
    _trainer(tmp_path / "torch", precision="32-true", callbacks=[]).fit(torch_module)
    ours = AdamWLM(ts.AdamW, offload="cpu")
    with K.use_isa("reference" if isa == "reference" else "auto"):
        trainer = _trainer(tmp_path / "ours", precision="32-true")
        trainer.fit(ours)
    assert isinstance(trainer.optimizers[0], ts.AdamW)
    assert len(ours.losses) == STEPS
    assert_runs_match(ours.losses, torch_module.losses, params_of(ours), params_of(torch_module),
                      exact=isa == "reference")
