"""Parameter offload onto a CUDA device: block weights in pinned host RAM or on NVMe, copied up on
a side stream, the compute stream waiting on its event; the optimizer updates the host images.
Compared with the same model resident on the device. Skipped without a GPU."""
from __future__ import annotations

import pytest
import torch

import tierstate as ts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
transformers = pytest.importorskip("transformers")


def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=128, n_positions=32, bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("step_in_backward", [False, True])
def test_streamed_to_cuda_trains_like_resident(tmp_path, tier, dtype, step_in_backward):
    ref = gpt2().to("cuda", dtype)
    model = gpt2().to(dtype)  # stays on the CPU: the streamer moves what is resident, streams the rest
    ws = ts.offload_weights(model, tier, nvme_dir=tmp_path / "w" if tier == "nvme" else None, device="cuda")
    assert model.transformer.wte.weight.device.type == "cuda"
    opts = [ts.AdamW(m.parameters(), lr=1e-2, offload="nvme", nvme_dir=tmp_path / n, step_in_backward=step_in_backward)
            for m, n in ((ref, "a"), (model, "b"))]
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        ids = torch.randint(0, 128, (2, 16), generator=g).cuda()
        for m, opt in zip((ref, model), opts):
            m(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    torch.cuda.synchronize()
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        got = ws.read_param(p) if ts.weights.streamed(p) is not None else p.detach().cpu()
        torch.testing.assert_close(got, want[name].detach().cpu(), rtol=0, atol=0, msg=name)
    st = ws.stats()
    assert st["copy_bytes"] > 0 and st["peak_window_bytes"] <= 3 * max(ws.block_bytes())
    ws.close()
