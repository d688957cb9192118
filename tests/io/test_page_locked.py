"""io.page_locked_empty: tierstate's own mapping registered with CUDA, for its whole lifetime.

Without a GPU the CUDA calls are replaced by recorders, which is enough to hold the part that
is tierstate's: the range registered is exactly the tensor's, and it is unregistered once,
after the last tensor on the memory has died, never while a view still uses it. The CUDA
test at the end (skipped without a device) checks what the registration buys there."""
from __future__ import annotations

import gc

import pytest
import torch

from tierstate import io as tio


class Recorder:
    def __init__(self, answer=None):
        self.calls = []
        self.answer = answer

    def register(self, address, nbytes):
        self.calls.append(("register", address, nbytes))
        return self.answer

    def unregister(self, address):
        self.calls.append(("unregister", address))


@pytest.mark.parametrize("nbytes, alignment", [(1, None), (4097, 64), (5 << 20, 4096), ((4 << 20) + 3, 1 << 16)])
def test_the_registered_range_is_the_tensors_and_is_released_after_its_last_view(nbytes, alignment):
    rec = Recorder()
    buf = tio.page_locked_empty(nbytes, alignment, register=rec.register, unregister=rec.unregister)
    assert buf.dtype == torch.uint8 and buf.numel() == nbytes
    assert buf.data_ptr() % (alignment or 4096) == 0
    assert rec.calls == [("register", buf.data_ptr(), nbytes)]
    address = buf.data_ptr()
    view = buf[nbytes // 2:].view(torch.uint8)
    buf.fill_(7)
    del buf
    gc.collect()
    assert rec.calls == [("register", address, nbytes)], "unregistered while a view still uses the memory"
    assert int(view[-1]) == 7
    del view
    gc.collect()
    assert rec.calls == [("register", address, nbytes), ("unregister", address)]


def test_zero_bytes_registers_nothing_and_bad_sizes_are_refused():
    rec = Recorder()
    assert tio.page_locked_empty(0, register=rec.register, unregister=rec.unregister).numel() == 0
    assert rec.calls == []
    for bad in (-1, 2.5, "8"):
        with pytest.raises(ValueError, match="nbytes="):
            tio.page_locked_empty(bad, register=rec.register, unregister=rec.unregister)


def test_a_failed_registration_falls_back_to_torchs_pinned_allocator(monkeypatch):
    rec = Recorder(answer="cudaHostRegister returned cudaErrorNotSupported")
    asked = {}

    def empty(*args, **kwargs):  # torch.empty, noting that pinned memory was asked of torch
        asked.update(kwargs)
        return torch.zeros(*args, dtype=kwargs.get("dtype"))

    monkeypatch.setattr(torch, "empty", empty)
    buf = tio.page_locked_empty(8192, register=rec.register, unregister=rec.unregister)
    assert asked.get("pin_memory") is True and buf.numel() == 8192
    gc.collect()
    assert [c[0] for c in rec.calls] == ["register"], "a range that was never registered is not unregistered"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_page_locked_memory_is_pinned_at_its_own_size_and_copies_asynchronously(torch_pinned_bytes):
    nbytes = (64 << 20) + 4096  # torch's pinned allocator would take 128 MiB for this

    before = torch_pinned_bytes()
    buf = tio.page_locked_empty(nbytes)
    assert buf.is_pinned()
    assert torch_pinned_bytes() == before, "the memory came from torch's CachingHostAllocator after all"
    src = torch.arange(nbytes, dtype=torch.int64).to(torch.uint8)
    buf.copy_(src)
    dev = buf.to("cuda", non_blocking=True)
    back = torch.empty_like(buf).pin_memory()
    back.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)
