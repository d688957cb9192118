"""Fine-tune a GPT-2 / Llama-style model with the Hugging Face Trainer and tierstate.AdamW.

    python examples/hf_trainer.py --tiny --model llama

Checkpoints stream the offloaded state (checkpoint-N/tierstate_optimizer/), the run resumes
from the last one, and tierstate's metrics appear in every log line.
"""
from __future__ import annotations

import tempfile

from transformers import TrainingArguments

import tierstate as ts
from common import build_model, dataset_for, figures, parser, steps_of
from tierstate.integrations.hf import TierstateTrainer


def main() -> None:
    args = parser(__doc__).parse_args()
    out = args.out or tempfile.mkdtemp(prefix="ts-hf-")
    steps = steps_of(args)
    model = build_model(args.model, args.tiny)
    training = TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=8 if args.tiny else 4,
        learning_rate=1e-2 if args.tiny else 3e-4, logging_steps=max(1, steps // 8), save_strategy="steps",
        save_steps=max(1, steps // 2), report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
        max_grad_norm=0.0,  # clipping happens in the optimizer, over every tier
    )
    trainer = TierstateTrainer(
        model=model, args=training, train_dataset=dataset_for(model, args.tiny),
        optimizer_cls_and_kwargs=(ts.AdamW, {"lr": training.learning_rate, "betas": (0.9, 0.95),
                                             "weight_decay": 0.1, "offload": "cpu", "max_grad_norm": 1.0}),
    )
    runtime = trainer.train().metrics["train_runtime"]  # includes the checkpoint at the middle step
    logs = [h for h in trainer.state.log_history if "loss" in h]
    print(f"loss {logs[0]['loss']:.3f} -> {logs[-1]['loss']:.3f} over {steps} steps; "
          f"optimizer step {logs[-1]['tierstate/step_ms']:.1f} ms; checkpoints in {out}")
    print(figures(trainer.optimizer, steps, runtime))
    # Resume from the middle checkpoint, as after a crash: it continues to the same end.
    resumed = TierstateTrainer(model=build_model(args.model, args.tiny), args=training,
                               train_dataset=dataset_for(model, args.tiny),
                               optimizer_cls_and_kwargs=trainer.optimizer_cls_and_kwargs)
    resumed.train(resume_from_checkpoint=f"{out}/checkpoint-{training.save_steps}")
    print(f"resumed from checkpoint-{training.save_steps} to step {resumed.state.global_step}")


if __name__ == "__main__":
    main()
