"""``benchmarks.common.process.kill_tree``: a job whose workers run in sessions of their own (as torchrun starts
them) is stopped whole, where killing its process group leaves the workers running."""

import os
import signal
import subprocess
import sys
import time

from benchmarks.common.process import kill_tree, process_tree

# A parent that starts a worker in a session of its own and waits, as torchrun's agent does.
AGENT = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], "
         "start_new_session=True); time.sleep(120)")


def start_agent() -> tuple[subprocess.Popen, int]:
    agent = subprocess.Popen([sys.executable, "-c", AGENT], start_new_session=True)
    deadline = time.monotonic() + 30
    while len(process_tree(agent.pid)) < 2:
        assert time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.05)
    return agent, process_tree(agent.pid)[1]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_killing_the_process_group_leaves_the_worker_and_kill_tree_stops_it():
    agent, worker = start_agent()
    os.killpg(agent.pid, signal.SIGKILL)
    agent.wait()
    try:
        time.sleep(0.2)
        assert alive(worker)  # its own session: untouched by the group's kill
    finally:
        os.kill(worker, signal.SIGKILL)


def test_kill_tree_stops_the_agent_and_its_workers():
    agent, worker = start_agent()
    kill_tree(agent.pid)
    assert agent.wait(timeout=10) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while alive(worker):
        assert time.monotonic() < deadline, "the worker outlived kill_tree"
        time.sleep(0.05)
