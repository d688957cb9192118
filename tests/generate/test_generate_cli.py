"""``tierstate generate`` and ``tierstate plan --generate`` in a real subprocess."""
from __future__ import annotations

import json
import subprocess
import sys

import torch

from _tiny import save_with_tokenizer, tiny


def _run(*argv, timeout=240):
    return subprocess.run([sys.executable, "-m", "tierstate", *argv], capture_output=True, text=True, timeout=timeout)


def test_generate_prompts_file_matches_transformers(tmp_path):
    model = tiny("llama")
    folder = tmp_path / "m"
    prompts = save_with_tokenizer(model, folder)
    pf = tmp_path / "prompts.txt"
    pf.write_text("\n".join(prompts[:2]) + "\n\n")
    r = _run("generate", str(folder), "--prompts-file", str(pf), "--prompt", prompts[2], "--max-new-tokens", "6",
             "--weights", "nvme", "--kv", "nvme", "--nvme-dir", str(tmp_path / "nv"), "--micro-batch", "2",
             "--num-micro-batches", "2", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    prompts = [prompts[2], *prompts[:2]]  # --prompt ones first, then the file's
    assert got["prompts"] == prompts
    assert got["stats"]["tokens"] == 18 and got["stats"]["tokens_per_s"] > 0
    assert "tokens/s" in r.stderr  # the progress line
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    ref = model.generate(**enc, max_new_tokens=6, pad_token_id=0)
    want = [tok.decode(row[enc["input_ids"].shape[1]:], skip_special_tokens=True) for row in ref]
    assert got["completions"] == want
    assert not (tmp_path / "nv" / "weights").exists()


def test_generate_bad_arguments_exit_2(tmp_path):
    model = tiny("gpt2")
    folder = tmp_path / "m"
    save_with_tokenizer(model, folder)
    r = _run("generate", str(folder), "--max-new-tokens", "2")
    assert r.returncode == 2 and "--prompt" in r.stderr
    r = _run("generate", str(folder), "--prompt", "w1", "--weights", "cpu=1.5")
    assert r.returncode == 2 and "cpu=1.5" in r.stderr
    r = _run("generate", str(tmp_path / "nothere"), "--prompt", "w1", "--weights", "cpu")
    assert r.returncode == 1 and "nothere" in r.stderr


def test_plan_generate_prints_choice_and_rejections():
    r = _run("plan", "llama-13b", "--generate", "--batch", "16", "--prompt-len", "32", "--new-tokens", "16",
             "--host-mem", "12GiB", "--disk", "100GiB")
    assert r.returncode == 0, r.stderr
    for word in ("weights:", "KV cache:", "micro_batch=", "tokens/s", "bottleneck", "rejected", "needs"):
        assert word in r.stdout, r.stdout
    r = _run("plan", "llama-13b", "--generate", "--host-mem", "1GiB", "--disk", "100GiB")
    assert r.returncode == 2 and "RAM" in r.stderr
    r = _run("plan", "llama-13b", "--generate", "--json", "--host-mem", "12GiB", "--disk", "100GiB")
    plan = json.loads(r.stdout)
    assert plan["ram_bytes"] <= 12 << 30 and len(plan["weight_tiers"]) == 40
