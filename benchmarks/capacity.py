"""The capacity case: a Llama-shaped model larger than RAM trains with its weights and its
optimizer state on NVMe.

    python benchmarks/capacity.py --size 7b --dir /mnt/nvme/cap --steps 3 --seq 64 [--moment-dtype q8]

What runs: a transformers ``LlamaForCausalLM`` built under ``with torch.device("meta")`` (no
memory), its decoder layers given to ``ts.offload_weights(model, "nvme", init=model._init_weights)``
(each layer materialized, initialized, written to the NVMe home and released in turn: the
model is never whole in RAM), in fp32, so the home holds the only copy of each weight (4 B per
parameter) and the optimizer keeps no master; then ``ts.AdamW`` with bf16 moments on NVMe
(4 B per parameter; ``--moment-dtype q8``: 8-bit codes and a scale per 256 elements, 2.03 B)
and ``step_in_backward=True``, so a layer's gradients are applied and
dropped as its backward ends. Batch 1 x ``--seq`` tokens of random ids. ``--host-allocator
retain`` keeps freed host memory in the heap (:mod:`tierstate.host_allocator`), so the 808 MB of
fp32 gradients a 7B layer makes each step are not mapped and faulted in afresh; it is off by
default because glibc cannot reuse a freed block for an aligned allocation of the same size, and
the heap grew to 19 GB while the 7B layers were written (killed for memory on 24 GiB).

What it prints: per step the time, the disk bytes read and written (``/proc/self/io``), the
streamer's counters; the peak RSS (sampled every 20 ms, and the kernel's VmHWM); and the floor
of a step next to it: max(disk bytes / disk bandwidth, compute), where the bandwidth is
``tierstate bench io`` on the same folder and the compute is the forward + backward of one
resident decoder layer times the layer count, plus the resident head and embedding.

Disk needed: 8 B per parameter (53.9 GB for 7B; with ``--moment-dtype q8`` 6.03 B, 40.6 GB;
the bandwidth test's 1 GiB file is removed before the model is written); the script checks the free space first. Both folders are removed at the end.
"""
from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SIZES = {  # Llama-2 shapes (7b is Llama-2-7B's: 6.74e9 parameters), and smaller ones to develop with
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4, vocab_size=1024),
    "1b": dict(hidden_size=2048, intermediate_size=5504, num_hidden_layers=16, num_attention_heads=16, vocab_size=32000),
    "3b": dict(hidden_size=3200, intermediate_size=8640, num_hidden_layers=26, num_attention_heads=32, vocab_size=32000),
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, vocab_size=32000),
}
GIB = 2**30
# Bytes per parameter on disk: the fp32 weights (the only copy) + the two moments: bf16, or
# 8-bit codes with an fp32 scale per 256-element block (Offload(moment_dtype="q8")).
MOMENT_BYTES = {"bf16": 2 * 2, "q8": 2 * (1 + 4 / 256)}
BENCH_IO_BYTES = 1 << 30


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="1b", help="the Llama shape (default 1b)")
    p.add_argument("--dir", required=True, type=Path,
                   help="folder on the NVMe drive: weights/ and state/ are made under it and removed at the end")
    p.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence, batch 1 (default 64)")
    p.add_argument("--prefetch", type=int, default=2, help="decoder layers read ahead (default 2)")
    p.add_argument("--subgroup-numel", type=int, default=None,
                   help="the optimizer's sub-group size in elements (default: ts.Offload's)")
    p.add_argument("--buffer-count", type=int, default=None,
                   help="the optimizer's NVMe records held in RAM (default: ts.Offload's)")
    p.add_argument("--host-allocator", choices=("retain", "system"), default="system",
                   help="glibc's policy for freed host memory, for the whole run (the compute floor too): "
                        "'retain' keeps it in the heap for the next step's gradients and activations "
                        "(tierstate.host_allocator), 'system' gives it back (default system: with "
                        "retain the 7B case's heap grew to 19 GB while writing the layers and was "
                        "killed for memory)")
    p.add_argument("--moment-dtype", choices=sorted(MOMENT_BYTES), default="bf16",
                   help="how the AdamW moments are stored on NVMe: bf16 (default) or q8, 8-bit codes with a "
                        "scale per 256 elements (Offload(moment_dtype='q8'), docs/compressed_state.md): half "
                        "the moment bytes read and written each step")
    p.add_argument("--quant-map", choices=("dynamic", "fp8"), default="fp8",
                   help="the 8-bit code family with --moment-dtype q8 (default fp8: the faster host kernel)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures as JSON to this file")
    p.add_argument("--no-bench-io", action="store_true", help="skip the disk bandwidth test (no floor then)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.seq < 1 or args.prefetch < 0:
        p.error(f"--steps {args.steps}, --seq {args.seq} must be >= 1 and --prefetch {args.prefetch} >= 0")
    return args


def llama_config(size: str):
    from transformers import LlamaConfig

    return LlamaConfig(**SIZES[size], num_key_value_heads=SIZES[size]["num_attention_heads"],
                       max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)


def param_count(cfg) -> int:
    h, i, n, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    kv = h // cfg.num_attention_heads * cfg.num_key_value_heads
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return n * layer + 2 * v * h + h


class Bar:
    """One line on stderr, rewritten: what runs, how far, and the time since the start."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._last = 0.0

    def show(self, label: str, done: int, total: int, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last < (0.2 if self.tty else 10.0):
            return
        self._last = now
        width = 30
        fill = int(width * done / max(total, 1))
        line = f"{label:<28} [{'#' * fill}{'.' * (width - fill)}] {done}/{total}  {now - self.t0:7.1f} s"
        sys.stderr.write(("\r" + line) if self.tty else (line + "\n"))
        sys.stderr.flush()

    def end(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


class RssSampler:
    """Peak RSS of this process, sampled every 20 ms on a thread."""

    def __init__(self) -> None:
        import psutil

        self.proc = psutil.Process()
        self.peak = self.proc.memory_info().rss
        self.span = self.peak  # the peak since the last take_span()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            rss = self.proc.memory_info().rss
            self.peak = max(self.peak, rss)
            self.span = max(self.span, rss)

    def take_span(self) -> int:
        """The peak since the previous call (sampled), and start a new span."""
        out, self.span = self.span, self.proc.memory_info().rss
        return max(out, self.span)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def vm_hwm() -> int | None:
    """The kernel's peak resident set of this process (VmHWM), in bytes."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def proc_io() -> dict[str, int]:
    """Bytes this process made the block layer read and write (page cache misses and O_DIRECT)."""
    out = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        k, v = line.split(":")
        out[k] = int(v)
    return {"read": out["read_bytes"], "write": out["write_bytes"]}


def disk_bandwidth(folder: Path) -> dict:
    """Sequential read and write GB/s of ``tierstate bench io`` on ``folder`` (best engine backend)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        cmd = [sys.executable, "-m", "tierstate", "bench", "io", "--dir", str(folder), "--size", "1G",
               "--reps", "3", "--no-fio", "--no-deepspeed", "--json", tmp.name]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()[-400:]}")
        res = json.loads(Path(tmp.name).read_text())
    best = {"read": 0.0, "write": 0.0}
    for m in res["methods"].values():
        for d in best:
            if m.get(f"{d}_median"):
                best[d] = max(best[d], m[f"{d}_median"])
    return {"read_gbps": best["read"], "write_gbps": best["write"], "command": " ".join(cmd[1:])}


def compute_floor(cfg, seq: int, reps: int = 2) -> dict:
    """Seconds of forward + backward of one resident fp32 decoder layer (the fastest of ``reps``:
    a floor, and the least disturbed by other processes on a shared machine),
    times the layer count, plus the embedding and the head: the compute a step cannot avoid."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    torch.manual_seed(0)
    layer = LlamaDecoderLayer(cfg, layer_idx=0)
    rotary = LlamaRotaryEmbedding(cfg)
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    x = torch.randn(1, seq, cfg.hidden_size, requires_grad=True)
    pos = torch.arange(seq).unsqueeze(0)
    pe = rotary(x, pos)

    def one_layer() -> None:
        out = layer(x, position_embeddings=pe, attention_mask=None, position_ids=pos)
        out = out[0] if isinstance(out, tuple) else out
        out.sum().backward()

    def head_and_loss() -> None:
        logits = head(x)
        torch.nn.functional.cross_entropy(logits.view(-1, cfg.vocab_size),
                                          torch.zeros(seq, dtype=torch.long)).backward()

    def timed(fn) -> float:
        fn()  # warm-up
        ts_ = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts_.append(time.perf_counter() - t0)
        return min(ts_)

    t_layer, t_head = timed(one_layer), timed(head_and_loss)
    del layer, head
    return {"layer_s": t_layer, "head_s": t_head, "compute_s": t_layer * cfg.num_hidden_layers + t_head}


def _as_dict(stats) -> dict | None:
    if stats is None:
        return None
    return stats.as_dict() if hasattr(stats, "as_dict") else dict(vars(stats))


def _stop_on_sigterm(signum, frame) -> None:
    raise SystemExit(f"stopped by signal {signum}")  # unwinds through the finally that removes the folders


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    import torch
    import transformers

    import tierstate as ts

    transformers.logging.set_verbosity_error()
    cfg = llama_config(args.size)
    n_params = param_count(cfg)
    args.dir.mkdir(parents=True, exist_ok=True)
    # the disk test's file is removed before the model is written: the larger of the two
    per_param = 4 + MOMENT_BYTES[args.moment_dtype]
    need = max(int(n_params * per_param), 0 if args.no_bench_io else BENCH_IO_BYTES)
    free = shutil.disk_usage(args.dir).free
    if free < need * 1.02:
        print(f"--dir {args.dir}: {free / 1e9:.1f} GB free, the {args.size} case needs {need / 1e9:.1f} GB "
              f"({n_params / 1e9:.2f} B parameters x {per_param:.2f} B: fp32 weights + two {args.moment_dtype} "
              "moments); "
              "free space or pick a smaller --size", file=sys.stderr)
        return 2
    wdir, sdir = args.dir / "weights", args.dir / "state"
    report: dict = {"size": args.size, "params": n_params, "seq": args.seq, "batch": 1, "steps": args.steps,
                    "moment_dtype": args.moment_dtype,
                    "quant_map": args.quant_map if args.moment_dtype == "q8" else None,
                    "dir": str(args.dir), "disk_free_before_gb": free / 1e9,
                    "torch_threads": torch.get_num_threads(), "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    print(f"capacity case: Llama {args.size}, {n_params / 1e9:.2f} B parameters, fp32 weights on NVMe "
          f"({n_params * 4 / 1e9:.1f} GB) + {args.moment_dtype} AdamW moments on NVMe "
          f"({n_params * MOMENT_BYTES[args.moment_dtype] / 1e9:.1f} GB), "
          f"batch 1 x {args.seq}, {torch.get_num_threads()} threads, under {args.dir}")
    if args.host_allocator == "retain":
        ts.host_allocator.retain_freed_memory()
    report["host_allocator"] = ts.host_allocator.policy()
    if not args.no_bench_io:
        report["disk"] = disk_bandwidth(args.dir)
        print(f"disk ({report['disk']['command']}): read {report['disk']['read_gbps']:.2f} GB/s, "
              f"write {report['disk']['write_gbps']:.2f} GB/s")
    report["floor_compute"] = compute_floor(cfg, args.seq)
    print(f"compute: one resident decoder layer fwd+bwd {report['floor_compute']['layer_s']:.3f} s, head "
          f"{report['floor_compute']['head_s']:.3f} s: {report['floor_compute']['compute_s']:.1f} s a step")

    rss = RssSampler()
    bar = Bar()
    layer_type = type(None)
    ws = opt = None
    try:
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(cfg)
        layer_type = type(model.model.layers[0])
        done = [0]

        def init(module) -> None:
            model._init_weights(module)
            if isinstance(module, layer_type):
                done[0] += 1
                bar.show("init + write weights", done[0], cfg.num_hidden_layers)

        t0 = time.perf_counter()
        io0 = proc_io()
        rss.take_span()
        ws = ts.offload_weights(model, "nvme", nvme_dir=wdir, init=init, prefetch=args.prefetch)
        io1 = proc_io()
        bar.show("init + write weights", done[0], cfg.num_hidden_layers, force=True)
        bar.end()
        report["init"] = {"seconds": time.perf_counter() - t0, "write_bytes": io1["write"] - io0["write"],
                          "rss_after": rss.proc.memory_info().rss, "rss_peak": rss.take_span()}
        inv = model.model.rotary_emb.inv_freq
        if not torch.isfinite(inv).all() or inv.max() > 1.0 or inv.min() <= 0:
            raise RuntimeError(f"rotary inv_freq was not initialized by init: {inv[:4]}")
        pool = {k: v for k, v in (("subgroup_numel", args.subgroup_numel), ("buffer_count", args.buffer_count))
                if v is not None}
        moments = {"bf16": dict(moment_dtype=torch.bfloat16),
                   "q8": dict(moment_dtype="q8", quant_map=args.quant_map)}[args.moment_dtype]
        offload = ts.Offload(nvme=1.0, nvme_dir=sdir, **moments,
                             host_allocator=args.host_allocator, **pool)
        report["offload"] = repr(offload)
        opt = ts.AdamW(model.parameters(), lr=1e-5, step_in_backward=True, offload=offload)
        model.train()
        phase = ["forward", 0]

        def fwd_hook(mod, inp, out) -> None:
            phase[1] += 1
            bar.show(f"step {step + 1}/{args.steps} {phase[0]}", phase[1], cfg.num_hidden_layers)

        def bwd_hook(mod, gin, gout) -> None:
            if phase[0] != "backward":
                phase[0], phase[1] = "backward", 0
            phase[1] += 1
            bar.show(f"step {step + 1}/{args.steps} {phase[0]}", phase[1], cfg.num_hidden_layers)

        hooks = []
        for layer in model.model.layers:
            hooks.append(layer.register_forward_hook(fwd_hook))
            hooks.append(layer.register_full_backward_hook(bwd_hook))
        g = torch.Generator().manual_seed(0)
        steps = []
        prev = ws.stats()
        for step in range(args.steps):
            ids = torch.randint(0, cfg.vocab_size, (1, args.seq), generator=g)
            phase[0], phase[1] = "forward", 0
            io0 = proc_io()
            rss.take_span()
            t0 = time.perf_counter()
            loss = model(ids, labels=ids).loss
            t1 = time.perf_counter()
            peak_fwd = rss.take_span()
            loss.backward()
            t2 = time.perf_counter()
            peak_bwd = rss.take_span()
            opt.step()
            opt.zero_grad()
            t3 = time.perf_counter()
            peak_step = rss.take_span()
            io1 = proc_io()
            bar.show(f"step {step + 1}/{args.steps} done", cfg.num_hidden_layers, cfg.num_hidden_layers, force=True)
            bar.end()
            st = ws.stats()
            delta = {k: st[k] - prev[k] for k in ("fetch_bytes", "writeback_bytes", "prefetch_hits",
                                                 "prefetch_misses", "stall_seconds")}
            prev = st
            steps.append({"step": step + 1, "loss": loss.item(), "seconds": t3 - t0, "forward_s": t1 - t0,
                          "backward_s": t2 - t1, "step_s": t3 - t2, "disk_read_bytes": io1["read"] - io0["read"],
                          "disk_write_bytes": io1["write"] - io0["write"], "rss_now": rss.proc.memory_info().rss,
                          "rss_peak": {"forward": peak_fwd, "backward": peak_bwd, "step": peak_step},
                          "streamer": delta, "optimizer": _as_dict(opt.stats())})
            s = steps[-1]
            print(f"step {s['step']}: {s['seconds']:.1f} s (forward {s['forward_s']:.1f}, backward+update "
                  f"{s['backward_s']:.1f}, step() {s['step_s']:.1f}), loss {s['loss']:.3f}, disk read "
                  f"{s['disk_read_bytes'] / 1e9:.1f} GB, written {s['disk_write_bytes'] / 1e9:.1f} GB, "
                  f"RSS {s['rss_now'] / GIB:.2f} GiB (peaks: forward {peak_fwd / GIB:.2f}, backward "
                  f"{peak_bwd / GIB:.2f}, step() {peak_step / GIB:.2f}), weight stalls {delta['stall_seconds']:.1f} s")
            report["steps"], report["streamer"] = steps, st
            if args.json:  # after every step: a run stopped early still leaves its figures
                args.json.write_text(json.dumps(report, indent=2, default=str))
        for h in hooks:
            h.remove()
        report["steps"] = steps
        report["streamer"] = ws.stats()
    finally:
        peak = rss.stop()
        report["peak_rss_sampled"] = peak
        report["vm_hwm"] = vm_hwm()
        if opt is not None and hasattr(opt, "close"):
            opt.close()
        if ws is not None:
            ws.close()
        for d in (wdir, sdir):
            shutil.rmtree(d, ignore_errors=True)
    _summary(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 0


def _summary(r: dict) -> None:
    steps = r["steps"]
    later = steps[1:] or steps  # the first step also learns the layers' order
    mean = lambda key: sum(s[key] for s in later) / len(later)  # noqa: E731
    t, rd, wr = mean("seconds"), mean("disk_read_bytes"), mean("disk_write_bytes")
    print("\nsummary")
    print(f"  model            Llama {r['size']}: {r['params'] / 1e9:.2f} B parameters, batch 1 x {r['seq']}")
    print(f"  peak RSS         {r['peak_rss_sampled'] / GIB:.2f} GiB sampled, VmHWM "
          f"{(r['vm_hwm'] or 0) / GIB:.2f} GiB (target <= 12 GiB)")
    print(f"  init             {r['init']['seconds']:.0f} s, {r['init']['write_bytes'] / 1e9:.1f} GB written, "
          f"peak RSS {r['init']['rss_peak'] / GIB:.2f} GiB")
    print(f"  step time        {t:.1f} s (mean of steps {later[0]['step']}..{later[-1]['step']}); "
          f"forward {mean('forward_s'):.1f}, backward with the updates {mean('backward_s'):.1f}, "
          f"step() {mean('step_s'):.1f}")
    print(f"  disk per step    read {rd / 1e9:.1f} GB, written {wr / 1e9:.1f} GB")
    c = r["floor_compute"]["compute_s"]
    if "disk" in r and r["disk"]["read_gbps"] > 0 and r["disk"]["write_gbps"] > 0:
        io = rd / (r["disk"]["read_gbps"] * 1e9) + wr / (r["disk"]["write_gbps"] * 1e9)
        floor = max(io, c)
        r["floor"] = {"io_s": io, "compute_s": c, "floor_s": floor, "ratio": t / floor}
        print(f"  floor            max(disk {io:.1f} s, compute {c:.1f} s) = {floor:.1f} s; "
              f"step / floor = {t / floor:.2f}")
    else:
        print(f"  floor            compute {c:.1f} s (disk not measured)")
    st = r["streamer"]
    print(f"  streamer         fetched {st['fetch_bytes'] / 1e9:.1f} GB at "
          f"{st['fetch_gbps'] or 0:.2f} GB/s, written back {st['writeback_bytes'] / 1e9:.1f} GB, prefetch "
          f"hits/misses {st['prefetch_hits']}/{st['prefetch_misses']}, stalls {st['stall_seconds']:.1f} s, "
          f"window peak {st['peak_window_bytes'] / GIB:.2f} GiB, pool {st['pool_bytes'] / GIB:.2f} GiB")


if __name__ == "__main__":
    sys.exit(main())
