"""The ``tierstate`` command line: ``demo``, ``probe``, ``plan``, ``generate``,
``bench {step,floor,io,e2e,gpu,overhead}``, ``report``.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``main(args) -> int``. Only the module of the subcommand being run is imported, so
``tierstate --help`` stays quick and one area that fails to import does not take the
others down with it: its subcommand alone exits 2 with a one-line reason.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Sequence

# Exit status for usage errors, as argparse uses.
USAGE_ERROR = 2
# Exit status when a command fails on a file or folder (its OSError names the path and errno).
IO_ERROR = 1


@dataclass(frozen=True)
class Command:
    """One subcommand: its words on the command line, the module implementing it, a summary."""

    words: tuple[str, ...]
    module: str
    summary: str


COMMANDS: tuple[Command, ...] = (
    Command(("demo",), "tierstate.demo.cli", "train a small GPT with offloaded optimizer state and show what happened"),
    Command(("probe",), "tierstate.placement.probe", "measure this machine's memory, PCIe and disk bandwidth"),
    Command(("plan",), "tierstate.plan_cli", "show where a model's optimizer state would be placed"),
    Command(("generate",), "tierstate.generate.cli",
            "generate with a causal LM whose weights and KV cache live in host RAM and on NVMe"),
    Command(("bench", "step"), "tierstate.bench.step",
            "time optimizer steps against their floor: memory bandwidth (--offload cpu) or the disk (nvme)"),
    Command(("bench", "floor"), "tierstate.bench.step_floor",
            "time opt.step() as a whole, right after a backward, against torch's fused step"),
    Command(("bench", "io"), "tierstate.bench.io", "time the NVMe tier's reads and writes"),
    Command(("bench", "e2e"), "tierstate.bench.e2e", "time end-to-end training steps"),
    Command(("bench", "gpu"), "tierstate.bench.gpu_train",
            "train a Llama-shaped model on one GPU: no offload, tierstate, DeepSpeed, torchao"),
    Command(("bench", "overhead"), "tierstate.bench.overhead", "the optimizer's cost on top of its kernels, incl. telemetry"),
    Command(("report",), "tierstate.telemetry.report", "plot where a traced run's time and bytes went"),
)

_GROUP_SUMMARIES = {"bench": "benchmarks: step, floor, io, e2e, gpu, overhead"}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tierstate`` command line with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        module, args = parse(argv)
    except _Unavailable as exc:
        print(f"tierstate: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    try:
        return int(module.main(args) or 0)
    except OSError as exc:  # a path the user gave (or a full disk): one line naming it, not a traceback
        print(f"tierstate {' '.join(_chosen_command(argv).words)}: error: {exc}", file=sys.stderr)
        return IO_ERROR


class _Unavailable(Exception):
    """The chosen subcommand's module cannot be imported."""


def parse(argv: Sequence[str]) -> tuple[ModuleType, argparse.Namespace]:
    """Parse ``argv`` as :func:`main` does, without running anything: the chosen command's module
    and its arguments. Bad arguments exit with status 2 and argparse's message (``SystemExit``)."""
    argv = list(argv)
    chosen = _chosen_command(argv)
    module = None
    if chosen is not None:
        try:
            module = _load(chosen)
        except Exception as exc:  # an area mid-edit may raise anything at import; it fails alone
            raise _Unavailable(f"`tierstate {' '.join(chosen.words)}` is unavailable: cannot import "
                               f"{chosen.module} ({type(exc).__name__}: {exc})") from None
    parser = _build_parser(chosen, module)
    args = parser.parse_args(argv)
    return module, args


def _chosen_command(argv: list[str]) -> Command | None:
    """The command whose words lead the positional arguments, if any."""
    positional = [a for a in argv if not a.startswith("-")]
    for command in COMMANDS:
        if tuple(positional[: len(command.words)]) == command.words:
            return command
    return None


def _load(command: Command) -> ModuleType:
    module = importlib.import_module(command.module)
    missing = [name for name in ("add_arguments", "main") if not callable(getattr(module, name, None))]
    if missing:
        raise ImportError(f"{command.module} does not define {' and '.join(missing)}()")
    return module


def _build_parser(chosen: Command | None, module: ModuleType | None) -> argparse.ArgumentParser:
    """The full parser; only ``chosen``'s sub-parser gets its real arguments (from ``module``)."""
    # No abbreviations: `tierstate plan 7B --offload nvme` would silently mean --offload-weights.
    parser = argparse.ArgumentParser(
        prog="tierstate",
        description="Train PyTorch models whose optimizer state lives in host RAM and on NVMe.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"tierstate {_version()}")
    top = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for command in COMMANDS:
        if len(command.words) == 1:
            sub = top.add_parser(command.words[0], help=command.summary, description=command.summary,
                                 allow_abbrev=False)
        else:
            group_word, leaf_word = command.words
            if group_word not in groups:
                group = top.add_parser(group_word, help=_GROUP_SUMMARIES[group_word],
                                       description=_GROUP_SUMMARIES[group_word], allow_abbrev=False)
                groups[group_word] = group.add_subparsers(dest=f"{group_word}_command", metavar="COMMAND",
                                                          required=True)
            sub = groups[group_word].add_parser(leaf_word, help=command.summary, description=command.summary,
                                                allow_abbrev=False)
        if command == chosen and module is not None:
            module.add_arguments(sub)
    return parser


def _version() -> str:
    # Read from the installed metadata rather than importing tierstate (and torch with it).
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tierstate")
    except PackageNotFoundError:
        return "(not installed; running from a source tree)"


if __name__ == "__main__":
    sys.exit(main())
