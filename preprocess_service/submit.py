"""``POST /v1/datasets`` behind the route: resolve and confine the source, identify the tokenizer,
compute the content address, run the synchronous preflight, and create (or find) the job.

What is checked synchronously (4xx at once, nothing queued, nothing written under ``datasets/``):
request schema, option values (``PretokenizeConfig``), source path confinement / existence / suffix /
emptiness, upload id, tokenizer (resolved, confined, loaded with ``trust_remote_code=False``), and a
*preflight*: the first ``preflight_rows`` (64) rows of a JSONL or Parquet source are run through the
real :func:`pretokenize` in ``tmp/`` (malformed line, missing column, wrong format, template absent,
``truncation='error'`` overflow in those rows). Everything else (row 5000 is malformed, JSON arrays,
CSV, ``save_to_disk`` folders) is found by the job, which then ends ``failed`` with the reason and no
dataset directory.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any

from preprocess_service.store import JobStore, QueueFull
from preprocess_service.schemas import DatasetRequest
from preprocess_service.security import ServiceError, confine
from preprocess_service.settings import Settings

ID_VERSION = 1
EMBEDDED_NAMES = ("pf-trl/mistral-7b-v0.1", "default")
SUFFIXES = (".json", ".jsonl", ".parquet", ".csv")


def dataset_id(source_sha256: str, tokenizer_sha256: str, options: dict[str, Any]) -> str:
    """Content address: sha256 of the source bytes' hash, the tokenizer identity and every option."""
    from pf_trl.data.shards import FORMAT_VERSION

    key = {"id_version": ID_VERSION, "format_version": FORMAT_VERSION, "source_sha256": source_sha256,
           "tokenizer_sha256": tokenizer_sha256, "options": options}
    return hashlib.sha256(json.dumps(key, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]


def content_sha256(path: Path) -> str:
    """sha256 of a file's bytes (its name is not part of it: an upload and a path with the same bytes are
    the same source); a directory: ``pretokenize.source_fingerprint`` (relative paths + bytes)."""
    from pf_trl.data.pretokenize import source_fingerprint

    if Path(path).is_dir():
        return source_fingerprint(path)
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def count_rows(path: Path) -> int | None:
    """Rows of a source, where it says so cheaply: Parquet metadata, the non-blank lines of JSON Lines,
    the Arrow files of a ``save_to_disk`` folder. None for a JSON array or CSV (only parsing tells)."""
    path = Path(path)
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
                return sum(1 for line in fh if line.strip())
    except Exception:  # noqa: BLE001 - a count is a nicety; the job finds real problems
        return None
    return None


def _unprocessable(field: str, detail: str, kind: str = "invalid-request") -> ServiceError:
    return ServiceError(422, "Unprocessable Content", detail, kind=kind, field=field)


class Submitter:
    def __init__(self, settings: Settings, store: JobStore):
        self.settings, self.store = settings, store
        self._tok_cache: dict[tuple, tuple[Any, dict[str, Any]]] = {}
        self._sha_cache: dict[tuple, str] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def _lock(self, key: str) -> threading.Lock:
        with self._locks_guard:
            if len(self._locks) > 4096:
                self._locks = {k: v for k, v in self._locks.items() if v.locked()}
            return self._locks.setdefault(key, threading.Lock())

    # ----------------------------------------------------------------------------------- source
    def resolve_source(self, request: DatasetRequest) -> tuple[Path, dict[str, Any]]:
        spec = request.source
        if spec.upload_id is not None:
            path = self.settings.uploads_dir / spec.upload_id
            if not path.is_file():
                raise ServiceError(422, "Unprocessable Content", f"source.upload_id: no upload {spec.upload_id!r}; "
                                   "POST the file to /v1/uploads first and use the upload_id it returns",
                                   kind="unknown-upload", field="source.upload_id")
            shown = {"upload_id": spec.upload_id}
        else:
            path = confine(spec.path, self.settings.data_roots, field="source.path")
            shown = {"path": str(path)}
            if path.is_file() and path.suffix.lower() not in SUFFIXES:
                raise _unprocessable("source.path", f"source.path: {path.name!r} has suffix {path.suffix!r}; "
                                     f"supported: {', '.join(SUFFIXES)} or a `save_to_disk` folder", "invalid-source")
        if path.is_file() and path.stat().st_size == 0:
            raise _unprocessable("source", f"source {shown.get('path') or shown.get('upload_id')} is empty (0 bytes); "
                                 "give a file with rows", "invalid-source")
        if not path.is_file() and not path.is_dir():
            raise _unprocessable("source.path", f"source.path: {path} is not a regular file or folder", "invalid-source")
        return path, shown

    def source_sha(self, path: Path) -> tuple[str, int]:
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        stats = [(str(f), f.stat().st_size, f.stat().st_mtime_ns, f.stat().st_ino) for f in files]
        key = (str(path), tuple(stats))
        size = sum(s[1] for s in stats)
        sha = self._sha_cache.get(key)
        if sha is None:
            sha = content_sha256(path)
            if len(self._sha_cache) > 1024:
                self._sha_cache.clear()
            self._sha_cache[key] = sha
        return sha, size

    # -------------------------------------------------------------------------------- tokenizer
    def tokenizer(self, raw: str) -> tuple[str, Any, dict[str, Any]]:
        """``(name to load, tokenizer, fingerprint)``; the tokenizer is loaded once per version of its files."""
        from pf_trl.data.tokenizer import DEFAULT_TOKENIZER, TokenizerLoadError, load_tokenizer, tokenizer_fingerprint

        if raw in EMBEDDED_NAMES:
            name, key = DEFAULT_TOKENIZER, ("embedded",)
        else:
            unknown = (f"tokenizer: {raw!r} is neither the embedded {DEFAULT_TOKENIZER!r} nor a tokenizer folder "
                       "under the data roots; the service never downloads from a hub: copy the tokenizer files "
                       "(tokenizer.json, tokenizer_config.json) into a folder under a data root and pass its path")
            if not self.settings.data_roots:
                raise _unprocessable("tokenizer", unknown, "unknown-tokenizer")
            try:
                path = confine(raw, self.settings.data_roots, field="tokenizer", what="tokenizer folder")
            except ServiceError as exc:
                if exc.kind == "path-not-found":
                    raise _unprocessable("tokenizer", unknown, "unknown-tokenizer") from exc
                raise
            if not path.is_dir():
                raise _unprocessable("tokenizer", f"tokenizer: {raw!r} is a file; pass the folder that holds "
                                     "tokenizer.json / tokenizer_config.json", "unknown-tokenizer")
            name = str(path)
            key = (name, tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.iterdir())
                               if p.is_file()))
        with self._lock("tok:" + name):
            hit = self._tok_cache.get(key)
            if hit is None:
                try:
                    tok = load_tokenizer(name)  # local files only, trust_remote_code=False
                except TokenizerLoadError as exc:
                    if "trust_remote_code" in str(exc) or "custom code" in str(exc):
                        raise _unprocessable("tokenizer", f"tokenizer: {raw!r} needs custom (remote) code, which this "
                                             "service never executes (trust_remote_code is always off); use a "
                                             "tokenizer folder with a plain tokenizer.json", "unknown-tokenizer") from exc
                    raise _unprocessable("tokenizer", f"tokenizer: {exc}", "unknown-tokenizer") from exc
                except Exception as exc:  # noqa: BLE001 - e.g. a config that asks for remote code
                    raise _unprocessable("tokenizer", f"tokenizer: could not load {raw!r} from local files without "
                                         f"remote code ({type(exc).__name__}: {exc})", "unknown-tokenizer") from exc
                hit = (tok, tokenizer_fingerprint(tok))
                self._tok_cache = {k: v for k, v in self._tok_cache.items() if k[0] != key[0]}
                self._tok_cache[key] = hit
        return name, hit[0], hit[1]

    # -------------------------------------------------------------------------------- preflight
    def preflight(self, path: Path, shown: str, config, tok) -> None:
        from pf_trl.data.options import for_service, service_field
        from pf_trl.data.pretokenize import PretokenizeError, pretokenize

        n = self.settings.preflight_rows
        suffix = path.suffix.lower()
        if n <= 0 or path.is_dir() or suffix not in (".json", ".jsonl", ".parquet"):
            return
        work = self.settings.scratch_dir / f"preflight-{uuid.uuid4().hex}"
        work.mkdir(parents=True)
        head = work / f"head{suffix}"
        try:
            if suffix == ".parquet":
                complete = self._parquet_head(path, head, n)
            else:
                complete = self._jsonl_head(path, head, n)
                if complete is None:
                    return  # a JSON array, not line-oriented: checked by the job
            # image paths of vision rows resolve against the source's folder, not the copy's, within the data roots
            pretokenize(head, work / "out", config, tokenizer=tok, progress=False,
                        image_roots=(str(path.parent), *map(str, self.settings.data_roots)))
        except PretokenizeError as exc:
            message = for_service(str(exc).replace(str(head), shown))
            if message.startswith("no example left") and not complete:
                return  # the first rows alone may all be dropped; the job judges the whole source
            field = f"options.{exc.option}" if getattr(exc, "option", None) else (service_field(message) or "source")
            raise _unprocessable(field, f"{field}: {message} (found by the synchronous check of the first "
                                 f"{n} rows; nothing was queued)", "invalid-data") from exc
        finally:
            shutil.rmtree(work, ignore_errors=True)

    @staticmethod
    def _jsonl_head(path: Path, head: Path, n: int) -> bool | None:
        with open(path, "rb") as src:
            start = src.read(4096).lstrip()
            if start.startswith(b"["):
                return None
            src.seek(0)
            rows, complete = 0, True
            with open(head, "wb") as dst:
                for line in src:
                    dst.write(line)
                    if line.strip():
                        rows += 1
                        if rows >= n:
                            complete = src.read(1) == b""
                            break
        return complete

    @staticmethod
    def _parquet_head(path: Path, head: Path, n: int) -> bool:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(str(path))
            batch = next(pf.iter_batches(batch_size=n), None)
        except Exception as exc:  # noqa: BLE001
            raise _unprocessable("source", f"source {path.name}: cannot read as Parquet ({exc})", "invalid-data") from exc
        table = pa.Table.from_batches([batch]) if batch is not None else pf.schema_arrow.empty_table()
        pq.write_table(table, str(head))
        return pf.metadata.num_rows <= n

    # ----------------------------------------------------------------------------------- submit
    def submit(self, request: DatasetRequest) -> tuple[dict[str, Any], bool]:
        from pf_trl.data.options import for_service
        from pf_trl.data.pretokenize import PretokenizeConfig, PretokenizeError
        from pf_trl.data.shards import is_shards_dir

        try:
            config = PretokenizeConfig(**request.options.model_dump())
        except PretokenizeError as exc:
            field = f"options.{exc.option}" if getattr(exc, "option", None) else "options"
            raise _unprocessable(field, f"{field}: {for_service(str(exc))}", "invalid-options") from exc
        path, shown = self.resolve_source(request)
        tok_name, tok, fingerprint = self.tokenizer(request.tokenizer)
        sha, size = self.source_sha(path)
        options = config.to_dict()
        job_id = dataset_id(sha, fingerprint["sha256"], options)
        record = {
            "source_path": str(path), "source_shown": shown, "source_sha256": sha, "source_size": size,
            "tokenizer": tok_name, "tokenizer_name": fingerprint.get("name") or tok_name,
            "tokenizer_sha256": fingerprint["sha256"], "options": options,
        }

        def stands(row: dict[str, Any]) -> bool:
            return row["state"] != "succeeded" or is_shards_dir(self.settings.datasets_dir / job_id)

        with self._lock(job_id):  # concurrent identical POSTs in this process wait for the first one
            row = self.store.get(job_id)
            if row is not None and row["state"] not in ("failed", "cancelled") and stands(row):
                return row, False
            self.preflight(path, shown.get("path") or f"upload {shown.get('upload_id')}", config, tok)
            record["rows_total"] = count_rows(path)  # known before the first progress report
            try:
                return self.store.submit(job_id, record, max_queued=self.settings.max_queued, exists_ok=stands)
            except QueueFull as exc:
                raise ServiceError(503, "Service Unavailable", f"the queue is full ({exc.args[0]} jobs waiting, "
                                   f"max_queued {self.settings.max_queued}); retry later", kind="queue-full",
                                   headers={"Retry-After": "30"}) from exc
