"""Which rank this process is, for folder names: ``nvme_dir="/mnt/nvme0/ts/{rank}"``.

Two ranks must never share an NVMe-tier folder (each run locks its folder; a second run
over it is refused with ``NvmeDirInUseError``). Without ``nvme_dir`` every process makes its
own ``run-<pid>-<hex>`` folder under the default root, so ranks are apart already; a folder
named by the user is one folder, so a multi-rank job names one per rank with a template.
"""
from __future__ import annotations

import os
import string

FIELDS = ("rank", "local_rank", "world_size", "local_world_size")


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    try:
        return int(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer; launchers (torchrun) set it to this process's "
                         f"{name.lower()}: unset it or give a whole number") from None


def group_world_size() -> int:
    """The size of the default process group; 1 when there is none (or torch.distributed is absent)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank_fields() -> dict[str, int]:
    """This process's ``rank``, ``local_rank``, ``world_size`` and ``local_world_size``.

    The rank and world size come from ``torch.distributed`` when its default group exists,
    else from the variables torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``); a process outside any launcher is rank 0 of 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    return {"rank": rank, "world_size": world, "local_rank": _env_int("LOCAL_RANK", rank),
            "local_world_size": _env_int("LOCAL_WORLD_SIZE", world)}


def expand_rank_template(text: str, what: str = "nvme_dir") -> str:
    """``text`` with ``{rank}``, ``{local_rank}``, ``{world_size}``, ``{local_world_size}`` filled in.

    A path without braces is returned as is. Any other field, a positional ``{}`` or an
    unmatched brace raises ValueError naming ``what``, the value and the fields allowed."""
    if "{" not in text and "}" not in text:
        return text
    allowed = ", ".join("{" + f + "}" for f in FIELDS)
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(text) if name is not None]
    except ValueError as exc:
        raise ValueError(f"{what}={text!r}: {exc}; the braces may hold only {allowed} (write {{{{ and }}}} for a "
                         "literal brace)") from None
    bad = [n for n in names if n not in FIELDS]
    if bad:
        raise ValueError(f"{what}={text!r}: unknown field {{{bad[0]}}}; the braces may hold only {allowed}, e.g. "
                         f"{what}='/mnt/nvme0/ts/rank{{rank}}' for one folder per rank")
    return text.format(**rank_fields())


__all__ = ["FIELDS", "expand_rank_template", "group_world_size", "rank_fields"]
