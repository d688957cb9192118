"""Every command and code block in README.md, examples/README.md and benchmarks/README.md is
executed or parsed here, so the documents cannot drift from the code.

What is extracted: every ```bash and ```python block of README.md, and every command (a line of
a fenced block, or an inline `code span`) that starts with ``tierstate``, ``python -m tierstate``,
``python examples/``, ``python benchmarks/``, ``torchrun`` or names an example script, in all
three documents.

How each is checked:

* README python blocks run in a fresh process. The reader's own objects (``model``, ``loader``,
  ``MyModel``) are defined by a prelude, and the few literal substitutions a CPU test machine
  needs are listed per block in ``PYTHON_BLOCKS``, keyed by the block's first line, each with
  its reason. A block missing from the table, an unused entry, or a substitution whose text is
  no longer in the block fails the test.
* README bash blocks are the two install commands: each must be a line of ``.ci/run``, which CI
  runs on a clean clone, and ``.ci/run`` must run no other ``python3 -m venv`` line.
* Commands in ``RUNS`` are run for real, with the tiny sizes given there and why: ``tierstate``
  ones as ``python -m tierstate``, ``python benchmarks/`` scripts from the checkout.
* Every other command is parsed by the parser that would run it, without running it: the
  ``tierstate`` ones through :func:`tierstate.cli.parse` (what ``tierstate`` itself does), the
  scripts and ``python -m`` modules by running them until their ``parse_args`` returns
  (``_parse_only``). That is the check for figures taken at full size or with DeepSpeed peers,
  which would take minutes to hours, and for torchrun's multi-process launches.
* Synopses (``[--opt]``, ``a/b`` choices, ``...``, placeholders such as ``TRACE``) are expanded
  by ``SYNOPSES`` into concrete commands; a synopsis not in that table fails the test.
* A bare command name in prose (``tierstate bench e2e``) must name a real command.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import tierstate
from tierstate import cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = {name: ROOT / name for name in ("README.md", "examples/README.md", "benchmarks/README.md")}
IMPORT_ROOT = Path(tierstate.__file__).resolve().parents[1]
COMMAND_START = ("tierstate ", "python -m tierstate", "python examples/", "python benchmarks/", "torchrun ")
EXAMPLE_SCRIPTS = sorted(p.name for p in (ROOT / "examples").glob("*.py") if p.name != "common.py")


# -- extraction ---------------------------------------------------------------------------------
def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)]


def commands(text: str) -> list[str]:
    """Every command in a document: fenced lines and inline spans, whitespace collapsed, comments cut."""
    found = []
    for _, body in fenced_blocks(text):
        for line in body.splitlines():
            line = line.split(" # ")[0].strip()
            if line.startswith(COMMAND_START):
                found.append(line)
    prose = re.sub(r"^```\w*\n.*?^```", "", text, flags=re.M | re.S)
    for m in re.finditer(r"`([^`]+)`", prose):
        span = " ".join(m.group(1).split())
        first = span.split(" ")[0]
        if span.startswith(COMMAND_START) or span == "tierstate" or (first in EXAMPLE_SCRIPTS and " " in span):
            found.append(span)
    return found


ALL_COMMANDS = sorted({c for path in DOCS.values() if path.is_file() for c in commands(path.read_text())})


# -- README python blocks -------------------------------------------------------------------------
_TINY_GPT = '''
import torch, tierstate as ts
torch.manual_seed(0)

class _Out:
    def __init__(self, loss):
        self.loss = loss

class MyModel(torch.nn.Module):
    """The reader's model: a small MLP whose call returns the loss."""
    def __init__(self, out=None):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        self._wrap = out
    def forward(self, batch):
        x = batch.to(self.net[0].weight.dtype)
        loss = (self.net(x) - x).pow(2).mean()
        return self._wrap(loss) if self._wrap else loss

loader = [torch.randn(8, 64) for _ in range(3)]
'''

_TINY_LLAMA = '''
import os, torch
loader = [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]
'''

PYTHON_BLOCKS = {
    "import torch, transformers, tierstate as ts": dict(
        prelude=_TINY_LLAMA,
        substitutions=[
            ("hidden_size=4096, intermediate_size=11008, num_hidden_layers=32",
             "hidden_size=64, intermediate_size=128, num_hidden_layers=3", "a tiny Llama: CI has minutes"),
            ("num_attention_heads=32, vocab_size=32000", "num_attention_heads=4, vocab_size=128", "the same"),
            ('"/mnt/nvme0/weights"', 'os.environ["DOC_TMP"] + "/w"', "a folder of the test's own"),
            ('"/mnt/nvme0/state"', 'os.environ["DOC_TMP"] + "/s"', "a folder of the test's own"),
            ('"/mnt/nvme0/model.safetensors"', 'os.environ["DOC_TMP"] + "/model.safetensors"',
             "a folder of the test's own"),
        ],
        prints="fetch_bytes",
        why="`loader` is the reader's: three batches of token ids"),
    "from transformers import LlamaConfig": dict(
        prelude="",
        substitutions=[('"/tmp/ts-tiny-llama"', 'os.environ["DOC_TMP"] + "/ts-tiny-llama"', "a folder of the test's own")],
        prints="torch.Size",
        why="runs as written: a tiny random-init Llama written to the test's folder"),
    "import tierstate as ts": dict(
        prelude=_TINY_GPT + "model = MyModel(out=_Out)\n",
        substitutions=[],
        why="`model` and `loader` are the reader's: a small MLP returning `.loss` and three batches"),
    "import torch, tierstate as ts": dict(
        prelude=_TINY_GPT,
        substitutions=[
            ('.to("cuda", torch.bfloat16)', '.to("cpu", torch.bfloat16)', "the test machines have no GPU"),
            ('"/mnt/nvme0/ts"', 'os.environ["DOC_TMP"] + "/nvme"', "a folder of the test's own"),
            ('f"ckpt/opt-{step}"', 'os.environ["DOC_TMP"] + f"/ckpt/opt-{step}"', "a folder of the test's own"),
        ],
        why="`MyModel` and `loader` are the reader's: a small MLP returning the loss and three batches"),
}


def _readme_blocks(lang: str) -> list[str]:
    return [body for block_lang, body in fenced_blocks(DOCS["README.md"].read_text()) if block_lang == lang]


def test_every_readme_python_block_is_covered_by_the_table():
    firsts = [body.splitlines()[0].strip() for body in _readme_blocks("python")]
    assert firsts, "README.md has no python block"
    assert sorted(firsts) == sorted(PYTHON_BLOCKS), "add the block to PYTHON_BLOCKS (or drop the stale entry)"


@pytest.mark.parametrize("first_line", sorted(PYTHON_BLOCKS))
def test_readme_python_block_runs(first_line, tmp_path):
    (body,) = [b for b in _readme_blocks("python") if b.splitlines()[0].strip() == first_line]
    entry = PYTHON_BLOCKS[first_line]
    for old, new, _why in entry["substitutions"]:
        assert old in body, f"the README block no longer contains {old!r}: update PYTHON_BLOCKS"
        body = body.replace(old, new)
    code = "import os\n" + entry["prelude"] + body
    env = {**os.environ, "DOC_TMP": str(tmp_path), "PYTHONPATH": str(IMPORT_ROOT),
           "TIERSTATE_NVME_DIR": str(tmp_path / "nvme-default")}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # each block ends by printing what happened: opt.stats() ("step ..."), or ws.stats()
    assert entry.get("prints", "step") in r.stdout


# -- README bash blocks: the install commands ----------------------------------------------------
def test_readme_install_commands_are_what_ci_runs():
    blocks = [b.strip() for b in _readme_blocks("bash")]
    assert len(blocks) == 2, blocks
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    for block in blocks:
        assert "\n" not in block and block in ci_lines, f"README command not run by .ci/run: {block}"
    venv_lines = [line for line in ci_lines if line.startswith("python3 -m venv")]
    assert sorted(venv_lines) == sorted(blocks), ".ci/run runs an install command the README does not show"


# -- commands -------------------------------------------------------------------------------------
# synopsis as written -> the concrete commands it stands for (each then run or parsed)
SYNOPSES = {
    "tierstate demo [--model tiny/small/medium/large] [--steps N] [--offload cpu/nvme/auto] [--dtype bf16]": [
        f"tierstate demo --model {m} --steps 3 --offload {o} --dtype bf16"
        for m in ("tiny", "small", "medium", "large") for o in ("cpu", "nvme", "auto")],
    "tierstate probe [--nvme-dir D ...]": ["tierstate probe --nvme-dir /tmp/a --nvme-dir /tmp/b"],
    "tierstate plan gpt2 --host-mem 16GiB --disk 200GiB [--json] [--compare ...]": [
        "tierstate plan gpt2 --host-mem 16GiB --disk 200GiB",
        "tierstate plan gpt2 --host-mem 16GiB --disk 200GiB --json --compare h100,mem=80GiB,price=3.5/h"],
    "tierstate plan llama-7b --device cpu --offload-weights auto "
    "--micro-batch 1 --seq-len 2048 --activation-checkpointing --host-mem 12GiB --disk 200GiB [--json]": [
        "tierstate plan llama-7b --device cpu --offload-weights auto "
        "--micro-batch 1 --seq-len 2048 --activation-checkpointing --host-mem 12GiB --disk 200GiB",
        "tierstate plan llama-7b --device cpu --offload-weights auto "
        "--micro-batch 1 --seq-len 2048 --activation-checkpointing --host-mem 12GiB --disk 200GiB --json"],
    "tierstate bench step [--offload nvme]": ["tierstate bench step", "tierstate bench step --offload nvme"],
    "tierstate report TRACE": ["tierstate report trace.json"],
    'tierstate generate DIR --prompt "..." [--compress int8|int4] [--dtype bf16 --compress lossless]': [
        'tierstate generate /tmp/ts-tiny-llama --prompt "Hello"',
        'tierstate generate /tmp/ts-tiny-llama --prompt "Hello" --compress int8',
        'tierstate generate /tmp/ts-tiny-llama --prompt "Hello" --compress int4',
        'tierstate generate /tmp/ts-tiny-llama --prompt "Hello" --dtype bf16 --compress lossless'],
    "python benchmarks/compare_builds.py --before OLD/.venv/bin/python --after .venv/bin/python": [
        "python benchmarks/compare_builds.py --before /opt/old/.venv/bin/python --after .venv/bin/python"],
    "python benchmarks/e2e.py --steps 6 --warmup 2 --repeats 2 [--modes torch,cpu,nvme,ds_z2_cpu,ds_z3_nvme]": [
        "python benchmarks/e2e.py --steps 6 --warmup 2 --repeats 2 --modes torch,cpu,nvme,ds_z2_cpu,ds_z3_nvme"],
    "tierstate bench e2e --steps 6 --warmup 2 --repeats 2 [--modes torch,cpu,nvme]": [
        "tierstate bench e2e --steps 6 --warmup 2 --repeats 2 --modes torch,cpu,nvme"],
    "tierstate bench step --sizes 25M,100M --threads 1,2 --reps 15 [--json step.json]": [
        "tierstate bench step --sizes 25M,100M --threads 1,2 --reps 15 --json step.json"],
    "python -m tierstate.bench.step ...": ["python -m tierstate.bench.step --sizes 25M,100M --threads 1,2 --reps 15"],
    "python -m tierstate.bench.e2e --tiny ...": ["python -m tierstate.bench.e2e --tiny --steps 6 --repeats 2"],
    "nvme_offload.py --nvme-dir DIR --steps 5": ["python examples/nvme_offload.py --nvme-dir /tmp/ts-nvme --steps 5"],
    "torchrun ... torchrun_ddp.py --tiny": ["torchrun --standalone --nproc-per-node 2 examples/torchrun_ddp.py --tiny"],
}

# commands run for real: as written -> (what runs, why it differs). {tmp} is a fresh folder.
RUNS = {
    "tierstate demo": ("tierstate demo --trace {tmp}/trace.json", "as written, plus a trace for `report`"),
    "tierstate report trace.json": ("tierstate report {tmp}/trace.json --out {tmp}/report",
                                    "on the trace the demo above wrote"),
    "tierstate plan gpt2 --host-mem 16GiB --disk 200GiB": ("tierstate plan gpt2 --host-mem 16GiB --disk 200GiB",
                                                           "as written"),
    "tierstate plan gpt2 --host-mem 16GiB --disk 200GiB --json --compare h100,mem=80GiB,price=3.5/h": (
        "tierstate plan gpt2 --host-mem 16GiB --disk 200GiB --json --compare h100,mem=80GiB,price=3.5/h",
        "as written"),
    "tierstate plan llama-7b --device cpu --offload-weights auto "
    "--micro-batch 1 --seq-len 2048 --activation-checkpointing --host-mem 12GiB --disk 200GiB": (
        "tierstate plan llama-7b --device cpu --offload-weights auto "
        "--micro-batch 1 --seq-len 2048 --activation-checkpointing --host-mem 12GiB --disk 200GiB", "as written"),
    "tierstate plan llama-7b --device cpu --offload-weights auto "
    "--micro-batch 1 --seq-len 2048 --activation-checkpointing --host-mem 12GiB --disk 200GiB --json": (
        "tierstate plan llama-7b --device cpu --offload-weights auto "
        "--micro-batch 1 --seq-len 2048 --activation-checkpointing --host-mem 12GiB --disk 200GiB --json",
        "as written"),
    "tierstate probe": ("tierstate probe --quick --no-save",
                        "--quick: ~1 s instead of ~5; --no-save: not into the user's profile"),
    "tierstate demo --model tiny --steps 3 --offload nvme --dtype bf16": (
        "tierstate demo --model tiny --steps 3 --offload nvme --dtype bf16 --nvme-dir {tmp}/nvme",
        "in a folder of the test's own"),
    "tierstate bench step --sizes 100M --threads 2 --reps 21 "
    "--variants native,native-bf16-moments,torch-fused+casts,deepspeed+copy,floor": (
        "tierstate bench step --sizes 1M --threads 2 --reps 2 --warmup 1 "
        "--variants native,native-bf16-moments,torch-fused+casts,floor",
        "1M params and 2 rounds instead of 100M and 21; DeepSpeed is a peer, not in the test venv"),
    "tierstate bench io --size 1G --reps 3 --block-size 4M --small-pages": (
        "tierstate bench io --size 16M --reps 1 --block-size 4M --small-pages --no-fio --no-deepspeed --dir {tmp}",
        "16 MiB once instead of 1 GiB three times; fio and DeepSpeed are peers, not in the test venv"),
    "tierstate bench step --offload nvme --params 100M": (
        "tierstate bench step --offload nvme --params 4M --steps 1 --warmup 1 --nvme-dir {tmp}",
        "4M params and one timed step instead of 100M and five"),
    "python benchmarks/e2e.py --modes torch,cpu,cpu_bf16,cpu_bf16_bwd,nvme,nvme_bf16,nvme_bf16_bwd,ds_z2_cpu,ds_z3_nvme "
    "--steps 4 --warmup 2 --repeats 2": (
        "python benchmarks/e2e.py --tiny --modes torch,nvme,ds_z2_cpu --steps 1 --warmup 1 --repeats 1 "
        "--nvme-dir {tmp}",
        "--tiny model, three of the modes, one step: GPT-2 124M takes minutes per mode; DeepSpeed is a peer "
        "(not in the test venv: its mode says so and the rest runs); cpu_bf16_bwd runs in the `tierstate bench "
        "e2e` command below, the others in tests/bench/test_bench_e2e.py"),
    "python benchmarks/weights_vs_zero3.py --size 125m": (
        "python benchmarks/weights_vs_zero3.py --size tiny --steps 1 --warmup 1 --repeats 1 --probe-bytes 32M "
        "--nvme-dir {tmp}",
        "the tiny Llama, one step: 125M takes minutes per mode; DeepSpeed is a peer (not in the test venv: "
        "its mode says so and tierstate's runs)"),
    "tierstate bench e2e --modes cpu_bf16_bwd,nvme_bf16_bwd": (
        "tierstate bench e2e --tiny --modes cpu_bf16_bwd --steps 1 --warmup 1 --repeats 1 "
        "--nvme-dir {tmp}",
        "--tiny model, one step, the first of the two modes: GPT-2 124M takes minutes per mode; "
        "nvme_bf16_bwd is run by tests/bench/test_bench_e2e.py"),
    "tierstate bench overhead --reps 30": ("tierstate bench overhead --layers 1 --reps 2 --warmup 1",
                                           "one GPT-2 block's shapes and 2 rounds instead of 12 and 30"),
}


def _concrete(command: str) -> list[str]:
    if command in SYNOPSES:
        return SYNOPSES[command]
    assert not re.search(r"\[|\.\.\.|\b[A-Z]{2,}\b", command), \
        f"{command!r} is a synopsis: give its concrete commands in SYNOPSES"
    return [command]


def _is_command_name(command: str) -> bool:
    words = tuple(command.split()[1:])
    return command == "tierstate" or any(words == c.words or words == c.words[:1] for c in cli.COMMANDS)


class _Parsed(Exception):
    pass


@contextlib.contextmanager
def _parse_only(argv0: str, args: list[str]):
    """Run a script or module only until its first ``ArgumentParser.parse_args`` returns."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, *a, **k):
        namespace = original(self, *a, **k)
        raise _Parsed(namespace)

    saved_argv = sys.argv
    argparse.ArgumentParser.parse_args = parse_then_stop
    sys.argv = [argv0, *args]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv = saved_argv


def _parse(command: str) -> None:
    """Parse ``command`` with the parser that would run it; fails the test with argparse's message."""
    argv = shlex.split(command)
    if argv[0] == "tierstate":
        try:
            cli.parse(argv[1:])
        except SystemExit as exc:
            pytest.fail(f"{command!r} does not parse (exit {exc.code})")
        return
    if argv[0] == "torchrun":
        script_at = next(i for i, a in enumerate(argv) if a.endswith(".py"))
        _parse_target("torch.distributed.run", argv[1:], module=True, command=command)
        argv = ["python", *argv[script_at:]]
    if argv[0] in EXAMPLE_SCRIPTS:  # a table cell names the script alone: it lives in examples/
        argv = ["python", f"examples/{argv[0]}", *argv[1:]]
    assert argv[0] == "python", command
    if argv[1] == "-m":
        _parse_target(argv[2], argv[3:], module=True, command=command)
    else:
        script = ROOT / argv[1] if (ROOT / argv[1]).is_file() else ROOT / "examples" / Path(argv[1]).name
        assert script.is_file(), f"{command!r}: no such script {script}"
        sys.path.insert(0, str(script.parent))
        try:
            _parse_target(str(script), argv[2:], module=False, command=command)
        finally:
            sys.path.remove(str(script.parent))


def _parse_target(target: str, args: list[str], module: bool, command: str) -> None:
    with _parse_only(target, args):
        try:
            if module:
                runpy.run_module(target, run_name="__main__", alter_sys=False)
            else:
                runpy.run_path(target, run_name="__main__")
        except _Parsed:
            return
        except SystemExit as exc:
            pytest.fail(f"{command!r}: {target} refused {args} (exit {exc.code})")
    pytest.fail(f"{command!r}: {target} finished without parsing any arguments")


def test_every_document_has_commands():
    for name, path in DOCS.items():
        assert commands(path.read_text()), f"no commands found in {name}: is the extraction broken?"


@pytest.mark.parametrize("command", ALL_COMMANDS)
def test_documented_command_parses(command):
    if _is_command_name(command):
        return  # a mention by name, checked against the command table
    if command.startswith(("python examples/", "torchrun")) or command.split()[0] in EXAMPLE_SCRIPTS:
        pytest.importorskip("transformers", reason="the examples need transformers (pip install tierstate[hf])")
    for concrete in _concrete(command):
        _parse(concrete)


def test_every_bare_command_name_is_a_real_command():
    for command in ALL_COMMANDS:
        words = command.split()
        if words[0] == "tierstate" and len(words) <= 3 and not any(w.startswith("-") for w in words):
            if command not in SYNOPSES and command not in RUNS and not _is_command_name(command):
                pytest.fail(f"{command!r} names no tierstate command")


def test_runs_table_names_documented_commands():
    documented = {c for command in ALL_COMMANDS for c in _concrete(command)}
    assert set(RUNS) <= documented, sorted(set(RUNS) - documented)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("doc-runs")


# report reads the demo's trace: run in this order
@pytest.mark.parametrize("command", sorted(RUNS, key=lambda c: (c.startswith("tierstate report"), c)))
def test_documented_command_runs(command, run_dir):
    line, _why = RUNS[command]
    argv = shlex.split(line.replace("{tmp}", str(run_dir)))
    env = {**os.environ, "PYTHONPATH": str(IMPORT_ROOT), "TIERSTATE_PROFILE": str(run_dir / "profile.json"),
           "TIERSTATE_NVME_DIR": str(run_dir / "nvme-default"), "MPLBACKEND": "Agg"}
    if argv[0] == "python":  # a script of the checkout's benchmarks/
        assert argv[1].startswith("benchmarks/"), line
        argv = [sys.executable, str(ROOT / argv[1]), *argv[2:]]
    else:
        argv = [sys.executable, "-m", "tierstate", *argv[1:]]
    r = subprocess.run(argv, cwd=run_dir, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{line}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
