"""Touching an FSDP2 shard that tierstate streams, between its block's uses, raises instead of
ending the process ([Note: touching a streamed parameter directly], FSDP2 part).

Between uses a streamed shard's storage holds no bytes; torch's kernels read through its null
pointer. Until 2026-12-07 ``p.sum()``, ``p.norm()``, ``p.clone()``, ``p.to_local().sum()``,
``torch.save(p)``, ``model.half()`` ... on a sharded streamed parameter ended the rank with
SIGSEGV. ``_fsdp_streaming_worker.py --job gpt2=touch`` (2 gloo ranks) runs each such touch on
both ranks, then checks that nothing changed and that training goes on; each touch must be
refused with the parameter's name and the way to its values; metadata (shape, dtype) passes.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _torchrun import launch_worker

pytest.importorskip("transformers")

WORKER = Path(__file__).with_name("_fsdp_streaming_worker.py")
LAUNCH_TIMEOUT_S = 240

pytestmark = [pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60),
              pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                 reason="this torch build has no torch.distributed with gloo")]

READS = ("sum", "norm", "clone", "add", "to_local", "full_tensor", "redistribute", "data", "detach",
         "parameters_to_vector", "deepcopy", "save",
         # aliases taken inside ws.gathered() (to_local(), detach(), a view), read after it
         "kept_to_local", "kept_detach", "kept_view",
         # a model state dict's entry where the copies would not fit in RAM (a placeholder)
         "placeholder")


@pytest.fixture(scope="module")
def said(tmp_path_factory) -> dict:
    runs = launch_worker(WORKER, 2, tmp_path_factory.mktemp("fsdp_touch"), "--job", "gpt2=touch",
                         timeout=LAUNCH_TIMEOUT_S)
    if isinstance(runs, str):  # the launch failed: a rank ended (SIGSEGV before the fix)
        pytest.fail(runs)
    return runs["gpt2"]["touch"]


@pytest.mark.parametrize("case", READS)
def test_a_read_between_uses_is_refused_with_the_way_to_the_values(said, case):
    kind, message = said[case]
    assert kind == ("TypeError" if case in ("save", "deepcopy") else "RuntimeError"), said[case]  # as StreamedParameter
    assert "parameter 'transformer.h.1.mlp.c_" in message and "ws.read_param" in message, message
    assert "torch.distributed.checkpoint" in message or case in ("to_local", "full_tensor", "redistribute",
                                                                 "deepcopy", "save"), message


@pytest.mark.parametrize("case", ["mul_", "data_set", "data_set_held"])
def test_a_write_between_uses_is_refused_with_the_way_to_write(said, case):
    """``p.data = other`` too, also while the shard has memory: it would cut the parameter from
    its block (the optimizer would keep updating the block, FSDP2 would gather the block)."""
    kind, message = said[case]
    assert kind == "RuntimeError" and "ws.write_param" in message, said[case]


@pytest.mark.parametrize("case", ["half", "to_float64", "to_cpu"])
def test_a_conversion_is_refused_before_it_changes_anything(said, case):
    """Even one that changes nothing: FSDP2's ``_apply`` swaps every sharded parameter for a new
    one (before, ``model.to("cpu")`` failed inside torch with "Cannot swap t1 because it has
    weakref associated with it")."""
    kind, message = said[case]
    assert kind == "RuntimeError" and "before ts.offload_weights" in message and "Nothing was changed" in message, \
        message


def test_a_torch_optimizer_is_refused(said):
    kind, message = said["torch_sgd"]
    assert kind == "RuntimeError" and "ts.AdamW" in message and "Nothing was changed" in message, message


def test_repr_describes_the_parameter(said):
    for case in ("repr", "format"):
        assert said[case] == "returned", said[case]


def test_nothing_changed_and_training_goes_on(said):
    assert said["name"] == "StreamedDTensor" and said["closed_class"] == "DTensor"
    assert said["saved_class"] == "DTensor"  # torch.save inside gathered(): no tierstate class in the file
    assert said["deepcopy_held"] == ("DTensor", True) and said["deepcopy_keeps_values"]  # a copy of its own
    assert said["shape"] == (160, 40) and said["numel"] == 6400 and said["dtype"] == torch.float32  # metadata passes
    assert said["unchanged"] and said["inside_gathered"]
    assert torch.isfinite(torch.tensor(said["loss_after"]))
