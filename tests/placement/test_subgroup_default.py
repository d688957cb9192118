"""The sub-group size an optimizer gets when Offload(subgroup_numel=...) is left out: 32 Mi
elements for CPU parameters with all state in host RAM that step after backward, 4 Mi
wherever sub-groups are the unit of disk records or of in-backward updates."""
from __future__ import annotations

import pytest
import torch

import tierstate as ts
from tierstate.placement import DEFAULT_SUBGROUP_NUMEL
from tierstate.placement.defaults import HOST_SUBGROUP_NUMEL

CPU = torch.device("cpu")


def _sizes(opt) -> list[int]:
    return [sg.numel for sg in opt.layout.subgroups]


def _params(n: int = (HOST_SUBGROUP_NUMEL + (3 << 20))):
    return [torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16))]


def test_host_only_cpu_parameters_take_the_large_size(tmp_path):
    opt = ts.AdamW(_params(), offload="cpu")
    assert opt.layout.subgroup_numel == HOST_SUBGROUP_NUMEL
    assert _sizes(opt) == [HOST_SUBGROUP_NUMEL, 3 << 20]
    ts.save_optimizer(opt, tmp_path / "ck")  # the checkpoint records the size the layout used
    import json
    assert json.loads((tmp_path / "ck" / "manifest.json").read_text())["placement"]["subgroup_numel"] == HOST_SUBGROUP_NUMEL


@pytest.mark.parametrize("case", ["nvme", "split", "in-backward"])
def test_disk_records_and_in_backward_updates_keep_the_small_size(case, tmp_path):
    if case == "in-backward":
        opt = ts.AdamW(_params(), offload="cpu", step_in_backward=True)
    else:
        offload = ts.Offload(cpu=0.0 if case == "nvme" else 0.5, nvme=1.0 if case == "nvme" else 0.5,
                             nvme_dir=tmp_path / "nv")
        opt = ts.AdamW(_params(), offload=offload)
    assert opt.layout.subgroup_numel == DEFAULT_SUBGROUP_NUMEL
    assert max(_sizes(opt)) == DEFAULT_SUBGROUP_NUMEL
    opt.close()


def test_an_explicit_size_is_kept_everywhere():
    offload = ts.Offload(cpu=1.0, subgroup_numel=1 << 20)
    assert offload.subgroup_numel_for(CPU, step_in_backward=False) == 1 << 20
    opt = ts.AdamW(_params(3 << 20), offload=offload)
    assert _sizes(opt) == [1 << 20] * 3


def test_the_rule_by_placement():
    host = ts.Offload(cpu=1.0)
    assert host.subgroup_numel is None
    assert host.subgroup_numel_for(CPU, step_in_backward=False) == HOST_SUBGROUP_NUMEL
    assert host.subgroup_numel_for(CPU, step_in_backward=False, streams_weights=True) == DEFAULT_SUBGROUP_NUMEL
    # accelerator parameters: the sub-groups pace the uploads that overlap the next update
    assert host.subgroup_numel_for(torch.device("cuda"), step_in_backward=False) == DEFAULT_SUBGROUP_NUMEL
    assert HOST_SUBGROUP_NUMEL % 4096 == 0 and DEFAULT_SUBGROUP_NUMEL % 4096 == 0  # whole q8 blocks


@pytest.mark.parametrize("bad", [0, 1023, 2.5, True, "4M"])
def test_a_bad_size_is_refused_naming_the_argument(bad):
    with pytest.raises(ValueError, match="subgroup_numel"):
        ts.Offload(subgroup_numel=bad)
