"""Fine-tune a GPT-2 / Llama-style model with Accelerate and tierstate.AdamW: gradient
accumulation, bf16 autocast, save_state/load_state through the streaming checkpoint.

    python examples/accelerate_train.py --tiny --model gpt2
"""
from __future__ import annotations

import tempfile
import time

import torch
from accelerate import Accelerator

import tierstate as ts
from common import build_model, dataset_for, figures, parser, steps_of
from tierstate.integrations.accelerate import attach, metrics

ACCUMULATE = 2


def main() -> None:
    args = parser(__doc__).parse_args()
    out = args.out or tempfile.mkdtemp(prefix="ts-accelerate-")
    steps = steps_of(args)
    accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=ACCUMULATE)
    torch.manual_seed(0)
    model = build_model(args.model, args.tiny)
    lr = 1e-2 if args.tiny else 3e-4
    opt = ts.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, offload="cpu", max_grad_norm=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    loader = torch.utils.data.DataLoader(dataset_for(model, args.tiny), batch_size=4, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    attach(accelerator, opt)  # fp16 scaling + step_was_skipped; streaming save_state/load_state
    watch = metrics(opt)
    done, first_loss, loss = 0, None, None
    start = time.perf_counter()
    while done < steps:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            first_loss = loss.item() if first_loss is None else first_loss
            if accelerator.sync_gradients:
                done += 1
                m = watch.collect()
                if done % max(1, steps // 4) == 0:
                    accelerator.print(f"step {done} loss {loss.item():.3f} optimizer {m['tierstate/step_ms']:.1f} ms "
                                      f"grad_norm {m['tierstate/grad_norm']:.2f}")
                if done == steps // 2:
                    accelerator.save_state(f"{out}/state")
            if done >= steps:
                break
    accelerator.print(figures(opt, steps, time.perf_counter() - start))  # includes the save_state
    accelerator.print(f"loss {first_loss:.3f} -> {loss.item():.3f} over {steps} steps (x{ACCUMULATE} micro-batches)")
    accelerator.load_state(f"{out}/state")  # streams the optimizer state back
    accelerator.print(f"reloaded {out}/state: step {opt.state[next(model.parameters())]['step'].item():.0f}")


if __name__ == "__main__":
    main()
