"""``tierstate bench step``: an optimizer step against its floor, state in host RAM or on NVMe.

    tierstate bench step [--offload cpu] [--sizes 25M,100M] [--threads 1,2] [--json [PATH]]
    tierstate bench step --offload nvme [--params 100M,400M] [--dtype bf16] [--json [PATH]]

``--offload nvme`` times the NVMe tier's step against max(disk time, CPU step), with
options of its own (:mod:`tierstate.bench.step_nvme`); an option of one tier given to the
other is refused. Both run their variants interleaved through one timing loop
(:func:`tierstate.bench._timing.interleave`) and write ``--json`` alike: to PATH besides
the tables, or, without a path, to standard output instead of them.

``--offload cpu`` (the default): the host step against its memory-bandwidth floor.
Mixed-precision AdamW (bf16 gradient in, bf16 weight out, fp32 master) measured in one
process, interleaved round-robin so that every variant sees the same memory-bandwidth
phase (on shared VMs it can move by ~1.7x within seconds), reported as medians:

- ``native``           tierstate's fused kernel, fp32 moments: 28 B/param
- ``native-bf16-moments`` the same with bf16 moments: 20 B/param
- ``torch-fused+casts`` torch AdamW(fused=True) plus the two casts a user needs
                        (bf16 grad -> fp32 grad, fp32 weight -> bf16): 40 B/param
- ``torch-foreach+casts`` the same with foreach=True: 40 B/param
- ``deepspeed+copy``    DeepSpeedCPUAdam plus the same casts, when importable: 40 B/param
- ``floor``             torch AdamW(fused=True) on fp32 grad/param alone: the 28 B/param
                        a fused step must move, at the speed torch moves it

Compressed state (``docs/compressed_state.md``), not run unless named in ``--variants``:

- ``native-q8``         8-bit moments in the dynamic maps, fp32 master: 16.06 B/param
- ``native-fp8``        8-bit moments in the fp8 maps, fp32 master: 16.06 B/param
- ``native-fp8-sr``     the fp8 maps with a stochastically rounded bf16 master, which is the
                        bf16 weight itself, updated in place (as ``ts.AdamW`` does for bf16
                        parameters on the host): 10.06 B/param
- ``native-fp8-kahan``  the same with a compensated bf16 master (the weight plus an int16
                        compensation): 14.06 B/param

Besides "x floor" (time over the floor row's), each row reports "x own floor": its time
over the floor of its own bytes, floor time * B/param / 28, so a layout that moves fewer
bytes is held to a shorter floor.

Every timed call starts after ``--gap-ms`` (default 20) of sleep. torch's OpenMP workers
spin-wait after each parallel region (libgomp's default policy): measured 5-8 ms of CPU
time within 40 ms of a 2-thread torch op, ~1 ms with OMP_WAIT_POLICY=PASSIVE. Back to
back, that spin takes a core from whichever variant runs next: on 2 cores (100M params,
2 threads, medians of per-round ratios over 5 runs) the native step timed right after
torch's step was 1.02-1.14x of the floor, the same step timed after another native call
0.95-1.03x; with the gap or OMP_WAIT_POLICY=PASSIVE the two positions agreed within 3.5%.
torch's own variants reuse the spinning workers and pay nothing. The gap also matches
offload training, where the step starts on CPUs that were idle during backward.
Caveat: torch gives each thread one contiguous half, so while another process holds a
core its step waits for the slower half; a gap lets such a process in, which then shows
as a slower, wider floor (seen at load average ~3). Quote ratios from a quiet host, or
cross-check with ``OMP_WAIT_POLICY=PASSIVE ... --gap-ms 0``.

Bytes per parameter count the traffic a step needs (reads + writes of each array once,
no write-allocate): native = read grad 2 + master 4 + m 4 + v 4, write master 4 + m 4 +
v 4 + bf16 weight 2. GB/s = bytes/param * params / time, 1e9 B.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from .. import kernels
from ..kernels import quant
from . import step_nvme
from ._timing import JSON_STDOUT, counts_arg, emit_json, interleave

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
VARIANTS = ("native", "native-bf16-moments", "torch-fused+casts", "torch-foreach+casts",
            "deepspeed+copy", "floor")
# Compressed state: named with --variants (the default run stays the uncompressed comparison).
# name -> (maps, master mode); a bf16 master is the bf16 weight itself (no weight written apart)
COMPRESSED_VARIANTS = {"native-q8": ("dynamic", "fp32"), "native-fp8": ("fp8", "fp32"),
                       "native-fp8-sr": ("fp8", "bf16_sr"), "native-fp8-kahan": ("fp8", "bf16_kahan")}
BYTES_PER_PARAM = {"native": 28, "native-bf16-moments": 20, "torch-fused+casts": 40,
                   "torch-foreach+casts": 40, "deepspeed+copy": 40, "floor": 28,
                   # bf16 grad in, codes + scales + master read and written, bf16 weight out
                   # beside an fp32 master (a bf16 master is the weight, read and written in place)
                   **{name: quant.QuantConfig(quant.DEFAULT_BLOCK_SIZE, master, maps).step_bytes_per_param(
                       out_bytes=2 if master == "fp32" else 0)
                      for name, (maps, master) in COMPRESSED_VARIANTS.items()}}


@dataclass
class Row:
    params: int
    threads: int
    variant: str
    bytes_per_param: float
    median_ms: float
    min_ms: float
    max_ms: float
    params_per_s: float
    gb_per_s: float
    vs_floor: float  # time / floor time (same size, threads, run)
    vs_own_floor: float  # time / (floor time * bytes_per_param / 28): the floor of the row's own bytes


def _parse_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,2, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"values must be >= 1, got {text!r}")
    return values


# The options of each tier's step; one of them given with the other --offload is refused.
CPU_OPTIONS = ("--sizes", "--threads", "--reps", "--variants", "--gap-ms")
NVME_OPTIONS = ("--params", "--dtype", "--moment-dtype", "--quant-map", "--master-dtype", "--param-numel",
                "--subgroup-numel",
                "--buffer-count", "--nvme-dir", "--steps", "--probe-bytes")


class _Noted(argparse.Action):
    """Stores the value like argparse's default action and notes the option in ``given``."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given = [*getattr(namespace, "given", []), self.option_strings[0]]


def _option(group, *names, **kwargs) -> None:
    group.add_argument(*names, action=_Noted, **kwargs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tierstate bench step``: the tier, those both tiers take, each tier's own."""
    parser.add_argument("--offload", choices=("cpu", "nvme"), default="cpu",
                        help="where the optimizer state lives: host RAM (default) or NVMe files")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    parser.add_argument("--json", metavar="PATH", nargs="?", const=JSON_STDOUT, default=None,
                        help="also write the figures as JSON to PATH; without PATH, print them instead of the tables")
    cpu = parser.add_argument_group("--offload cpu", "the host step against its memory-bandwidth floor")
    _option(cpu, "--sizes", type=counts_arg, default=counts_arg("25M,100M"),
            help="parameter counts, comma-separated (default: 25M,100M)")
    _option(cpu, "--threads", type=_parse_ints, default=[1, 2], help="thread counts, comma-separated (default: 1,2)")
    _option(cpu, "--reps", type=int, default=15, help="timed rounds per variant (default 15)")
    _option(cpu, "--variants", default=",".join(VARIANTS),
            help=f"comma-separated subset of: {', '.join(VARIANTS)}; and compressed state, run only when named: "
                 f"{', '.join(COMPRESSED_VARIANTS)}")
    _option(cpu, "--gap-ms", type=float, default=20.0,
            help="sleep before each timed call, longer than torch's OpenMP spin-wait (default 20; 0: back to back)")
    parser.set_defaults(given=[])
    step_nvme.add_arguments(parser.add_argument_group(
        "--offload nvme", "the NVMe tier's step against max(disk time, CPU step)"), _option)


def _deepspeed_adam() -> type | None:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-not-found]
    except Exception:  # not installed, or its JIT build failed: the row is skipped
        return None
    return DeepSpeedCPUAdam


def _build(n: int, variants: list[str]) -> dict[str, Callable[[], None]]:
    """Allocates each variant's buffers once; returns one step callable per variant."""
    gen = torch.Generator().manual_seed(0)
    grad_bf16 = torch.randn(n, generator=gen).bfloat16()
    weight_bf16 = torch.empty(n, dtype=torch.bfloat16)
    steps: dict[str, Callable[[], None]] = {}
    step_count = [0]

    def adam_kwargs() -> dict:
        step_count[0] += 1
        t = min(step_count[0], 1000)
        return dict(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY,
                    decoupled=True, bias_correction1=1 - BETAS[0] ** t,
                    bias_correction2=1 - BETAS[1] ** t)

    if "native" in variants or "native-bf16-moments" in variants:
        master = torch.randn(n, generator=gen)
    if "native" in variants:
        m, v = torch.zeros(n), torch.zeros(n)
        steps["native"] = lambda: kernels.adam_update(master, grad_bf16, m, v, None, weight_bf16,
                                                      **adam_kwargs())
    if "native-bf16-moments" in variants:
        mb, vb = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
        steps["native-bf16-moments"] = lambda: kernels.adam_update(
            master, grad_bf16, mb, vb, None, weight_bf16, **adam_kwargs())
    for name in COMPRESSED_VARIANTS.keys() & set(variants):
        from ..kernels import quant  # noqa: PLC0415 - only when a compressed variant is asked for

        maps, mode = COMPRESSED_VARIANTS[name]
        config = quant.QuantConfig(quant.DEFAULT_BLOCK_SIZE, mode, maps)
        state = config.init_state(torch.randn(n, generator=gen))
        # a bf16 master is the bf16 weight itself: updated in place, nothing written apart
        out = weight_bf16 if mode == "fp32" else None
        steps[name] = (lambda st=state, c=config, o=out: kernels.adam_q8_update(
            st, grad_bf16, o, config=c, step=step_count[0] + 1, **adam_kwargs()))

    torch_variants = {"torch-fused+casts", "torch-foreach+casts", "floor"} & set(variants)
    if torch_variants:
        param = torch.nn.Parameter(torch.randn(n, generator=gen))
        param.grad = grad_bf16.float()
        def with_casts(opt: torch.optim.Optimizer) -> Callable[[], None]:
            """The step a mixed-precision user of ``opt`` runs: bf16 grad -> fp32, step, fp32 -> bf16."""
            def step() -> None:
                param.grad.copy_(grad_bf16)
                opt.step()
                weight_bf16.copy_(param.detach())
            return step

        if {"torch-fused+casts", "floor"} & torch_variants:
            fused = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)
            steps["torch-fused+casts"] = with_casts(fused)
            steps["floor"] = fused.step
        if "torch-foreach+casts" in torch_variants:
            foreach = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                        foreach=True)
            steps["torch-foreach+casts"] = with_casts(foreach)

    ds_adam = _deepspeed_adam() if "deepspeed+copy" in variants else None
    if ds_adam is not None:
        ds_param = torch.nn.Parameter(torch.randn(n, generator=gen))
        ds_param.grad = torch.empty(n)
        ds = ds_adam([ds_param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                     adamw_mode=True)

        def ds_copy() -> None:
            ds_param.grad.copy_(grad_bf16)
            ds.step()
            weight_bf16.copy_(ds_param.detach())

        steps["deepspeed+copy"] = ds_copy
    return {name: steps[name] for name in variants if name in steps}


def measure(n: int, threads: int, variants: list[str], reps: int, warmup: int, gap_ms: float = 20.0) -> list[Row]:
    torch.set_num_threads(threads)
    kernels.set_num_threads(threads)
    steps = _build(n, variants)
    with torch.no_grad():
        times = interleave(steps, reps, warmup, f"{n / 1e6:g}M params, {threads} threads", gap_ms=gap_ms)
    floor = statistics.median(times["floor"]) if "floor" in times else float("nan")
    rows = []
    for name, samples in times.items():
        med = statistics.median(samples)
        rows.append(Row(n, threads, name, BYTES_PER_PARAM[name], med * 1e3, min(samples) * 1e3,
                        max(samples) * 1e3, n / med, BYTES_PER_PARAM[name] * n / med / 1e9,
                        med / floor, med / (floor * BYTES_PER_PARAM[name] / 28)))
    del steps
    return rows


def _print_table(rows: list[Row]) -> None:
    headers = ["params", "threads", "variant", "B/param", "median ms", "min-max ms", "Gparam/s",
               "GB/s", "x floor", "x own floor"]
    cells = [[f"{r.params / 1e6:g}M", str(r.threads), r.variant, f"{r.bytes_per_param:g}",
              f"{r.median_ms:.1f}", f"{r.min_ms:.1f}-{r.max_ms:.1f}", f"{r.params_per_s / 1e9:.2f}",
              f"{r.gb_per_s:.0f}", f"{r.vs_floor:.2f}", f"{r.vs_own_floor:.2f}"] for r in rows]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
        print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
        for c in cells:
            print("  ".join(x.ljust(w) for x, w in zip(c, widths)))
        return
    table = Table(title="AdamW step, bf16 grad in / bf16 weight out (medians, interleaved)")
    for h in headers:
        table.add_column(h, justify="left" if h == "variant" else "right")
    for c in cells:
        table.add_row(*c)
    Console(width=max(Console().width, 132)).print(table)


def _summary(rows: list[Row]) -> list[str]:
    lines = []
    groups = sorted({(r.params, r.threads) for r in rows})
    for params, threads in groups:
        by = {r.variant: r for r in rows if (r.params, r.threads) == (params, threads)}
        nat = by.get("native")
        if nat is None:
            continue
        parts = [f"{params / 1e6:g}M, {threads} thr: native = {nat.vs_floor:.2f}x floor"]
        if "torch-fused+casts" in by:
            parts.append(f"{by['torch-fused+casts'].median_ms / nat.median_ms:.2f}x faster than torch fused+casts")
        if "deepspeed+copy" in by:
            parts.append(f"{by['deepspeed+copy'].median_ms / nat.median_ms:.2f}x faster than deepspeed+copy")
        if "native-bf16-moments" in by:
            parts.append(f"bf16 moments = {by['native-bf16-moments'].vs_floor:.2f}x floor")
        for name in COMPRESSED_VARIANTS:
            if name in by:
                parts.append(f"{name} = {by[name].vs_own_floor:.2f}x the floor of its {by[name].bytes_per_param:.2f} B")
        lines.append("; ".join(parts))
    return lines


def main(args: argparse.Namespace) -> int:
    """Run the step benchmark of ``args.offload``'s tier; returns the exit status (2: bad options)."""
    other = NVME_OPTIONS if args.offload == "cpu" else CPU_OPTIONS
    misplaced = [name for name in dict.fromkeys(getattr(args, "given", [])) if name in other]
    if misplaced:
        print(f"tierstate bench step: error: {', '.join(misplaced)}: an option of "
              f"--offload {'nvme' if args.offload == 'cpu' else 'cpu'}, not of --offload {args.offload}; "
              "pass that --offload or leave the option out", file=sys.stderr)
        return 2
    if args.offload == "nvme":
        return step_nvme.main(args)
    return _main_cpu(args)


def _main_cpu(args: argparse.Namespace) -> int:
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    known = (*VARIANTS, *COMPRESSED_VARIANTS)
    unknown = [v for v in variants if v not in known]
    if unknown:
        print(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(known)}", file=sys.stderr)
        return 2
    if not {"floor"} & set(variants) and COMPRESSED_VARIANTS.keys() & set(variants):
        print("--variants: the compressed variants are priced against the floor row; add floor", file=sys.stderr)
        return 2
    if args.reps < 1 or args.warmup < 0 or args.gap_ms < 0:
        print("--reps must be >= 1, --warmup >= 0 and --gap-ms >= 0", file=sys.stderr)
        return 2
    if "deepspeed+copy" in variants and _deepspeed_adam() is None:
        print("note: deepspeed is not importable; its row is skipped", file=sys.stderr)
    info = kernels.backend_info()
    load1, load5, _ = os.getloadavg()
    tables = args.json != JSON_STDOUT
    if tables:
        lookup = (f" q8-table-lookup={info['q8_table_lookup']} q8-row-decode={info['q8_row_decode']}"
                  if COMPRESSED_VARIANTS.keys() & set(variants) else "")
        print(f"kernels: isa={info['isa']} native={info['native']}{lookup}; torch {torch.__version__} "
              f"(cpu capability {torch.backends.cpu.get_cpu_capability()}); load average {load1:.2f} {load5:.2f}; "
              f"{args.gap_ms:g} ms gap before each timed call")
    rows: list[Row] = []
    for n in args.sizes:
        for threads in args.threads:
            rows.extend(measure(n, threads, variants, args.reps, args.warmup, args.gap_ms))
    if tables:
        _print_table(rows)
        for line in _summary(rows):
            print(line)
    emit_json(args.json, {"backend": info, "load_average": [load1, load5], "rows": [asdict(r) for r in rows]})
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     prog="python -m tierstate.bench.step", description=__doc__.split("\n")[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
