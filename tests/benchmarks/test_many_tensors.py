"""benchmarks/many_tensors.py: the whole step over many tensors against one tensor of the same bytes."""
from __future__ import annotations

import pytest

from benchmark_scripts import load

many = load("many_tensors")


def test_a_tiny_run_times_every_variant_against_the_one_tensor_floor(capsys):
    assert many.main(["--shapes", "3x1024,2x4096", "--rounds", "2", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()[2:]]
    assert [(r[0], r[1]) for r in rows] == [(s, v) for s in ("3x1024", "2x4096") for v in many.VARIANTS]
    for r in rows:
        median, x_floor = float(r[2]), float(r[4])
        assert median > 0 and x_floor > 0
        if r[1] == "floor":
            assert x_floor == 1.0 and float(r[5]) == 0.0


@pytest.mark.parametrize("argv, message", [
    (["--shapes", "400"], "--shapes: '400' is not COUNTxNUMEL"),
    (["--shapes", "0x4096"], "--shapes: '0x4096' is not COUNTxNUMEL"),
    (["--rounds", "0"], "--rounds 0: must be >= 1"),
    (["--threads", "0"], "--threads 0: must be >= 1"),
    (["--round", "3"], "unrecognized arguments: --round"),
])
def test_bad_arguments_are_refused_by_name(capsys, argv, message):
    with pytest.raises(SystemExit):
        many.main(argv)
    assert message in capsys.readouterr().err
