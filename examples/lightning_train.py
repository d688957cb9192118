"""Fine-tune a GPT-2 / Llama-style model with Lightning and tierstate.AdamW: LR scheduler,
clipping through max_grad_norm, checkpoint and resume.

    python examples/lightning_train.py --tiny --model llama
"""
from __future__ import annotations

import glob
import tempfile
import time

import lightning.pytorch as pl
import torch

import tierstate as ts
from common import build_model, dataset_for, figures, parser, steps_of
from tierstate.integrations.lightning import TierstateMetrics


class FineTune(pl.LightningModule):
    def __init__(self, kind: str, tiny: bool, steps: int) -> None:
        super().__init__()
        self.model = build_model(kind, tiny)
        self.tiny, self.steps = tiny, steps

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("loss", loss, on_step=True, prog_bar=True, batch_size=len(batch["input_ids"]))
        return loss

    def configure_optimizers(self):
        # Clipping lives in the optimizer (max_grad_norm): Lightning refuses gradient_clip_val
        # under mixed precision for optimizers that unscale inside step().
        opt = ts.AdamW(self.parameters(), lr=1e-2 if self.tiny else 3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                       offload="cpu", max_grad_norm=1.0)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=opt.defaults["lr"], total_steps=self.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(dataset_for(self.model, self.tiny), batch_size=8 if self.tiny else 4)


def main() -> None:
    args = parser(__doc__).parse_args()
    out = args.out or tempfile.mkdtemp(prefix="ts-lightning-")
    steps = steps_of(args)
    common = dict(accelerator="auto", devices=1, max_steps=steps, precision="bf16-mixed", enable_progress_bar=False,
                  enable_model_summary=False, log_every_n_steps=1, default_root_dir=out,
                  logger=pl.loggers.CSVLogger(out, name="logs"))
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=f"{out}/ckpt", every_n_train_steps=max(1, steps // 2), save_top_k=-1)
    pl.seed_everything(0)
    module = FineTune(args.model, args.tiny, steps)
    trainer = pl.Trainer(callbacks=[TierstateMetrics(), ckpt], **common)
    start = time.perf_counter()
    trainer.fit(module)
    runtime = time.perf_counter() - start  # includes fit's set-up and the checkpoints
    m = trainer.logged_metrics
    print(f"final loss {float(m['loss']):.3f}; optimizer step {float(m['tierstate/step_ms']):.1f} ms; "
          f"metrics logged to {trainer.logger.log_dir}/metrics.csv")
    print(figures(trainer.optimizers[0], steps, runtime))
    middle = sorted(glob.glob(f"{out}/ckpt/*step={max(1, steps // 2)}*.ckpt"))[0]
    resumed = pl.Trainer(callbacks=[TierstateMetrics()], **{**common, "enable_checkpointing": False})
    resumed.fit(FineTune(args.model, args.tiny, steps), ckpt_path=middle)
    print(f"resumed from {middle} to step {resumed.global_step}")


if __name__ == "__main__":
    main()
