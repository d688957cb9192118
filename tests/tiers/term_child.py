"""A child process for the termination and fork tests.

argv: ``what where disposition`` where

- ``what``: ``step`` (steps in a loop), ``save`` (saves a checkpoint in a loop), ``export``
  (writes a 64 MiB model with ``save_weights`` in a loop, into the checkpoint folder), ``fork``
  (forks a child that exits normally, then keeps stepping), ``mpfork`` (the same through
  multiprocessing's fork start method), ``forkterm`` (a forked child killed by SIGTERM);
- ``where``: the nvme_dir (``-``: the default, under TIERSTATE_NVME_DIR); a checkpoint goes
  to ``<where>.ckpt`` (or ``$CKPT_DIR``);
- ``disposition`` of SIGTERM set before the optimizer is built: ``default`` (SIG_DFL),
  ``ignore`` (SIG_IGN), ``exit`` (a Python handler that calls ``sys.exit(3)``), ``flag`` (a
  Python handler that only records the signal; the loop then finishes the step or the
  save and returns normally), ``thread`` (SIG_DFL, optimizer built on another thread).

It prints one JSON line ``{"pid", "folders", "files"}`` once the first step is done, then
``loop`` lines as it goes; it stops when stdin closes (or, with ``flag``, once signalled).
"""
import gc
import json
import multiprocessing
import os
import signal
import sys
import threading
import traceback

import torch

import tierstate as ts
from tierstate.placement import TierKind

STOP = threading.Event()
SEEN = []


def _flag(signum, frame):
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    SEEN.append(names)
    STOP.set()


def _exit(signum, frame):
    sys.exit(3)


def build(where):
    params = [torch.nn.Parameter(torch.randn(1 << 20))]
    opt = ts.AdamW(params, offload=ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=None if where == "-" else where,
                                              subgroup_numel=1 << 16, buffer_count=2))
    params[0].grad = torch.randn(1 << 20)
    return params, opt


def watch_stdin():
    sys.stdin.read()
    STOP.set()


def report(opt, **more):
    tier = opt.tiers[TierKind.NVME]
    print(json.dumps({"pid": os.getpid(), "folders": [str(f) for f in tier.folders],
                      "files": [str(f) for f in tier.files], **more}), flush=True)


def _mp_child(conn_path):
    # drop every reference this child has to the optimizer, as a worker would, and collect
    gc.collect()
    with open(conn_path, "w") as f:
        f.write("done")


def main() -> None:
    what, where, disposition = sys.argv[1:4]
    # The dispositions the test names, whatever the test runner left: an ignored signal stays
    # ignored across exec, and a runner started under nohup ignores SIGHUP (the SIGHUP test
    # then waited 60 s for a child that rightly left the ignored signal alone).
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    if disposition == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif disposition == "exit":
        signal.signal(signal.SIGTERM, _exit)
    elif disposition == "flag":
        signal.signal(signal.SIGTERM, _flag)
    if disposition == "thread":
        box = []
        t = threading.Thread(target=lambda: box.append(build(where)))
        t.start()
        t.join()
        params, opt = box[0]
    else:
        params, opt = build(where)
    opt.step()
    ckpt = os.environ.get("CKPT_DIR") or f"{where}.ckpt"
    if what in ("fork", "mpfork", "forkterm"):
        run_fork(what, opt)
        return
    report(opt)
    threading.Thread(target=watch_stdin, daemon=True).start()
    model = torch.nn.Linear(4096, 4096, bias=False) if what == "export" else None
    n = 0
    while not STOP.is_set():
        if what == "step":
            opt.step()
        elif what == "export":
            os.makedirs(ckpt, exist_ok=True)
            ts.save_weights(model, os.path.join(ckpt, "model.safetensors"))
        else:
            ts.save_optimizer(opt, ckpt, shard_bytes=1 << 20, buffer_bytes=1 << 20)
        n += 1
        print("loop", n, flush=True)
    if SEEN:
        print(json.dumps({"seen": SEEN}), flush=True)
        # the run goes on after a handler that returned: one more step and a whole save
        opt.step()
        ts.save_optimizer(opt, ckpt, shard_bytes=1 << 20, buffer_bytes=1 << 20)
        print(json.dumps({"after": "ok"}), flush=True)


def run_fork(what, opt):
    report(opt)
    if what == "fork":
        pid = os.fork()
        if pid == 0:
            # the child returns through the interpreter's normal exit: atexit, finalizers, all of it
            sys.argv = ["child"]
            del opt
            gc.collect()
            return
        _, status = os.waitpid(pid, 0)
        child = os.waitstatus_to_exitcode(status)
    elif what == "mpfork":
        ctx = multiprocessing.get_context("fork")
        mark = os.environ["MARK_FILE"]
        p = ctx.Process(target=_mp_child, args=(mark,))
        p.start()
        p.join()
        child = p.exitcode
    else:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(w, b"x")  # ready: a signal before CPython's after-fork reset would be dropped
            threading.Event().wait(60)
            os._exit(0)
        os.read(r, 1)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
        child = os.waitstatus_to_exitcode(status)
    tier = opt.tiers[TierKind.NVME]
    files = [os.path.exists(f) for f in tier.files]
    folders = {str(f): sorted(os.listdir(f)) if os.path.isdir(f) else None for f in tier.folders}
    try:
        for _ in range(3):
            opt.step()
        stepped = True
    except Exception:  # noqa: BLE001 - reported to the test
        traceback.print_exc()
        stepped = False
    print(json.dumps({"child": child, "files_exist": files, "folders": folders, "stepped": stepped}), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
