"""A forked child and the parent's engine: the child's copy has no worker threads."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from io_helpers import available_backends

CHILD = textwrap.dedent("""
    import gc, os, sys
    import numpy as np
    import tierstate.io as tio

    backend, path = sys.argv[1], sys.argv[2]
    engine = tio.set_default_engine(backend=backend, threads=2)
    f = tio.File(path, "w+")
    f.write(np.arange(4096, dtype=np.uint8))
    pid = os.fork()
    if pid == 0:
        code = 0
        try:  # the inherited engine's workers are the parent's: using it must say so, not hang
            f.pwrite(np.zeros(4096, np.uint8)).get()
            code = 5
        except RuntimeError as exc:
            if str(os.getppid()) not in str(exc) and "fork" not in str(exc):
                code = 6
        g = tio.File(path + ".child", "w+")  # the child's own default engine works
        g.write(np.ones(4096, np.uint8))
        back = np.empty(4096, np.uint8)
        g.read_exact(back)
        if not (back == 1).all():
            code = 7
        g.close()
        engine.close()
        del f, engine, g
        gc.collect()
        sys.exit(code)  # interpreter exit: atexit closes the default engine, finalizers run
    _, status = os.waitpid(pid, 0)
    back = np.empty(4096, np.uint8)
    f.read_exact(back)
    assert (back == np.arange(4096, dtype=np.uint8)).all(), "the child wrote into the parent's file"
    f.close()
    print("child", os.waitstatus_to_exitcode(status), flush=True)
""")


@pytest.mark.parametrize("backend", available_backends())
def test_forked_child_exits_without_touching_the_parents_engine(tmp_path, backend):
    """A child forked while the engine's workers wait for work exits normally (destroying its
    copy of the queue, whose waiters exist only in the parent, would block for ever), and a
    submit on the inherited engine raises instead of queueing work no thread will ever run."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, backend, str(tmp_path / "f.bin")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the parent and its hung child
        proc.communicate()
        pytest.fail("the forked child hung on the parent's I/O engine")
    assert proc.returncode == 0, stderr
    assert stdout.strip() == "child 0", stdout + stderr
