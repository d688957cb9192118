"""``tierstate plan``: bytes per tier, predicted step time and the best placement for a model.

    tierstate plan gpt2 --device cpu --param-dtype fp32
    tierstate plan llama-7b --micro-batch 4 --seq-len 2048 --host-mem 64GiB --nvme-dir /mnt/nvme --json
    tierstate plan 13B --compare "a100-80g,mem=80GiB,price=1.9/h" --compare "h100,mem=80GiB,price=3.5/h,speed=2" \\
        --price 0.9/h
    tierstate plan mypkg.models:build_model --placement 0,0.6,0.4
    tierstate plan 1.3B --optimizer sgd --momentum 0.9
    tierstate plan llama-7b --device cpu --offload-weights auto --micro-batch 1 --seq-len 2048 \\
        --activation-checkpointing --host-mem 12GiB
    tierstate plan llama-13b --generate --batch 32 --prompt-len 64 --new-tokens 32 --host-mem 16GiB

``--generate`` plans offloaded generation instead (:mod:`tierstate.placement.generate_plan`).

``--offload-weights auto`` (or ``cpu``/``nvme``) also plans the weights (parameter offload):
which blocks stay resident, which stream from pinned host RAM or NVMe, the window and the
prefetch depth (:mod:`tierstate.placement.weights_plan`); the weights and the optimizer state
then share the host RAM and disk budgets, split where the joint step is shortest
(:mod:`tierstate.placement.joint`). The model must be one whose blocks are known (a built-in
shape, a transformers config or a factory).

The optimizer's state per parameter comes from its own update rule (the keys its
``state_specs`` name for the hyper-parameters given), so the plan prices what that optimizer
allocates.

Rates come from the saved hardware profile (``tierstate probe``), else conservative defaults
(the output says which). Budgets not given are read from this machine now: 80% of the
available RAM, the free space under ``--nvme-dir`` (else under the default NVMe folder, on
the filesystem of its nearest existing parent), the free device memory from the profile.
Exit status 2 with a message naming what is missing when no placement fits.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import replace

from . import optim
from .placement.auto import HOST_FRACTION, existing_ancestor
from .placement.cost_model import BUDGET_NAMES, Kind
from .placement.defaults import DEFAULT_SUBGROUP_NUMEL
from .placement.joint import JointPlan, plan_joint
from .placement.layout import TIER_ORDER
from .placement.model_spec import ModelSpec, parse_count, resolve_model
from .placement.plan_inputs import DTYPE_BYTES, Budgets, Hardware, Placement, PlanError, PlanRequest, gib
from .placement.planner import Plan, choose, evaluate

_SIZE_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "KIB": 1 << 10, "M": 10**6, "MB": 10**6, "MIB": 1 << 20,
               "G": 10**9, "GB": 10**9, "GIB": 1 << 30, "T": 10**12, "TB": 10**12, "TIB": 1 << 40}
# --optimizer NAME -> the optimizer whose rule says what state it keeps: every optimizer the package
# exports, so a new rule is priced without an edit here
OPTIMIZERS = {cls.rule.name: cls for cls in (getattr(optim, name) for name in optim.__all__) if hasattr(cls, "rule")}
# hyper-parameters that change which state keys a rule keeps: --flag -> param-group key
STATE_FLAGS = {"--amsgrad": "amsgrad", "--momentum": "momentum"}


def parse_size(text: str, name: str = "size") -> int:
    """``"40GiB"`` -> 42949672960; also GB, MiB, TB, plain bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else None
    if not m or unit not in _SIZE_UNITS:
        raise ValueError(f"{name}={text!r}: expected a size such as 64GiB, 500GB or 1.5TiB")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def parse_price(text: str) -> tuple[float, str]:
    """``"2.5/h"`` -> (2.5, "hour"); ``"25000"`` -> (25000, "purchase"); a leading $ is allowed."""
    m = re.fullmatch(r"\s*\$?([0-9]*\.?[0-9]+)\s*(/\s*h(?:our)?)?\s*", str(text))
    if not m:
        raise ValueError(f"price={text!r}: expected dollars per hour such as 2.5/h, or a purchase price such as 25000")
    return float(m.group(1)), ("hour" if m.group(2) else "purchase")


def parse_compare(text: str) -> dict:
    """``"NAME,mem=80GiB[,price=3.5/h][,speed=2]"``: a GPU to price against offloading."""
    name, *fields = [f.strip() for f in text.split(",")]
    option = {"name": name, "speed": 1.0, "price": None}
    for f in fields:
        key, _, value = f.partition("=")
        if key == "mem":
            option["mem"] = parse_size(value, "--compare mem")
        elif key == "price":
            option["price"] = parse_price(value)
        elif key == "speed":
            try:
                option["speed"] = float(value)
            except ValueError:
                raise ValueError(f"--compare {text!r}: speed={value!r} is not a number; give the GPU's compute "
                                 "relative to this machine's, e.g. speed=2") from None
            if not option["speed"] > 0:
                raise ValueError(f"--compare {text!r}: speed={value!r} must be > 0, e.g. speed=2")
        else:
            raise ValueError(f"--compare {text!r}: unknown field {key!r}; use NAME,mem=80GiB,price=3.5/h,speed=1.5")
    if not name or "mem" not in option:
        raise ValueError(f"--compare {text!r}: give at least a name and mem=, e.g. h100,mem=80GiB,price=3.5/h")
    return option


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``tierstate plan``."""
    parser.add_argument("model", nargs="?", help="parameter count (124M, 7B), built-in shape (gpt2, llama-7b, ...), "
                                                 "transformers config name/path, or pkg.mod:factory")
    parser.add_argument("--params", help="parameter count, instead of MODEL")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="where the parameters live (default: cuda when "
                                                                   "the profile saw one, else cpu)")
    parser.add_argument("--param-dtype", choices=sorted(DTYPE_BYTES), help="default bf16 on cuda, fp32 on cpu")
    parser.add_argument("--moment-dtype", choices=("fp32", "bf16", "q8"), default="fp32",
                        help="moments in fp32, bf16 or blockwise 8-bit (q8: 1 B + a 4 B scale per --quant-block)")
    parser.add_argument("--master-dtype", choices=("fp32", "bf16_kahan", "bf16_sr"), default="fp32",
                        help="the master weight: fp32 (4 B), bf16 + int16 compensation (4 B) or bf16 with "
                             "stochastic rounding (2 B); the bf16 modes need --moment-dtype q8")
    parser.add_argument("--quant-block", type=int, default=256, help="elements per scale of q8 moments (default 256)")
    parser.add_argument("--quant-map", choices=("dynamic", "fp8"), default="dynamic",
                        help="the 8-bit maps of q8 moments (Offload.quant_map: the same bytes; fp8 runs a faster "
                             "fused kernel)")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw",
                        help="the tierstate optimizer whose state is priced (default adamw)")
    parser.add_argument("--amsgrad", action="store_true", default=None,
                        help="adam/adamw with amsgrad=True (one more moment, max_exp_avg_sq)")
    parser.add_argument("--momentum", type=float, help="sgd's momentum (> 0 keeps a momentum_buffer; default 0)")
    parser.add_argument("--micro-batch", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--subgroup-numel", type=int, default=PlanRequest.subgroup_numel)
    parser.add_argument("--buffer-count", type=int, default=None,
                        help="NVMe pool buffers (default: the optimizer's, 16, or with --step-in-backward over "
                             "streamed weights 16 + twice the records one block spans)")
    parser.add_argument("--step-in-backward", action="store_true",
                        help="plan for ts.AdamW(step_in_backward=True) (its default NVMe pool with streamed weights)")
    parser.add_argument("--no-pin-memory", action="store_true")
    parser.add_argument("--grad-streaming", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--device-mem", help="device memory budget, e.g. 80GiB (default: free memory in the profile)")
    parser.add_argument("--host-mem", help=f"host RAM budget (default: {HOST_FRACTION * 100:.0f}%% of the available RAM now)")
    parser.add_argument("--pinned-mem", help="page-locked RAM budget (default: unchecked)")
    parser.add_argument("--disk", help="disk budget for NVMe state (default: free space under --nvme-dir, or under "
                                         "the default NVMe folder, $TIERSTATE_NVME_DIR or ~/.cache/tierstate/nvme)")
    parser.add_argument("--nvme-dir", help="where NVMe state would go (for its free space and the messages)")
    parser.add_argument("--placement", metavar="GPU,CPU,NVME", help="price this placement instead of choosing one")
    parser.add_argument("--gpu-tier", action="store_true", help="let the planner put part of the state on the device")
    parser.add_argument("--profile", help="hardware profile to use (default: the saved one)")
    parser.add_argument("--compare", action="append", default=[], metavar="NAME,mem=SIZE[,price=P][,speed=S]",
                        help="price a GPU that would hold everything without offload (repeatable); price is $/h "
                             "(3.5/h) or a purchase price; speed is its compute relative to this one")
    parser.add_argument("--price", help="price of the current setup: $/h (1.2/h) or purchase, for --compare")
    parser.add_argument("--offload-weights", choices=("none", "auto", "cpu", "nvme"), default="none",
                        help="also plan the weights (parameter offload): auto chooses resident blocks, pinned host "
                             "RAM and NVMe homes, window and prefetch; cpu/nvme stream every block from that tier")
    parser.add_argument("--max-prefetch", type=int, default=4, help="deepest weight prefetch to consider (default 4)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    gen = parser.add_argument_group("generation (--generate)")
    gen.add_argument("--generate", action="store_true",
                     help="plan offloaded generation instead: weight and KV placement, micro-batch size and count")
    gen.add_argument("--batch", type=int, default=8, help="prompts to generate for (default 8)")
    gen.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt (default 128)")
    gen.add_argument("--new-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    gen.add_argument("--num-micro-batches", type=int, help="fix the micro-batch count (default: searched)")
    from .generate.cli import add_compress_arguments  # noqa: PLC0415

    add_compress_arguments(gen)


def state_keys_of(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The per-element state keys ``--optimizer`` keeps with the hyper-parameters given, from its
    update rule: (moments, keys kept in fp32). ValueError naming a flag that optimizer does not
    take, or a bad value."""
    rule = OPTIMIZERS[args.optimizer].rule
    group = rule.defaults()
    for flag, key in STATE_FLAGS.items():
        value = getattr(args, key)
        if value is None:
            continue
        if key not in group:
            takes = sorted(name for name, cls in OPTIMIZERS.items() if key in cls.rule.defaults())
            raise ValueError(f"{flag}: {args.optimizer} has no {key}; it applies to --optimizer {'/'.join(takes)}")
        group[key] = value
    rule.validate(group)
    specs = rule.state_specs(group)
    return tuple(s.name for s in specs if s.moment), tuple(s.name for s in specs if not s.moment)


def _load_hardware(path: str | None) -> tuple[Hardware, dict | None]:
    from .placement import probe

    try:
        profile = probe.load_profile(path)  # ValueError when the file is not a profile
    except OSError as exc:
        raise type(exc)(exc.errno, f"--profile: cannot read the hardware profile ({exc.strerror})",
                        exc.filename) from exc
    if profile is None:
        if path is not None:
            raise ValueError(f"--profile {path}: no such file; run `tierstate probe --out {path}`")
        where = probe.default_profile_path()
        return replace(Hardware.conservative(), source=f"conservative defaults (no profile at {where}; run "
                                                       "`tierstate probe`)"), None
    return Hardware.from_profile(profile, source=f"profile {path or probe.default_profile_path()} "
                                                 f"({profile.get('created_at', '?')})"), profile


def build_inputs(args: argparse.Namespace) -> tuple[PlanRequest, Hardware, Budgets, list[str]]:
    """Turn parsed arguments into planner inputs; the list says where each default came from."""
    import psutil

    if bool(args.model) == bool(args.params):
        raise ValueError("give the model either as MODEL or as --params N (e.g. `tierstate plan gpt2` or --params 7B)")
    model: ModelSpec = resolve_model(args.model) if args.model else \
        ModelSpec(f"{args.params} params", (parse_count(args.params),), None, "count")
    hw, profile = _load_hardware(args.profile)
    profile_has_cuda = bool(profile and "skipped" not in (profile["measurements"].get("cuda") or {"skipped": 1}))
    device = args.device or ("cuda" if profile_has_cuda else "cpu")
    streaming = {"auto": None, "on": True, "off": False}[args.grad_streaming]
    moments, fp32_keys = state_keys_of(args)
    req = PlanRequest(model, device=device, param_dtype=args.param_dtype or ("bf16" if device == "cuda" else "fp32"),
                      moment_dtype=args.moment_dtype, master_dtype=args.master_dtype, quant_block=args.quant_block,
                      quant_map=args.quant_map,
                      optimizer=args.optimizer, grad_streaming=streaming,
                      pin_memory=not args.no_pin_memory, subgroup_numel=args.subgroup_numel,
                      buffer_count=args.buffer_count, micro_batch=args.micro_batch, seq_len=args.seq_len,
                      grad_accum=args.grad_accum, activation_checkpointing=args.activation_checkpointing,
                      step_in_backward=args.step_in_backward, state_keys=moments, fp32_state_keys=fp32_keys)
    sources = [f"rates: {hw.source}"]
    if args.host_mem:
        host = parse_size(args.host_mem, "--host-mem")
    else:
        available = psutil.virtual_memory().available
        host = int(available * HOST_FRACTION)
        sources.append(f"host budget: {HOST_FRACTION:.0%} of {gib(available)} available now (--host-mem to set)")
    if args.nvme_dir:
        disk_dir = args.nvme_dir
        if os.path.exists(disk_dir) and not os.path.isdir(disk_dir):
            raise ValueError(f"--nvme-dir {disk_dir!r} is a file, not a folder; give the folder NVMe state would go in")
    else:  # where offload="nvme" would put its files: priced by the disk it would land on
        from .placement.offload import default_nvme_root

        disk_dir = str(default_nvme_root())
    if args.disk:
        disk = parse_size(args.disk, "--disk")
    else:
        st = os.statvfs(existing_ancestor(disk_dir))
        disk = st.f_bavail * st.f_frsize
        where = "" if args.nvme_dir else " (the default NVMe folder; --nvme-dir or --disk to set)"
        sources.append(f"disk budget: free space under {disk_dir}{where}")
    if args.device_mem:
        device_mem = parse_size(args.device_mem, "--device-mem")
    elif device == "cuda" and hw.device_free:
        device_mem = hw.device_free
        sources.append("device budget: free device memory in the profile")
    else:
        device_mem = None
    pinned = parse_size(args.pinned_mem, "--pinned-mem") if args.pinned_mem else None
    return req, hw, Budgets(device_mem, host, pinned, disk, disk_dir), sources


def _parse_placement(text: str) -> Placement:
    try:
        gpu, cpu, nvme = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--placement {text!r}: expected three fractions GPU,CPU,NVME summing to 1, e.g. 0,0.6,0.4") from None
    if min(gpu, cpu, nvme) < 0 or abs(gpu + cpu + nvme - 1) > 1e-6:
        raise ValueError(f"--placement {text!r}: fractions must be >= 0 and sum to 1")
    return Placement(gpu, cpu, nvme)


def compare(plan: Plan, options: list[dict], price: tuple[float, str] | None) -> list[dict]:
    """The current plan against GPUs big enough to hold everything (no offload), with costs."""
    req = replace(plan.request, device="cuda", grad_streaming=False, weights_offloaded=False)
    rows = []

    def cost(step_s: float, p: tuple[float, str] | None) -> dict:
        out = {"step_s": step_s, "steps_per_hour": 3600 / step_s if step_s else None}
        if p and p[1] == "hour":
            out["usd_per_1k_steps"] = p[0] * step_s * 1000 / 3600
        elif p:
            out["purchase_usd"] = p[0]
            out["usd_per_step_per_s"] = p[0] * step_s  # purchase price per unit of throughput
        return out

    rows.append({"option": "current (offload)", "fits": True,
                 "placement": f"gpu {plan.placement.gpu:g}, cpu {plan.placement.cpu:g}, nvme {plan.placement.nvme:g}",
                 **cost(plan.time.total, price)})
    for opt in options:
        hw = plan.hardware
        faster = replace(hw, device_flops=hw.device_flops * opt["speed"], host_flops=hw.host_flops * opt["speed"],
                         device_bandwidth=hw.device_bandwidth * opt["speed"])
        try:
            alt = evaluate(req, Placement(1.0, 0.0, 0.0), faster, Budgets(device=opt["mem"]))
        except PlanError as exc:
            rows.append({"option": opt["name"], "fits": False, "why": str(exc)})
            continue
        rows.append({"option": opt["name"], "fits": True, "placement": "all on the device (no offload)",
                     "device_bytes": alt.budget_total("device"), **cost(alt.time.total, opt["price"])})
    return rows


def _print_weights(console, joint: JointPlan) -> None:
    from rich.table import Table

    for line in joint.weights.describe():
        console.print(line)
    table = Table(title="joint budget: weights and optimizer state")
    table.add_column("")
    for name in ("device", "host", "disk"):
        table.add_column(name, justify="right")
    usage = joint.usage()
    for row in ("weights", "state", "total", "budget"):
        cells = [usage[name][row] for name in ("device", "host", "disk")]
        label = f"[bold]{row}[/bold]" if row == "total" else row
        table.add_row(label, *[gib(c) if c is not None else "-" for c in cells])
    console.print(table)
    if joint.step_seconds is not None:
        console.print(f"joint step: [bold]{joint.step_seconds * 1e3:.1f} ms[/bold] (optimizer plan "
                      f"{joint.state.time.total * 1e3:.1f} ms with the compute, + waiting on weights "
                      f"{(joint.weights.stall_seconds or 0) * 1e3:.1f} ms, - the upload the fetches make)")


def _print_human(plan: Plan, sources: list[str], comparison: list[dict] | None,
                 joint: JointPlan | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    req, p = plan.request, plan.placement
    console.print(f"[bold]{req.model.name}[/bold]: {req.model.numel:,} parameters ({req.model.source}); "
                  f"{req.device}, params {req.param_dtype}, moments {req.moment_dtype}"
                  + (f" ({req.quant_map} maps)" if req.moment_dtype == "q8" else "")
                  + (f", master {req.master_dtype}" if req.master_dtype != "fp32" else "")
                  + f", {req.optimizer}; state {req.state_bytes_per_param:.2f} B/param")
    pool = (f", subgroup_numel={req.subgroup_numel}" if req.subgroup_numel != DEFAULT_SUBGROUP_NUMEL else "") + (
        f", buffer_count={req.buffer_count}" if req.buffer_count is not None and p.nvme > 0 else "")
    console.print(f"placement: [bold]Offload(gpu={p.gpu:g}, cpu={p.cpu:g}, nvme={p.nvme:g}{pool})[/bold] - "
                  f"{plan.reason}" + (f"; NVMe pool of {req.pool_buffers} buffers" if p.nvme > 0 else ""))
    table = Table(title="memory by tier")
    table.add_column("state")
    for tier in TIER_ORDER:
        table.add_column(BUDGET_NAMES[tier], justify="right")
    table.add_column("note")
    for kind in Kind:
        cells = [plan.bytes_of(tier, kind) for tier in TIER_ORDER]
        if any(cells):
            pinned = any(m.pinned for m in plan.memory if m.kind is kind)
            notes = "; ".join(sorted({m.note for m in plan.memory if m.kind is kind and m.note}))
            table.add_row(kind.value, *[gib(c) if c else "" for c in cells], ("pinned; " if pinned else "") + notes)
    table.add_row("[bold]total[/bold]", *[f"[bold]{gib(plan.tier_total(t))}[/bold]" for t in TIER_ORDER],
                  f"pinned {gib(plan.pinned_total())}")
    b = plan.budgets
    table.add_row("budget", *[gib(v) if v is not None else "-" for v in (b.device, b.host, b.disk)], "")
    console.print(table)
    t = plan.time
    times = Table(title=f"predicted step: {t.total * 1e3:.1f} ms, bottleneck: {t.bottleneck}")
    times.add_column("component")
    times.add_column("ms", justify="right")
    rows = [("compute (fwd+bwd)", t.compute), ("grad D2H (exposed / all)", None), ("weight H2D", t.weight_h2d),
            ("gradient norm pass", t.grad_pass), ("CPU update", t.cpu_update), ("NVMe I/O", t.disk),
            ("device update", t.device_update), ("optimizer step", t.optimizer)]
    for name, value in rows:
        if name.startswith("grad D2H"):
            if t.grad_d2h:
                times.add_row(name, f"{t.grad_d2h_exposed * 1e3:.1f} / {t.grad_d2h * 1e3:.1f}")
        elif value is None:
            times.add_row(name, "- (give --micro-batch and --seq-len)")
        elif value:
            times.add_row(name, f"{value * 1e3:.1f}")
    console.print(times)
    if joint is not None:
        _print_weights(console, joint)
    if comparison:
        cmp = Table(title="alternatives")
        for col in ("option", "fits", "step ms", "$ / 1k steps", "purchase $", "placement / why not"):
            cmp.add_column(col)
        for row in comparison:
            cmp.add_row(row["option"], "yes" if row["fits"] else "no",
                        f"{row['step_s'] * 1e3:.1f}" if row.get("step_s") else "",
                        f"{row['usd_per_1k_steps']:.2f}" if "usd_per_1k_steps" in row else "",
                        f"{row['purchase_usd']:,.0f}" if "purchase_usd" in row else "",
                        row.get("placement") or row.get("why", ""))
        console.print(cmp)
        console.print("alternatives assume the same compute speed unless speed= is given")
    for line in sources + plan.notes:
        console.print(f"[dim]{line}[/dim]")


def main(args: argparse.Namespace) -> int:
    """Run ``tierstate plan``: 0 on success, 2 when the budgets cannot be met or the input is invalid."""
    if getattr(args, "generate", False):
        from .generate.cli import plan_main

        return plan_main(args, _load_hardware, parse_size)
    try:
        req, hw, budgets, sources = build_inputs(args)
        options = [parse_compare(c) for c in args.compare]
        price = parse_price(args.price) if args.price else None
        joint = None
        if args.max_prefetch < 0:
            raise ValueError(f"--max-prefetch {args.max_prefetch}: must be >= 0 (0 fetches each block on demand)")
        if args.offload_weights != "none":
            joint = plan_joint(req, hw, budgets, weights_tier=args.offload_weights, max_prefetch=args.max_prefetch,
                               allow_device_tier=args.gpu_tier,
                               placement=_parse_placement(args.placement) if args.placement else None)
            plan = joint.state
        elif args.placement:
            plan = evaluate(req, _parse_placement(args.placement), hw, budgets, reason="given by --placement")
        else:
            plan = choose(req, hw, budgets, allow_device_tier=args.gpu_tier)
    except PlanError as exc:
        print(f"tierstate plan: {exc}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, OSError) as exc:
        print(f"tierstate plan: {exc}", file=sys.stderr)
        return 2
    comparison = compare(plan, options, price) if options else None
    if args.json:
        out = plan.as_dict() | {"sources": sources}
        if comparison is not None:
            out["compare"] = comparison
        if joint is not None:
            out["weights"] = joint.weights.as_dict()
            out["joint"] = joint.as_dict()
        print(json.dumps(out, indent=2, default=str))
    else:
        _print_human(plan, sources, comparison, joint)
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(allow_abbrev=False, prog="tierstate plan", description=__doc__.split("\n")[0])
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
