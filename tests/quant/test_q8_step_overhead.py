"""The per-call host work of the 8-bit kernels stays small next to the kernel itself: the
stochastic-rounding key is integer arithmetic, not torch tensors (a step of a 50-tensor model
spent 25 ms in it, more than the kernels)."""
from __future__ import annotations

import random
import time

import torch

from tierstate.kernels import quant as Q


def test_sr_key_is_cheap_and_equals_the_tensor_hash():
    rng = random.Random(3)
    for _ in range(200):
        x = rng.getrandbits(32)
        assert Q._lowbias32_int(x) == int(Q.lowbias32(torch.tensor([x], dtype=torch.int64))[0])
    t = time.perf_counter()
    for step in range(10_000):
        Q.sr_key(0x1234_5678_9ABC_DEF0, step)
    elapsed = time.perf_counter() - t
    # 4 hashes of integers: ~10 us a call even on a loaded 2-core machine; torch tensors took ~470 us
    assert elapsed < 1.0, f"10,000 sr_key calls took {elapsed:.2f} s"
