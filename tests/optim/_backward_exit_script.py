"""A script that ends (argv[1] == "exit") or raises ("raise") right after a backward whose
sub-group updates run on the backward worker thread (the accelerator path, forced on CPU):
the worker is still updating the first layer, whose gradient came last, when Python ends."""
import sys

import torch

import tierstate as ts

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8192, 4096), torch.nn.Linear(4096, 64))  # 33.6M params first
opt = ts.AdamW(model.parameters(), lr=1e-3, offload="cpu", step_in_backward=True)
opt._engine.backward.inline = False  # what a CUDA model gets: updates on the worker thread
x = torch.randn(4, 8192)
for _ in range(2):
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
model(x).pow(2).mean().backward()
if sys.argv[1] == "raise":
    raise RuntimeError("the script fails after backward")
print("done", flush=True)
