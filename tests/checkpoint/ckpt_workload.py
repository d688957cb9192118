"""A deterministic little training run, shared by the checkpoint tests and their child processes.

Run as a script it is the process the tests kill, resume or measure::

    python ckpt_workload.py train  MODE CKPT STEPS        # saves after every step, prints begin/end
                                                          # (CKPT_TEST_PAUSE: stop one save at a phase;
                                                          # CKPT_TEST_SIGTERM_EXIT=1: SIGTERM -> sys.exit(3))
    python ckpt_workload.py digests MODE STEPS            # JSON: digest after every step, no saves
    python ckpt_workload.py resume MODE STEPS CKPT...     # JSON per CKPT: loaded step, digests
    python ckpt_workload.py rss MODE HIDDEN BUFFER CKPT   # JSON: peak RSS growth of save and load
    python ckpt_workload.py soak MODE STEPS EVERY CKPT    # JSON: RSS, fds, disk use at every save

Batches depend only on the step number, every process runs one thread, so two processes
that start from equal state produce bit-identical results.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time

import torch

import tierstate as ts
from tierstate.checkpoint import load_optimizer, save_optimizer

IN = 256
HIDDEN = 512
SAVE_KW = dict(shard_bytes=2 << 20, buffer_bytes=1 << 20)


def offload_for(mode: str, nvme_dir: str | None = None):
    if mode == "cpu":
        return "cpu"
    # small sub-groups, so that parameters straddle sub-groups and the pool cycles
    return ts.Offload(cpu=0.0, nvme=1.0, subgroup_numel=1 << 16, buffer_count=3, nvme_dir=nvme_dir)


def build(mode: str = "cpu", hidden: int = HIDDEN, nvme_dir: str | None = None, **opt_kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, hidden),
                                torch.nn.GELU(), torch.nn.Linear(hidden, 8))
    kw = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    kw.update(opt_kw)
    opt = ts.AdamW(model.parameters(), offload=offload_for(mode, nvme_dir), **kw)
    return model, opt


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(32, IN, generator=g), torch.randn(32, 8, generator=g)


def train_step(model, opt, step: int) -> None:
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def digest(model, opt) -> str:
    """sha256 over every parameter's and every state tensor's bytes, plus the steps."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    sd = opt.state_dict()
    for index in sorted(sd["state"]):
        for key in sorted(sd["state"][index]):
            t = sd["state"][index][key]
            h.update(f"{index}.{key}".encode())
            h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, so that equality is bitwise (NaN == NaN, -0.0 != 0.0)."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).clone()


def _plain(value):
    """A hyper-parameter value in a comparable form (tensors by dtype and bytes)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), bytes(_bits(value).numpy()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_plain(v) for v in value))
    return (type(value).__name__, value)


def snapshot(opt) -> dict:
    """Everything a load may change in a live optimizer, copied out for :func:`assert_same_snapshot`.

    Parameters (bitwise), param_groups (every hyper-parameter, with its type, and which
    parameter objects each group holds), every state key of every parameter on every tier
    (NVMe state read through the tier, not from the published host views), the keys
    published in ``opt.state``, per-parameter step and flags, ``skipped_steps`` and the
    step counter. A plain ``torch.optim.Optimizer`` gives its ``state_dict()``.
    """
    params = [p for g in opt.param_groups for p in g["params"]]
    snap = {
        "params": [(str(p.dtype), tuple(p.shape), bytes(_bits(p).numpy())) for p in params],
        "groups": [{k: ([id(p) for p in v] if k == "params" else _plain(v)) for k, v in g.items()}
                   for g in opt.param_groups],
        "published": {i: sorted(opt.state[p].keys()) for i, p in enumerate(params) if p in opt.state},
    }
    if isinstance(opt, ts.OffloadOptimizer):
        opt.sync_state()
        store = opt.state_store
        state = {}
        for s in store.slots:
            if not s.has_state:
                continue
            keys = store.held_keys(s)
            state[s.index] = {k: (str(store.dtypes[k]), bytes(_bits(store.read_flat(s, k)).numpy())) for k in keys}
        snap["state"] = state
        snap["slots"] = [(s.index, s.has_state, s.master.filled, s.step, s.trainable) for s in store.slots]
        snap["counters"] = (opt.skipped_steps, opt.steps_taken)
        snap["state_dtypes"] = {k: str(v) for k, v in store.dtypes.items()}
    else:
        sd = opt.state_dict()
        snap["state"] = {i: {k: _plain(v) for k, v in st.items()} for i, st in sd["state"].items()}
    return snap


def assert_same_snapshot(before: dict, after: dict) -> None:
    """Assert two :func:`snapshot` results are identical, naming the first part that differs."""
    assert before.keys() == after.keys()
    for part in before:
        if part == "params":
            for i, (a, b) in enumerate(zip(before[part], after[part])):
                assert a == b, f"parameter {i} changed"
        elif part == "state":
            assert before[part].keys() == after[part].keys(), "the set of parameters with state changed"
            for i in before[part]:
                assert before[part][i].keys() == after[part][i].keys(), f"state keys of parameter {i} changed"
                for k in before[part][i]:
                    assert before[part][i][k] == after[part][i][k], f"state {k!r} of parameter {i} changed"
        assert before[part] == after[part], f"{part} changed"


def _say(*words) -> None:
    print(*words, flush=True)


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    cmd, mode = argv[0], argv[1]
    nvme_dir = os.environ.get("CKPT_TEST_NVME_DIR")
    if cmd == "train":
        ckpt, steps = argv[2], int(argv[3])
        if os.environ.get("CKPT_TEST_SIGTERM_EXIT") == "1":  # a graceful-exit handler, as launchers' users write
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(3))
        else:  # the default disposition the test means, even where the test runner ignores SIGTERM
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # Ctrl-C raises KeyboardInterrupt, as in a terminal, even when this process was started
        # from a background job: a shell's `cmd &` ignores SIGINT, and exec keeps it ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        model, opt = build(mode, nvme_dir=nvme_dir)
        handshake = os.environ.get("CKPT_TEST_HANDSHAKE") == "1"
        # CKPT_TEST_PAUSE=<phase>:<step>:<marker>: the save of <step> stops at <phase> (save.py's testing aid)
        pause = os.environ.get("CKPT_TEST_PAUSE")
        for step in range(steps):
            train_step(model, opt, step)
            if pause is not None:
                phase, at, marker = pause.split(":", 2)
                if step + 1 == int(at):
                    os.environ["TIERSTATE_TEST_PAUSE_AT"] = f"{phase}:{marker}"
            _say("begin", step + 1)
            if handshake:  # the killing test says when to go, so its clock starts with the save
                sys.stdin.readline()
            t0 = time.perf_counter()
            save_optimizer(opt, ckpt, extra={"step": step + 1}, **SAVE_KW)
            _say("end", step + 1, f"{time.perf_counter() - t0:.6f}")
    elif cmd == "digests":
        steps = int(argv[2])
        model, opt = build(mode, nvme_dir=nvme_dir)
        out = {0: digest(model, opt)}
        for step in range(steps):
            train_step(model, opt, step)
            out[step + 1] = digest(model, opt)
        _say(json.dumps(out))
    elif cmd == "resume":
        steps, dirs = int(argv[2]), argv[3:]
        results = {}
        for ckpt in dirs:
            model, opt = build(mode, nvme_dir=nvme_dir)
            start = load_optimizer(opt, ckpt)["step"]
            loaded = digest(model, opt)
            for step in range(start, steps):
                train_step(model, opt, step)
            # a new save into the crashed save's directory sweeps its debris
            save_optimizer(opt, ckpt, extra={"step": steps}, **SAVE_KW)
            results[ckpt] = {"step": start, "loaded": loaded, "final": digest(model, opt),
                             "files": sorted(os.listdir(ckpt))}
            opt.close()
        _say(json.dumps(results))
    elif cmd == "rss":
        hidden, buffer_bytes, ckpt = int(argv[2]), int(argv[3]), argv[4]
        model, opt = build(mode, hidden=hidden, nvme_dir=nvme_dir)
        train_step(model, opt, 0)
        # parameters + exp_avg + exp_avg_sq, all fp32 (no master: fp32 CPU parameters)
        state_bytes = sum(p.numel() for p in model.parameters()) * 12

        def status(field: str) -> int:
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

        def reset_peak() -> None:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM (the peak RSS) to the current RSS

        reset_peak()
        base = status("VmRSS")
        save_optimizer(opt, ckpt, buffer_bytes=buffer_bytes, shard_bytes=state_bytes // 4)
        save_peak = status("VmHWM")
        reset_peak()
        load_base = status("VmRSS")
        load_optimizer(opt, ckpt, buffer_bytes=buffer_bytes)
        load_peak = status("VmHWM")
        _say(json.dumps({"state_bytes": state_bytes, "save_growth": save_peak - base,
                         "load_growth": load_peak - load_base}))
    elif cmd == "soak":
        steps, every, ckpt = int(argv[2]), int(argv[3]), argv[4]
        model, opt = build(mode, hidden=256, nvme_dir=nvme_dir)
        samples = []
        for step in range(steps):
            train_step(model, opt, step % 50)  # 50 distinct batches, over and over
            if (step + 1) % every == 0:
                save_optimizer(opt, ckpt, extra={"step": step + 1}, **SAVE_KW)
                with open("/proc/self/status") as f:
                    rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
                disk = sum(os.path.getsize(os.path.join(d, n)) for top in (nvme_dir, ckpt)
                           for d, _, names in os.walk(top) for n in names)
                samples.append({"step": step + 1, "rss": rss, "fds": len(os.listdir("/proc/self/fd")), "disk": disk})
        _say(json.dumps(samples))
    else:
        raise SystemExit(f"unknown command {cmd!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
