"""A streamed parameter touched directly, outside its block's forward and backward.

Between uses a streamed parameter has no memory (its block's storage is resized to 0). Until
2026-12-07 reading one directly (``p.sum()``, ``p.norm()`` for logging, ``p.clone()``,
``torch.nn.utils.parameters_to_vector``, W&B's histograms, ``model.half()``, ``copy.deepcopy``
of a layer) read through a null pointer and the process died with SIGSEGV, taking the run
with it; so did building torch's DistributedDataParallel over the model (its broadcast of
every ``param.detach()``), and torch's SGD stopped there after updating the resident
parameters. Now each of those raises an error naming the parameter and the way to its
values (``ws.read_param``, ``ws.write_param``, ``ws.gathered()``, FSDP2, a tierstate
optimizer), and nothing is changed by the refused call; metadata (shape, dtype, device,
grad, ...), a ``model.to()`` that changes nothing, ``repr``, reads inside ``ws.gathered()``
and transformers' helpers work.

The cases run in one subprocess (``_direct_access_worker.py``), each on a fresh model: a crash
there fails that case and the ones after it, not the test run.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("_direct_access_worker.py")
NAME = "blocks.1.up.weight"  # p
FIRST = "blocks.0.norm.weight"  # the model's first streamed parameter, where a whole-model call stops

# code -> the words the error must contain besides the parameter's name
REFUSED_READS = {
    "p.sum()": "read_param",
    "p.norm()": "read_param",
    "p.clone()": "read_param",
    "p + 1": "read_param",
    "p.numpy()": "read_param",
    "p[0]": "read_param",
    "p.detach().sum()": "read_param",
    "p.data.abs()": "read_param",
    "torch.nn.utils.parameters_to_vector(model.blocks[1].up.parameters())": "read_param",
    "torch.save(p, io.BytesIO())": "read_param",
    "pickle.dumps(p)": "read_param",
    "copy.deepcopy(p)": "read_param",
    "copy.deepcopy(model.blocks[1].up)": "read_param",
    # an alias taken while the block had memory is read after it has none
    "with ws.gathered(): kept = p.detach()\nkept.sum()": "read_param",
    "with ws.gathered(): kept = p.data\nkept.norm()": "read_param",
    "with ws.gathered(): kept = p.T\nkept.sum()": "read_param",
    "with ws.gathered(): kept = p.view(-1)[3:9]\nkept.sum()": "read_param",
    "with ws.gathered(): kept = p.chunk(2)\nkept[1].clone()": "read_param",
}
REFUSED_WRITES = {
    "with torch.no_grad(): p.zero_()": "write_param",
    "p.data.copy_(torch.zeros(p.shape))": "write_param",
    "with torch.no_grad(): p += 1": "write_param",
}
DDP = ("import torch.distributed as dist\n"
       "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
       "try:\n    {}\nfinally:\n    dist.destroy_process_group()")
REFUSED_LIBRARIES = {  # DistributedDataParallel broadcasts param.detach() of every parameter in C++
    DDP.format("torch.nn.parallel.DistributedDataParallel(model)"): "fully_shard",
}
TORCH_STEP = "o = torch.optim.{}(model.parameters(), lr=1e-3); model(ids).sum().backward(); o.step()"
REFUSED_OPTIMIZERS = {  # torch's SGD updated the resident parameters, then ended the process
    TORCH_STEP.format("SGD"): "ts.AdamW",
    TORCH_STEP.format("AdamW"): "ts.AdamW",
}
REFUSED_CONVERSIONS = {
    "model.half()": "offload_weights",
    "model.to(torch.float64)": "offload_weights",
    "p.double()": "offload_weights",
    # an in-place function that returns its argument is no no-op for a streamed parameter
    "model.share_memory()": "write_param",
    "torch.__future__.set_swap_module_params_on_conversion(True)\ntry:\n    model.share_memory()\n"
    "finally:\n    torch.__future__.set_swap_module_params_on_conversion(False)": "write_param",
}


REFUSED = {**REFUSED_READS, **REFUSED_WRITES, **REFUSED_LIBRARIES, **REFUSED_OPTIMIZERS, **REFUSED_CONVERSIONS}
WORKING = {  # code -> repr of the ``result`` it sets
    "result = (tuple(p.shape), str(p.dtype), str(p.device), p.numel(), p.requires_grad, p.is_leaf, p.dim())":
        repr(((32, 16), "torch.float32", "cpu", 512, True, True, 2)),
    "result = (p.grad is None, p.element_size(), p.is_floating_point(), p.stride())": repr((True, 4, True, (16, 1))),
    "result = tuple(torch.zeros_like(p).shape)": repr((32, 16)),
    "model.to('cpu'); model.float(); model.to(torch.float32); result = str(next(model.parameters()).dtype)":
        repr("torch.float32"),
    "result = 'streamed' in repr(p) and 'blocks.1.up.weight' in str(p) and 'blocks.1.up.weight' in f'{p}'": "True",
    "with ws.gathered(): result = torch.equal(p.clone(), ws.read_param(p))": "True",
    "with ws.gathered(): result = torch.equal(p.detach() + 0, ws.read_param(p))": "True",
    "result = torch.equal(model(ids), twin(ids))": "True",
    "print(model); result = sum(q.numel() for q in model.parameters())": "4962",
    # a refused conversion changes nothing, and training goes on alike
    "try:\n    model.half()\nexcept RuntimeError:\n    pass\n"
    "result = sorted({str(t.dtype) for t in [*model.parameters(), *model.buffers()]})\n"
    "train_step(model, opt, ids); train_step(twin, twin_opt, ids)": repr(["torch.float32"]),
}
# torch's future conversion modes wrap every parameter in a new nn.Parameter, a no-op one too:
# the streamed ones skip it (a no-op `model.to("cpu")` raised "Couldn't swap LayerNorm.weight"
# under the swap flag, and "detach: ... no alias to give" under the overwrite flag). Training
# goes on after a swap; an overwrite gives the other layers new Parameter objects, which the
# optimizer built before does not hold (torch's own behaviour under that flag), so not there.
FUTURE = ("torch.__future__.set_{flag}_module_params_on_conversion(True)\n"
          "try:\n    {conversion}\nfinally:\n    torch.__future__.set_{flag}_module_params_on_conversion(False)\n"
          "{train}result = (type(model.blocks[1].up.weight).__name__, model.blocks[1].up.weight is p, "
          "[n for n, _ in model.named_parameters()] == [n for n, _ in twin.named_parameters()], "
          "sorted({{str(t.dtype) for t in model.parameters()}}))")
for _flag in ("swap", "overwrite"):
    for _conversion in ("model.to('cpu'); model.float(); model.blocks[0].to(torch.float32)",
                        "try:\n        model.half()\n    except RuntimeError:\n        pass"):
        _train = "train_step(model, opt, ids); train_step(twin, twin_opt, ids)\n" if _flag == "swap" else ""
        WORKING[FUTURE.format(flag=_flag, conversion=_conversion, train=_train)] = repr(
            ("StreamedParameter", True, True, ["torch.float32"]))
# The other order: DistributedDataParallel first, then streaming (its reducer's buckets would
# alias gradients the streamer drops, its broadcasts read every weight).
DDP_FIRST = DDP.format("ts.offload_weights(torch.nn.parallel.DistributedDataParallel(twin), 'cpu', device='cpu')")
CASES = [*REFUSED, *WORKING, DDP_FIRST]


@pytest.fixture(scope="module")
def outcomes() -> dict[str, dict]:
    """Every case's outcome, from one worker process (each case on a fresh model there; a
    start of the interpreter per case made this file 36 launches, ~1.5 min of CPU)."""
    r = subprocess.run([sys.executable, str(WORKER), json.dumps(CASES)], capture_output=True, text=True,
                       timeout=600)
    got = {CASES[d["case"]]: d for d in map(json.loads, (ln for ln in r.stdout.splitlines() if ln.startswith("{")))}
    ended = f"the worker ended (returncode {r.returncode}) before this case:\n{r.stderr[-3000:]}"
    return {code: got.get(code, {"ended": ended}) for code in CASES}


def _outcome(outcomes: dict, code: str) -> dict:
    out = dict(outcomes[code])
    assert "ended" not in out, out["ended"]
    out.pop("case")
    return out


@pytest.mark.parametrize("code,hint", list(REFUSED.items()))
def test_a_direct_touch_is_refused_with_the_way_to_the_values(outcomes, code, hint):
    out = _outcome(outcomes, code)
    assert out.get("error") in ("RuntimeError", "TypeError"), out
    whole_model = (code.startswith(("model.", "torch.__future__")) or code in REFUSED_LIBRARIES
                   or code in REFUSED_OPTIMIZERS)
    name = FIRST if whole_model else NAME
    assert name in out["message"] and hint in out["message"], out["message"]
    assert out["after"] is True, "the refused call changed the model"


@pytest.mark.parametrize("code,want", list(WORKING.items()))
def test_metadata_no_op_conversions_and_gathered_reads_work(outcomes, code, want):
    assert _outcome(outcomes, code) == {"value": want, "after": True}


def test_a_ddp_model_is_refused_by_offload_weights(outcomes):
    out = _outcome(outcomes, DDP_FIRST)
    assert out.get("error") == "TypeError" and "fully_shard" in out["message"], out
    assert out["after"] is True


def test_what_transformers_reads_of_a_model_works_on_streamed_weights(tmp_path):
    """transformers' helpers read only metadata: they give what the resident twin gives, and
    the model trains and generates alike (in this process: nothing here touches values)."""
    import tierstate as ts
    from tierstate.weights import StreamedParameter, streamed

    from _models import batches, offload, twin

    ref, model = twin("gpt2")
    ws = offload(model, "nvme", nvme_dir=tmp_path / "w")
    streamed_params = [p for p in model.parameters() if streamed(p) is not None]
    assert streamed_params and all(type(p) is StreamedParameter for p in streamed_params)
    for probe in (lambda m: m.device, lambda m: m.dtype, lambda m: m.num_parameters(),
                  lambda m: m.num_parameters(only_trainable=True), lambda m: m.get_memory_footprint()):
        assert probe(model) == probe(ref)
    assert model.to("cpu") is model and model.float() is model
    model.requires_grad_(True)
    data = batches(2)
    for m in (ref, model):
        opt = ts.AdamW(m.parameters(), lr=1e-2, offload="cpu")
        for ids in data:
            m(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    ids = data[0][:1, :4]
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
    ws.close()
    assert not any(type(p) is StreamedParameter for p in model.parameters())  # plain Parameters again


def test_a_layout_conversion_of_streamed_conv_weights_is_refused_and_a_no_op_passes():
    """``model.to(memory_format=torch.channels_last)`` changes a 4-D weight's layout, which
    the block's storage fixes: refused with the conversion's message, before anything
    changed; on an already channels-last model's 1-D biases and a same-device ``.to()``
    nothing changes and the call passes. (In process: nothing here reads a weight.)"""
    import tierstate as ts

    class ConvNet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = torch.nn.Conv2d(3, 4, 1)
            self.blocks = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.ReLU()) for _ in range(2))

        def forward(self, x):
            x = self.stem(x)
            for b in self.blocks:
                x = b(x)
            return x

    torch.manual_seed(0)
    model = ConvNet()
    ws = ts.offload_weights(model, "cpu", device="cpu")
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        before = model(x)
    with pytest.raises(RuntimeError, match="fixed when offload_weights is called") as info:
        model.to(memory_format=torch.channels_last)
    assert "blocks.0.0.weight" in str(info.value)
    assert model.stem.weight.is_contiguous()  # the resident stem was not converted either
    assert model.to("cpu") is model
    with torch.no_grad():
        assert torch.equal(model(x), before)
    ws.close()
