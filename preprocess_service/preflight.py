"""The synchronous checks of ``POST /v1/datasets`` that read what a client names, in a sandboxed process.

The API process never parses client data: a row nested 20,000 deep crashes Arrow's JSON reader, a 200 MB line is
held whole by every reader, a hostile tokenizer folder can hold anything. The API only resolves paths (``stat``)
and streams bytes into a hash; everything that parses runs here, in ``python -m preprocess_service.preflight``
processes (forked from the replica's template process, :mod:`preprocess_service.forks`), each in its own session,
under an address-space limit (``RLIMIT_AS``, ``--preflight-memory``) and given at most ``--preflight-timeout-s``
per request. A sandbox that crashes, runs out of memory or time is replaced; the request that did it gets a 422
naming what happened, and the API answers the next one.

Protocol: one JSON request per line on the sandbox's stdin, one JSON answer per line on a private pipe (its
stdout; stray prints of libraries go to stderr). Requests (``op``):

- ``tokenizer`` ``{name}`` -> ``{fingerprint}``: load a tokenizer (local files, no remote code) and fingerprint it;
- ``identify`` ``{path}`` -> ``{sha256, size}``: a ``save_to_disk`` folder's content hash, after checking that every
  data file its ``state.json`` names lies inside it;
- ``preflight`` ``{path, shown, tokenizer, options, rows, limits}`` -> ``{rows_total}``: the source's files and
  limits, then its first ``rows`` rows through the real ``pretokenize()``.

An error answer is ``{"error": {"status", "kind", "field", "detail"}}``, raised in the API as a ServiceError.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from pf_trl.errors import PfTrlError

logger = logging.getLogger("preprocess_service.preflight")


# ------------------------------------------------------------------------------ inside the sandbox
class _Refusal(PfTrlError):
    def __init__(self, status: int, kind: str, field: str, detail: str):
        super().__init__(detail)
        self.answer = {"error": {"status": status, "kind": kind, "field": field, "detail": detail}}


def _unprocessable(field: str, detail: str, kind: str) -> _Refusal:
    return _Refusal(422, kind, field, detail)


HEAD_SUFFIXES = (".json", ".jsonl", ".parquet")
"""Source formats whose first rows the preflight cuts out and tokenizes (a CSV is checked by the job)."""

class _Sandbox:
    """Request handlers; tokenizers are cached per name and the status of their files."""

    def __init__(self, scratch: Path):
        from pf_trl.data.tokenizer import TokenizerCache

        self.scratch = scratch
        self._tokenizers = TokenizerCache()

    def _tokenizer(self, name: str):
        from pf_trl.data.tokenizer import TokenizerLoadError

        shown = name
        try:
            return self._tokenizers.get(name)  # local files only, trust_remote_code=False
        except TokenizerLoadError as exc:
            if "trust_remote_code" in str(exc) or "custom code" in str(exc):
                raise _unprocessable("tokenizer", f"tokenizer: {shown!r} needs custom (remote) code, which this "
                                     "service never executes (trust_remote_code is always off); use a tokenizer "
                                     "folder with a plain tokenizer.json", "unknown-tokenizer") from exc
            raise _unprocessable("tokenizer", f"tokenizer: {exc}", "unknown-tokenizer") from exc
        except Exception as exc:
            raise _unprocessable("tokenizer", f"tokenizer: could not load {shown!r} from local files without remote "
                                 f"code ({type(exc).__name__}: {str(exc)[:300]})", "unknown-tokenizer") from exc

    def op_tokenizer(self, req: dict[str, Any]) -> dict[str, Any]:
        self._tokenizer(req["name"])  # loaded (or refused with the reason) first
        return {"fingerprint": self._tokenizers.fingerprint(req["name"])}

    def op_hub(self, req: dict[str, Any]) -> dict[str, Any]:
        """A Hub dataset's split -> its files in the order ``datasets`` lists them (repository paths, not downloaded:
        the job downloads them, outside this sandbox's time limit), their sizes as the Hub tells them, and the
        repository and commit. The cheap checks only: the revision resolved, the README `configs:` parsed and
        confined (the README the one file fetched), the split's files as ``datasets`` resolves them, each confined to
        the repository and of a suffix the service reads."""
        from pf_trl.data.hub_datasets import HubDatasetError, HubSplitFiles, hub_split_files
        from pf_trl.data.pretokenize import SOURCE_SUFFIXES
        from pf_trl.hub import HubError, file_sizes

        repo_id, split, revision = req["repo_id"], req["split"], req.get("revision")
        try:
            found = hub_split_files(repo_id, config=req.get("config"), data_dir=None, data_files=None,
                                    revision=revision, flag="source.hub")
            if not isinstance(found, HubSplitFiles):  # a dataset saved whole (or the Hub not reached)
                raise _unprocessable("source.hub", f"source.hub {repo_id}: a dataset saved whole (save_to_disk or "
                                     "pf-trl shards) is not read by the service; train it with pf-trl train "
                                     "--dataset_name", "invalid-source")
            files = found.files.get(split)
            if not files:
                raise _unprocessable("source.hub.split", f"source.hub {repo_id}: no {split!r} split (its splits: "
                                     f"{', '.join(found.files) or 'none'})", "invalid-source")
            for name in files:  # each file of the split; the first one the service does not read is named
                if not name.lower().endswith(tuple(SOURCE_SUFFIXES)):
                    raise _unprocessable("source.hub.split", f"source.hub {repo_id}: {name} (of the {split!r} "
                                         "split) is not a file the service reads (suffixes: "
                                         f"{', '.join(SOURCE_SUFFIXES)})", "invalid-source")
            sizes = file_sizes(repo_id, files, repo_type="dataset", commit=found.commit, flag="source.hub")
        except (HubError, HubDatasetError) as exc:
            raise _unprocessable("source.hub", str(exc), "invalid-source") from exc
        return {"files": files, "sizes": sizes,
                "hub": {"repo_id": repo_id, "repo_type": "dataset", "revision": revision, "commit": found.commit}}

    def op_identify(self, req: dict[str, Any]) -> dict[str, Any]:
        from pf_trl.data.pretokenize import source_fingerprint
        from pf_trl.data.source_files import SourceFileError, save_to_disk_files

        path = Path(req["path"])
        try:
            files = save_to_disk_files(path)
        except SourceFileError as exc:
            raise _unprocessable("source.path", f"source.path: {exc}", "invalid-source") from exc
        return {"sha256": source_fingerprint(path), "size": sum(f.stat().st_size for f in files)}

    def op_preflight(self, req: dict[str, Any]) -> dict[str, Any]:
        from pf_trl.data.options import for_service, service_field
        from pf_trl.data.pretokenize import PretokenizeConfig, PretokenizeError, pretokenize
        from pf_trl.data.source_files import SourceFileError, check_source_files
        from pf_trl.data.source_limits import SourceLimitError, SourceLimits, check_source_limits

        path, shown, n = Path(req["path"]), req["shown"], int(req["rows"])
        limits = SourceLimits(**req["limits"])
        config = PretokenizeConfig(**req["options"])
        try:
            check_source_files(path)
            check_source_limits(path, limits, max_rows=n if n > 0 else 1)
        except (SourceFileError, SourceLimitError) as exc:
            raise _unprocessable("source", f"source {shown}: {exc}", "invalid-data") from exc
        rows_total = count_rows(path, deadline=time.monotonic() + float(req.get("count_s", 20.0)))
        suffix = path.suffix.lower()
        if n <= 0 or path.is_dir() or suffix not in HEAD_SUFFIXES:
            return {"rows_total": rows_total}
        tok = self._tokenizer(req["tokenizer"])
        work = self.scratch / f"preflight-{uuid.uuid4().hex}"
        work.mkdir(parents=True)
        head = work / f"head{suffix}"
        try:
            complete = _parquet_head(path, head, n) if suffix == ".parquet" else _jsonl_head(path, head, n)
            if complete is None:
                return {"rows_total": rows_total}  # a JSON array, not line-oriented: checked by the job
            roots = req.get("image_roots")
            pretokenize(head, work / "out", config, tokenizer=tok, progress=False, limits=limits,
                        image_roots=tuple(roots) if roots else (str(path.parent),))
        except PretokenizeError as exc:
            message = for_service(str(exc).replace(str(head), shown))  # the request's field names, not CLI flags
            if message.startswith("no example left") and not complete:
                return {"rows_total": rows_total}  # the first rows alone may all be dropped; the job judges
            field = f"options.{exc.option}" if getattr(exc, "option", None) else (service_field(message) or "source")
            raise _unprocessable(field, f"{field}: {message} (found by the synchronous check of the first {n} rows; "
                                 "nothing was queued)", "invalid-data") from exc
        except SourceFileError as exc:
            raise _unprocessable("source", f"source {shown}: {exc}", "invalid-data") from exc
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return {"rows_total": rows_total}


def count_rows(path: Path, deadline: float | None = None) -> int | None:
    """Rows of a source, where it says so cheaply: Parquet metadata, the non-blank lines of JSON Lines (counted
    in blocks: no line is held whole), the Arrow files of a ``save_to_disk`` folder. None for a JSON array or CSV,
    and when counting would pass ``deadline`` (``time.monotonic()``; the job reports the count as it runs)."""
    try:
        if path.is_dir():
            import datasets

            loaded = datasets.load_from_disk(str(path))
            return loaded.num_rows if isinstance(loaded, datasets.Dataset) else None
        suffix = path.suffix.lower()
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(str(path)).metadata.num_rows
        if suffix in (".jsonl", ".json"):
            with open(path, "rb") as fh:
                if fh.read(4096).lstrip().startswith(b"["):
                    return None
                fh.seek(0)
                rows, open_line = 0, False  # open_line: the line under way holds a non-blank byte
                while block := fh.read(1 << 20):
                    if deadline is not None and time.monotonic() > deadline:
                        return None
                    pieces = block.split(b"\n")
                    for piece in pieces[:-1]:
                        rows += open_line or bool(piece.strip())
                        open_line = False
                    open_line = open_line or bool(pieces[-1].strip())
                return rows + open_line
    except Exception:
        return None
    return None


def _jsonl_head(path: Path, head: Path, n: int) -> bool | None:
    with open(path, "rb") as src:
        if src.read(4096).lstrip().startswith(b"["):
            return None
        src.seek(0)
        rows, complete = 0, True
        with open(head, "wb") as dst:
            for line in src:  # every line here passed max_row_bytes already (check_source_limits)
                dst.write(line)
                if line.strip():
                    rows += 1
                    if rows >= n:
                        complete = src.read(1) == b""
                        break
    return complete


def _parquet_head(path: Path, head: Path, n: int) -> bool:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(str(path))
        batch = next(pf.iter_batches(batch_size=n), None)
    except Exception as exc:
        raise _unprocessable("source", f"source {path.name}: cannot read as Parquet ({str(exc)[:300]})",
                             "invalid-data") from exc
    table = pa.Table.from_batches([batch]) if batch is not None else pf.schema_arrow.empty_table()
    pq.write_table(table, str(head))
    return pf.metadata.num_rows <= n


def _serve(scratch: Path) -> int:
    """The sandbox's loop: the protocol on the pipe that was stdout; stdout itself goes to stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sandbox = _Sandbox(scratch)
    try:  # warm: the imports and the embedded tokenizer cost seconds, once
        import pf_trl.data.pretokenize  # noqa: F401
        from pf_trl.data.tokenizer import DEFAULT_TOKENIZER

        sandbox._tokenizer(DEFAULT_TOKENIZER)
    except Exception:
        logger.exception("preflight warm-up failed")
    out.write(json.dumps({"ready": os.getpid()}) + "\n")
    from pf_trl.hub import one_commit_per_repository

    for line in sys.stdin:
        try:
            req = json.loads(line)
            with one_commit_per_repository():  # a request reads each Hub repository at one commit
                answer = getattr(sandbox, "op_" + req["op"])(req)
        except _Refusal as exc:
            answer = exc.answer
        except MemoryError:
            answer = {"error": {"status": 422, "kind": "invalid-data", "field": "source", "detail": "__memory__"}}
        except Exception as exc:
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
                answer = {"error": {"status": 507, "kind": "insufficient-storage", "field": "source",
                                    "detail": f"the service's disk is full ({exc.strerror}); DELETE old datasets or "
                                    "uploads, or ask the operator for space, then retry"}}
            else:
                logger.exception("preflight request failed")
                answer = {"error": {"status": 422, "kind": "invalid-data", "field": "source",
                                    "detail": f"__failed__{type(exc).__name__}: {str(exc)[:300]}"}}
        out.write(json.dumps(answer) + "\n")
    return 0


# -------------------------------------------------------------------------------------- in the API
class PreflightError(PfTrlError):
    """A sandbox answered with a refusal, crashed, or ran out of time or memory."""

    def __init__(self, status: int, kind: str, field: str, detail: str):
        super().__init__(detail)
        self.status, self.kind, self.field, self.detail = status, kind, field, detail


class _Proc:
    def __init__(self, popen: subprocess.Popen):
        self.popen, self.buffer = popen, b""

    def read_line(self, deadline: float) -> bytes | None:
        """One line from the sandbox, or None on EOF; raises TimeoutError at ``deadline``."""
        fd = self.popen.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self.buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise TimeoutError
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return None
                self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line


class PreflightPool:
    """``size`` sandbox processes; a request borrows one, a broken one is replaced."""

    def __init__(self, settings, env: dict[str, str], forks=None):
        from preprocess_service.forks import ForkServer

        self.settings = settings
        # sandboxes are forked from the replica's template process; without one given, the pool has its own
        self._own_forks = forks is None
        self.forks = forks if forks is not None else ForkServer(env)
        self.size = settings.preflight_procs
        self._idle: queue.Queue[_Proc | None] = queue.Queue()
        self._all: set[_Proc] = set()
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> None:
        for _ in range(self.size):
            self._idle.put(None)  # started on first use or by warm(); None = a slot without a process
        threading.Thread(target=self._warm, daemon=True, name="pf-preflight-warm").start()

    def _warm(self) -> None:
        slots = [self._idle.get() for _ in range(self.size)]
        for i, slot in enumerate(slots):
            try:
                slots[i] = slot or self._spawn()
            except Exception:
                logger.exception("could not start a preflight sandbox")
        for slot in slots:
            self._idle.put(slot)

    def _spawn(self) -> _Proc:
        scratch = self.settings.scratch_dir / "preflight"
        scratch.mkdir(parents=True, exist_ok=True)
        # its own session and process group (killed whole on a timeout), its memory limit, no core dumps
        popen = self.forks.spawn("preprocess_service.preflight", [str(scratch)], stdin=True, stdout=True, session=True,
                                 memory_bytes=self.settings.preflight_memory_bytes, name="pf-preflight")
        proc = _Proc(popen)
        line = proc.read_line(time.monotonic() + 300)
        if line is None:
            raise RuntimeError(f"the preflight sandbox exited at start-up ({popen.wait()})")
        with self._lock:
            self._all.add(proc)
        return proc

    def _kill(self, proc: _Proc) -> int | None:
        try:
            os.killpg(proc.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        code = proc.popen.wait()
        with self._lock:
            self._all.discard(proc)
        return code

    def ready(self) -> int:
        """Sandboxes alive now."""
        with self._lock:
            return sum(1 for p in self._all if p.popen.poll() is None)

    def call(self, request: dict[str, Any], *, what: str) -> dict[str, Any]:
        """Send one request to a sandbox; its answer, or PreflightError (refusal, crash, time or memory)."""
        timeout, limit = self.settings.preflight_timeout_s, self.settings.preflight_memory_bytes
        proc = self._idle.get()
        try:
            if proc is None or proc.popen.poll() is not None:
                if proc is not None:
                    self._kill(proc)
                    proc = None
                try:
                    proc = self._spawn()
                except Exception as exc:
                    logger.exception("could not start a preflight sandbox")
                    raise PreflightError(503, "not-ready", "source", "the preflight sandbox could not start "
                                         f"({type(exc).__name__}); retry shortly") from exc
            try:
                proc.popen.stdin.write((json.dumps(request) + "\n").encode())
                proc.popen.stdin.flush()
                line = proc.read_line(time.monotonic() + timeout)
            except TimeoutError:
                self._kill(proc)
                proc = None
                raise PreflightError(422, "invalid-data", "source", f"{what}: the synchronous check took more than "
                                     f"{timeout:g} s (--preflight-timeout-s) and was stopped; nothing was queued") from None
            except BrokenPipeError:
                line = None
            if line is None:
                code = self._kill(proc)
                proc = None
                how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                raise PreflightError(422, "invalid-data", "source", f"{what}: reading it crashed the sandboxed "
                                     f"check ({how}; limit {limit // 2**20} MiB of memory, --preflight-memory); "
                                     "nothing was queued: check that the file is well formed")
            answer = json.loads(line)
            error = answer.get("error")
            if error:
                detail = error["detail"]
                if detail == "__memory__":
                    self._kill(proc)
                    proc = None
                    detail = (f"{what}: reading it needs more than the sandbox's {limit // 2**20} MiB of memory "
                              "(--preflight-memory); nothing was queued: shorten its rows")
                elif detail.startswith("__failed__"):
                    detail = f"{what}: the synchronous check failed ({detail[10:]}); nothing was queued"
                raise PreflightError(error["status"], error["kind"], error["field"], detail)
            return answer
        finally:
            self._idle.put(proc)

    def stop(self) -> None:
        with self._lock:
            procs = list(self._all)
        for proc in procs:
            self._kill(proc)
        if self._own_forks:
            self.forks.stop()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s preflight %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API stops it; Ctrl-C in a terminal goes to the API first
    sys.exit(_serve(Path(sys.argv[1])))
