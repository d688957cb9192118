"""WeightStreamer's contract outside the training loop: bad arguments, a damaged home, meta
models built block by block, reading and writing weights, close."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import tierstate as ts
from tierstate.weights import WeightsLostError, streamed

from _models import VOCAB, batches, gpt2, offload, transformers


def test_bad_arguments_name_the_argument(tmp_path):
    m = gpt2()
    with pytest.raises(ValueError, match="prefetch=-1"):
        offload(m, "nvme", nvme_dir=tmp_path, prefetch=-1)
    with pytest.raises(ValueError, match="offload='disk'"):
        offload(m, "disk")
    with pytest.raises(ValueError, match="nvme_dir="):
        offload(m, "cpu", nvme_dir=tmp_path)
    with pytest.raises(ValueError, match="no nn.ModuleList"):
        offload(nn.Linear(4, 4), "cpu")
    with pytest.raises(ValueError, match=r"blocks\[0\].*not a submodule"):
        offload(m, "cpu", blocks=[nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="one of"):
        offload(m, ["cpu"], blocks="auto")
    with pytest.raises(ValueError, match="Offload\\(gpu=0.5\\)"):
        offload(m, ts.Offload(gpu=0.5, cpu=0.5))
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        offload("gpt2", "cpu")
    cfg = m.config
    with torch.device("meta"):
        meta = transformers.GPT2LMHeadModel(cfg)
    with pytest.raises(ValueError, match="init=None"):
        offload(meta, "cpu")
    ws = offload(m, "cpu")
    with pytest.raises(ValueError, match="already streamed"):
        offload(m, "cpu")
    ws.close()


def test_a_changed_home_is_found_before_it_reaches_a_parameter(tmp_path):
    m = gpt2()
    ws = offload(m, "nvme", nvme_dir=tmp_path / "w", prefetch=0)
    home = ws.window.homes[1]
    with open(home.path, "r+b") as f:  # another process flips bytes in block 1's record
        f.seek(home.offsets[1] + 100)
        f.write(b"\xff" * 8)
        os.fsync(f.fileno())
    ids = batches(1)[0]
    with pytest.raises(WeightsLostError) as info:
        m(ids, labels=ids)
    err = info.value
    assert isinstance(err, ts.StateLostError) and err.filename == str(home.path) and err.offset == home.offsets[1]
    assert "block 1" in str(err) and "CRC-32C" in str(err)
    ws.close()


def test_meta_model_built_block_by_block_trains(tmp_path):
    cfg = gpt2().config
    with torch.device("meta"):
        m = transformers.GPT2LMHeadModel(cfg)
    ws = offload(m, "nvme", nvme_dir=tmp_path / "w", init=m._init_weights)
    assert m.lm_head.weight is m.transformer.wte.weight and not m.lm_head.weight.is_meta  # tie kept
    name, p = ws.named_streamed()[0]
    w = ws.read_param(p)
    assert torch.isfinite(w).all() and (w.std() > 0 or "ln" in name)
    opt = ts.AdamW(m.parameters(), lr=1e-2, offload="nvme", nvme_dir=tmp_path / "s")
    losses = []
    for ids in batches(1) * 16:  # one batch, memorized
        loss = m(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert abs(losses[0] - torch.log(torch.tensor(float(VOCAB))).item()) < 0.5  # an initialized model
    assert losses[-1] < losses[0] - 0.3
    ws.close()


def test_read_write_gathered_and_close(tmp_path):
    m = gpt2()
    want = {n: p.detach().clone() for n, p in m.named_parameters()}
    ws = offload(m, "nvme", nvme_dir=tmp_path / "w")
    folder_files = list((tmp_path / "w").iterdir())
    assert folder_files
    for name, p in ws.named_streamed():
        assert torch.equal(ws.read_param(p), want[name])
    name, p = ws.named_streamed()[0]
    ws.write_param(p, torch.full(p.shape, 0.5))
    with ws.gathered():
        assert torch.equal(p.detach(), torch.full(p.shape, 0.5))
        assert all(torch.equal(q.detach(), want[n]) for n, q in ws.named_streamed()[1:])
    with pytest.raises(ValueError, match="shape"):
        ws.write_param(p, torch.zeros(3))
    ws.close()
    assert not (tmp_path / "w").exists() or not any((tmp_path / "w").iterdir())
    assert p.shape == (0,)  # a forward now fails with a shape error, not a read of freed memory
    with pytest.raises(RuntimeError):
        m(batches(1)[0])


def test_cpu_storage_is_the_image_and_in_place_writes_are_kept(tmp_path):
    """On the CPU a materialized block's parameters live in its host image (no allocation, no
    copy), a change made to one in place is written back to the NVMe home, and a grown pool
    shrinks back once the blocks are released."""
    m = gpt2()
    ws = offload(m, "nvme", nvme_dir=tmp_path / "w", prefetch=0)
    win = ws.window
    base_pool = ws.stats()["pool_bytes"]
    name, p = ws.named_streamed()[0]
    b = streamed(p).block
    with ws.gathered([b]):
        image = win.state[b].image
        assert image.data_ptr() <= p.data_ptr() < image.data_ptr() + image.numel()
        with torch.no_grad():
            p.fill_(0.25)
    with ws.gathered():  # every block at once: the pool grows past its base and evicts block b's image
        pass
    assert ws.stats()["pool_bytes"] == base_pool
    ws.window.flush()
    ws.window.drop_images()
    assert win.state[b].image is None  # the next read comes from the file
    assert torch.equal(ws.read_param(p), torch.full(p.shape, 0.25))
    ws.close()


def test_a_forward_that_raises_releases_its_block(tmp_path):
    m = gpt2()
    ws = offload(m, "nvme", nvme_dir=tmp_path / "w", prefetch=0)
    block = m.transformer.h[1]
    b = streamed(block.attn.c_attn.weight).block

    def fail(module, args):
        raise RuntimeError("injected")

    h = block.attn.register_forward_pre_hook(fail)
    ids = batches(1)[0]
    with pytest.raises(RuntimeError, match="injected"):
        m(ids, labels=ids)
    h.remove()
    st = ws.window.state[b]
    assert st.holds == 0 and not st.materialized  # released, its image free for others
    assert all(not s.materialized for s in ws.window.state)
    m(ids, labels=ids).loss.backward()  # and the model still runs
    ws.close()


def test_changed_images_are_written_behind_once_no_update_is_pending(tmp_path):
    """An image the optimizer changed after its block ran is written back in the background at
    the next block's use, unless a gradient for that block is still to be applied."""
    m = gpt2()
    ws = offload(m, "nvme", nvme_dir=tmp_path / "w", prefetch=0)
    win = ws.window
    _, p = ws.named_streamed()[-1]
    b = streamed(p).block
    ws.write_param(p, torch.zeros(p.shape))  # as an update does: the image only
    assert win.state[b].dirty
    p.grad = torch.ones(p.shape)  # an update still pending: keep the image as it is
    ws._use(0)
    assert win.state[b].dirty and win.state[b].write is None
    p.grad = None
    before = ws.stats()["writeback_bytes"]
    ws._use(0)
    assert not win.state[b].dirty and ws.stats()["writeback_bytes"] > before
    win.release(0)
    ws.flush()
    win.drop_images()
    assert torch.equal(ws.read_param(p), torch.zeros(p.shape))
    ws.close()


def test_optimizer_stats_carry_weight_streaming(tmp_path):
    m = gpt2(n_layer=4)
    ws = offload(m, "nvme", nvme_dir=tmp_path / "w", prefetch=0)
    opt = ts.AdamW(m.parameters(), lr=1e-2, offload="nvme", nvme_dir=tmp_path / "s")
    for ids in batches(2):
        m(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    d = opt.stats().as_dict()
    # a pool of 2 images for 4 blocks: each step reads every block at least once
    assert d["counters"]["weight_fetch_bytes"] >= sum(ws.block_bytes())
    assert "weight_prefetch_misses" in d["counters"] and d["gauges"]["weight_window_bytes"] > 0
    ws.close()


def test_trace_shows_weight_reads_and_waits(tmp_path):
    import json

    m = gpt2(n_layer=4)
    ws = offload(m, "nvme", nvme_dir=tmp_path / "w", prefetch=0)
    opt = ts.AdamW(m.parameters(), lr=1e-2, offload="nvme", nvme_dir=tmp_path / "s")
    opt.trace(tmp_path / "trace.json")
    for ids in batches(2):
        m(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    path = opt.stop_trace()
    events = json.loads(open(path).read())
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e.get("name") for e in events}
    assert {"weight_fetch", "weight_wait"} <= names
    from tierstate.telemetry.report import parse_trace, summarize

    text = summarize(parse_trace(json.loads(open(path).read())), str(path))
    assert "weight_fetch" in text  # tierstate report lists the lane's time
    ws.close()


def test_auto_follows_the_planner(tmp_path, monkeypatch):
    """offload='auto' asks the weight planner; a model that fits stays resident, and the streamer
    follows whatever plan it gets (here: the budgets of this machine, a small model)."""
    from tierstate.placement.auto import choose_weights

    from tierstate.weights.blocks import assign, auto_blocks

    m = gpt2()
    blocks, resident = assign(m, auto_blocks(m))
    plan = choose_weights([b.nbytes for b in blocks], sum(p.numel() * p.element_size() for _, p in resident), "cpu",
                          nvme_dir=tmp_path / "w", max_prefetch=2)
    ws = offload(m, "auto", nvme_dir=tmp_path / "w")
    assert list(ws.tiers) == [t for t in plan.tier_of if t != "resident"]
    ids = batches(1)[0]
    assert torch.isfinite(m(ids, labels=ids).loss)
    ws.close()
