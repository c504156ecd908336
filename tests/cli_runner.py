"""The command line in a real child process, without paying Python's and PyTorch's start-up for each run.

``run("check", "builtin", cwd=tmp_path)`` runs what ``python -m tf32lab check builtin`` runs, in a separate process
with its own exit code, signals, stdout and stderr bytes (through pipes, as ``subprocess.run(capture_output=True)``
gives them), and returns the same ``subprocess.CompletedProcess``. The process is forked from a server that this
test worker started once and that has imported torch and tf32lab (a zygote, as Android's, or the ``forkserver``
start method of :mod:`multiprocessing` with a preload): each run then costs the command's own work, not the 2-3 CPU
seconds of importing torch. Nothing in the server runs a torch operation before it forks: OpenMP's thread pool does
not survive a fork, and a child of a process that started it hangs in its first parallel region.

What the server read at its start, its child reads too. So a run gets a fresh interpreter (``fresh=True``, or by
itself) when its environment differs from the server's in a variable that Python, PyTorch, OpenMP, numba or CUDA
read at start-up (``PYTHON*`` but ``PYTHONPATH``, ``TORCH*``, ``OMP_*``...), when its ``PYTHONPATH`` would import
another torch or tf32lab than the server's, when its working directory (or ``PYTHONPATH``) holds another copy of a
module the server imported, or when a test means the genuine entry point (the console script, ``-m``
as Python runs it, Ctrl-C). Children share the server's hash seed (a fresh interpreter draws one per run); Python's
and numpy's global random generators are reseeded in each child, and torch's is still at its start-up seed.

Forked runs are children of the server, not of the test worker, so the worker's ``RUSAGE_CHILDREN`` does not see
them: :func:`forked_cpu_seconds` adds them up (and the server's own start) for ``--cpu-durations`` (conftest.py).

A run's stdout or stderr may be a file the test opened (``/dev/full``, a file a link names) or :data:`CLOSED`
(the descriptor closed, as ``>&-`` leaves it): the child gets that very descriptor, as ``subprocess.run(stdout=f)``
gives it. A test that needs its runs in another mount namespace (a tiny tmpfs) starts a server of its own there:
``with cli_runner.server(["unshare", "-rm", ...]) as inside: cli_runner.run(..., server=inside)``."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Any

# read once, at start-up, by the interpreter or a library the server has imported: a run that changes one of these
# needs a fresh interpreter to see it
_READ_AT_START = re.compile(r"^(PYTHON(?!PATH$)|TORCH|PYTORCH|OMP_|KMP_|GOMP_|MKL|OPENBLAS|NUMBA_|CUDA|NVIDIA|"
                            r"LD_|MALLOC|ATEN|DNNL|ONEDNN|XLA|HF_|TRANSFORMERS|TOKENIZERS|LC_|LANG$)")
# what the commands import as they run (tf32lab imports lazily), so that each run pays its own work only: a check
# of a small model costs 0.1 CPU seconds instead of 0.5
_PRELOAD = ("torch", "numpy", "tf32lab", "tf32lab.cli", "rich.console", "jinja2", "tf32lab.workloads.specs",
            "tf32lab.measure.check", "tf32lab.measure.training", "tf32lab.report.text", "tf32lab.report.html",
            "tf32lab.report.training", "tf32lab.report.tune_html", "tf32lab.decide.tune", "tf32lab.machine.doctor")
# what a run of an ``hf:`` folder or of all-MiniLM-L6-v2 imports beyond the above (``run(preload=HF)``): transformers
# (with Dynamo and Inductor) costs about 4.5 CPU seconds a process, sentence-transformers 0.9 more; a server of its own
# imports them once, the default one never (tests check that a run imports neither)
HF = ("transformers", "transformers.modeling_utils", "sentence_transformers")
CLOSED = "closed"  # a run's stdout or stderr closed, as `>&-` leaves it

_servers: dict[tuple[str, ...], _Server] = {}
_forked_cpu = 0.0


def forked_cpu_seconds() -> float:
    """CPU seconds of the forked runs so far, and of the server's start, in this process."""
    return _forked_cpu


def run(*args: str, cwd: str | Path | None = None, env: dict[str, str] | None = None, timeout: float = 300,
        module: str = "tf32lab", fresh: bool = False, input: str | None = None, stdout: Any = None,
        stderr: Any = None, server: _Server | None = None,
        preload: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``python -m <module> <args>`` in ``cwd`` with ``env`` (default: this process's), its output as text.

    ``stdout``/``stderr``: None (captured), an open file or a file descriptor (the child writes to it; not
    captured), or :data:`CLOSED`.
    ``server``: one from :func:`server`, which runs every run it is given (never a fresh interpreter instead).
    ``preload``: modules the run would import anyway (:data:`HF`), imported once by a server of this worker's that
    has imported them besides the default's: for runs that mean to import them, never for one that checks what a
    run imports."""
    cmd = [sys.executable, "-m", module, *args]
    env = dict(os.environ if env is None else env)
    where = str(Path(cwd or os.getcwd()).resolve())
    if server is not None:
        if fresh or not server.can_run(env, where):
            raise ValueError("this server cannot run that: its child would not be what a fresh interpreter runs")
        return server.run(cmd, module, list(args), where, env, timeout, input, stdout, stderr)
    server = None if fresh else _the_server(preload)
    if server is None or not server.can_run(env, where):
        closed = [fd for fd, stream in ((1, stdout), (2, stderr)) if stream is CLOSED]
        pipe = [subprocess.PIPE if stream is None else None if stream is CLOSED else stream
                for stream in (stdout, stderr)]
        return subprocess.run(cmd, stdout=pipe[0], stderr=pipe[1], text=True, cwd=cwd, env=env, timeout=timeout,
                              input=input, preexec_fn=(lambda: [os.close(fd) for fd in closed]) if closed else None)
    return server.run(cmd, module, list(args), where, env, timeout, input, stdout, stderr)


@contextlib.contextmanager
def server(wrapper: list[str]) -> Iterator[_Server]:
    """A server of its own, started through ``wrapper`` (a command that ends by running its arguments, as
    ``unshare -rm sh -c 'mount ...; exec "$0" "$@"'`` does), so that its children share what the wrapper set up."""
    own = _Server(wrapper)
    try:
        yield own
    finally:
        own.close()


def _the_server(preload: tuple[str, ...] = ()) -> _Server | None:
    """This process's server (of those ``preload`` modules), started anew where this process's environment has
    changed since in a variable read at start-up: importing sentence-transformers sets ``KMP_DUPLICATE_LIB_OK``,
    ``KMP_INIT_AT_FORK`` and ``TORCHINDUCTOR_CACHE_DIR``, and a worker that imported it after its server started
    sent every later run to a fresh interpreter (a suite's CPU time nearly doubled)."""
    found = _servers.get(preload)
    if found is not None and found.alive() and not found.can_run(dict(os.environ), found.cwd):
        found.close()
        found = None
    if found is None or not found.alive():
        found = _servers[preload] = _Server(preload=preload)
    return found


class _Server:
    def __init__(self, wrapper: list[str] | tuple[str, ...] = (), preload: tuple[str, ...] = ()) -> None:
        global _forked_cpu
        self.env = dict(os.environ)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (the server's output while it lives)
        self.cwd = os.path.dirname(os.path.abspath(__file__))
        self.process = subprocess.Popen([*wrapper, sys.executable, __file__, str(theirs.fileno()), *preload],
                                        pass_fds=[theirs.fileno()], cwd=self.cwd,
                                        stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log, env=self.env)
        theirs.close()
        self.sock = ours
        hello = self.sock.recv(1 << 20)
        if not hello:
            self.process.wait()
            self.log.seek(0)
            raise RuntimeError(f"the CLI's fork server did not start: {self.log.read().decode(errors='replace')}")
        hello = json.loads(hello)
        self.sys_path, self.origins = hello["sys_path"], hello["origins"]
        self.imported: dict[str, str] = hello["imported"]  # top-level modules the server imported: their files
        self.set_by_imports: dict[str, str] = hello["set_by_imports"]  # each child sets them where it lacks them
        _forked_cpu += hello["cpu"]

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        """Stop the server: it ends when its socket closes."""
        self.sock.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()

    def child_path(self, env: dict[str, str], cwd: str) -> list[str]:
        """sys.path as ``python -m`` in ``cwd`` with ``env`` would have it."""
        ours = [p for p in self.env.get("PYTHONPATH", "").split(os.pathsep) if p]
        rest = list(self.sys_path[1:])
        for entry in ours:  # the server's own PYTHONPATH entries come right after its sys.path[0]
            if rest and rest[0] == os.path.abspath(entry):
                rest.pop(0)
        return [*self.first_path(env, cwd), *rest]

    @staticmethod
    def first_path(env: dict[str, str], cwd: str) -> list[str]:
        """The folders ``python -m`` in ``cwd`` with ``env`` puts before the installed packages."""
        theirs = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        return [cwd, *(os.path.abspath(os.path.join(cwd, p)) for p in theirs)]

    def can_run(self, env: dict[str, str], cwd: str) -> bool:
        keys = {k for k in (*env, *self.env) if _READ_AT_START.match(k)}
        # a variable the preloaded imports set is, in a fresh interpreter, set by the same imports where the
        # environment lacks it: a worker that has since imported sentence-transformers itself (KMP_*) still forks
        implied = self.set_by_imports
        if any(env.get(k, implied.get(k)) != self.env.get(k, implied.get(k)) for k in keys):
            return False
        if self._shadowed(self.first_path(env, cwd)):
            return False
        if env.get("PYTHONPATH", "") == self.env.get("PYTHONPATH", ""):
            return True
        # another PYTHONPATH is fine while it finds the very torch and tf32lab the server imported
        path = self.child_path(env, cwd)
        for name, origin in self.origins.items():
            spec = PathFinder.find_spec(name, path)
            if spec is None or spec.origin != origin:
                return False
        return True

    def _shadowed(self, folders: list[str]) -> bool:
        """Whether a folder the child's sys.path puts first holds another copy of a module the server imported
        (a fresh interpreter would import the folder's: the run's cwd first, as ``-m`` puts it)."""
        for folder in folders:
            try:
                names = {entry.split(".")[0] for entry in os.listdir(folder)} & self.imported.keys()
            except OSError:
                continue
            for name in names:
                spec = PathFinder.find_spec(name, [folder])
                if spec is not None and spec.origin is not None and spec.origin != self.imported[name]:
                    return True
        return False

    def run(self, cmd, module, args, cwd, env, timeout, input, stdout=None, stderr=None) -> subprocess.CompletedProcess:
        global _forked_cpu
        in_r, in_w = os.pipe() if input is not None else (os.open(os.devnull, os.O_RDONLY), None)
        given: list[int] = [in_r]  # the child's fds 0, 1, 2 (but closed ones), ours to close once sent
        chunks: dict[int, list[bytes]] = {}
        readers: list[int | None] = []
        for stream in (stdout, stderr):
            if stream is None:  # captured through a pipe
                read, write = os.pipe()
                chunks[read] = []
                readers.append(read)
                given.append(write)
            else:
                readers.append(None)
                if stream is not CLOSED:
                    given.append(os.dup(stream if isinstance(stream, int) else stream.fileno()))
        closed = [fd for fd, stream in ((1, stdout), (2, stderr)) if stream is CLOSED]
        request = {"module": module, "argv": args, "cwd": cwd, "env": env, "path": self.child_path(env, cwd),
                   "closed": closed}
        socket.send_fds(self.sock, [json.dumps(request).encode()], given)
        for fd in given:
            os.close(fd)
        pid = json.loads(self.sock.recv(1 << 16))["pid"]
        if in_w is not None:
            try:
                os.write(in_w, input.encode())
            finally:
                os.close(in_w)
        deadline = time.monotonic() + timeout
        killed = False
        with selectors.DefaultSelector() as selector:
            for fd in chunks:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                left = deadline - time.monotonic()
                if left <= 0 and not killed:
                    os.kill(pid, signal.SIGKILL)
                    killed = True
                for key, _ in selector.select(timeout=max(left, 0.1) if not killed else 1):
                    data = os.read(key.fd, 1 << 16)
                    if data:
                        chunks[key.fd].append(data)
                    else:
                        selector.unregister(key.fd)
                        os.close(key.fd)
        done = json.loads(self.sock.recv(1 << 16))
        _forked_cpu += done["cpu"]
        out, err = (None if fd is None else b"".join(chunks[fd]).decode(errors="replace") for fd in readers)
        if killed:
            raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err)
        return subprocess.CompletedProcess(cmd, done["returncode"], out, err)


# -- the server ------------------------------------------------------------------------------------------------------
def _serve(fd: int, preload: tuple[str, ...] = ()) -> None:
    import importlib
    import importlib.util

    start = time.process_time()
    said = (io.StringIO(), io.StringIO())  # what the imports print, each child prints again (as a fresh one would)
    before = dict(os.environ)
    with contextlib.redirect_stdout(said[0]), contextlib.redirect_stderr(said[1]):
        for name in _PRELOAD:  # imports only: no torch operation may run before a fork
            importlib.import_module(name)
        for name in preload:  # those installed (the test extra alone has transformers, not sentence-transformers)
            if importlib.util.find_spec(name.split(".")[0]) is not None:
                importlib.import_module(name)
    # what the imports set in the environment (sentence-transformers' KMP_*, Inductor's TORCHINDUCTOR_CACHE_DIR),
    # each child sets again where its own environment lacks it, as a fresh interpreter's imports would
    set_by_imports = {k: v for k, v in os.environ.items() if k not in before}
    sock = socket.socket(fileno=fd)
    origins = {name: sys.modules[name].__spec__.origin for name in ("torch", "tf32lab")}
    imported = {name: m.__spec__.origin for name, m in list(sys.modules.items())
                if "." not in name and getattr(m, "__file__", None) and getattr(m, "__spec__", None)}
    sock.send(json.dumps({"sys_path": sys.path, "origins": origins, "imported": imported,
                          "set_by_imports": set_by_imports, "cpu": time.process_time() - start}).encode())
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
        except OSError:
            return
        if not message:  # the test worker has gone
            return
        pid = os.fork()
        if pid == 0:
            sock.close()
            _child(json.loads(message), fds, said=(said[0].getvalue(), said[1].getvalue()),
                   set_by_imports=set_by_imports)
        for child_fd in fds:
            os.close(child_fd)
        sock.send(json.dumps({"pid": pid}).encode())
        _, status, usage = os.wait4(pid, 0)
        sock.send(json.dumps({"returncode": _returncode(status), "cpu": usage.ru_utime + usage.ru_stime}).encode())


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _child(request: dict, fds: list[int], said: tuple[str, str], set_by_imports: dict[str, str] | None = None) -> None:
    """Become ``python -m <module> <argv>``: never returns."""
    import atexit
    import random
    import runpy
    import threading
    import traceback

    code = 1
    try:
        closed = request.get("closed", [])
        for fd, target in zip(fds, [t for t in (0, 1, 2) if t not in closed]):
            os.dup2(fd, target)
            os.close(fd)
        for target in closed:
            os.close(target)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for key, value in (set_by_imports or {}).items():
            os.environ.setdefault(key, value)
        sys.path[:] = request["path"]
        # the streams a fresh interpreter would open on fds 0-2, open until the child ends
        sys.stdin = sys.__stdin__ = open(0, closefd=False, encoding=sys.stdin.encoding, errors=sys.stdin.errors)  # noqa: SIM115
        # (None where the fd is closed, as Python leaves sys.stdout when it starts with fd 1 closed), buffered as
        # Python buffers them: PYTHONUNBUFFERED (the same in the server) writes through, to unbuffered files
        sys.stdout = sys.__stdout__ = None if 1 in closed else _stream(1, sys.stdout.encoding, sys.stdout.errors)
        sys.stderr = sys.__stderr__ = None if 2 in closed else _stream(2, sys.stderr.encoding, "backslashreplace")
        for stream, text in zip((sys.stdout, sys.stderr), said):
            if stream is not None and text:
                with contextlib.suppress(OSError):  # as a warning printed to a full stderr is dropped
                    stream.write(text)
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        sys.argv = ["-m", *request["argv"]]
        # as ``-m`` does: the module runs as __main__, and anything importing it by name imports it anew; of a
        # package, that module is its __main__ (the package itself is imported once: popped, a second package
        # object would lack the submodules the server imported, and ``import tf32lab.errors`` not attach them)
        name = request["module"]
        if hasattr(sys.modules.get(name), "__path__"):
            name += ".__main__"
        sys.modules.pop(name, None)
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit_:
            if exit_.code is None:
                code = 0
            elif isinstance(exit_.code, int):
                code = exit_.code
            else:
                print(exit_.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            traceback.print_exc()
            _flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # as Python ends on an unhandled Ctrl-C
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        threading._shutdown()  # as at a normal exit: wait for the threads that are not daemons, then atexit
        atexit._run_exitfuncs()
        if not _flush():
            code = 120  # Python's own exit code when stdout cannot be flushed at exit
    except BaseException:  # the runner's own failure: said on the child's stderr, never lost
        os.write(2, traceback.format_exc().encode())
    finally:
        os._exit(code)


def _stream(fd: int, encoding: str, errors: str) -> io.TextIOWrapper:
    """The stream Python opens on fd 1 or 2: named and buffered as its own (stderr line-buffered, stdout only on a
    terminal; PYTHONUNBUFFERED, the same in the server, writes through to an unbuffered file)."""
    if os.environ.get("PYTHONUNBUFFERED"):
        stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=encoding, errors=errors,
                                  write_through=True)
        stream.mode = "w"
    else:
        stream = open(fd, "w", closefd=False, encoding=encoding, errors=errors, buffering=1 if fd == 2 else -1)  # noqa: SIM115
    getattr(stream.buffer, "raw", stream.buffer).name = "<stdout>" if fd == 1 else "<stderr>"
    return stream


def _flush() -> bool:
    """Flush stdout and stderr as Python does at exit: False (exit code 120) when either fails, and a failed stdout
    said on stderr."""
    ok = True
    for stream in (sys.stdout, sys.stderr):
        if stream is None:
            continue
        try:
            stream.flush()
        except Exception as exc:
            ok = False
            if stream is sys.stdout and sys.stderr is not None:
                with contextlib.suppress(Exception):
                    sys.stderr.write(f"Exception ignored in: {stream!r}\n{type(exc).__name__}: {exc}\n")
                    sys.stderr.flush()
    return ok


if __name__ == "__main__":
    _serve(int(sys.argv[1]), tuple(sys.argv[2:]))
