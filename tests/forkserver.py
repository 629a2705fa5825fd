"""Start the tests' Python children by forking a process that has imported torch once.

Every kill test starts many short training processes; each fresh ``python`` spends seconds
importing torch. A fork server imports torch and the engine once (import only: no op runs
and no thread starts before a fork), then forks one child per request. Each child is a real
process that behaves as a fresh ``python SCRIPT ARGS`` / ``python -m MODULE ARGS`` would:

- its own pid, killable at any instant; its exit code, or ``-N`` when killed by signal N, is
  reported to the test (the server holds the exited child as a zombie until the test has read
  its status, so a pid the test signals is never reused meanwhile, and reaps it before
  ``wait`` returns, as ``subprocess`` does);
- the test's argv, environment (``SPLITLOOP_FAULTS`` included, read by the child's own code
  after the fork as in a fresh process), working directory and ``sys.path`` (script directory
  or working directory first, then ``PYTHONPATH``); stdin is /dev/null, stdout and stderr are
  the pipes or files the test gives;
- the state of a fresh interpreter: the server only imported modules, so thread settings, the
  fault registry and ``memory://`` are untouched; torch's and numpy's global RNGs are reseeded
  from the OS as at a fresh start (``random`` reseeds itself at fork); signal dispositions and
  mask are restored;
- the end of a fresh interpreter (non-daemon threads joined, atexit handlers, stdio flushed,
  an uncaught exception printed with exit code 1), without tearing down every module: in a
  forked child that teardown would touch every page shared with the server and cost seconds.

What a fork cannot give: a new ``PYTHONHASHSEED``, and environment variables read only at
import time (the server's environment is the test process's; ``OMP_NUM_THREADS`` given to a
child is applied with ``torch.set_num_threads``). The client API
mirrors ``subprocess``: :func:`run` and :func:`popen`. Both fall back to ``subprocess`` when
the server is unavailable (not Linux, no ``os.pidfd_open``, or ``SPLITLOOP_TESTS_FORKSERVER=0``).

Run as a script, this file is the server: ``python tests/forkserver.py SOCKET [MODULE...]``.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import IO, Any, Sequence

DISABLE_VARIABLE = "SPLITLOOP_TESTS_FORKSERVER"
PRELOAD = ("torch", "torch._dynamo", "torch.profiler._cupti_monitor", "torch.utils.data", "fsspec",
           "fsspec.implementations.chained", "msgpack", "engine", "engine.cli.main", "engine.demo",
           "importlib.resources.readers", "argparse", "runpy")
# The Lightning adapter's tests start many children; Lightning's import costs seconds (an optional extra).
PRELOAD += ("pytorch_lightning", "engine.lightning") if importlib.util.find_spec("pytorch_lightning") else ()
PIPE = subprocess.PIPE
DEVNULL = subprocess.DEVNULL
STDOUT = subprocess.STDOUT
_START_TIMEOUT = 120.0


# ---------------------------------------------------------------------------------------------
# client side (the test process)
# ---------------------------------------------------------------------------------------------


class ForkedProcess:
    """A child of the fork server, with the part of ``subprocess.Popen``'s interface the tests
    use: ``pid``, ``stdout``/``stderr`` (when PIPE), ``returncode``, ``poll``, ``wait``,
    ``communicate``, ``send_signal``, ``kill``, ``terminate``."""

    def __init__(self, args: list[str], control: socket.socket, pid: int, stdout: IO | None, stderr: IO | None,
                 text: bool):
        self.args = args
        self.text = text
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.stdin = None
        self.returncode: int | None = None
        self._control = control
        self._buffer = b""

    def _read_status(self, timeout: float | None) -> int | None:
        while b"\n" not in self._buffer:
            self._control.settimeout(timeout)
            try:
                chunk = self._control.recv(4096)
            except (socket.timeout, BlockingIOError):
                return None
            if not chunk:
                raise RuntimeError(f"fork server lost child {self.pid} of {self.args}")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        returncode = int(json.loads(line)["returncode"])
        # Have the server reap the child before returning, as subprocess does: a test may check
        # next that its pid is gone. From here on the pid may be reused.
        self._control.settimeout(None)
        self._control.sendall(b"reap\n")
        while not self._buffer.endswith(b"reaped\n"):
            chunk = self._control.recv(4096)
            if not chunk:
                raise RuntimeError(f"fork server did not reap child {self.pid} of {self.args}")
            self._buffer += chunk
        self._control.close()
        self.returncode = returncode
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read_status(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and self._read_status(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:  # until its status is read, the pid is this child (or its zombie)
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """Read stdout and stderr (those given as PIPE) to their end, then wait for the exit."""
        streams = [s for s in (self.stdout, self.stderr) if s is not None]
        chunks: dict[int, list[bytes]] = {id(s): [] for s in streams}
        deadline = None if timeout is None else _now() + timeout
        with selectors.DefaultSelector() as selector:
            for stream in streams:
                selector.register(stream.fileno(), selectors.EVENT_READ, stream)
            while selector.get_map():
                remaining = None if deadline is None else max(0.0, deadline - _now())
                events = selector.select(remaining)
                if not events and remaining == 0.0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                for key, _ in events:
                    data = os.read(key.fd, 65536)
                    if data:
                        chunks[id(key.data)].append(data)
                    else:
                        selector.unregister(key.fd)
        self.wait(None if deadline is None else max(0.0, deadline - _now()))
        results = []
        for stream in (self.stdout, self.stderr):
            if stream is None:
                results.append(None)
                continue
            data = b"".join(chunks[id(stream)])
            results.append(data.decode() if self.text else data)
            stream.close()
        return results[0], results[1]

    def __enter__(self) -> "ForkedProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        if self.returncode is None:
            self.kill()
            self.wait()


def _now() -> float:
    return time.monotonic()


class _Server:
    """The fork server of this test process (one per pytest worker), started on first use."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="splitloop-forkserver-")
        self.address = os.path.join(self.directory, "socket")
        env = dict(os.environ)
        env["OPENBLAS_NUM_THREADS"] = "1"  # numpy's OpenBLAS would start a thread pool at import
        self.process = subprocess.Popen([sys.executable, __file__, self.address, *PRELOAD], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=env)
        self.ready: bool | None = None
        self.closed = False

    def wait_ready(self) -> bool:
        if self.ready is None:
            assert self.process.stdout is not None
            with selectors.DefaultSelector() as selector:
                selector.register(self.process.stdout, selectors.EVENT_READ)
                line = self.process.stdout.readline() if selector.select(_START_TIMEOUT) else b""
            self.ready = line.strip() == b"ready"
            if not self.ready:
                print(f"fork server did not start ({line!r}); using plain subprocesses", file=sys.stderr)
                self.close()
        return self.ready

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()  # the server exits at the end of its stdin
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        assert self.process.stdout is not None
        self.process.stdout.close()
        try:
            os.unlink(self.address)
        except FileNotFoundError:
            pass
        os.rmdir(self.directory)


class _AttachedServer:
    """The server of another process (a test's), whose socket :func:`address` gave: a process
    that test started (a torchrun agent's rank relay, tests/distributed/rank_relay.py) forks
    its own child from it."""

    def __init__(self, address: str) -> None:
        self.address = address

    def wait_ready(self) -> bool:
        return True


_server: _Server | _AttachedServer | None = None


def address() -> str | None:
    """The socket of this process's server (to hand to a process this one starts, see
    :func:`attach`), or None when children cannot be forked here."""
    return _server.address if available() and _server is not None else None


def attach(server_address: str) -> None:
    """Fork this process's children from the server at ``server_address`` (another process's)."""
    global _server
    _server = _AttachedServer(server_address)


def available() -> bool:
    """Whether children can be forked from a server here (else :func:`popen` uses subprocess)."""
    if os.environ.get(DISABLE_VARIABLE, "1") == "0" or not hasattr(os, "pidfd_open") or not hasattr(os, "fork"):
        return False
    return _get_server() is not None


def start() -> None:
    """Start the server in the background now (it imports torch while the caller goes on)."""
    if os.environ.get(DISABLE_VARIABLE, "1") != "0" and hasattr(os, "pidfd_open"):
        _get_server(wait=False)


def _get_server(wait: bool = True) -> _Server | _AttachedServer | None:
    global _server
    if _server is None:
        _server = _Server()
        atexit.register(_server.close)
    if not wait:
        return _server
    return _server if _server.wait_ready() else None


def _descriptor(target: Any, opened: list[int]) -> int:
    """The file descriptor to hand to the child for a stdout/stderr argument."""
    if target is None:
        return -1  # inherit this process's own
    if target == DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        opened.append(fd)
        return fd
    if isinstance(target, int):
        return target
    return target.fileno()


def popen(args: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
          stdout: Any = None, stderr: Any = None, text: bool = False, start_new_session: bool = False) -> Any:
    """Start ``args`` (``[sys.executable, SCRIPT | -m MODULE, ...]``) as a forked child, or
    with ``subprocess.Popen`` when the server is unavailable or ``args`` is something else."""
    args = [str(a) for a in args]
    if not (_forkable(args) and available()):
        return subprocess.Popen(args, env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=text,
                                start_new_session=start_new_session)
    opened: list[int] = []
    readers: list[IO | None] = []
    handed: list[int] = [os.open(os.devnull, os.O_RDONLY)]
    opened.append(handed[0])
    for target, inherited in ((stdout, 1), (stderr, 2)):
        if target == STDOUT:  # stderr into whatever stdout is
            handed.append(handed[1])
            readers.append(None)
        elif target == PIPE:
            read_end, write_end = os.pipe()
            opened.append(write_end)
            readers.append(os.fdopen(read_end, "r" if text else "rb"))
            handed.append(write_end)
        else:
            fd = _descriptor(target, opened)
            handed.append(inherited if fd == -1 else fd)
            readers.append(None)
    request = {"argv": args, "env": dict(os.environ if env is None else env), "cwd": cwd or os.getcwd(),
               "new_session": start_new_session}
    control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        assert _server is not None
        control.connect(_server.address)
        socket.send_fds(control, [json.dumps(request).encode() + b"\n"], handed)
    finally:
        for fd in opened:
            os.close(fd)
    reply = b""
    while not reply.endswith(b"\n"):
        chunk = control.recv(4096)
        if not chunk:
            raise RuntimeError(f"the fork server did not start {args}")
        reply += chunk
    first, _, rest = reply.partition(b"\n")
    process = ForkedProcess(args, control, int(json.loads(first)["pid"]), readers[0], readers[1], text)
    process._buffer = rest
    return process


def run(args: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
        capture_output: bool = False, text: bool = False, timeout: float | None = None,
        check: bool = False) -> subprocess.CompletedProcess:
    """Like ``subprocess.run``; the child is forked from the server when it can be."""
    if not (_forkable([str(a) for a in args]) and available()):
        return subprocess.run(args, env=env, cwd=cwd, capture_output=capture_output, text=text, timeout=timeout,
                              check=check)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:  # files: a chatty child never blocks
        process = popen(args, env=env, cwd=cwd, stdout=out if capture_output else None,
                        stderr=err if capture_output else None)
        try:
            returncode = process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        outputs: list[Any] = [None, None]
        if capture_output:
            for index, stream in enumerate((out, err)):
                stream.seek(0)
                data = stream.read()
                outputs[index] = data.decode() if text else data
    completed = subprocess.CompletedProcess(list(args), returncode, outputs[0], outputs[1])
    if check:
        completed.check_returncode()
    return completed


def _forkable(args: list[str]) -> bool:
    """Only ``python SCRIPT ...`` and ``python -m MODULE ...`` of this very interpreter."""
    if len(args) < 2 or args[0] != sys.executable:
        return False
    return (args[1] == "-m" and len(args) >= 3) or not args[1].startswith("-")


class SubprocessShim:
    """Stands in for the ``subprocess`` module inside code that starts Python children (e.g.
    ``engine.testing.harness``): its ``run`` and ``Popen`` fork from the server."""

    PIPE = PIPE
    DEVNULL = DEVNULL
    STDOUT = STDOUT
    TimeoutExpired = subprocess.TimeoutExpired
    CompletedProcess = subprocess.CompletedProcess
    run = staticmethod(run)
    Popen = staticmethod(popen)


# ---------------------------------------------------------------------------------------------
# server side (``python tests/forkserver.py SOCKET MODULE...``)
# ---------------------------------------------------------------------------------------------


class _Child:
    def __init__(self, pid: int, control: socket.socket):
        self.pid = pid
        self.control = control
        self.pidfd = os.pidfd_open(pid)
        self.exited = False


def _serve(address: str) -> dict:
    """Accept requests and fork; returns (only in a forked child) the request to run."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(0, selectors.EVENT_READ, "stdin")
    children: dict[int, _Child] = {}
    os.write(1, b"ready\n")
    while True:
        for key, _ in selector.select():
            if key.data == "stdin":
                if not os.read(0, 4096):  # the test process went away
                    for child in children.values():
                        if not child.exited:
                            os.kill(child.pid, signal.SIGKILL)
                    sys.exit(0)
            elif key.data == "accept":
                control, _ = listener.accept()
                request, fds = _receive(control)
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    for child in children.values():
                        child.control.close()
                        os.close(child.pidfd)
                    control.close()
                    for target, fd in enumerate(fds):
                        os.dup2(fd, target)
                        os.close(fd)
                    return request
                for fd in fds:
                    os.close(fd)
                child = _Child(pid, control)
                children[pid] = child
                control.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                selector.register(child.pidfd, selectors.EVENT_READ, ("exited", child))
                selector.register(control, selectors.EVENT_READ, ("control", child))
            elif key.data[0] == "exited":
                child = key.data[1]
                selector.unregister(child.pidfd)
                info = os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # stays a zombie: pid not reused
                assert info is not None
                returncode = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
                child.exited = True
                try:
                    child.control.sendall(json.dumps({"returncode": returncode}).encode() + b"\n")
                except OSError:
                    pass  # the test is gone; reaped below when its connection closes
            elif key.data[0] == "control":
                child = key.data[1]
                try:
                    data = child.control.recv(4096)
                except OSError:
                    data = b""
                if data and not (data.startswith(b"reap") and child.exited):
                    continue
                # the test read the status and asks for the reap, or it closed (gave up on the child)
                selector.unregister(child.control)
                if not child.exited:
                    os.kill(child.pid, signal.SIGKILL)
                    selector.unregister(child.pidfd)
                os.waitpid(child.pid, 0)
                os.close(child.pidfd)
                if data:
                    try:
                        child.control.sendall(b"reaped\n")
                    except OSError:
                        pass
                child.control.close()
                del children[child.pid]


def _receive(control: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(control, 1 << 20, 3)
    while not data.endswith(b"\n"):
        chunk = control.recv(1 << 20)
        if not chunk:
            break
        data += chunk
    return json.loads(data), fds


def _become_fresh(request: dict, base_path: list[str], dispositions: dict[int, Any]) -> tuple[str, str]:
    """Turn the forked child into what ``python ARGV`` started in ``cwd`` with ``env`` would be."""
    if request.get("new_session"):
        os.setsid()
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    for signum, handler in dispositions.items():
        if signal.getsignal(signum) != handler:
            signal.signal(signum, handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"][1:]
    if argv[0] == "-m":
        kind, target, sys.argv = "module", argv[1], [argv[1], *argv[2:]]
        first = os.getcwd()
    else:
        kind, target, sys.argv = "script", argv[0], list(argv)
        first = os.path.dirname(os.path.realpath(argv[0]))
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *base_path]
    sys.path_importer_cache.clear()
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        torch.seed()  # a fresh process seeds torch's default generator from the OS
        threads = request["env"].get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:  # read by OpenMP when a fresh process loads it
            torch.set_num_threads(int(threads))
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # and numpy's global RNG
    return kind, target


def _server_main(argv: list[str]) -> None:
    dispositions = {s: signal.getsignal(s) for s in signal.valid_signals()
                    if s not in (signal.SIGKILL, signal.SIGSTOP) and signal.getsignal(s) is not None}
    own_pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base_path = [p for p in sys.path[1:] if p not in own_pythonpath]
    sys.path[:] = [*own_pythonpath, *base_path]  # not this file's directory: tests/progress would shadow progress
    for module in argv[1:]:
        __import__(module)
    request = _serve(argv[0])
    kind, target = _become_fresh(request, base_path, dispositions)
    _exit_like_python(_run_like_python, kind, target)


def _run_like_python(kind: str, target: str) -> None:
    import runpy

    if kind == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(target, run_name="__main__")


def _exit_like_python(function: Any, *args: Any) -> None:
    """Run ``function`` as a script's top level, then end the process as the interpreter would
    (exit code, traceback, non-daemon threads joined, atexit handlers, stdio flushed), but
    without tearing down every module: in a forked child that teardown touches every page
    inherited from the server and costs seconds."""
    import atexit
    import threading
    import traceback

    code = 0
    interrupted = False
    try:
        function(*args)
    except SystemExit as exit_info:
        if exit_info.code is None:
            code = 0
        elif isinstance(exit_info.code, int):
            code = exit_info.code & 0xFF
        else:
            print(exit_info.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_Finalize does first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = code or 120
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


if __name__ == "__main__":
    _server_main(sys.argv[1:])
