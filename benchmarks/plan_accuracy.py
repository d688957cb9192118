"""How well the planner predicts real runs on this machine: memory and optimizer step time.

    python benchmarks/plan_accuracy.py                 # time table (probe, then interleaved rounds)
    python benchmarks/plan_accuracy.py --memory        # also the peak-RSS table
    python benchmarks/plan_accuracy.py --rounds 9 --numel 50M --nvme-dir /mnt/nvme/ts

Run from a source checkout with tierstate installed (the tests of the planner's memory
figure, ``tests/benchmarks/test_plan_accuracy_memory.py``, use its memory runs).

Time: every configuration gets its own optimizer over the same parameter shapes, with fixed
gradients, and ``opt.step()`` is timed round-robin (one step of each per round) so that all
of them see the same memory-bandwidth phase. Right before each step the probe re-measures
the optimizer kernel and the gradient pass (8 Mi elements, more where the last-level cache
would hold them: :func:`tierstate.placement.probe.beyond_cache_numel`), and once per round
the disk (256 MiB each way under ``--nvme-dir``); each step's prediction uses the rates
measured just before it. The table gives the median measured step, the median prediction,
and the median of the per-step errors (prediction and measurement seconds apart, so in the
same bandwidth phase). Forward/backward time is not part of this benchmark (the planner's
compute figure is a FLOP count at the measured matmul rate, which this does not check).

Memory: :func:`measure_memory` runs one configuration in a fresh Python process (so earlier
allocations do not hide in the peak), resets the kernel's peak-RSS mark once tierstate and
torch's kernels are loaded (a warm-up step of each), builds a GPT of a few tens of M params,
trains 3 steps and reports ``VmHWM`` growth; the planner's host total for the same
configuration is compared with it (with glibc's mmap threshold fixed, and with the default
malloc: see the note at :data:`MMAP_THRESHOLD_ENV`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# -- memory: one configuration per process ------------------------------------------------------
MEMORY_CONFIGS = {
    "cpu-fp32": dict(param_dtype="fp32", moment_dtype="fp32", offload="cpu"),
    "cpu-bf16-params": dict(param_dtype="bf16", moment_dtype="fp32", offload="cpu"),
    "cpu-bf16-moments": dict(param_dtype="fp32", moment_dtype="bf16", offload="cpu"),
    "nvme-fp32": dict(param_dtype="fp32", moment_dtype="fp32", offload="nvme"),
}
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field} line (needs Linux)")


def _memory_child(cfg: dict) -> dict:
    """Runs in the child process: build, train 3 steps, report the peak-RSS growth."""
    import torch

    import tierstate as ts
    from tierstate.demo.model import GPT, GPTConfig
    from tierstate.kernels import backend_info

    torch.manual_seed(0)
    torch.set_num_threads(2)
    # Library memory is loaded before the baseline, as it is not what the planner prices:
    # - tierstate's, on the first optimizer construction (torch.optim's lazy imports, the native
    #   module, its thread pool: ~70 MB here). The warm-up optimizer must leave glibc as it is:
    #   a CPU optimizer's default host-allocator policy ("retain") is process-wide and would
    #   otherwise apply to the NVMe run too, whose own default is "system".
    # - torch's, on the first forward/backward (its matmul and autograd workspaces): one block of
    #   the same width, once. Without it every configuration measured 22-35 MiB more (2-vCPU
    #   AVX-512 VM: nvme-fp32 292-299 MiB cold, 271-272 warm, 279 predicted).
    warm = torch.nn.Parameter(torch.zeros(1))
    warm.grad = torch.zeros(1)
    ts.AdamW([warm], offload=ts.Offload(cpu=1.0, host_allocator="system")).step()
    block = GPT(GPTConfig(n_layer=1, n_head=8, d_model=cfg["d_model"], max_seq_len=cfg["seq"]))
    block = block.to(getattr(torch, _DTYPES[cfg["param_dtype"]]))
    sample = torch.randint(0, block.config.vocab_size, (cfg["batch"], cfg["seq"]))
    out = block(sample)
    torch.nn.functional.cross_entropy(out.float().view(-1, out.size(-1)), sample.view(-1)).backward()
    del block, sample, out
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_kib("VmRSS")
    gcfg = GPTConfig(n_layer=cfg["n_layer"], n_head=8, d_model=cfg["d_model"], max_seq_len=cfg["seq"])
    model = GPT(gcfg).to(getattr(torch, _DTYPES[cfg["param_dtype"]]))
    params = [p for p in model.parameters() if p.requires_grad]
    moment = getattr(torch, _DTYPES[cfg["moment_dtype"]])
    if cfg["offload"] == "nvme":
        offload = ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=cfg["nvme_dir"], subgroup_numel=cfg["subgroup_numel"],
                             buffer_count=cfg["buffer_count"], moment_dtype=moment)
    else:
        offload = ts.Offload(cpu=1.0, subgroup_numel=cfg["subgroup_numel"], moment_dtype=moment)
    opt = ts.AdamW(params, lr=1e-4, offload=offload)
    tokens = torch.randint(0, gcfg.vocab_size, (cfg["batch"], cfg["seq"]))
    for _ in range(3):
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), tokens.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = _status_kib("VmHWM")
    return {"numels": [p.numel() for p in params], "peak_growth_bytes": (peak - base) * 1024,
            "tier_bytes": opt.tier_bytes(), "native": backend_info()["native"], "host_allocator": opt.host_allocator,
            "shape": [gcfg.n_layer, gcfg.d_model, gcfg.n_head, gcfg.vocab_size, gcfg.max_seq_len]}


def memory_config(name: str, nvme_dir: str | None = None, d_model: int = 512, n_layer: int = 8) -> dict:
    """The child's settings for one of :data:`MEMORY_CONFIGS` (a ~25M-param GPT by default)."""
    cfg = dict(MEMORY_CONFIGS[name], d_model=d_model, n_layer=n_layer, batch=1, seq=64,
               subgroup_numel=1 << 21, buffer_count=4, nvme_dir=nvme_dir)
    if cfg["offload"] == "nvme" and not nvme_dir:
        raise ValueError(f"memory config {name!r} needs nvme_dir")
    return cfg


# [Note: glibc's dynamic mmap threshold]
# By default glibc serves a freed block's size from its heap afterwards (the mmap threshold
# rises to the largest block freed, up to 32 MiB), and a heap rarely shrinks: gradients freed
# by zero_grad and allocated again by the next backward can then sit twice in RSS. Run to run,
# the same 25M-param job peaked at 427 or 506 MiB that way. Fixing the threshold at 1 MiB
# (MALLOC_MMAP_THRESHOLD_) makes every tensor >= 1 MiB its own mapping, returned on free, so
# RSS tracks live bytes (409-413 MiB over 6 runs, before torch's warm-up above) - which is
# what the planner prices. The benchmark shows both; the planner's figure is the floor a
# default-malloc run can exceed by about one gradient set. The CPU configurations' optimizers apply their default host-allocator
# policy, "retain" (tierstate.host_allocator: every block from the heap, freed ones reused),
# which overrides this threshold: their peak is then the heap's high-water mark, 408 MiB
# predicted against 398-403 MiB measured for cpu-fp32 (3 runs, AVX-512 VM). The NVMe
# configuration keeps glibc's allocator ("system"), so the threshold holds there.
MMAP_THRESHOLD_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}


def measure_memory(cfg: dict, timeout: float = 300, default_malloc: bool = False) -> dict:
    """Run one memory configuration in a fresh interpreter; returns the child's report.

    ``default_malloc=False`` fixes glibc's mmap threshold (see the note above)."""
    import tierstate

    env = dict(os.environ) if default_malloc else {**os.environ, **MMAP_THRESHOLD_ENV}
    # the child imports the tierstate this process did (the script's own folder is not a package)
    env.setdefault("PYTHONPATH", os.path.dirname(os.path.dirname(os.path.abspath(tierstate.__file__))))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(cfg)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"memory run {cfg} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _adamw_state_keys() -> tuple[str, ...]:
    """The state keys ts.AdamW keeps (its rule's), which every configuration here trains with."""
    from tierstate import AdamW

    return tuple(spec.name for spec in AdamW.rule.state_specs(AdamW.rule.defaults()))


def predicted_memory(cfg: dict, report: dict):
    """The planner's plan for a memory configuration, from the parameter sizes the child saw."""
    from tierstate.placement.model_spec import TransformerShape, from_param_numels
    from tierstate.placement.plan_inputs import Hardware, Placement, PlanRequest
    from tierstate.placement.planner import evaluate

    spec = from_param_numels(report["numels"], name="demo GPT", shape=TransformerShape(*report["shape"]))
    req = PlanRequest(spec, device="cpu", param_dtype=cfg["param_dtype"], moment_dtype=cfg["moment_dtype"],
                      subgroup_numel=cfg["subgroup_numel"], buffer_count=cfg["buffer_count"],
                      micro_batch=cfg["batch"], seq_len=cfg["seq"], state_keys=_adamw_state_keys())
    placement = Placement(0.0, 0.0, 1.0) if cfg["offload"] == "nvme" else Placement(0.0, 1.0, 0.0)
    return evaluate(req, placement, Hardware.conservative())


# -- time: interleaved rounds in this process ---------------------------------------------------
def time_configs(nvme_dir: str | None) -> dict:
    configs = {
        "cpu fp32": dict(param_dtype="fp32", moment_dtype="fp32", cpu=1.0),
        "cpu bf16 params (fp32 master)": dict(param_dtype="bf16", moment_dtype="fp32", cpu=1.0),
        "cpu fp32, bf16 moments": dict(param_dtype="fp32", moment_dtype="bf16", cpu=1.0),
    }
    if nvme_dir:
        configs["nvme fp32"] = dict(param_dtype="fp32", moment_dtype="fp32", cpu=0.0)
        configs["cpu 0.5 / nvme 0.5 fp32"] = dict(param_dtype="fp32", moment_dtype="fp32", cpu=0.5)
    return configs


def run_time_benchmark(numel: int, tensors: int, rounds: int, nvme_dir: str | None, subgroup_numel: int,
                       buffer_count: int) -> list[dict]:
    import torch

    import tierstate as ts
    from tierstate.placement import probe
    from tierstate.placement.model_spec import from_param_numels
    from tierstate.placement.cost_model import predict_time
    from tierstate.placement.plan_inputs import Hardware, Placement, PlanRequest

    torch.manual_seed(0)
    sizes = [numel // tensors] * tensors
    spec = from_param_numels(sizes, name="flat")
    probe_numel = probe.beyond_cache_numel(8 << 20, 16)  # w, g, m, v in fp32
    runs = {}
    for i, (name, c) in enumerate(time_configs(nvme_dir).items()):
        run_dir = os.path.join(nvme_dir, f"run{i}") if nvme_dir else None  # one NVMe folder per optimizer
        dtype = getattr(torch, _DTYPES[c["param_dtype"]])
        params = [torch.nn.Parameter(torch.randn(n).to(dtype)) for n in sizes]
        for p in params:
            p.grad = (torch.randn(p.numel()) * 1e-3).to(dtype)
        offload = ts.Offload(cpu=c["cpu"], nvme=1.0 - c["cpu"], nvme_dir=run_dir, subgroup_numel=subgroup_numel,
                             buffer_count=buffer_count, moment_dtype=getattr(torch, _DTYPES[c["moment_dtype"]]))
        opt = ts.AdamW(params, lr=1e-5, offload=offload)
        for _ in range(2):  # first step creates the state; the second fills the NVMe write-back cache
            opt.step()
        req = PlanRequest(spec, device="cpu", param_dtype=c["param_dtype"], moment_dtype=c["moment_dtype"],
                          subgroup_numel=subgroup_numel, buffer_count=buffer_count, state_keys=_adamw_state_keys())
        runs[name] = dict(opt=opt, req=req, placement=Placement(0.0, c["cpu"], 1.0 - c["cpu"]), measured=[],
                          predicted=[], keep=params)
    for _ in range(rounds):
        disk = probe.measure_disk(nvme_dir, 256 << 20, 1) if nvme_dir else None
        for run in runs.values():
            # the rates right before this step: the bandwidth level can change within seconds
            rates = probe.measure_optimizer_step(probe_numel, 2)
            hw = Hardware.from_profile({"measurements": {**rates, "nvme": [disk] if disk else []}}, source="probe")
            t0 = time.perf_counter()
            run["opt"].step()
            run["measured"].append(time.perf_counter() - t0)
            t = predict_time(run["req"], run["placement"], hw)
            run["predicted"].append((t.optimizer, t.bottleneck))
    rows = []
    for name, run in runs.items():
        measured = statistics.median(run["measured"])
        predicted = statistics.median(p for p, _ in run["predicted"])
        paired = statistics.median(p / m - 1 for (p, _), m in zip(run["predicted"], run["measured"]))
        rows.append({"config": name, "params": sum(sizes), "measured_ms": measured * 1e3,
                     "predicted_ms": predicted * 1e3, "error": predicted / measured - 1, "paired_error": paired,
                     "bottleneck": run["predicted"][-1][1],
                     "measured_range_ms": [min(run["measured"]) * 1e3, max(run["measured"]) * 1e3]})
        run["opt"].close()
    return rows


def run_memory_benchmark(nvme_dir: str | None) -> list[dict]:
    rows = []
    for name in MEMORY_CONFIGS:
        if MEMORY_CONFIGS[name]["offload"] == "nvme" and not nvme_dir:
            continue
        cfg = memory_config(name, nvme_dir)
        report = measure_memory(cfg)
        default = measure_memory(cfg, default_malloc=True)
        from tierstate.placement import TierKind
        plan = predicted_memory(cfg, report)
        predicted = plan.tier_total(TierKind.HOST)
        rows.append({"config": name, "params": sum(report["numels"]), "measured_mib": report["peak_growth_bytes"] / 2**20,
                     "default_malloc_mib": default["peak_growth_bytes"] / 2**20,
                     "predicted_mib": predicted / 2**20, "error": predicted / report["peak_growth_bytes"] - 1,
                     "native": report["native"]})
    return rows


def _print_table(title: str, rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """A Markdown table: ``columns`` are (header, format string over the row's keys)."""
    print(f"\n{title}")
    print("| " + " | ".join(h for h, _ in columns) + " |")
    print("|" + " --- |" * len(columns))
    for row in rows:
        print("| " + " | ".join(fmt.format(**row) for _, fmt in columns) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     prog="python benchmarks/plan_accuracy.py", description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--numel", default="48M", help="parameters per time configuration (default 48M)")
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--subgroup-numel", type=int, default=1 << 22)
    parser.add_argument("--buffer-count", type=int, default=4)
    parser.add_argument("--nvme-dir", help="folder for NVMe configurations (default: a temporary folder in $TMPDIR)")
    parser.add_argument("--no-nvme", action="store_true", help="skip the NVMe configurations")
    parser.add_argument("--memory", action="store_true", help="also run the peak-RSS comparison")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_memory_child(json.loads(args.child))))
        return 0
    from tierstate.placement.model_spec import parse_count

    with tempfile.TemporaryDirectory(prefix="ts-plan-acc-", dir=args.nvme_dir) as tmp:
        nvme_dir = None if args.no_nvme else tmp
        print(f"load average before: {os.getloadavg()[0]:.2f}", file=sys.stderr)
        result = {"time": run_time_benchmark(parse_count(args.numel), args.tensors, args.rounds, nvme_dir,
                                             args.subgroup_numel, args.buffer_count)}
        if args.memory:
            result["memory"] = run_memory_benchmark(nvme_dir)
        print(f"load average after: {os.getloadavg()[0]:.2f}", file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    _print_table("optimizer step time (median of interleaved rounds)", result["time"],
                 [("config", "{config}"), ("params", "{params:,}"), ("measured ms", "{measured_ms:.1f}"),
                  ("predicted ms", "{predicted_ms:.1f}"), ("error of medians", "{error:+.0%}"),
                  ("median paired error", "{paired_error:+.0%}"), ("bottleneck", "{bottleneck}")])
    if args.memory:
        _print_table("peak RSS growth, 3 training steps", result["memory"],
                     [("config", "{config}"), ("params", "{params:,}"), ("measured MiB", "{measured_mib:.0f}"),
                      ("default malloc MiB", "{default_malloc_mib:.0f}"), ("predicted MiB", "{predicted_mib:.0f}"),
                      ("error", "{error:+.1%}")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
