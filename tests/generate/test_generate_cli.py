"""``tierstate generate`` and ``tierstate plan --generate``: one run in a real subprocess, the
argument and refusal checks through the console script's entry point in this process."""
from __future__ import annotations

import json
import subprocess
import sys


from _tiny import save_with_tokenizer, tiny


def _run(*argv, timeout=240):
    return subprocess.run([sys.executable, "-m", "tierstate", *argv], capture_output=True, text=True, timeout=timeout)


def _main(capsys, *argv) -> tuple[int, str, str]:
    """``tierstate ...`` through tierstate.cli.main, what the console script calls: (status, stdout, stderr)."""
    from tierstate import cli

    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


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


def test_generate_bad_arguments_exit_2(tmp_path, capsys):
    model = tiny("gpt2")
    folder = tmp_path / "m"
    save_with_tokenizer(model, folder)
    code, _, err = _main(capsys, "generate", str(folder), "--max-new-tokens", "2")
    assert code == 2 and "--prompt" in err
    code, _, err = _main(capsys, "generate", str(folder), "--prompt", "w1", "--weights", "cpu=1.5")
    assert code == 2 and "cpu=1.5" in err
    code, _, err = _main(capsys, "generate", str(tmp_path / "nothere"), "--prompt", "w1", "--weights", "cpu")
    assert code == 1 and "nothere" in err


def test_plan_generate_prints_choice_and_rejections(capsys):
    code, out, err = _main(capsys, "plan", "llama-13b", "--generate", "--batch", "16", "--prompt-len", "32",
                           "--new-tokens", "16", "--host-mem", "12GiB", "--disk", "100GiB")
    assert code == 0, err
    for word in ("weights:", "KV cache:", "micro_batch=", "tokens/s", "bottleneck", "rejected", "needs"):
        assert word in out, out
    code, out, err = _main(capsys, "plan", "llama-13b", "--generate", "--host-mem", "1GiB", "--disk", "100GiB")
    assert code == 2 and "RAM" in err
    code, out, err = _main(capsys, "plan", "llama-13b", "--generate", "--json", "--host-mem", "12GiB", "--disk", "100GiB")
    plan = json.loads(out)
    assert plan["ram_bytes"] <= 12 << 30 and len(plan["weight_tiers"]) == 40


def test_plan_generate_with_compression_keeps_more_layers_in_ram(capsys):
    args = ("plan", "llama-13b", "--generate", "--json", "--host-mem", "12GiB", "--disk", "100GiB")
    counts = {}
    for mode in (None, "int8", "int4"):
        code, out, err = _main(capsys, *args, *(("--compress", mode) if mode else ()))
        assert code == 0, err
        plan = json.loads(out)
        assert plan["ram_bytes"] <= 12 << 30
        counts[mode] = plan["weight_tiers"].count("cpu")
        assert (plan["breakdown"]["ram_parts"]["compute_buffer"] > 0) == (mode is not None)
    assert counts[None] < counts["int8"] < counts["int4"], counts
    code, out, err = _main(capsys, "plan", "llama-13b", "--generate", "--compress", "int4", "--host-mem", "12GiB",
                           "--disk", "100GiB")
    assert code == 0 and "stored as int4" in out, out + err
    code, out, err = _main(capsys, *args, "--compress", "int4", "--group", "7")
    assert code == 2 and "group=7" in err
    code, out, err = _main(capsys, *args, "--group", "32")
    assert code == 2 and "--group 32: give --compress" in err


def test_generate_compressed_from_the_command_line(tmp_path):
    model = tiny("llama")
    folder = tmp_path / "m"
    prompts = save_with_tokenizer(model, folder)
    r = _run("generate", str(folder), "--prompt", prompts[0], "--max-new-tokens", "4", "--weights", "nvme",
             "--nvme-dir", str(tmp_path / "nv"), "--compress", "int8", "--group", "16", "--json", "--quiet")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["stats"]["tokens"] == 4
    from tierstate.generate import OffloadedLM
    with OffloadedLM.from_pretrained(folder, weights="nvme", kv="cpu", nvme_dir=tmp_path / "nv2") as full:
        full.generate(prompts[:1], max_new_tokens=4)
        # int8 matrices at group 16: 1 + 4/16 bytes per fp32 value's 4
        assert got["stats"]["weight_read_bytes"] < 0.4 * full.stats()["weight_read_bytes"]


def test_lossless_from_the_command_line(tmp_path, capsys):
    """``--compress lossless`` (with ``--dtype bf16``): the tokens of the uncompressed model from
    fewer bytes read; refused with ``--group``; planned with the coded bytes read from NVMe."""
    model = tiny("llama")
    folder = tmp_path / "m"
    prompts = save_with_tokenizer(model, folder)
    common = ("generate", str(folder), "--prompt", prompts[0], "--max-new-tokens", "4", "--weights", "nvme",
              "--dtype", "bf16", "--json", "--quiet")
    coded = _run(*common, "--nvme-dir", str(tmp_path / "a"), "--compress", "lossless")
    plain = _run(*common, "--nvme-dir", str(tmp_path / "b"))
    assert coded.returncode == 0 and plain.returncode == 0, coded.stderr + plain.stderr
    c, p = json.loads(coded.stdout), json.loads(plain.stdout)
    assert c["completions"] == p["completions"]
    assert c["stats"]["weight_read_bytes"] < 0.8 * p["stats"]["weight_read_bytes"]
    code, out, err = _main(capsys, *common, "--nvme-dir", str(tmp_path / "c"), "--compress", "lossless",
                           "--group", "16")
    assert code == 2 and "lossless has no groups" in err
    code, out, err = _main(capsys, "plan", "llama-13b", "--generate", "--compress", "lossless", "--host-mem", "12GiB",
                           "--disk", "100GiB")
    assert code == 0 and "as the lossless code reads them from NVMe" in out, out + err
