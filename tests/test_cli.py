"""The ``tierstate`` command line: help, subcommand dispatch, and how failures are reported."""
import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tierstate import cli
import tierstate

# the folder holding the tierstate under test (the checkout, or site-packages when installed):
# children must import that one, whose native module was built
IMPORT_ROOT = Path(tierstate.__file__).resolve().parents[1]


REPO = Path(__file__).resolve().parents[1]


def _run(*args, code=None):
    env = {**os.environ, "PYTHONPATH": str(IMPORT_ROOT)}
    argv = [sys.executable, "-c", code] if code else [sys.executable, "-m", "tierstate", *args]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)


def test_help_lists_every_command():
    result = _run("--help")
    assert result.returncode == 0, result.stderr
    for word in ("demo", "probe", "plan", "bench", "report"):
        assert f"\n    {word} " in result.stdout


def test_help_imports_no_subcommand_module():
    # Whatever `import tierstate` itself loads is the package's business; the listing must
    # add none of the subcommand modules on top of it.
    code = (
        "import sys\nimport tierstate\nfrom tierstate.cli import COMMANDS, main\n"
        "before = set(sys.modules)\n"
        "try:\n    main(['--help'])\nexcept SystemExit as exit:\n    assert exit.code == 0\n"
        "print(sorted(c.module for c in COMMANDS if c.module in set(sys.modules) - before))"
    )
    result = _run(code=code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_demo_help_shows_the_demo_options():
    result = _run("demo", "--help")
    assert result.returncode == 0, result.stderr
    for option in ("--model", "--steps", "--offload", "--nvme-dir", "--dtype", "--json", "--trace"):
        assert option in result.stdout


def test_unknown_subcommand_is_a_usage_error():
    result = _run("frobnicate")
    assert result.returncode == 2
    assert "invalid choice: 'frobnicate'" in result.stderr


def test_bench_needs_a_benchmark_name(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["bench"])
    assert exit.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


def test_a_subcommand_that_cannot_import_fails_alone(monkeypatch, capsys):
    ghost = cli.Command(("ghost",), "tierstate.no_such_module", "a command whose module is missing")
    monkeypatch.setattr(cli, "COMMANDS", (*cli.COMMANDS, ghost))
    assert cli.main(["ghost", "--flag"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "tierstate.no_such_module" in err and "ghost" in err
    # The listing still works and still shows it.
    with pytest.raises(SystemExit) as exit:
        cli.main(["--help"])
    assert exit.value.code == 0
    assert "ghost" in capsys.readouterr().out


def test_a_module_without_the_entry_points_is_reported(monkeypatch, capsys):
    # tierstate.demo.model is importable but has no add_arguments()/main().
    odd = cli.Command(("odd",), "tierstate.demo.model", "not a command module")
    monkeypatch.setattr(cli, "COMMANDS", (*cli.COMMANDS, odd))
    assert cli.main(["odd"]) == 2
    assert "does not define add_arguments and main()" in capsys.readouterr().err


def test_a_module_that_raises_at_import_is_reported(tmp_path, monkeypatch, capsys):
    (tmp_path / "broken_command.py").write_text("raise RuntimeError('half-written')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "COMMANDS", (*cli.COMMANDS, cli.Command(("broken",), "broken_command", "broken")))
    assert cli.main(["broken"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "broken_command (RuntimeError: half-written)" in err


def test_dispatch_runs_the_chosen_module(tmp_path, monkeypatch):
    module = tmp_path / "echo_command.py"
    module.write_text(
        "def add_arguments(parser):\n    parser.add_argument('--code', type=int, default=0)\n"
        "def main(args):\n    return args.code\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "COMMANDS", (*cli.COMMANDS, cli.Command(("bench", "echo"), "echo_command", "echo")))
    monkeypatch.setattr(cli, "_GROUP_SUMMARIES", {"bench": "benchmarks"})
    assert cli.main(["bench", "echo", "--code", "7"]) == 7


def test_bench_step_offload_nvme_selects_the_nvme_step_benchmark() -> None:
    """One command, one module: ``--offload`` is its own option, parsed with the others."""
    module, args = cli.parse(["bench", "step", "--offload", "nvme", "--params", "1M"])
    assert module.__name__ == "tierstate.bench.step"
    assert args.offload == "nvme" and args.params == [1_000_000]
    module, args = cli.parse(["bench", "step", "--offload=cpu"])
    assert module.__name__ == "tierstate.bench.step" and args.offload == "cpu"
    assert cli.parse(["bench", "step"])[1].offload == "cpu"  # the default


def test_bench_step_refuses_another_tier_and_the_other_tier_s_options(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.parse(["bench", "step", "--offload", "gpu"])
    assert exit.value.code == 2
    assert "--offload" in capsys.readouterr().err
    # an option of the NVMe step given to the CPU one (and back) is a usage error naming both,
    # before anything runs
    for argv, option in ((["--params", "1M"], "--params"), (["--offload", "nvme", "--sizes", "1M"], "--sizes"),
                         (["--gap-ms", "0", "--offload", "nvme"], "--gap-ms")):
        assert cli.main(["bench", "step", *argv]) == 2
        out, err = capsys.readouterr()
        assert option in err and "--offload" in err and out == "", err


def _leaf_commands(parser=None, prefix=()):
    """Every runnable command path, discovered by walking the parser's sub-parsers (not a hand list)."""
    import argparse

    parser = parser or cli._build_parser(None, None)
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [prefix]
    out = []
    for action in subs:
        for word, sub in action.choices.items():
            out += _leaf_commands(sub, prefix + (word,))
    return out


def test_the_parser_walk_finds_every_registered_command():
    # the walk is what the --help test below iterates over: it must see every command
    assert sorted(_leaf_commands()) == sorted(c.words for c in cli.COMMANDS)


# `bench step --offload nvme` has options of its own, listed in the same help
_HELP_CASES = [list(words) for words in _leaf_commands()] + [["bench", "step", "--offload", "nvme"], []]


@pytest.mark.parametrize("words", _HELP_CASES, ids=lambda w: " ".join(w) or "(top)")
def test_every_command_help_prints_its_options(words, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main([*words, "--help"])
    out, err = capsys.readouterr()
    assert exit.value.code == 0, err
    assert out.startswith("usage: tierstate"), out[:200]
    assert "options:" in out or "optional arguments:" in out
    assert err == ""


def _parser_of(words):
    command = next(c for c in cli.COMMANDS if c.words == tuple(words))
    parser = cli._build_parser(command, cli._load(command))
    sub = parser
    for word in words:
        sub = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction)).choices[word]
    return parser, sub


@pytest.mark.parametrize("words", _leaf_commands(), ids=" ".join)
def test_no_command_takes_an_abbreviated_option(words, capsys):
    """argparse's default takes any unambiguous prefix: `tierstate plan 7B --offload nvme` ran as
    --offload-weights nvme. Every option must be spelt out."""
    parser, sub = _parser_of(words)
    options = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    longest = max(options, key=len)
    prefix = longest[:-2]
    assert not any(o.startswith(prefix) and o != longest for o in options)
    with pytest.raises(SystemExit) as exit:
        parser.parse_args([*words, prefix, "1"])
    assert exit.value.code == 2
    assert f"unrecognized arguments: {prefix}" in capsys.readouterr().err


def test_plan_offload_is_not_taken_for_offload_weights():
    result = _run("plan", "7B", "--offload", "nvme")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "unrecognized arguments: --offload nvme" in result.stderr
