"""Training with streamed weights is bit for bit training with resident weights.

Every case trains two copies of one model for 10 steps with the same optimizer (its state
on NVMe): one with resident weights, one with ``ts.offload_weights``. All parameters and
every optimizer state key must be equal bit for bit, for GPT-2 (tied embeddings) and
Llama, under activation checkpointing (both autograd flavours), with frozen parameters,
gradient accumulation, clipping, a GradScaler, and a module called twice.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import tierstate as ts
from tierstate.weights import streamed

from _models import batches, offload, twin

STEPS = 10


def values(model, ws):
    return {n: (ws.read_param(p) if streamed(p) is not None else p.detach().clone())
            for n, p in model.named_parameters()}


def assert_same(ref, ref_opt, model, opt, ws):
    want = {n: p.detach() for n, p in ref.named_parameters()}
    got = values(model, ws)
    differing = [n for n in want if not torch.equal(want[n], got[n])]
    assert not differing, f"parameters differ: {differing[:6]}"
    s1, s2 = ref_opt.state_dict(), opt.state_dict()
    assert s1["state"].keys() == s2["state"].keys()
    for i, st in s1["state"].items():
        assert st.keys() == s2["state"][i].keys()
        for k, v in st.items():
            assert torch.equal(v, s2["state"][i][k]), (i, k)


def train(model, opt, data, *, accumulate: int = 1, clip: float | None = None, scaler=None):
    for step in range(STEPS):
        for micro in range(accumulate):
            ids = data[(step * accumulate + micro) % len(data)]
            loss = model(ids, labels=ids).loss / accumulate
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if clip is not None:
            if scaler is not None:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()


def make_opt(model, tmp_path, name, **kw):
    return ts.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, offload="nvme", nvme_dir=tmp_path / name, **kw)


def streamer(model, tier, tmp_path, **kw):
    if tier == "split":
        tier = ts.Offload(cpu=0.5, nvme=0.5)
    return offload(model, tier, nvme_dir=tmp_path / "w" if tier != "cpu" else None, **kw)


CASES = [("cpu", None), ("split", None), ("nvme", None), ("nvme", "non-reentrant"), ("nvme", "reentrant")]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("tier,checkpointing", CASES)
def test_streamed_training_equals_resident(tmp_path, kind, tier, checkpointing):
    dtype = torch.bfloat16 if tier == "split" else torch.float32  # bf16: the master path too
    ref, model = twin(kind, dtype)
    if checkpointing is not None:
        for m in (ref, model):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
            m.train()
    ws = streamer(model, tier, tmp_path)
    ref_opt, opt = make_opt(ref, tmp_path, "a"), make_opt(model, tmp_path, "b")
    data = batches(4)
    train(ref, ref_opt, data)
    train(model, opt, data)
    assert_same(ref, ref_opt, model, opt, ws)
    st = ws.stats()
    assert st["peak_window_bytes"] <= 2 * max(ws.block_bytes())
    if tier != "cpu":
        assert st["fetch_bytes"] > 0
    ws.close()


@pytest.mark.parametrize("step_in_backward", [False, True])
def test_tied_llama_and_in_backward(tmp_path, step_in_backward):
    ref, model = twin("llama", torch.bfloat16, tied=True)
    ws = streamer(model, "nvme", tmp_path)
    # small sub-groups: every block spans several, so the optimizer updates it piece by piece
    ref_opt = make_opt(ref, tmp_path, "a", step_in_backward=step_in_backward)
    opt = ts.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, step_in_backward=step_in_backward,
                   offload=ts.Offload(nvme=1.0, nvme_dir=tmp_path / "b", subgroup_numel=4096))
    train(ref, ref_opt, batches(3))
    train(model, opt, batches(3))
    assert_same(ref, ref_opt, model, opt, ws)
    st = ws.stats()
    # a block is copied up when it is materialized, not again after each piece the optimizer
    # updates while backward holds it (that cost 60 GB a step at 1B)
    assert st["copy_bytes"] <= st["materializations"] * max(ws.block_bytes())
    if step_in_backward:  # applied gradients of streamed weights are gone after backward
        ids = batches(1, seed=9)[0]
        model(ids, labels=ids).loss.backward()
        assert all(p.grad is None for _, p in ws.named_streamed())
        opt.step()
        opt.zero_grad()


def test_many_blocks_small_pool_evicts_and_writes_back(tmp_path):
    """prefetch=0 leaves a pool of 2 images for 6 blocks (3 on the CPU, where the block in use
    is one of them): every step evicts, writes back changed images and reads them again, and
    the result is still exact."""
    ref, model = twin("gpt2", n_layer=6)
    ws = streamer(model, "nvme", tmp_path, prefetch=0)
    ref_opt, opt = make_opt(ref, tmp_path, "a"), make_opt(model, tmp_path, "b")
    train(ref, ref_opt, batches(3))
    train(model, opt, batches(3))
    assert_same(ref, ref_opt, model, opt, ws)
    st = ws.stats()
    assert st["pool_bytes"] == (2 + ws.window.alias) * max(ws.window.homes[0].record_nbytes.values())
    assert st["writeback_bytes"] > sum(ws.block_bytes())  # more than the first fill
    assert st["fetch_bytes"] >= STEPS * sum(ws.block_bytes())


def test_accumulation_clipping_and_scaler(tmp_path):
    ref, model = twin("gpt2")
    ws = streamer(model, "nvme", tmp_path)
    ref_opt, opt = make_opt(ref, tmp_path, "a"), make_opt(model, tmp_path, "b")
    s1, s2 = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8), torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    train(ref, ref_opt, batches(4), accumulate=2, clip=0.5, scaler=s1)
    train(model, opt, batches(4), accumulate=2, clip=0.5, scaler=s2)
    assert_same(ref, ref_opt, model, opt, ws)


class LoRALinear(nn.Module):
    """A frozen base weight plus a trainable low-rank update (what peft's LoRA adds)."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base
        self.base.weight.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x):
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


def lora(model):
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.model.layers:
        layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LoRALinear(layer.self_attn.v_proj)
    return model


def test_lora_frozen_weights_stream_adapters_stay(tmp_path):
    ref, model = twin("llama")
    torch.manual_seed(5)
    lora(ref)
    torch.manual_seed(5)
    lora(model)
    ws = streamer(model, "nvme", tmp_path, keep_resident=lambda name, p: p.requires_grad)
    names = {n for n, _ in ws.named_streamed()}
    assert names and all("lora" not in n for n in names) and any("q_proj.base" in n for n in names)
    mk = lambda m, name: ts.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, offload="nvme",  # noqa: E731
                                  nvme_dir=tmp_path / name)
    ref_opt, opt = mk(ref, "a"), mk(model, "b")
    train(ref, ref_opt, batches(3))
    train(model, opt, batches(3))
    assert_same(ref, ref_opt, model, opt, ws)
    # frozen blocks: written once (the first fill), never again
    assert ws.stats()["writeback_bytes"] == sum(ws.window.homes[0].record_nbytes.values())


class Twice(nn.Module):
    """Block 1 runs twice per forward: two holds, two backward passes through it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(50, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)) for _ in range(3))
        self.head = nn.Linear(16, 50)

    def forward(self, ids, labels):
        h = self.emb(ids)
        for i in (0, 1, 2, 1):
            h = h + self.blocks[i](h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def test_module_called_twice(tmp_path):
    ref, model = Twice(), Twice()
    ws = offload(model, "nvme", nvme_dir=tmp_path / "w")
    ref_opt, opt = make_opt(ref, tmp_path, "a"), make_opt(model, tmp_path, "b")
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 50, (2, 8), generator=g) for _ in range(3)]
    for step in range(STEPS):
        for m, o in ((ref, ref_opt), (model, opt)):
            m(data[step % 3], data[step % 3]).backward()
            o.step()
            o.zero_grad()
    assert_same(ref, ref_opt, model, opt, ws)
    assert ws.stats()["prefetch_misses"] <= 2  # the order (0, 1, 2, 1, then back) is learned after step 1


def test_save_and_load_optimizer_with_streamed_weights(tmp_path):
    ref, model = twin("gpt2", torch.bfloat16)
    ws = streamer(model, "nvme", tmp_path)
    ref_opt, opt = make_opt(ref, tmp_path, "a"), make_opt(model, tmp_path, "b")
    train(ref, ref_opt, batches(2))
    train(model, opt, batches(2))
    ts.save_optimizer(opt, tmp_path / "ckpt")
    train(model, opt, batches(2, seed=7))  # moves away from the checkpoint
    ts.load_optimizer(opt, tmp_path / "ckpt")
    train(ref, ref_opt, batches(2, seed=7))
    train(model, opt, batches(2, seed=7))
    assert_same(ref, ref_opt, model, opt, ws)


def test_weights_streamed_after_the_optimizer_was_built(tmp_path):
    """The optimizer re-assembles when its parameters start streaming (state carried over)."""
    ref, model = twin("gpt2", torch.bfloat16)
    ref_opt, opt = make_opt(ref, tmp_path, "a"), make_opt(model, tmp_path, "b")
    train(ref, ref_opt, batches(2))
    train(model, opt, batches(2))
    ws = streamer(model, "nvme", tmp_path)
    train(ref, ref_opt, batches(2, seed=3))
    train(model, opt, batches(2, seed=3))
    assert_same(ref, ref_opt, model, opt, ws)
    assert opt.state_store.slot_of(ws.named_streamed()[0][1]) is not None


@pytest.mark.parametrize("step_in_backward", [False, True])
def test_gradient_stream_leaves_streamed_weights_out(tmp_path, step_in_backward):
    """With the gradient stream on (the CUDA default, forced here on CPU) a streamed parameter's
    gradient is read from param.grad when applied: no host arena as large as the weights."""
    ref, model = twin("gpt2", torch.bfloat16)
    ws = streamer(model, "nvme", tmp_path)
    opts = [ts.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, step_in_backward=step_in_backward,
                     offload=ts.Offload(nvme=1.0, nvme_dir=tmp_path / n, grad_streaming=True))
            for m, n in ((ref, "a"), (model, "b"))]
    train(ref, opts[0], batches(2))
    train(model, opts[1], batches(2))
    assert_same(ref, opts[0], model, opts[1], ws)
    streamed_bytes = sum(p.numel() * p.element_size() for _, p in ws.named_streamed())
    resident_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - streamed_bytes
    assert opts[1].tier_bytes().get("host_grads", 0) <= resident_bytes < opts[0].tier_bytes()["host_grads"]


def test_in_backward_refusals_with_streamed_weights_name_the_way_out(tmp_path):
    """Updates of streamed weights made during backward cannot be rolled back (their gradients
    are released once applied), so step_in_backward=True takes no clipping, no GradScaler and no
    accumulation there: each is refused with the fix. The second backward of an accumulation
    was refused with "keep the number of backward() calls per step() constant", which the
    user had done (found 2026-12-07 by fuzzing): it now says why and what to do instead."""
    _, model = twin("gpt2", n_layer=2, n_embd=16)
    ws = streamer(model, "cpu", tmp_path)
    with pytest.raises(ValueError, match=r"max_grad_norm=1\.0 and parameters whose weights stream"):
        ts.AdamW(model.parameters(), lr=1e-2, step_in_backward=True, max_grad_norm=1.0)
    opt = ts.AdamW(model.parameters(), lr=1e-2, step_in_backward=True)
    ids = batches(1)[0]
    (model(ids, labels=ids).loss / 2).backward()
    with pytest.raises(RuntimeError) as info:
        (model(ids, labels=ids).loss / 2).backward()
    message = str(info.value)
    assert "offload_weights" in message and "step_in_backward=False" in message, message
    assert "constant" not in message, message
    opt.close()
    ws.close()


def test_a_grad_scaler_in_backward_with_streamed_weights_says_what_was_done(tmp_path):
    """A loss scaler is seen only at ``scaler.step``, after backward applied the scaled gradients
    to streamed weights, which cannot be rolled back: the refusal says they stand."""
    _, model = twin("gpt2", n_layer=2, n_embd=16)
    ws = streamer(model, "cpu", tmp_path)
    opt = ts.AdamW(model.parameters(), lr=1e-2, step_in_backward=True)
    scaler = torch.amp.GradScaler("cpu")
    ids = batches(1)[0]
    scaler.scale(model(ids, labels=ids).loss).backward()
    with pytest.raises(ValueError, match="GradScaler.*stand.*step_in_backward=False"):
        scaler.step(opt)
    opt.close()
    ws.close()


def test_a_failed_weight_write_back_during_the_update_completes_the_step_and_raises_at_its_end(tmp_path):
    """The optimizer updates streamed weights in their blocks' images, taking a buffer from the
    window, which may write another changed block back to make room. When that write failed the
    update stopped where it was (found 2026-12-07 by a sweep of faults): some blocks updated,
    others not, the optimizer's state ahead of the weights, values of no step. Now the failed
    block keeps its image (its bytes are not lost, its write is tried again when next evicted),
    the update goes on in a new buffer, and the error (path, errno) is raised at the end of
    ``step()``, as for the optimizer's own NVMe records: the step is complete, the next ones work."""
    import errno

    from tierstate.io.faults import fail_nth

    ref, model = twin("gpt2", n_layer=6, n_embd=16)
    ws = offload(model, "nvme", nvme_dir=tmp_path / "w", prefetch=0)
    ref_opt = ts.AdamW(ref.parameters(), lr=1e-2, offload="cpu")
    opt = ts.AdamW(model.parameters(), lr=1e-2, offload="cpu")
    data = batches(3)
    for m, o in ((ref, ref_opt), (model, opt)):
        for step, ids in enumerate(data):
            m(ids, labels=ids).loss.backward()
            if m is model and step == 1:  # the update's first write-back fails
                with fail_nth("write", 1, errno.EIO, path_contains=str(tmp_path / "w")) as plan:
                    with pytest.raises(OSError) as info:
                        o.step()
                assert plan.fired == 1
                assert info.value.errno == errno.EIO and str(tmp_path / "w") in str(info.value)
            else:
                o.step()
            o.zero_grad()
    assert_same(ref, ref_opt, model, opt, ws)
    ws.close()


@pytest.mark.parametrize("how", ["write_param", "gathered", "write_param-in-backward"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_weights_written_between_steps_are_what_the_next_step_updates(tmp_path, how, dtype, tier):
    """A weight set between steps (``ws.write_param``, or in place inside ``ws.gathered()`` on
    the CPU) is what the next step trains from, as a write to a resident parameter is: a bf16
    weight's fp32 master follows it, also where the update runs in backward. Until 2026-12-07
    the master of the old weight wrote it back."""
    ref, model = twin("llama", dtype)
    ws = streamer(model, tier, tmp_path)
    kw = dict(step_in_backward=True) if how.endswith("in-backward") else {}
    ref_opt, opt = make_opt(ref, tmp_path, "a", **kw), make_opt(model, tmp_path, "b", **kw)
    data = batches(5)
    train_steps = [data[:2], data[2:]]
    for chunk in train_steps[:1]:
        for ids in chunk:
            for m, o in ((ref, ref_opt), (model, opt)):
                m(ids, labels=ids).loss.backward()
                o.step()
                o.zero_grad()
    name = "model.layers.1.mlp.up_proj.weight"
    new = torch.randn(ref.get_parameter(name).shape, generator=torch.Generator().manual_seed(9)).to(dtype)
    with torch.no_grad():
        ref.get_parameter(name).copy_(new)
        if how.startswith("write_param"):
            ws.write_param(model.get_parameter(name), new)
        else:
            with ws.gathered():
                model.get_parameter(name).copy_(new)
    for ids in train_steps[1]:
        for m, o in ((ref, ref_opt), (model, opt)):
            m(ids, labels=ids).loss.backward()
            o.step()
            o.zero_grad()
    assert_same(ref, ref_opt, model, opt, ws)
    ws.close()
