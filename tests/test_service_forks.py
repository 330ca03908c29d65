"""The service's template process (preprocess_service/forks.py), driven as the supervisor and the preflight pool drive
it: children forked with the heavy libraries already imported, pipes as their stdin / stdout, exit codes and signals
reported as ``Popen.returncode``, a session and a memory limit applied, and nothing left behind when the service
process dies. The service's own tests (kill -9, crashed sandboxes, secrets) run every worker and sandbox through it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

PROBE = textwrap.dedent('''
    import json, os, resource, sys
    # what the child found already imported: the template's preloads (a fresh interpreter has none of them)
    preloaded = {m: m in sys.modules for m in ("torch", "datasets", "pf_trl.data.pretokenize")}
    if preloaded["pf_trl.data.pretokenize"]:
        from pf_trl.data.tokenizer import DEFAULT_TOKENIZER, TokenizerCache
        preloaded["tokenizer"] = DEFAULT_TOKENIZER in TokenizerCache()._cache  # loaded before the fork
    mode = sys.argv[1]
    if mode == "echo":
        line = sys.stdin.readline()
        print(json.dumps({"line": line.strip(), "preloaded": preloaded, "pid": os.getpid(), "ppid": os.getppid(),
                          "sid": os.getsid(0), "as_limit": resource.getrlimit(resource.RLIMIT_AS)[0],
                          "argv": sys.argv[1:], "env": os.environ.get("PROBE_ENV")}), flush=True)
        sys.exit(int(sys.argv[2]))
    if mode == "wait":
        print("waiting", flush=True)
        for line in sys.stdin:  # until stdin closes, like a preflight sandbox
            pass
    if mode == "raise":
        raise RuntimeError("probe failed")
''')


@pytest.fixture
def forks(tmp_path):
    from preprocess_service.forks import ForkServer

    (tmp_path / "forkprobe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]), "PROBE_ENV": "from-template"}
    server = ForkServer(env)
    yield server
    server.stop()


def _echo(server, code: int = 0, **kw):
    proc = server.spawn("forkprobe", ["echo", str(code)], stdin=True, stdout=True, **kw)
    proc.stdin.write(b"hello\n")
    proc.stdin.flush()
    answer = json.loads(proc.stdout.readline())
    return proc, answer


@pytest.mark.slow
def test_children_start_preloaded_with_their_pipes_exit_codes_and_limits(forks):
    proc, answer = _echo(forks, 0)
    assert answer["line"] == "hello" and answer["argv"] == ["echo", "0"] and answer["env"] == "from-template"
    assert answer["preloaded"] == {"torch": True, "datasets": True, "pf_trl.data.pretokenize": True, "tokenizer": True}
    assert answer["ppid"] == forks.pid and answer["pid"] == proc.pid
    assert answer["sid"] != proc.pid and answer["as_limit"] == -1  # no session nor limit unless asked
    assert proc.wait(30) == 0 and proc.poll() == 0

    proc, answer = _echo(forks, 3, session=True, memory_bytes=8 * 2**30, name="pf-probe")
    assert answer["sid"] == proc.pid and answer["as_limit"] == 8 * 2**30
    assert proc.wait(30) == 3

    failing = forks.spawn("forkprobe", ["raise"])
    assert failing.wait(30) == 1  # an uncaught exception: exit code 1, as `python -m` gives

    waiting = forks.spawn("forkprobe", ["wait"], stdin=True, stdout=True)
    assert waiting.stdout.readline() == b"waiting\n"
    with pytest.raises(subprocess.TimeoutExpired):
        waiting.wait(0.3)
    waiting.send_signal(signal.SIGSEGV)
    assert waiting.wait(30) == -signal.SIGSEGV  # a signal: negative, as Popen.returncode
    waiting.kill()  # after the exit: a no-op, never a signal to a reused pid


@pytest.mark.slow
def test_the_template_leaves_with_the_service_and_takes_its_children_along(tmp_path):
    """A process owning a ForkServer (the service) is SIGKILLed: the template and a child waiting on its stdin
    (as an idle preflight sandbox does) are gone within seconds. Control: while the owner lives, both run."""
    (tmp_path / "forkprobe.py").write_text(PROBE)
    owner_code = textwrap.dedent(f'''
        import os, sys, time
        sys.path.insert(0, {str(REPO)!r})
        from preprocess_service.forks import ForkServer
        env = {{**os.environ, "PYTHONPATH": {str(tmp_path)!r} + os.pathsep + {str(REPO)!r}}}
        server = ForkServer(env)
        child = server.spawn("forkprobe", ["wait"], stdin=True, stdout=True)
        assert child.stdout.readline() == b"waiting\\n"
        print(server.pid, child.pid, flush=True)
        time.sleep(600)
    ''')
    owner = subprocess.Popen([sys.executable, "-c", owner_code], stdout=subprocess.PIPE, text=True)
    try:
        template_pid, child_pid = map(int, owner.stdout.readline().split())
        time.sleep(1.0)
        assert _alive(template_pid) and _alive(child_pid)
        owner.kill()
        owner.wait()
        deadline = time.time() + 20
        while (_alive(template_pid) or _alive(child_pid)) and time.time() < deadline:
            time.sleep(0.1)
        assert not _alive(template_pid) and not _alive(child_pid)
    finally:
        if owner.poll() is None:
            owner.kill()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_a_dead_template_is_replaced_and_its_children_reported_dead(forks):
    waiting = forks.spawn("forkprobe", ["wait"], stdin=True, stdout=True)
    assert waiting.stdout.readline() == b"waiting\n"
    first = forks.pid
    os.kill(first, signal.SIGKILL)
    assert waiting.wait(30) == -signal.SIGKILL
    deadline = time.time() + 10
    while _alive(waiting.pid) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(waiting.pid)
    proc, answer = _echo(forks, 0)  # the next spawn starts a new template
    assert forks.pid not in (None, first) and answer["ppid"] == forks.pid
    assert proc.wait(30) == 0
