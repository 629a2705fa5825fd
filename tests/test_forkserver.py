"""The tests' fork server (tests/forkserver.py) starts children that behave like fresh
``python`` processes: the kill tests rely on it."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import forkserver

pytestmark = pytest.mark.slow

PROBE = r'''
import json, os, random, signal, sys
import torch
from engine import faults
faults.arm_from_environment()
print(json.dumps({
    "name": __name__, "argv": sys.argv, "cwd": os.getcwd(), "path": sys.path[:2], "pid": os.getpid(),
    "variable": os.environ.get("PROBE_VARIABLE"), "threads": torch.get_num_threads(),
    "armed": faults.armed_at("split_end"), "seed": torch.initial_seed(), "random": random.random(),
    "sigterm": str(signal.getsignal(signal.SIGTERM)), "sigint": str(signal.getsignal(signal.SIGINT)),
}))
sys.stdout.flush()
if len(sys.argv) > 1 and sys.argv[1] == "wait":
    print("waiting", flush=True)
    signal.pause()
if len(sys.argv) > 1 and sys.argv[1] == "raise":
    raise ValueError("probe failed on purpose")
raise SystemExit(int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 0)
'''


@pytest.fixture
def probe(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    return str(path)


def environment(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("SPLITLOOP_FAULTS", "PROBE_VARIABLE")}
    env.update(extra)
    return env


def test_the_server_is_used_and_has_no_thread_when_it_forks():
    assert forkserver.available()
    assert len(os.listdir(f"/proc/{forkserver._server.process.pid}/task")) == 1


def test_a_forked_child_sees_what_a_fresh_process_sees(probe, tmp_path):
    env = environment(PROBE_VARIABLE="set", SPLITLOOP_FAULTS="split_end:3:sigkill", OMP_NUM_THREADS="1",
                      PYTHONPATH=str(tmp_path / "extra"))
    args = [sys.executable, probe, "7"]
    forked = forkserver.run(args, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
    fresh = subprocess.run(args, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert forked.returncode == fresh.returncode == 7, forked.stderr
    seen, expected = json.loads(forked.stdout), json.loads(fresh.stdout)
    for key in ("name", "argv", "cwd", "path", "variable", "threads", "armed", "sigterm", "sigint"):
        assert seen[key] == expected[key], key
    assert seen["pid"] != os.getpid() and seen["armed"] and seen["threads"] == 1
    assert seen["path"] == [str(tmp_path), str(tmp_path / "extra")]


def test_each_child_gets_fresh_random_seeds(probe):
    first, second = (json.loads(forkserver.run([sys.executable, probe], env=environment(), capture_output=True,
                                               text=True, timeout=60).stdout) for _ in range(2))
    assert first["seed"] != second["seed"]
    assert first["random"] != second["random"]
    assert first["pid"] != second["pid"]


def test_a_module_runs_as_with_dash_m(tmp_path):
    (tmp_path / "probe_module.py").write_text("import sys\nprint(__name__, sys.argv[1:])\n")
    forked = forkserver.run([sys.executable, "-m", "probe_module", "a", "b"], cwd=str(tmp_path), env=environment(),
                            capture_output=True, text=True, timeout=60)
    assert (forked.returncode, forked.stdout) == (0, "__main__ ['a', 'b']\n"), forked.stderr


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_signal_kills_the_child_and_the_test_sees_it(probe, signum):
    process = forkserver.popen([sys.executable, probe, "wait"], env=environment(), stdout=subprocess.PIPE, text=True)
    assert isinstance(process, forkserver.ForkedProcess)
    json.loads(process.stdout.readline())
    assert process.stdout.readline() == "waiting\n"
    assert process.poll() is None
    process.send_signal(signum)
    assert process.wait(60) == -signum
    process.send_signal(signal.SIGKILL)  # after its status was read: no signal is sent to a reused pid
    process.stdout.close()


def test_a_new_session_makes_the_child_a_process_group_leader(probe):
    process = forkserver.popen([sys.executable, probe, "wait"], env=environment(), stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    json.loads(process.stdout.readline())
    assert process.stdout.readline() == "waiting\n"
    assert os.getpgid(process.pid) == os.getsid(process.pid) == process.pid
    os.killpg(process.pid, signal.SIGKILL)
    assert process.wait(60) == -signal.SIGKILL
    process.stdout.close()


def test_an_uncaught_exception_prints_a_traceback_and_exits_1(probe):
    process = forkserver.popen([sys.executable, probe, "raise"], env=environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 1
    assert json.loads(out.splitlines()[0])["name"] == "__main__"
    assert "ValueError: probe failed on purpose" in err


def test_stderr_can_go_where_stdout_goes(probe, tmp_path):
    with open(tmp_path / "log", "w") as log:
        process = forkserver.popen([sys.executable, probe, "raise"], env=environment(), stdout=log,
                                   stderr=forkserver.STDOUT)
    assert process.wait(60) == 1
    logged = (tmp_path / "log").read_text()
    assert json.loads(logged.splitlines()[0])["name"] == "__main__"
    assert "ValueError: probe failed on purpose" in logged


def test_an_exited_child_stays_a_zombie_until_its_status_is_read(probe):
    """So a signal the test sends meanwhile can only reach this child, never a reused pid."""
    process = forkserver.popen([sys.executable, probe, "3"], env=environment(), stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while process_state(process.pid) != "Z":
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.01)
    assert process.returncode is None
    process.send_signal(signal.SIGKILL)  # reaches the zombie: no effect
    assert process.wait(60) == 3
    with pytest.raises(ProcessLookupError):  # reaped by the time wait returns, as with subprocess
        os.kill(process.pid, 0)


def process_state(pid):
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def test_without_the_server_children_are_plain_subprocesses(probe, monkeypatch):
    monkeypatch.setenv(forkserver.DISABLE_VARIABLE, "0")
    process = forkserver.popen([sys.executable, probe], env=environment(), stdout=subprocess.PIPE)
    assert isinstance(process, subprocess.Popen)
    process.communicate(timeout=120)
    assert process.returncode == 0


# ---- tests/distributed/rank_relay.py: a torchrun rank forked from the server -----------------

RANK_RELAY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed", "rank_relay.py")


def start_relayed(probe, *args):
    """The relay as torchrun starts a rank (a fresh process in a session of its own), the probe
    forked behind it; (relay, the probe's pid)."""
    relay = subprocess.Popen([sys.executable, RANK_RELAY, forkserver.address(), probe, *args], env=environment(),
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    seen = json.loads(relay.stdout.readline())
    if args == ("wait",):
        assert relay.stdout.readline() == "waiting\n"
    return relay, seen["pid"]


def test_a_relayed_rank_exits_with_the_code_of_its_training_process(probe):
    relay, pid = start_relayed(probe, "7")
    assert relay.wait(60) == 7
    assert pid != relay.pid
    relay.stdout.close()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_to_a_relayed_ranks_group_reaches_its_training_process(probe, signum):
    """As torchrun ends a rank: a signal to the rank's process group (the relay's)."""
    relay, pid = start_relayed(probe, "wait")
    os.killpg(relay.pid, signum)
    assert relay.wait(60) == -signum  # the probe died of it (default action), then the relay as it did
    with pytest.raises(ProcessLookupError):  # reaped before the relay ended
        os.kill(pid, 0)
    relay.stdout.close()


def test_a_sigkilled_training_process_is_a_sigkilled_rank(probe):
    """A test's SIGKILL of the pid a rank wrote, or a fault point's, is seen by torchrun."""
    relay, pid = start_relayed(probe, "wait")
    os.kill(pid, signal.SIGKILL)
    assert relay.wait(60) == -signal.SIGKILL
    relay.stdout.close()


def test_a_sigkilled_relay_takes_its_training_process_with_it(probe):
    relay, pid = start_relayed(probe, "wait")
    relay.kill()
    assert relay.wait(60) == -signal.SIGKILL
    deadline = time.monotonic() + 60
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "the training process outlived its relay"
        time.sleep(0.01)
    relay.stdout.close()
