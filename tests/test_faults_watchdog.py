"""No hang, ever: a node stuck past node_timeout in a wait that a signal ends is stopped and named; one stuck in
native code that no signal reaches is named and its process ends (exit code 124) after recording it; Ctrl-C names
the node that ran, alone or arriving together with the watchdog, and never breaks a lock."""

import os
import queue
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import toy
from exogym import Trainer
from exogym.backends.errors import NodeTimeoutError
from exogym.launch.supervision import _died
from exogym.backends.sim.baton import Baton, CollectiveCall
from exogym.backends.sim.watchdog import KICK_SIGNAL, STUCK_EXIT_CODE, Watchdog, WatchdogInterrupt
from exogym.strategy import SimpleReduceStrategy

pytestmark = pytest.mark.skipif(KICK_SIGNAL is None or not hasattr(signal, "pthread_kill"),
                                reason="stopping a node in a wait needs POSIX signals (pthread_kill)")

STUCK_STEP = 3  # every node of the Baton-level runs below is at this step
MAIN = threading.main_thread().ident


def _meet(baton, rank):
    baton.rendezvous(rank, (0, 1), CollectiveCall("sum", ("sum",), {}, step=STUCK_STEP), lambda calls: None)


def _run_two(wait, node_timeout=0.5, **kw):
    """Node 0 waits for node 1 in a collective; node 1 calls `wait()` first."""
    baton = Baton(2, on_resume=lambda r: None, on_pause=lambda r: None, node_timeout=node_timeout,
                  step_of=lambda r: STUCK_STEP, **kw)

    def node1():
        wait()
        _meet(baton, 1)
    return baton.run([lambda: _meet(baton, 0), node1])


def _held_lock():
    lock = threading.Lock()
    lock.acquire()
    return lock.acquire


def _silent_socket(call):
    mine, theirs = socket.socketpair()  # both ends stay open (the closure holds them): nothing ever arrives
    return lambda: (call(mine), theirs)


def _child_sleeping():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    _child_sleeping.child = child
    return child.wait


WAITS = {  # each would wait a minute or forever
    "time.sleep": lambda: lambda: time.sleep(60),
    "Event.wait": lambda: threading.Event().wait,
    "Lock.acquire": _held_lock,
    "queue.get": lambda: queue.Queue().get,
    "select": lambda: _silent_socket(lambda s: select.select([s], [], [], 60)),
    "socket.recv": lambda: _silent_socket(lambda s: s.recv(1)),
    "subprocess.wait": _child_sleeping,
}


@pytest.mark.spawns
@pytest.mark.parametrize("name", list(WAITS))
def test_a_node_waiting_in_an_interruptible_call_is_stopped_and_named(name):
    wait = WAITS[name]()
    started = time.monotonic()
    try:
        with pytest.raises(NodeTimeoutError) as info:
            _run_two(wait)
    finally:
        if name == "subprocess.wait":
            _child_sleeping.child.kill()
            _child_sleeping.child.wait()
    assert info.value.rank == 1 and info.value.step == STUCK_STEP
    assert "node 1 ran for" in str(info.value) and "node 0 (step 3): sum" in str(info.value)
    assert time.monotonic() - started < 20  # stopped, not waiting out the minute


def test_the_signal_handlers_are_the_callers_again_after_the_run():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, KICK_SIGNAL)}
    with pytest.raises(NodeTimeoutError):
        _run_two(threading.Event().wait)
    _run_two(lambda: None)
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_kick_signal_that_is_not_the_watchdogs_goes_to_the_callers_handler():
    calls = []
    previous = signal.signal(KICK_SIGNAL, lambda signum, frame: calls.append(signum))
    try:
        _run_two(lambda: signal.pthread_kill(MAIN, KICK_SIGNAL), node_timeout=30.0)  # the run completes
    finally:
        signal.signal(KICK_SIGNAL, previous)
    assert calls == [KICK_SIGNAL]


def test_off_the_main_thread_a_python_loop_is_still_stopped():
    caught = []

    def spin():
        while True:
            pass

    def in_thread():
        try:
            _run_two(spin)
        except NodeTimeoutError as e:
            caught.append(e)
    t = threading.Thread(target=in_thread)
    t.start()
    t.join(30)
    assert not t.is_alive() and caught and caught[0].rank == 1


def test_a_node_that_catches_the_interrupt_and_moves_on_is_told_so_and_not_ended(capsys):
    progress, stuck = [(1, 0, STUCK_STEP, None)], []
    with Watchdog(0.2, lambda: progress[0], on_stuck=stuck.append, grace=0.3):
        try:
            time.sleep(30)
        except WatchdogInterrupt:  # what a node must not do; then it makes progress again
            progress[0] = (1, 1, STUCK_STEP + 1, None)
        time.sleep(1.0)  # past the grace: the process would have ended, were the node still stuck
    assert stuck == []
    assert "node 1 caught the watchdog's interrupt" in capsys.readouterr().err


# ---- Ctrl-C --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("node_timeout", [None, 30.0])
def test_ctrl_c_in_a_wait_is_a_keyboard_interrupt_naming_the_node_and_its_step(node_timeout):
    threading.Timer(0.3, lambda: signal.pthread_kill(MAIN, signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt) as info:
        _run_two(threading.Event().wait, node_timeout=node_timeout)
    assert "(interrupted while node 1 ran, at step 3)" in info.value.__notes__


def test_ctrl_c_and_the_watchdog_arriving_together_give_one_keyboard_interrupt():
    def both_at_once():
        # Hold both signals back until the watchdog has sent its own, then let Ctrl-C and it in together.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, KICK_SIGNAL})
        try:
            deadline = time.monotonic() + 20
            while KICK_SIGNAL not in signal.sigpending() and time.monotonic() < deadline:
                time.sleep(0.02)
            signal.pthread_kill(MAIN, signal.SIGINT)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, KICK_SIGNAL})
        threading.Event().wait(5)  # where the watchdog's interrupt would land, were it not silenced

    with pytest.raises(KeyboardInterrupt) as info:
        _run_two(both_at_once)
    note = " ".join(info.value.__notes__)
    assert "interrupted while node 1 ran, at step 3; it had run past node_timeout=0.5 s" in note, note


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_while_the_watchdog_unwinds_the_node_is_raised_after_it(presses):
    def stopped_then_interrupted():
        try:
            threading.Event().wait()
        finally:  # the watchdog's interrupt is unwinding this node: Ctrl-C now would land in a wait's cleanup
            for _ in range(presses):
                signal.pthread_kill(MAIN, signal.SIGINT)
            threading.Event().wait(0.01)

    with pytest.raises(KeyboardInterrupt) as info:
        _run_two(stopped_then_interrupted)
    note = " ".join(info.value.__notes__)
    if presses == 1:  # held back, then raised once the nodes had unwound, from the watchdog's error
        assert isinstance(info.value.__cause__, NodeTimeoutError) and info.value.__cause__.rank == 1
        assert "interrupted while the watchdog stopped node 1 at step 3" in note, note
    else:  # a second press goes through at once
        assert "interrupted while node 1 ran, at step 3" in note, note


def test_ctrl_c_held_back_for_a_node_that_then_carried_on_is_raised_when_the_run_ends():
    finished = []

    def catches_the_interrupt_then_ctrl_c():
        try:
            threading.Event().wait()
        except BaseException:  # what a node must not do: it carries on to its collective
            signal.pthread_kill(MAIN, signal.SIGINT)  # held back: the watchdog's interrupt counts as unwinding
            threading.Event().wait(0.01)
        finished.append(1)

    with pytest.raises(KeyboardInterrupt):
        _run_two(catches_the_interrupt_then_ctrl_c)
    assert finished == [1]  # the nodes completed; the Ctrl-C was not lost


# ---- native code that no signal reaches: a subprocess ends -----------------------------------------------------

# The node never stops, so the grace after the watchdog fired (stuck_grace: at least 5 s) is waited in full: the
# script shortens it to 1 s, which changes no outcome, only the grace the message names.
STUCK_SCRIPT = """
import torch
from exogym.backends.sim import watchdog
from exogym.backends.sim.baton import Baton, CollectiveCall

watchdog.stuck_grace = lambda timeout: 1.0

def meet(rank):
    baton.rendezvous(rank, (0, 1), CollectiveCall("sum", ("sum",), {}, step=3), lambda calls: None)

def stuck():
    torch.futures.Future().wait()  # a C++ wait: it retries after a signal, so only ending the process stops it

baton = Baton(2, on_resume=lambda r: None, on_pause=lambda r: None, node_timeout=1.0, step_of=lambda r: 3)
baton.run([lambda: meet(0), stuck])
"""


def _start_stuck(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.Popen([sys.executable, str(script)], env=env, stderr=subprocess.PIPE, text=True)


# With on_stuck (fit's, which records the failure in the run folder), the watchdog names the node on stderr and ends
# its process with STUCK_EXIT_CODE: tests/test_faults_run_end.py::test_a_node_stuck_in_native_code_ends_the_process_
# with_the_run_folder_saying_so. Without it, the process is left to its caller:


@pytest.mark.spawns
def test_without_on_stuck_the_process_is_named_on_stderr_and_left_to_its_caller(tmp_path):
    proc = _start_stuck(tmp_path)
    try:
        lines, deadline = [], time.monotonic() + 120
        while time.monotonic() < deadline and not any("left running" in line for line in lines):
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
        err = "".join(lines)
        assert "exogym watchdog: node 1 ran for" in err and "Its process is left running" in err, err
        assert f"kill {proc.pid}" in err and "was still running 1 s after the watchdog" in err
        assert proc.poll() is None  # the message came; the process was not ended for its caller
    finally:
        proc.kill()
        proc.wait()


def test_a_process_that_ended_itself_for_a_stuck_node_is_explained():
    class Ended:
        exitcode = STUCK_EXIT_CODE

        def join(self, timeout=None):
            pass
    failure = _died(4, "process 1 (nodes 4-7)", Ended())
    assert failure.rank == 4
    assert "exited with code 124: its watchdog found a node stuck in native code" in failure.summary


# ---- through fit ---------------------------------------------------------------------------------------------

class WaitsAtStep3(SimpleReduceStrategy):
    """DDP, except that node 1 waits at step 3 instead of reaching its all-reduce: in a threading.Event (which a
    signal ends) or in a torch future (a C++ wait that no signal ends)."""

    def __init__(self, *args, native=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.native = native

    def step(self):
        if self.rank == 1 and self.local_step + 1 == STUCK_STEP:
            torch.futures.Future().wait() if self.native else threading.Event().wait()
        super().step()


def _fit(strategy, nodes=3, **kw):
    t = Trainer(toy.TinyMLP(), toy.make_classification(96))
    return t.fit(strategy, nodes, batch_size=4, max_steps=6, progress=False, device="cpu", logger=False, **kw)


def test_a_node_waiting_in_an_event_is_stopped_within_its_timeout():
    # The reported case: with node_timeout=3 such a node still ran at 45 s, and Ctrl-C broke a lock.
    started = time.monotonic()
    with pytest.raises(NodeTimeoutError) as info:
        _fit(WaitsAtStep3("sgd", lr=0.1), node_timeout=2.0)
    assert info.value.rank == 1 and info.value.step == STUCK_STEP
    assert "in wait" in str(info.value)  # its stack ends in Event.wait
    assert time.monotonic() - started < 30


@pytest.mark.spawns
def test_a_simulating_process_stuck_in_native_code_is_named_by_the_caller():
    started = time.monotonic()
    with pytest.raises(NodeTimeoutError) as info:
        _fit(WaitsAtStep3("sgd", lr=0.1, native=True), nodes=2, processes=2, node_timeout=1.0)
    msg = str(info.value)
    assert info.value.rank == 1 and info.value.step == STUCK_STEP, msg
    assert "inside native code that ignores signals" in msg and f"code {STUCK_EXIT_CODE}" in msg, msg
    assert "raised in the process of node 1" in " ".join(info.value.__notes__)
    assert time.monotonic() - started < 120


class PollsForever(SimpleReduceStrategy):
    """Node 1 spins on poll() at step 3, at one simulated time, for a message nobody sends (issue 46)."""

    sends_messages = True

    def step(self):
        if self.rank == 1 and self.local_step == STUCK_STEP - 1:
            from exogym.comm import poll
            while not poll():
                pass
        super().step()


@pytest.mark.parametrize("processes", [1, pytest.param(2, marks=pytest.mark.spawns)])
def test_a_node_spinning_on_poll_without_its_clock_moving_is_stopped_within_its_timeout(processes):
    _fit(SimpleReduceStrategy("sgd", lr=0.1), nodes=2)  # the first run's imports (torch.optim's) are not node time
    started = time.monotonic()
    with pytest.raises(NodeTimeoutError) as info:
        _fit(PollsForever("sgd", lr=0.1), nodes=2, processes=processes, node_timeout=3.0)
    assert info.value.rank == 1 and info.value.step == STUCK_STEP, info.value
    assert "without its simulated clock moving" in str(info.value) or "node_timeout" in str(info.value)
    assert time.monotonic() - started < 60
