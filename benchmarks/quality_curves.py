"""Training quality of compressed optimizer state: loss curves and final losses.

Trains the same model from the same initialisation on the same batches with each state
format of ``ts.AdamW`` (fp32 state, bf16 moments, 8-bit moments in the dynamic maps and in
the fp8 maps, each also with a bf16 master kept by compensation or by stochastic rounding;
torchao's ``AdamW8bit`` and bitsandbytes' ``AdamW8bit`` where importable: both run on CPU, and
neither is a dependency of tierstate), for several seeds, on two models:

- ``demo``: the GPT of ``tierstate demo`` (preset ``tiny`` unless ``--demo-preset``) on its
  generated corpus;
- ``gpt2``: a ``transformers`` ``GPT2LMHeadModel`` on the same generated corpus (byte-level
  vocabulary of 256). The default configuration is a *small* GPT-2 (2 layers, width 128,
  4 heads: 0.45M parameters), not GPT-2 small (124M): 124M would take hours per run on a
  2-core machine. ``--gpt2-layers/--gpt2-width/--gpt2-heads`` choose another.

Writes ``quality_curves.png`` (mean training loss over the seeds, smoothed, per format and
model), ``quality_curves.json`` (every run's loss per step and final held-out loss) and
prints a table of final held-out losses and their ratio to the fp32-state run (mean over
seeds, and the worst seed).

    python benchmarks/quality_curves.py --steps 1000 --seeds 3 --out docs/figures

The runs are saved as each finishes: ``--report-only`` reports what a stopped sweep saved, and
the same command with ``--resume`` keeps those runs and trains only the rest (a larger
``--seeds`` adds seeds to a finished sweep).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

FORMATS = {
    # name: Offload keyword arguments (None: a peer optimizer)
    "fp32 state": dict(),
    "bf16 moments": dict(moment_dtype=torch.bfloat16),
    "q8 moments": dict(moment_dtype="q8"),
    "q8 + bf16_kahan": dict(moment_dtype="q8", master_dtype="bf16_kahan"),
    "q8 + bf16_sr": dict(moment_dtype="q8", master_dtype="bf16_sr"),
    "fp8 moments": dict(moment_dtype="q8", quant_map="fp8"),
    "fp8 + bf16_kahan": dict(moment_dtype="q8", quant_map="fp8", master_dtype="bf16_kahan"),
    "fp8 + bf16_sr": dict(moment_dtype="q8", quant_map="fp8", master_dtype="bf16_sr"),
    "torchao AdamW8bit": None,
    "bitsandbytes AdamW8bit": None,
}


def _peer(name: str):
    """The peer optimizer class, or the reason it cannot run here."""
    try:
        if name.startswith("torchao"):
            from torchao.optim import AdamW8bit  # type: ignore[import-not-found]
        else:
            from bitsandbytes.optim import AdamW8bit  # type: ignore[import-not-found]
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available here"
        return None, f"{type(exc).__name__}: {exc}"
    return AdamW8bit, ""


def _model(kind: str, args):
    if kind == "demo":
        from tierstate.demo.model import GPT, GPTConfig

        cfg = GPTConfig.preset(args.demo_preset)
        return GPT(cfg), cfg.num_parameters()
    from transformers import GPT2Config, GPT2LMHeadModel

    # bos/eos: GPT-2's defaults (50256) lie outside the byte vocabulary, and transformers warns of it
    cfg = GPT2Config(n_layer=args.gpt2_layers, n_embd=args.gpt2_width, n_head=args.gpt2_heads, vocab_size=256,
                     n_positions=max(128, args.seq_len), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(cfg)
    return model, sum(p.numel() for p in model.parameters())


def _logits(kind: str, model, x):
    return model(x) if kind == "demo" else model(input_ids=x).logits


def run_one(job: dict) -> dict:
    """One (model, format, seed) run: loss per step and the final held-out loss."""
    import tierstate as ts
    from tierstate.demo.corpus import SyntheticCorpus
    from tierstate.demo.train import warmup_cosine

    torch.set_num_threads(1)
    kind, fmt, seed, args = job["kind"], job["format"], job["seed"], job["args"]
    torch.manual_seed(seed)
    model, numel = _model(kind, args)
    params = [p for p in model.parameters() if p.requires_grad]
    hyper = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    if FORMATS[fmt] is None:
        cls, why = _peer(fmt)
        if cls is None:
            return {**job, "args": None, "skipped": why}
        opt = cls(params, **hyper)
    else:
        opt = ts.AdamW(params, offload=ts.Offload(cpu=1.0, **FORMATS[fmt]), **hyper)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.steps, max_warmup=50))
    corpus = SyntheticCorpus(seed=1234)  # the data is the same for every run; the seed sets init and batches
    gen = torch.Generator().manual_seed(seed)
    losses = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        x, y = corpus.batch(args.batch_size, args.seq_len, gen)
        loss = F.cross_entropy(_logits(kind, model, x).reshape(-1, 256), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.item())
    eval_gen = torch.Generator().manual_seed(10_000)  # the same held-out batches for every run
    with torch.no_grad():
        held = [float(F.cross_entropy(_logits(kind, model, x).reshape(-1, 256), y.reshape(-1)))
                for x, y in (corpus.batch(args.batch_size, args.seq_len, eval_gen) for _ in range(args.eval_batches))]
    if hasattr(opt, "close"):
        opt.close()
    return {**job, "args": None, "numel": numel, "losses": losses, "final": sum(held) / len(held),
            "seconds": time.perf_counter() - t0}


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _plot(results: list[dict], path: Path, kinds: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(kinds), figsize=(6.5 * len(kinds), 4.5), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for fmt in FORMATS:
            runs = [r for r in results if r["kind"] == kind and r["format"] == fmt and "losses" in r]
            if not runs:
                continue
            mean = [sum(v) / len(v) for v in zip(*(r["losses"] for r in runs))]
            ax.plot(_smooth(mean, 25), label=f"{fmt} (final {sum(r['final'] for r in runs) / len(runs):.4f})",
                    linewidth=1.2, linestyle="--" if "sr" in fmt or "kahan" in fmt else "-")
        numel = next((r["numel"] for r in results if r["kind"] == kind and "numel" in r), 0)
        seeds = len({r["seed"] for r in results if r["kind"] == kind and "losses" in r})
        ax.set_title(f"{kind} ({numel / 1e6:.2f}M params), mean of {seeds} seed(s)")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (25-step mean)")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _table(results: list[dict], kinds: list[str]) -> list[dict]:
    rows = []
    for kind in kinds:
        base = {r["seed"]: r["final"] for r in results if r["kind"] == kind and r["format"] == "fp32 state"}
        for fmt in FORMATS:
            runs = [r for r in results if r["kind"] == kind and r["format"] == fmt]
            if not runs:
                continue
            skipped = next((r["skipped"] for r in runs if "skipped" in r), None)
            if skipped:
                rows.append({"model": kind, "format": fmt, "skipped": skipped})
                continue
            ratios = [r["final"] / base[r["seed"]] for r in runs if r["seed"] in base]
            rows.append({"model": kind, "format": fmt, "final_mean": sum(r["final"] for r in runs) / len(runs),
                         "ratio_mean": sum(ratios) / len(ratios), "ratio_worst": max(ratios), "seeds": len(runs),
                         "seconds_mean": sum(r["seconds"] for r in runs) / len(runs)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--models", default="demo,gpt2", help="comma-separated: demo, gpt2")
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated names of FORMATS")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--demo-preset", default="tiny")
    ap.add_argument("--gpt2-layers", type=int, default=2)
    ap.add_argument("--gpt2-width", type=int, default=128)
    ap.add_argument("--gpt2-heads", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2, help="runs at once, one thread each")
    ap.add_argument("--out", default=".", help="folder for quality_curves.png and .json")
    ap.add_argument("--report-only", action="store_true", help="table and figure from OUT/quality_curves.json")
    ap.add_argument("--resume", action="store_true",
                    help="keep the runs OUT/quality_curves.json holds (same configuration) and run only the rest")
    args = ap.parse_args(argv)
    for name in ("steps", "seeds", "batch_size", "seq_len", "eval_batches", "workers"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    kinds = [k for k in args.models.split(",") if k]
    formats = [f for f in args.formats.split(",") if f]
    for k in kinds:
        if k not in ("demo", "gpt2"):
            ap.error(f"--models: {k!r} is not one of demo, gpt2")
    for f in formats:
        if f not in FORMATS:
            ap.error(f"--formats: {f!r} is not one of {', '.join(FORMATS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:  # table and figure from the runs a previous (perhaps interrupted) run saved
        saved = json.loads((out / "quality_curves.json").read_text())
        return _report(saved["runs"], kinds, out, saved["meta"])
    jobs = [{"kind": k, "format": f, "seed": s, "args": args} for s in range(args.seeds) for k in kinds for f in formats]
    t0 = time.perf_counter()
    from tierstate.placement.probe import cpu_model

    meta = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "cpu": cpu_model() or "unknown CPU",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "torch": torch.__version__, "python": platform.python_version(), "config": {
                k: v for k, v in vars(args).items() if k not in _NOT_CONFIG}}
    results = _resumed(out, meta) if args.resume else []
    kept = {(r["kind"], r["format"], r["seed"]) for r in results}
    total = len(jobs)
    jobs = [j for j in jobs if (j["kind"], j["format"], j["seed"]) not in kept]
    with mp.get_context("spawn").Pool(args.workers) as pool:
        for r in pool.imap_unordered(run_one, jobs):
            results.append({k: v for k, v in r.items() if k != "args"})
            done = "skipped: " + r["skipped"][:60] if "skipped" in r else f"final {r['final']:.4f} in {r['seconds']:.0f}s"
            print(f"[{len(results)}/{total}] {r['kind']} {r['format']} seed {r['seed']}: {done}", flush=True)
            meta["wall_s"] = time.perf_counter() - t0 + meta.get("wall_s_earlier", 0.0)
            # saved after every run: an interrupted sweep still reports (--report-only)
            (out / "quality_curves.json").write_text(json.dumps({"meta": meta, "runs": results}, indent=1))
    return _report(results, kinds, out, meta)


# options that change how a sweep runs, not what a run computes
_NOT_CONFIG = ("out", "workers", "report_only", "resume", "seeds", "models", "formats")


def _resumed(out: Path, meta: dict) -> list[dict]:
    """The finished runs a previous sweep saved in ``out``, if it trained as this one does."""
    path = out / "quality_curves.json"
    if not path.exists():
        return []
    saved = json.loads(path.read_text())
    theirs = {k: v for k, v in saved["meta"].get("config", {}).items() if k not in _NOT_CONFIG}
    if theirs != meta["config"]:
        differ = sorted(k for k in set(theirs) | set(meta["config"]) if theirs.get(k) != meta["config"].get(k))
        raise SystemExit(f"--resume: {path} was trained with other settings ({', '.join(differ)}); "
                         f"pass another --out or the same settings")
    meta["date"] = saved["meta"].get("date", meta["date"]) + " to " + meta["date"]
    meta["wall_s_earlier"] = saved["meta"].get("wall_s", 0.0)  # which counts any sweep before it
    print(f"--resume: {len(saved['runs'])} runs kept from {path}", flush=True)
    return list(saved["runs"])


def _report(results: list[dict], kinds: list[str], out: Path, meta: dict) -> int:
    # a seed counts only where its fp32-state run finished (the ratios need it)
    results = [r for r in results if any(b["kind"] == r["kind"] and b["seed"] == r["seed"] and
                                         b["format"] == "fp32 state" and "final" in b for b in results)]
    rows = _table(results, kinds)
    _plot(results, out / "quality_curves.png", kinds)
    (out / "quality_table.json").write_text(json.dumps({"meta": meta, "table": rows}, indent=1))
    print(f"\n{meta['cpu']}, {meta['date']}, {meta.get('wall_s', 0):.0f}s wall")
    print(f"{'model':6} {'format':24} {'final loss':>10} {'/ fp32':>8} {'worst seed':>10}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['model']:6} {r['format']:24} not run: {r['skipped'][:70]}")
        else:
            print(f"{r['model']:6} {r['format']:24} {r['final_mean']:10.4f} {r['ratio_mean']:8.4f} "
                  f"{r['ratio_worst']:10.4f}  ({r['seeds']} seeds)")
    return 0




if __name__ == "__main__":
    sys.exit(main())
