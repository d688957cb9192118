"""The host tier's state sits on memory the kernel may back with transparent huge pages
(tiers/host.py, [Note: huge pages for host state]); checked in /proc/self/smaps, where the
mapping holding each arena must be THP-eligible (madvised, or THP "always")."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tierstate as ts
from tierstate.io import huge_page_size, mapping_fields
from tierstate.placement import TierKind

PAGE = huge_page_size()  # 0 where the kernel gives none (THP "never", or absent)


def _thp_always() -> bool:
    """THP in mode "always": every anonymous mapping is eligible unless advised otherwise."""
    return "[always]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()


@pytest.mark.skipif(PAGE == 0, reason="the kernel offers no transparent huge pages here")
@pytest.mark.parametrize("moment_dtype", [torch.float32, "q8"])
def test_every_host_arena_is_on_huge_page_eligible_memory(moment_dtype):
    params = [torch.nn.Parameter(torch.randn(3 << 20).bfloat16()), torch.nn.Parameter(torch.randn(1 << 20).bfloat16())]
    opt = ts.AdamW(params, offload=ts.Offload(cpu=1.0, moment_dtype=moment_dtype))
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    arenas = opt.tiers[TierKind.HOST].arenas
    assert {"master", "exp_avg", "exp_avg_sq"} <= {k.split(".")[0] for k in arenas}
    for key, arena in arenas.items():
        if arena.numel() * arena.element_size() < PAGE:
            continue  # smaller than one huge page (a q8 block scale): nothing to gain
        fields = mapping_fields(arena.data_ptr()) or {}
        assert fields.get("THPeligible") == "1", (key, fields)
        assert arena.data_ptr() % PAGE == 0, f"{key}: starts inside a huge page, so its first one cannot be huge"
    opt.close()


def _gpt2_like(seed=0):
    torch.manual_seed(seed)
    # a 4 MiB embedding and a 2.25 MiB projection (moved), a 3 KiB bias (too small to move)
    return torch.nn.Sequential(torch.nn.Embedding(1024, 1024), torch.nn.Linear(1024, 576), torch.nn.Linear(576, 768))


@pytest.mark.skipif(PAGE == 0, reason="the kernel offers no transparent huge pages here")
def test_fp32_cpu_parameters_move_to_huge_pages_and_keep_their_values_and_identity():
    model = _gpt2_like()
    before = {n: (p, p.detach().clone(), p.data_ptr()) for n, p in model.named_parameters()}
    hook_calls = []
    model[1].weight.register_hook(lambda g: hook_calls.append(1))
    opt = ts.AdamW(model.parameters(), lr=1e-3, offload="cpu")
    for name, (p, values, ptr) in before.items():
        now = dict(model.named_parameters())[name]
        assert now is p and p.requires_grad  # the same Parameter object
        assert torch.equal(p.detach(), values)  # bit for bit
        big = p.numel() * p.element_size() >= PAGE
        if big:  # moved unless torch's memory happened to be huge-page aligned AND eligible (THP "always")
            assert p.data_ptr() % PAGE == 0 and (mapping_fields(p.data_ptr()) or {}).get("THPeligible") == "1", name
        else:
            assert p.data_ptr() == ptr, name
    # the moved parameters train: hooks still fire and the update lands in the model
    model(torch.arange(8).view(2, 4)).sum().backward()
    opt.step()
    assert hook_calls == [1]
    assert not torch.equal(model[0].weight.detach(), before["0.weight"][1])
    opt.close()


@pytest.mark.skipif(PAGE == 0, reason="the kernel offers no transparent huge pages here")
def test_moved_parameters_match_torch_adamw_for_seven_steps():
    model, ref = _gpt2_like(1), _gpt2_like(1)
    opt = ts.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, offload="cpu")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    assert model[0].weight.data_ptr() % PAGE == 0
    x = torch.randint(0, 1024, (4, 8))
    for _ in range(7):
        # Both take the reference's gradients: with each model's own backward, the ULP-level
        # differences of the two updates feed back through the forward, and Adam's m/sqrt(v)
        # amplifies them where a gradient is near zero (one element of 442,368 was 6e-5 apart
        # after 7 steps on a Xeon). The parity suite does the same.
        ref_opt.zero_grad()
        ref(x).square().mean().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            p.grad = q.grad.clone()
        opt.step()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)  # the parity suite's fp32 tolerance
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][key], ref_opt.state[q][key], rtol=1e-5, atol=1e-8)
    # the forward reads the moved storage
    torch.testing.assert_close(model(x), ref(x), rtol=1e-4, atol=1e-5)
    opt.close()


@pytest.mark.skipif(PAGE == 0, reason="the kernel offers no transparent huge pages here")
def test_a_huge_page_aligned_parameter_off_huge_pages_still_moves():
    # Regression: alignment was taken for "already on huge pages", so a parameter whose storage
    # torch's allocator happened to place on a 2 MiB boundary (a brk-heap address seen in CI)
    # stayed on 4 KiB pages under THP "madvise". Here the memory is aligned but not advised.
    # A fresh anonymous mapping nobody advised, cut at a huge-page boundary: heap memory from
    # posix_memalign may carry an earlier user's advice (numpy advises arrays of >= 4 MiB).
    import mmap

    values = torch.randn(1 << 20)
    fresh = mmap.mmap(-1, (4 << 20) + PAGE)
    start = torch.frombuffer(fresh, dtype=torch.uint8).data_ptr()
    offset = -start % PAGE
    p = torch.nn.Parameter(torch.frombuffer(fresh, dtype=torch.float32, count=1 << 20, offset=offset))
    p.data.copy_(values)
    assert p.data_ptr() % PAGE == 0
    madvised = (mapping_fields(p.data_ptr()) or {}).get("THPeligible") == "1"
    assert madvised == _thp_always()  # eligible only under THP "always"
    ptr = p.data_ptr()
    opt = ts.AdamW([p], offload="cpu")
    assert (mapping_fields(p.data_ptr()) or {}).get("THPeligible") == "1"
    assert (p.data_ptr() == ptr) == madvised  # moved exactly when it was not eligible
    assert torch.equal(p.detach(), values)
    # built again over the same, now moved, parameter: it stays (no second copy)
    moved = p.data_ptr()
    ts.AdamW([p], offload="cpu").close()
    assert p.data_ptr() == moved
    opt.close()


def _kernel_would_back_with_huge_pages(fields: dict) -> bool:
    """The kernel's rule for an anonymous mapping, from what smaps says of it: advised
    MADV_HUGEPAGE ("hg"), or THP "always" unless advised MADV_NOHUGEPAGE ("nh")."""
    flags = fields["VmFlags"].split()
    return "hg" in flags or (_thp_always() and "nh" not in flags)


@pytest.mark.skipif(PAGE == 0, reason="the kernel offers no transparent huge pages here")
def test_huge_page_eligible_reads_the_kernels_answer():
    import ctypes
    import mmap

    from tierstate.io import aligned_empty, huge_page_eligible

    advised = aligned_empty(4 << 20, PAGE, huge_pages=True)
    # posix_memalign memory: eligible or not as whoever used that heap range before left it
    # (numpy advises its arrays of >= 4 MiB, and glibc hands the range out again when freed)
    heap = aligned_empty(4 << 20, PAGE, huge_pages=False)
    fresh = mmap.mmap(-1, 4 << 20)  # a new anonymous mapping nobody advised
    fresh_address = ctypes.addressof(ctypes.c_char.from_buffer(fresh))
    buffers = {"advised": advised.data_ptr(), "heap": heap.data_ptr(), "fresh": fresh_address}
    for name, start in buffers.items():
        for address in (start, start + (4 << 20) - 1):  # at both ends
            fields = mapping_fields(address)
            assert fields["start"] <= address < fields["end"]
            assert huge_page_eligible(address) == _kernel_would_back_with_huge_pages(fields), (name, fields)
    assert "hg" in mapping_fields(advised.data_ptr())["VmFlags"].split()  # the MADV_HUGEPAGE flag
    assert huge_page_eligible(advised.data_ptr())
    assert huge_page_eligible(fresh_address) == _thp_always()  # under "madvise", unadvised memory is not
    assert not huge_page_eligible(0)  # no mapping holds page 0
    del fresh_address
    fresh.close()


@pytest.mark.skipif(PAGE == 0, reason="the kernel offers no transparent huge pages here")
def test_heap_memory_another_library_advised_is_reported_eligible():
    """Seen in CI (2026-12-06): a 4 MiB posix_memalign block landed on heap memory numpy had
    advised MADV_HUGEPAGE for an array, then freed; the kernel calls it eligible, and so must
    huge_page_eligible. In a process of its own, so that the heap starts as this test needs."""
    import subprocess
    import sys

    script = (
        "import numpy as np\n"
        "from tierstate.io import aligned_empty, huge_page_eligible, mapping_fields\n"
        "a = np.ones((8 << 20) // 8); del a\n"  # a freed mmapped chunk raises glibc's mmap threshold
        "b = np.ones((6 << 20) // 8); del b\n"  # so this one comes from the heap, advised by numpy
        "buf = aligned_empty(4 << 20, %d, huge_pages=False)\n"
        "flags = mapping_fields(buf.data_ptr())['VmFlags'].split()\n"
        "print('hg' in flags, huge_page_eligible(buf.data_ptr()))\n" % PAGE
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    advised, eligible = (word == "True" for word in out.stdout.split())
    assert eligible == (advised or _thp_always())


def test_parameters_that_share_or_view_storage_are_left_where_they_are():
    base = torch.randn(2 << 20)
    view = torch.nn.Parameter(base[: 1 << 20])  # a view: moving it would cut it from `base`
    shared = torch.nn.Parameter(torch.empty(0))
    shared.data = base.view(2, 1 << 20)  # whole storage, but `base` sees it too
    small = torch.nn.Parameter(torch.randn(16))
    bf16 = torch.nn.Parameter(torch.randn(2 << 20).bfloat16())  # has a master: updated there, rounded into it
    ptrs = [p.data_ptr() for p in (view, shared, small, bf16)]
    opt = ts.AdamW([view, shared, small, bf16], offload="cpu")
    assert [p.data_ptr() for p in (view, shared, small, bf16)] == ptrs
    for p in (view, shared, small, bf16):
        p.grad = torch.ones_like(p)
    opt.step()
    assert torch.equal(base[: 1 << 20], view.detach())  # the view still is the base's memory
    opt.close()
