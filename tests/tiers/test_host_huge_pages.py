"""The host tier's state sits on memory the kernel may back with transparent huge pages
(tiers/host.py, [Note: huge pages for host state]); checked in /proc/self/smaps, where the
mapping holding each arena must be THP-eligible (madvised, or THP "always")."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tierstate as ts
from tierstate.io import huge_page_size
from tierstate.placement import TierKind

PAGE = huge_page_size()  # 0 where the kernel gives none (THP "never", or absent)


def _mapping_of(address: int) -> dict[str, str]:
    """The smaps fields of the mapping that holds ``address``."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            if inside:
                return fields
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
            fields = {}
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    if inside:
        return fields
    raise AssertionError(f"no mapping holds {address:#x}")


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
        fields = _mapping_of(arena.data_ptr())
        assert fields.get("THPeligible") == "1", (key, fields)
        assert arena.data_ptr() % PAGE == 0, f"{key}: starts inside a huge page, so its first one cannot be huge"
    opt.close()
