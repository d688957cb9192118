"""The table ``tierstate demo`` ends with, drawn from :func:`~tierstate.demo.run_demo`'s summary."""
from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.table import Table


def format_bytes(nbytes: float) -> str:
    """``1536`` -> ``"1.5 KiB"``: binary units, three significant figures."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    value, power = float(nbytes), 0
    while abs(value) >= 1024 and power < len(units) - 1:
        value, power = value / 1024, power + 1
    return f"{value:.0f} B" if power == 0 else f"{value:.3g} {units[power]}"


def summary_renderable(summary: dict[str, Any]) -> Group:
    """The run at a glance (a key/value table) and where its time went (a phase table)."""
    steps = summary["steps"]
    overview = Table(title="tierstate demo", show_header=False, title_justify="left")
    overview.add_column(style="bold")
    overview.add_column()
    overview.add_row(
        "model",
        f"{summary['model']}: {summary['parameters']:,} parameters, {summary['dtype']} on {summary['device']}",
    )
    overview.add_row(
        "data",
        f"{steps} steps x {summary['batch_size']} x {summary['seq_len']} tokens of the synthetic corpus",
    )
    overview.add_row(
        "loss",
        f"{summary['loss_first']:.3f} -> {summary['loss_last']:.3f}  (mean of the first / last "
        f"{min(5, steps)} steps; uniform guess {summary['loss_uniform']:.2f}, corpus floor "
        f"{summary['loss_floor']:.2f})",
    )
    overview.add_row(
        "step time",
        f"median {summary['step_s_median'] * 1e3:.1f} ms, {summary['tokens_per_s']:,.0f} tokens/s",
    )
    offload = summary["offload"] + (f" ({summary['nvme_dir']})" if summary.get("nvme_dir") else "")
    overview.add_row("offload", offload)
    overview.add_row(
        "state per tier",
        ", ".join(f"{tier} {format_bytes(n)}" for tier, n in summary["tier_bytes"].items()) or "-",
    )
    moved = summary["optimizer_bytes"]
    overview.add_row(
        "bytes moved",
        ", ".join(f"{key} {format_bytes(n / steps)}/step" for key, n in sorted(moved.items())) or "-",
    )
    overview.add_row("optimizer kernels", _describe_kernels(summary["kernels"]))
    overview.add_row("peak RSS", format_bytes(summary["peak_rss_bytes"]))
    if summary.get("trace_path"):
        overview.add_row("trace", summary["trace_path"])

    total_s = sum(summary["phases_s"].values())
    phases = Table(title="time per phase (summed over steps)", title_justify="left")
    phases.add_column("phase")
    phases.add_column("total s", justify="right")
    phases.add_column("ms/step", justify="right")
    phases.add_column("share", justify="right")

    def add(name: str, seconds: float, style: str | None = None) -> None:
        share = seconds / total_s if total_s > 0 else 0.0
        phases.add_row(name, f"{seconds:.3f}", f"{seconds / steps * 1e3:.2f}", f"{share:.0%}", style=style)

    for name, seconds in summary["phases_s"].items():
        add(name, seconds)
        if name == "optimizer":
            # The optimizer's own critical-path breakdown of the same time.
            for inner, inner_s in sorted(summary["optimizer_phases_s"].items(), key=lambda kv: -kv[1]):
                add(f"  {inner}", inner_s, style="dim")
    return Group(overview, phases)


def _describe_kernels(kernels: dict[str, Any]) -> str:
    if kernels["native"]:
        return f"native, {kernels['isa']}, {kernels['threads']} threads"
    return f"pure-torch reference, several times slower (native module: {kernels['native_error']})"


def print_summary(summary: dict[str, Any], console: Console | None = None) -> None:
    """Print :func:`summary_renderable` to ``console`` (default: stdout)."""
    (console or Console()).print(summary_renderable(summary))
