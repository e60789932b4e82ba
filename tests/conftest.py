import os
import signal
import sys

import torch

# Test modules in subfolders import the shared toy models as `toy`.
sys.path.insert(0, os.path.dirname(__file__))

# One intra-op thread: CI machines have 2 cores, and results must not depend on thread count.
torch.set_num_threads(1)
# The same for the processes the tests start (command lines, scripts, sweeps and their workers): their results then
# match this process's on any machine, and on a loaded 2-core machine torch's default of one thread per core made
# their small ops wait on each other (the PostgreSQL outage sweep: 26 s, against 9.5 s with one thread).
os.environ["OMP_NUM_THREADS"] = "1"

# Ctrl-C is Python's KeyboardInterrupt here however the suite was started. A shell that starts it in the background
# (`.ci/run &`, no job control) starts it with SIGINT ignored, and Python then installs no handler: the tests that
# press Ctrl-C waited forever (seen running .ci/run that way), and the processes the tests start inherit the ignoring.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _run_in_tmp_dir(tmp_path, monkeypatch):
    """fit() writes logs/<run_name>/ into the working directory by default: keep it out of the repo."""
    monkeypatch.chdir(tmp_path)



class _StartsAProcess(RuntimeError):
    pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test not marked `spawns` may not start a process, in its body or in any fixture it sets up (a module's
    fixture too): the fast tier (-m "not spawns") is what it says. One that does fails, naming the mark to add."""
    if item.get_closest_marker("spawns") is not None:
        yield
        return
    import multiprocessing.process
    import subprocess

    def refuse(*args, **kwargs):
        raise _StartsAProcess(f"{item.nodeid} starts a process: mark it @pytest.mark.spawns (the fast tier, "
                              "-m 'not spawns', leaves those out)")

    saved = subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start
    subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start = refuse, refuse
    try:
        yield
    finally:
        subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start = saved
