"""Defaults of the offload policy: sizes and the NVMe folders (no torch import: the planner reads them too)."""
from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

# 4 Mi elements per sub-group: a record of 16 MiB fp32 master + 32 MiB fp32 moments. Large
# enough that each record streams at full disk speed (requests of >= 8 MiB), small enough
# that each NVMe pool buffer holds 32-48 MiB of host RAM and that a 124M-parameter model
# gives ~30 sub-groups to overlap I/O with updates (16 Mi gave 8: measured 1.29x the
# floor vs 1.24x at 4 Mi in `tierstate bench step --offload nvme` on a loaded machine).
DEFAULT_SUBGROUP_NUMEL = 1 << 22

# 32 Mi elements when the sub-groups only bound the kernel calls: CPU parameters whose state
# is all in host RAM, stepped after backward (no disk record, no update during backward, no
# upload to overlap). Each sub-group costs a kernel call and ~0.1-0.2 ms of Python; measured on
# a 2-vCPU Zen 4, opt.step() of 50M / 100M bf16 params right after backward, 20 interleaved
# steps: 31.1 / 62.6 ms at 4 Mi, 29.7 / 59.7 at 16 Mi, 28.7 / 56.1 at 64 Mi (the kernel alone
# over the same bytes: 28.1 ms for 50M). At 32 Mi a 124M model still has 4 sub-groups.
HOST_SUBGROUP_NUMEL = 1 << 25

# 16 buffers: with 4 Mi-element sub-groups a pool of 512 MiB (fp32 params: m and v) to
# 768 MiB (low-precision params: + fp32 master). The pool is a write-back cache whose last
# buffer_count records of a step serve the next one, so each step moves S - buffer_count
# records each way: on GPT-2 124M (30 records) 4 buffers left 0.95 s of a 2.8 s step waiting
# on the disk, 16 buffers 0.29 s (tierstate bench e2e, loaded machine), at 0.5 GiB more RSS.
DEFAULT_BUFFER_COUNT = 16


def default_buffer_count(bytes_per_element: Mapping[str, float], block_records: int = 0) -> int:
    """The NVMe pool's default size for records of these state keys (key -> stored bytes per
    element, :func:`state_bytes_per_element`'s table): as many buffers as fit in the RAM 16
    records of the same keys at fp32 would take, or 16 plus twice ``block_records`` if that
    is more (the read-ahead of weights streamed per block, see
    :meth:`tierstate.placement.Offload.buffer_count_for`; 112 buffers of 16 MiB for a
    Llama-2-7B layer with bf16 moments, already 3.5x that RAM).

    Why bytes and not a count: compressed records are small (q8 moments under a bf16_sr master
    on bf16 parameters store 2.03 B an element against 8 at fp32), so 16 of them cached 130 MiB
    at 4 Mi elements against fp32 state's 512 MiB, and a 400M bf16 step on NVMe took 1,440 ms,
    1.48x its CPU-bound floor, against 1,029 ms (1.05x) with 94 buffers (Zen 1 VM,
    benchmarks/README.md); 505-509 ms against 597-617 with 63 buffers (Xeon VM,
    docs/compressed_state.md).
    Key parts (``exp_avg.fp8``, ``exp_avg.scale``, ``master.comp``) count as one fp32 key."""
    stored = sum(bytes_per_element.values())
    fp32 = 4.0 * len({key.split(".")[0] for key in bytes_per_element})
    scaled = math.floor(DEFAULT_BUFFER_COUNT * fp32 / stored + 1e-9) if stored > 0 else DEFAULT_BUFFER_COUNT
    return max(DEFAULT_BUFFER_COUNT + 2 * block_records, scaled)

# Compressed state (tierstate.kernels.quant): 8-bit moments and a 16-bit master.
Q8 = "q8"
MASTER_DTYPES = ("fp32", "bf16_kahan", "bf16_sr")
DEFAULT_QUANT_BLOCK = 256
QUANT_BLOCK_RANGE = (64, 4096)  # powers of two; the native kernels' chunks are multiples of 4096
# The 8-bit map families (tierstate.kernels.quant.MAP_FAMILIES) and the part name of each
# one's codes (quant.CODES_PART; tests/quant/test_fp8_maps.py checks they agree).
QUANT_MAPS = ("dynamic", "fp8")
DEFAULT_QUANT_MAP = "dynamic"
QUANT_CODES_PART = {"dynamic": "codes", "fp8": "fp8"}


def is_own_master(param_dtype: str, master_dtype: str) -> bool:
    """Whether a parameter updated in host memory is its own master: its dtype (``"fp32"``,
    ``"bf16"``, ``"fp16"``) is the master's, so the update reads and writes it in place and
    no copy of it is stored. An fp32 parameter under an fp32 master, as in torch; a bf16
    parameter under a bf16 master (``"bf16_kahan"``, ``"bf16_sr"``): the master is rounded
    to bf16 after every update and the parameter receives exactly that value, so a stored
    copy would only repeat it (2 B/param in the state and in every NVMe record, read and
    written each step). ``"bf16_kahan"`` still keeps its compensation (``master.comp``)."""
    if param_dtype == "fp32":
        return master_dtype == "fp32"
    return param_dtype == "bf16" and master_dtype in ("bf16_kahan", "bf16_sr")


def state_bytes_per_element(moment_dtype: str, master_dtype: str = "fp32", quant_block: int = DEFAULT_QUANT_BLOCK,
                            *, moment_keys=("exp_avg", "exp_avg_sq"), fp32_keys=(), needs_master: bool = True,
                            quant_map: str = DEFAULT_QUANT_MAP) -> dict[str, float]:
    """Bytes per parameter of each stored state key: the one table the optimizer's stats and the
    planner read.

    ``moment_dtype``: ``"fp32"`` (4 B a moment), ``"bf16"`` (2 B) or ``"q8"`` (1 B of code plus
    a 4 B scale per ``quant_block`` elements: 1.016 B at 256); ``master_dtype``: ``"fp32"``
    (4 B), ``"bf16_kahan"`` (2 B bf16 + 2 B int16 compensation, key ``master.comp``) or
    ``"bf16_sr"`` (2 B). The master is counted only where one is kept (``needs_master``:
    accelerator parameters, and host parameters that are not their own master, see
    :func:`is_own_master`); ``master.comp`` wherever the mode is ``"bf16_kahan"``. AdamW with
    q8 moments: 6.03 B with an fp32 master, 6.03 with bf16 + compensation, 4.03 with stochastic
    rounding; on host parameters that are their own master 2.03 (fp32 under fp32, bf16 under
    ``"bf16_sr"``) and 4.03 (bf16 under ``"bf16_kahan"``). ``quant_map`` names the
    codes' part (``exp_avg.codes`` for ``"dynamic"``, ``exp_avg.fp8`` for ``"fp8"``); both
    families take the same bytes.
    """
    if moment_dtype == Q8:
        parts = ((QUANT_CODES_PART[quant_map], 1.0), ("scale", 4.0 / quant_block))
        per_moment = {f"{k}.{part}": b for k in moment_keys for part, b in parts}
    else:
        per_moment = {k: float({"fp32": 4, "bf16": 2}[moment_dtype]) for k in moment_keys}
    out = per_moment | {k: 4.0 for k in fp32_keys}
    if needs_master:
        out["master"] = 4.0 if master_dtype == "fp32" else 2.0
    if master_dtype == "bf16_kahan":
        out["master.comp"] = 2.0
    return out


def default_nvme_root() -> Path:
    """Where NVMe-tier files go when no ``nvme_dir`` is given, as an absolute path.

    ``$TIERSTATE_NVME_DIR`` if set, else ``$XDG_CACHE_HOME/tierstate/nvme`` (default
    ``~/.cache/tierstate/nvme``). Each run makes its own sub-folder there. A relative value
    is resolved against the working directory of the moment it is read, so that a later
    ``os.chdir`` cannot move the run's files (or point its cleanup elsewhere).
    """
    env = os.environ.get("TIERSTATE_NVME_DIR")
    if env:
        return Path(os.path.abspath(env))
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(os.path.abspath(os.path.join(cache, "tierstate", "nvme")))


def nvme_dirs_of(nvme_dir) -> tuple[Path, ...]:
    """The absolute folders named by ``Offload(nvme_dir=...)``, checked.

    ``None`` gives :func:`default_nvme_root`; a path or a list of paths gives those,
    made absolute now (see :func:`default_nvme_root` for why). Raises ``TypeError`` for
    a value that is not a path, ``ValueError`` for an empty list, an empty path, or a
    folder listed twice (after resolving ``..`` and symlinks): two stripes of one tier in
    one folder would share a lock, and one drive would carry twice its share. A path may
    name this process's rank: ``{rank}``, ``{local_rank}``, ``{world_size}``,
    ``{local_world_size}`` (:func:`tierstate.dist.expand_rank_template`), so that the ranks
    of a job, which must not share a folder, each get their own.
    """
    if nvme_dir is None:
        return (default_nvme_root(),)
    if isinstance(nvme_dir, (str, bytes, os.PathLike)):
        entries = [nvme_dir]
    else:
        try:
            entries = list(nvme_dir)
        except TypeError:
            raise TypeError(f"Offload(nvme_dir={nvme_dir!r}): expected a folder (str or os.PathLike) or a list "
                            f"of folders, one per drive, not {type(nvme_dir).__name__}") from None
    if not entries:
        raise ValueError("Offload(nvme_dir=[]): give at least one folder, or None for the default")
    dirs, seen = [], {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, (str, bytes, os.PathLike)):
            raise TypeError(f"Offload(nvme_dir={nvme_dir!r}): entry {i} is {entry!r} ({type(entry).__name__}); "
                            "each entry must be a folder path (str or os.PathLike)")
        text = os.fspath(entry)
        if isinstance(text, bytes):
            text = os.fsdecode(text)
        if "{" in text or "}" in text:  # "/nvme/ts/{rank}": a folder per rank (torch only then)
            from ..dist.ranks import expand_rank_template

            text = expand_rank_template(text, f"Offload(nvme_dir) entry {i}")
        if not text:
            raise ValueError(f"Offload(nvme_dir={nvme_dir!r}): an empty path names no folder (it would mean the "
                             "working directory); give the folder explicitly, or None for the default")
        path = Path(os.path.abspath(text))
        key = os.path.realpath(path)
        if key in seen:
            raise ValueError(f"Offload(nvme_dir={entries!r}) lists {path} twice (entries {seen[key]} and {i}"
                             f"{', the same folder once resolved' if str(path) != key else ''}); give one folder "
                             "per drive, each once")
        seen[key] = i
        dirs.append(path)
    return tuple(dirs)
