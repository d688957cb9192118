"""Resources of saving and loading: peak RSS bounded by the buffers; a soak stays flat."""
from __future__ import annotations

import json

import pytest

from test_kill import _env, _json_from

BUFFER = 1 << 20


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_save_and_load_peak_rss_is_bounded_by_the_buffers(tmp_path, mode):
    # hidden=2048: 4.7 M parameters, 54 MiB of parameters + moments = 27x the two 1 MiB buffers
    got = _json_from(["rss", mode, "2048", str(BUFFER), str(tmp_path / "ckpt")], _env(tmp_path / "nvme"))
    assert got["state_bytes"] >= 8 * 2 * BUFFER
    # two buffers plus 4 MiB for the interpreter's own churn (JSON, small tensors, allocator slack)
    bound = 2 * BUFFER + (4 << 20)
    assert got["save_growth"] <= bound, got
    assert got["load_growth"] <= bound, got
    print(json.dumps(got))


@pytest.mark.slow
def test_soak_2000_nvme_steps_with_periodic_saves_stays_flat(tmp_path):
    samples = _json_from(["soak", "nvme", "2000", "100", str(tmp_path / "ckpt")], _env(tmp_path / "nvme"))
    assert len(samples) == 20
    settled, last = samples[1], samples[-1]  # the first save warms up allocator and I/O engine
    print(json.dumps([samples[0], settled, last]))
    assert max(s["fds"] for s in samples[1:]) == min(s["fds"] for s in samples[1:]), samples
    # equal but for the manifest's few varying bytes (the step number, the time)
    assert max(s["disk"] for s in samples) - min(s["disk"] for s in samples) < 64, samples
    assert last["rss"] - settled["rss"] <= 8 << 20, samples
