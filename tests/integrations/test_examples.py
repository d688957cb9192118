"""Every example runs at its --tiny size in a subprocess and reports a falling loss."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tierstate

# the folder holding the tierstate under test (the checkout, or site-packages when installed):
# children must import that one, whose native module was built
IMPORT_ROOT = Path(tierstate.__file__).resolve().parents[1]


pytest.importorskip("transformers", reason="transformers is not installed (pip install tierstate[hf])")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _run(args: list[str], tmp_path) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(IMPORT_ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(args + ["--out", str(tmp_path)] if "--nvme-dir" not in args else args, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _falls(out: str) -> None:
    m = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", out)
    assert m, out
    assert float(m.group(2)) < float(m.group(1)) - 0.2, m.group(0)


def test_hf_trainer_example(tmp_path):
    pytest.importorskip("accelerate", reason="accelerate is not installed")
    out = _run([sys.executable, str(EXAMPLES / "hf_trainer.py"), "--tiny", "--model", "llama"], tmp_path)
    _falls(out)
    assert "resumed from checkpoint-4 to step 8" in out


def test_accelerate_example(tmp_path):
    pytest.importorskip("accelerate", reason="accelerate is not installed")
    out = _run([sys.executable, str(EXAMPLES / "accelerate_train.py"), "--tiny", "--model", "gpt2"], tmp_path)
    _falls(out)
    assert "step 4" in out.splitlines()[-1]


def test_lightning_example(tmp_path):
    pytest.importorskip("lightning", reason="lightning is not installed (pip install tierstate[lightning])")
    out = _run([sys.executable, str(EXAMPLES / "lightning_train.py"), "--tiny", "--model", "llama"], tmp_path)
    assert "tierstate/step_ms" in (tmp_path / "logs" / "version_0" / "metrics.csv").read_text().splitlines()[0]
    assert re.search(r"resumed from .*step=4.ckpt to step 8", out), out


def test_nvme_example(tmp_path):
    out = _run([sys.executable, str(EXAMPLES / "nvme_offload.py"), "--tiny", "--nvme-dir", str(tmp_path)], tmp_path)
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.2, out
    assert "'nvme'" in out.splitlines()[0], out


def test_torchrun_example(tmp_path):
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(EXAMPLES / "torchrun_ddp.py"), "--tiny"], tmp_path)
    _falls(out)
    assert "replicas identical: True" in out
