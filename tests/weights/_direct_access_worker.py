"""Touch a streamed parameter directly, as user code does (run as a subprocess by
test_direct_access.py, so that a crash is a failed test and not a dead test run).

argv: a JSON list of cases' code (Python statements; ``p`` is a streamed weight, ``model``
the streamed model, ``ws`` its streamer, ``twin`` a resident copy trained alike; ``opt``
``twin_opt`` their optimizers), each run on a fresh model. Prints one JSON line per case:
{"case": i, "error": type, "message": ...} or {"case": i, "value": repr of ``result`` if the
code set it}, with "after": whether the model still computes what its resident twin does
(nothing corrupted by what the case did or was refused).
"""
from __future__ import annotations

import copy  # noqa: F401 - the cases use these names
import io  # noqa: F401
import json
import pickle  # noqa: F401
import sys

import torch
from torch import nn

import tierstate as ts


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 50)

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def train_step(net, opt, ids):
    loss = nn.functional.cross_entropy(net(ids).flatten(0, 1), ids.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()


def run_case(code: str) -> dict:
    """One case on a fresh model: its outcome and whether the model still computes what its
    resident twin does."""
    torch.manual_seed(0)
    twin, model = Net(), Net()
    model.load_state_dict(twin.state_dict())
    ws = ts.offload_weights(model, "cpu", device="cpu")
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    twin_opt = ts.AdamW(twin.parameters(), lr=1e-2, offload="cpu")
    train_step(twin, twin_opt, ids)
    opt = ts.AdamW(model.parameters(), lr=1e-2, offload="cpu")
    train_step(model, opt, ids)
    p = model.blocks[1].up.weight  # a streamed weight, released between uses
    scope = dict(globals(), p=p, model=model, ws=ws, twin=twin, opt=opt, twin_opt=twin_opt, ids=ids)
    try:
        exec(code, scope)
        out = {"value": repr(scope["result"]) if "result" in scope else None}
    except Exception as e:  # noqa: BLE001 - the case's outcome, whatever it is
        out = {"error": type(e).__name__, "message": str(e)}
    with torch.no_grad():
        out["after"] = torch.equal(model(ids), twin(ids))
    ws.close()
    opt.close()
    twin_opt.close()
    return out


def main() -> None:
    for i, code in enumerate(json.loads(sys.argv[1])):
        print(json.dumps({"case": i, **run_case(code)}), flush=True)  # a crash keeps the lines before it


if __name__ == "__main__":
    main()
