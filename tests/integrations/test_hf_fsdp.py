"""HF Trainer under FSDP2 with ``optimizer_cls_and_kwargs=(tierstate.AdamW, ...)``, two CPU ranks.

The training runs in ``_hf_fsdp_worker.py`` under torchrun (gloo); this file checks what the
ranks wrote: the parameters really are sharded, FSDP reaches the losses and gradient norms of the
same training under DDP, tierstate's metrics are in Trainer's logs, each rank's optimizer state
goes into the checkpoint through the streaming save, and resuming from it continues
bit-identically to the uninterrupted run, on every rank. About 30 s on 2 shared cores, most of
it importing transformers in each rank.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install tierstate[hf])")
pytest.importorskip("accelerate", reason="accelerate is not installed (pip install tierstate[hf])")

import tierstate  # noqa: E402
from tierstate.integrations.hf import _refuse_other_world_size  # noqa: E402

WORKER = Path(__file__).with_name("_hf_fsdp_worker.py")
# The folder holding the tierstate under test: the ranks must import that one.
IMPORT_ROOT = Path(tierstate.__file__).resolve().parents[1]
WORLD = 2
STEPS, CHECKPOINT_STEP = 6, 3
# tiny_lm's Llama: vocab 64 x hidden 32; FSDP2 shards dim 0 of every parameter across the ranks.
EMBED = "model.embed_tokens.weight"
EMBED_SHAPE = (64, 32)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("this torch build has no torch.distributed with gloo")
    out = tmp_path_factory.mktemp("hf_fsdp")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(IMPORT_ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(WORLD), str(WORKER), str(out)],
                          env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_parameters_and_state_are_sharded(ranks):
    for rank in ranks:
        assert rank["world_size"] == WORLD
        assert rank["replicated"]["fsdp_enabled"] is False
        for run in ("straight", "checkpointed", "resumed"):
            assert rank[run]["fsdp_enabled"] is True, run
            assert rank[run]["optimizer_type"] == "AdamW"
    # Each rank holds its half of the embedding rows, and the optimizer's moments match that shard.
    shards = [rank["straight"]["params"][EMBED] for rank in ranks]
    assert sum(s.shape[0] for s in shards) == EMBED_SHAPE[0] and all(s.shape[1:] == EMBED_SHAPE[1:] for s in shards)
    assert all(s.shape[0] < EMBED_SHAPE[0] for s in shards)
    embed_index = list(ranks[0]["straight"]["params"]).index(EMBED)
    for rank, shard in zip(ranks, shards):
        state = rank["straight"]["opt_state"][embed_index]
        assert state["exp_avg"].shape == shard.shape and state["exp_avg_sq"].shape == shard.shape
        assert float(state["step"]) == STEPS


def test_fsdp_trains_like_ddp(ranks):
    for rank in ranks:
        sharded, replicated = rank["straight"], rank["replicated"]
        assert len(sharded["losses"]) == STEPS
        assert sharded["losses"][-1] < sharded["losses"][0] - 0.5, sharded["losses"]
        # Same data, same initial weights, same global gradient: only summation order differs.
        for a, b in zip(sharded["losses"], replicated["losses"]):
            assert math.isclose(a, b, rel_tol=1e-4), (sharded["losses"], replicated["losses"])
        # Clipping must see the norm over all shards, not this rank's part of it.
        norms = [m["tierstate/grad_norm"] for m in sharded["metrics"]]
        for a, b in zip(norms, [m["tierstate/grad_norm"] for m in replicated["metrics"]]):
            assert math.isclose(a, b, rel_tol=1e-5), (norms, replicated["metrics"])
    assert ranks[0]["straight"]["metrics"] and all(
        ranks[0]["straight"]["metrics"][i]["tierstate/grad_norm"] == ranks[1]["straight"]["metrics"][i]["tierstate/grad_norm"]
        for i in range(STEPS))


def test_our_metrics_reach_trainer_logs(ranks):
    for rank in ranks:
        for logged in rank["straight"]["metrics"]:
            assert logged["tierstate/step_ms"] > 0
            assert logged["tierstate/state_gib_host"] > 0
            assert logged["tierstate/skipped_steps"] == 0


def test_checkpoint_holds_each_ranks_state_and_resumes_bit_identically(ranks):
    files = set(ranks[0]["checkpoint_files"])
    assert {f"tierstate_optimizer_rank{r}_of_{WORLD}" for r in range(WORLD)} <= files, files
    assert not any(name.startswith("optimizer") for name in files), files  # Trainer's FSDP optimizer files
    for rank in ranks:
        straight, resumed = rank["straight"], rank["resumed"]
        assert resumed["global_step"] == STEPS
        assert resumed["losses"][CHECKPOINT_STEP:] == straight["losses"][CHECKPOINT_STEP:]
        assert straight["params"].keys() == resumed["params"].keys()
        for name, value in straight["params"].items():
            assert torch.equal(value, resumed["params"][name]), name
        assert straight["opt_state"].keys() == resumed["opt_state"].keys()
        for index, state in straight["opt_state"].items():
            for key, value in state.items():
                assert torch.equal(value, resumed["opt_state"][index][key]), (index, key)


def test_resume_with_another_world_size_is_refused(tmp_path):
    (tmp_path / "tierstate_optimizer_rank0_of_2").mkdir()
    (tmp_path / "tierstate_optimizer_rank1_of_2").mkdir()
    with pytest.raises(ValueError, match="world size"):
        _refuse_other_world_size(str(tmp_path), "tierstate_optimizer_rank0_of_4")
    _refuse_other_world_size(str(tmp_path / "tierstate_optimizer_rank0_of_2"), "x")  # nothing saved there: no error
