"""The service's worker and preflight processes, forked from one pre-imported template process.

A worker or a preflight sandbox imports torch, transformers, datasets and pandas before it can tokenize: ~4 s of CPU
and a few hundred MB of private memory per process, paid again for every replacement (a sandbox that crashed or
overran, a worker killed by a DELETE or the out-of-memory killer). So the service starts one template process per
replica, with the children's environment (no secret: :mod:`preprocess_service.jobs`), which imports those libraries
once; each worker and sandbox is then forked from it: ready in milliseconds, the imported code's memory shared.

The template runs no Python thread (``fork`` copies only the calling thread: a lock another thread held would stay
locked in the child forever; the one native thread, pyarrow's jemalloc background thread, is fork-safe: jemalloc
holds its own locks across a fork) and never tokenizes (the tokenizers library's thread pool must not exist before a
fork); it loads the embedded tokenizer, which starts no thread. It reaps its children and reports how each ended,
and leaves when the service process that started it is gone. A child sees the pipes the service gave it as its
stdin / stdout; what it runs is a module as ``python -m`` would.

Messages are JSON datagrams on a Unix ``SOCK_SEQPACKET`` socket pair (a spawn request carries the child's pipe ends
as ``SCM_RIGHTS``): ``{"ready": pid}``, ``{"op": "spawn", "id", "module", "argv", "fds", "session", "memory_bytes",
"name"}`` answered by ``{"id", "pid"}`` (or ``{"id", "error"}``), and ``{"exited": pid, "code"}`` (``code`` as
``Popen.returncode``: negative for a signal).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import Any

from pf_trl.errors import PfTrlError

logger = logging.getLogger("preprocess_service")

# What every worker and sandbox imports before its first job: loaded once, in the template.
PRELOAD = (
    "torch",
    "transformers.models.auto.tokenization_auto",
    "datasets",
    "datasets.load",  # load_dataset's packaged builders (json, csv, parquet) and pandas
    "pyarrow.parquet",
    "pf_trl.data.pretokenize",
    "preprocess_service.worker",
    "preprocess_service.preflight",
)
_MAX_MESSAGE = 1 << 16
_START_TIMEOUT_S = 300.0  # the template's imports: seconds, minutes on a loaded node


class ForkServerError(PfTrlError, OSError):
    """The template process could not be started, or could not fork a child."""


class ForkedProcess:
    """A child of the template, with the part of :class:`subprocess.Popen`'s interface the service uses: ``pid``,
    ``stdin`` / ``stdout`` (binary pipes, when asked for), ``poll``, ``wait``, ``send_signal``, ``terminate``,
    ``kill`` and ``returncode`` (negative: the signal that ended it)."""

    def __init__(self, server: ForkServer, pid: int, stdin=None, stdout=None):
        self._server, self.pid, self.stdin, self.stdout = server, pid, stdin, stdout
        self.returncode: int | None = None
        self.args = [f"<forked pid {pid}>"]

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._server._cond:
            if not self._server._cond.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        # Until the template reports the exit, the pid is its unreaped child (a zombie at worst): never reused.
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The template process of one service replica: started on the first :meth:`spawn` (and again if it died),
    stopped by :meth:`stop`. Thread-safe."""

    def __init__(self, env: dict[str, str]):
        self.env = dict(env)
        self._lock = threading.Lock()  # one start-up and one request at a time on the socket
        self._cond = threading.Condition()  # replies, exits
        self._sock: socket.socket | None = None
        self._popen: subprocess.Popen | None = None
        self._replies: dict[int, dict[str, Any]] = {}
        self._children: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}  # exits reported before the spawning thread registered the child
        self._next_id = 0
        self._stopped = False

    @property
    def pid(self) -> int | None:
        """The template's pid while it runs."""
        return self._popen.pid if self._popen is not None and self._popen.poll() is None else None

    def spawn(self, module: str, argv: list[str], *, stdin: bool = False, stdout: bool = False,
              session: bool = False, memory_bytes: int = 0, name: str | None = None) -> ForkedProcess:
        """Fork a child that runs ``python -m module *argv``; ``stdin`` / ``stdout``: a pipe from / to this process
        (``proc.stdin`` / ``proc.stdout``); ``session``: its own session and process group; ``memory_bytes``: its
        address-space limit (0: none), no core dumps; ``name``: its process name as ``ps -o comm`` shows it."""
        ours, theirs, targets = {}, [], []
        if stdin:
            r, w = os.pipe()
            theirs.append(r)
            targets.append(0)
            ours["stdin"] = os.fdopen(w, "wb")
        if stdout:
            r, w = os.pipe()
            theirs.append(w)
            targets.append(1)
            ours["stdout"] = os.fdopen(r, "rb")
        try:
            with self._lock:
                self._ensure_running()
                self._next_id += 1
                rid = self._next_id
                request = {"op": "spawn", "id": rid, "module": module, "argv": list(argv), "fds": targets,
                           "session": session, "memory_bytes": int(memory_bytes or 0), "name": name}
                try:
                    socket.send_fds(self._sock, [json.dumps(request).encode()], theirs)
                except OSError as exc:
                    raise ForkServerError(f"the service's template process is gone ({exc})") from exc
                with self._cond:
                    if not self._cond.wait_for(lambda: rid in self._replies or self._sock is None, 60):
                        raise ForkServerError("the service's template process did not answer a spawn request")
                    reply = self._replies.pop(rid, None)
                    if reply is None:
                        raise ForkServerError("the service's template process died")
                    if "error" in reply:
                        raise ForkServerError(f"could not fork a {module} process: {reply['error']}")
                    proc = ForkedProcess(self, reply["pid"], **ours)
                    if proc.pid in self._early_exits:
                        proc.returncode = self._early_exits.pop(proc.pid)
                    else:
                        self._children[proc.pid] = proc
                    return proc
        except BaseException:
            for f in ours.values():
                f.close()
            raise
        finally:
            for fd in theirs:
                os.close(fd)

    def _ensure_running(self) -> None:
        if self._sock is not None and self._popen is not None and self._popen.poll() is None:
            return
        if self._stopped:
            raise ForkServerError("the service is stopping")
        self._close_socket()
        here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._popen = subprocess.Popen(
                [sys.executable, "-m", "preprocess_service.forks", str(there.fileno()), str(os.getpid())],
                env=self.env, pass_fds=(there.fileno(),), stdin=subprocess.DEVNULL, close_fds=True)
        finally:
            there.close()
        here.settimeout(_START_TIMEOUT_S)
        try:
            ready = here.recv(_MAX_MESSAGE)
        except OSError:
            ready = b""
        if not ready:
            here.close()
            code = self._popen.poll()
            if code is None:
                self._popen.kill()
                code = self._popen.wait()
            raise ForkServerError(f"the service's template process did not start (exit code {code}); its error is "
                                  "in the service's log")
        here.settimeout(None)
        self._sock = here
        logger.info("template process started (pid %d)", json.loads(ready)["ready"])
        threading.Thread(target=self._read, args=(here,), daemon=True, name="pf-forks").start()

    def _read(self, sock: socket.socket) -> None:
        while True:
            try:
                data = sock.recv(_MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            msg = json.loads(data)
            with self._cond:
                if "exited" in msg:
                    proc = self._children.pop(msg["exited"], None)
                    if proc is None:
                        self._early_exits[msg["exited"]] = msg["code"]
                    else:
                        proc.returncode = msg["code"]
                else:
                    self._replies[msg["id"]] = msg
                self._cond.notify_all()
        # The template is gone: its children cannot be reaped from here any more. Each is killed (a worker would
        # leave by itself on seeing its parent change; a sandbox not before its stdin closes) and reported dead.
        with self._cond:
            if self._sock is sock:
                self._sock = None
            orphans, self._children = list(self._children.values()), {}
            for proc in orphans:
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.returncode = -signal.SIGKILL
            self._cond.notify_all()
        if orphans and not self._stopped:
            logger.error("the template process died; %d of its processes were stopped and are replaced",
                         len(orphans))

    def _close_socket(self) -> None:
        with self._cond:
            sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the template (after its children: stop those first). It leaves when its socket closes."""
        with self._lock:
            self._stopped = True
            self._close_socket()
            if self._popen is not None:
                try:
                    self._popen.wait(timeout)
                except subprocess.TimeoutExpired:
                    self._popen.kill()
                    self._popen.wait()


# ------------------------------------------------------------------------------------------------ the template
def _preload() -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # a child that needs it fails with the reason, as it would have started alone
            logger.exception("template: could not import %s", name)
    try:  # the embedded tokenizer every worker and sandbox loads first (loading starts no thread)
        from pf_trl.data.tokenizer import DEFAULT_TOKENIZER, TokenizerCache

        TokenizerCache.seed(DEFAULT_TOKENIZER)
    except Exception:
        logger.exception("template: could not load the embedded tokenizer")


def _set_name(name: str) -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME: what ps -o comm and top show
    except Exception:
        pass


def _child(sock: socket.socket, wakeup: tuple[int, int], request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: become ``python -m module argv`` with the given pipes; never returns."""
    code = 1
    try:
        sock.close()
        signal.set_wakeup_fd(-1)
        for fd in wakeup:
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd, target in zip(fds, request["fds"]):
            os.dup2(fd, target)
            os.close(fd)
        if request.get("session"):
            os.setsid()
        if request.get("memory_bytes"):
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (request["memory_bytes"], request["memory_bytes"]))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if request.get("name"):
            _set_name(request["name"])
        root = logging.getLogger()  # the child configures its own logging, as a fresh process would
        for handler in list(root.handlers):
            root.removeHandler(handler)
        root.setLevel(logging.WARNING)
        import runpy

        sys.argv = [request["module"], *request["argv"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _send(sock: socket.socket, msg: dict[str, Any]) -> bool:
    try:
        sock.send(json.dumps(msg).encode())
        return True
    except OSError:
        return False


def _reap(sock: socket.socket) -> bool:
    """Report every child that ended; False when the service's end of the socket is gone."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid == 0:
            return True
        if not _send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)}):
            return False


def serve(fd: int, parent_pid: int) -> int:
    """The template's loop: fork on request, report exits, leave when the service is gone."""
    import selectors

    sock = socket.socket(fileno=fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the service, which stops everything in order
    _preload()
    wakeup = os.pipe()
    os.set_blocking(wakeup[0], False)
    os.set_blocking(wakeup[1], False)
    signal.set_wakeup_fd(wakeup[1])
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a child's exit wakes the loop up (through the wakeup pipe)
    if not _send(sock, {"ready": os.getpid()}):
        return 1
    with selectors.DefaultSelector() as sel:
        sel.register(sock, selectors.EVENT_READ, "request")
        sel.register(wakeup[0], selectors.EVENT_READ, "exit")
        while os.getppid() == parent_pid:
            if not _reap(sock):
                return 0
            for key, _ in sel.select(0.5):
                if key.data == "exit":
                    try:
                        os.read(wakeup[0], 4096)
                    except BlockingIOError:
                        pass
                    continue
                try:
                    data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 8)
                except OSError:
                    return 0
                if not data:
                    return 0  # the service closed its end: stopping
                request = json.loads(data)
                sys.stdout.flush()
                sys.stderr.flush()
                try:
                    pid = os.fork()
                except OSError as exc:
                    for f in fds:
                        os.close(f)
                    _send(sock, {"id": request["id"], "error": str(exc)})
                    continue
                if pid == 0:
                    _child(sock, wakeup, request, fds)
                for f in fds:
                    os.close(f)
                _send(sock, {"id": request["id"], "pid": pid})
    return 0  # the service process is gone: its children see their parent change and leave too


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s template %(levelname)s %(message)s")
    sys.exit(serve(int(sys.argv[1]), int(sys.argv[2])))
