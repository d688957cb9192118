"""FSDP2 shards, tierstate streams the shard: ``offload_weights`` over a ``fully_shard``-ed model.

``_fsdp_streaming_worker.py`` trains transformers GPT-2 (tied embedding) and Llama (uneven
shards) on 2 gloo ranks, FSDP2 per block and at the root, with activation checkpointing,
gradient accumulation, clipping and frozen weights, each rank's block shards kept in RAM, on
NVMe or split between them. Checked here:

- 10 steps are bit-identical to the same FSDP2 run with the shards resident (losses and every
  parameter), with and without activation checkpointing, and under FSDP2's own mixed precision;
- each rank streams 1/N of every block (FSDP2's padding and alignment aside);
- between steps the streamed shards hold no memory (they live on their tier), NVMe shards
  were read from disk, and training held at most two blocks' shards at once (the one FSDP2
  gathers and the one its backward prefetch gathers);
- a ``torch.distributed.checkpoint`` saved and loaded inside ``ws.gathered()``, or without it
  (the model's state dict reads and writes the shards' homes), resumes bit for bit.

One torchrun launch, about 30 s on 2 shared cores. The same worker passed on 4 ranks
(``--job llama=resident,split,nvme-resume``) in 16 launches by hand, bit-identical too; the
4-rank FSDP2 paths are covered in CI by test_fsdp_checkpoint.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _torchrun import launch_worker

pytest.importorskip("transformers")

WORKER = Path(__file__).with_name("_fsdp_streaming_worker.py")
LAUNCH_TIMEOUT_S = 300
WORLD = 2
RUNS = {"gpt2": "resident,cpu,nvme,split,nvme-noac,nvme-resume,nvme-resume-plain,resident-mp,nvme-mp,errors",
        "llama": "resident,nvme,split,nvme-resume"}

pytestmark = [pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60),
              pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                 reason="this torch build has no torch.distributed with gloo")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict | str:
    jobs = [arg for model, variants in RUNS.items() for arg in ("--job", f"{model}={variants}")]
    return launch_worker(WORKER, WORLD, tmp_path_factory.mktemp("fsdp_streaming"), *jobs, timeout=LAUNCH_TIMEOUT_S)


def cases():
    return [pytest.param(m, v, id=f"{m}-w{WORLD}-{v}") for m, vs in RUNS.items() for v in vs.split(",")
            if not v.startswith("resident") and v != "errors"]


def result(runs, model: str) -> dict:
    if isinstance(runs, str):
        pytest.fail(runs)
    return runs[model]


@pytest.mark.parametrize("model,variant", cases())
def test_streamed_shards_train_as_resident_ones(runs, model, variant):
    r = result(runs, model)
    ref = r["resident-mp" if variant.endswith("-mp") else "resident"]  # the same run, shards resident
    got = r[variant]
    assert got["losses"] == ref["losses"]
    assert got["params"].keys() == ref["params"].keys()
    for name, value in ref["params"].items():
        assert torch.equal(got["params"][name], value), name


@pytest.mark.parametrize("model,variant", cases())
def test_shards_live_on_their_tier_between_steps(runs, model, variant):
    world = WORLD
    ranks = result(runs, model)[variant]["ranks"]
    assert len(ranks) == world
    for rank, info in enumerate(ranks):
        assert len(info["held"]) == 10 and set(info["held"]) == {0}, (rank, info["held"])
        stats, blocks = info["stats"], info["block_bytes"]
        assert stats["blocks"] == 6 and info["streamed_bytes"] == sum(blocks) > 0
        if variant.startswith("nvme"):
            assert stats["block_tiers"] == {"nvme": 6}
            assert stats["fetch_bytes"] > 2 * sum(blocks), stats  # read back every step, not kept in RAM
        if variant == "split":
            assert stats["block_tiers"] == {"cpu": 3, "nvme": 3}
        for b, (mine, whole, pad) in enumerate(zip(blocks, info["whole_block_bytes"], info["pad_bytes"])):
            # this rank's share of the block: 1/N of it, plus FSDP2's padding (at most a row per
            # parameter) and 64-byte alignment per parameter
            assert whole / world - 64 <= mine <= whole / world + pad + 64 * 12, (rank, b, mine, whole, pad)
        if "resume" not in variant:  # (the resumed run's checkpoint holds this rank's shards at once)
            assert stats["peak_window_bytes"] <= 2 * max(blocks), stats


def test_what_cannot_work_is_refused_with_the_fix(runs):
    said = result(runs, "gpt2")["errors"]
    assert "torch.distributed.checkpoint" in said["save_weights"] and "get_state_dict" in said["save_weights"]
    assert "'transformer.h.0'" in said["root_only"] and "fully_shard(block)" in said["root_only"]
    assert said["read_param_is_the_shard"] and said["write_param_is_kept"]
    assert "this rank's shard" in said["write_param_global_shape"]
