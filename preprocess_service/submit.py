"""``POST /v1/datasets`` behind the route: resolve and confine the source, identify the tokenizer,
compute the content address, run the preflight, and create (or find) the job.

What is checked synchronously (4xx at once, nothing queued, nothing written under ``datasets/``):
request schema, option values (``PretokenizeConfig``), source path confinement / existence / suffix /
emptiness / hard links, upload id, and, in a sandboxed process (:mod:`preprocess_service.preflight`; this
process parses nothing a client names), the tokenizer (resolved, confined, loaded with
``trust_remote_code=False``), a ``save_to_disk`` folder's data files (inside it), the source's row limits, and a
*preflight*: the first ``preflight_rows`` (64) rows of a JSONL or Parquet source run through the real
:func:`pretokenize` (malformed line, missing column, wrong format, template absent, ``truncation='error'``
overflow in those rows). Everything else (row 5000 is malformed, JSON arrays, CSV, ``save_to_disk`` folders) is
found by the job, which then ends ``failed`` with the reason and no dataset directory.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from preprocess_service.locks import KeyedLocks
from preprocess_service.preflight import PreflightError, PreflightPool
from preprocess_service.store import JobStore, QueueFull
from preprocess_service.schemas import DatasetRequest
from preprocess_service.security import ServiceError, confine
from preprocess_service.settings import Settings
from preprocess_service.uploads import touch
from pf_trl.data.pretokenize import SOURCE_SUFFIXES

ID_VERSION = 1


def content_address(key: dict[str, Any]) -> str:
    """A job id: sha256 (first 32 hex digits) of the canonical JSON of everything that makes the dataset
    (with the id and shards format versions, so a format change never reuses an old dataset)."""
    from pf_trl.data.shards import FORMAT_VERSION

    key = {"id_version": ID_VERSION, "format_version": FORMAT_VERSION, **key}
    return hashlib.sha256(json.dumps(key, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]


def dataset_id(source_sha256: str, tokenizer_sha256: str, options: dict[str, Any],
               hub: dict[str, Any] | None = None) -> str:
    """Content address: sha256 of the source bytes' hash, the tokenizer identity and every option (and, for a Hub
    source, its repository and resolved commit, as ``pf-trl train``'s cache key)."""
    key = {"source_sha256": source_sha256, "tokenizer_sha256": tokenizer_sha256, "options": options}
    if hub:
        key["hub"] = [hub.get("repo_id"), hub.get("commit")]
    return content_address(key)


def _unprocessable(field: str, detail: str, kind: str = "invalid-request") -> ServiceError:
    return ServiceError(422, "Unprocessable Content", detail, kind=kind, field=field)


class Submitter:
    """What a POST runs before it queues a job: the checks, the source's hash and the tokenizer's fingerprint."""

    def __init__(self, settings: Settings, store: JobStore, preflight: PreflightPool, integrity=None):
        self.settings, self.store, self.preflight_pool = settings, store, preflight
        self.integrity = integrity  # a preprocess_service.integrity.DatasetIntegrity: corrupt datasets are rebuilt
        self._fingerprints: dict[str, tuple[tuple, dict[str, Any]]] = {}  # computed in the sandbox, by files' status
        self._sha_cache: dict[str, tuple[list, str, int]] = {}
        self._lock = KeyedLocks()

    # ----------------------------------------------------------------------------------- source
    def resolve_source(self, request: DatasetRequest) -> tuple[Path | None, dict[str, Any]]:
        """The source's local path and what the status shows of it; a Hub source has no local path yet (None) and
        says in ``shown["fetch"]`` what the job downloads."""
        spec = request.source
        if spec.hub is not None:
            return self._hub_source(spec.hub)
        if spec.upload_id is not None:
            path = self.settings.uploads_dir / spec.upload_id
            if not path.is_file():
                raise ServiceError(422, "Unprocessable Content", f"source.upload_id: no upload {spec.upload_id!r}; "
                                   "POST the file to /v1/uploads first and use the upload_id it returns",
                                   kind="unknown-upload", field="source.upload_id")
            shown = {"upload_id": spec.upload_id}
            touch(path)  # named by a POST: the upload's expiry starts over (before its status is taken for the hash)
        else:
            path = confine(spec.path, self.settings.data_roots, field="source.path")
            shown = {"path": str(path)}
            if path.is_file() and path.suffix.lower() not in SOURCE_SUFFIXES:
                raise _unprocessable("source.path", f"source.path: {path.name!r} has suffix {path.suffix!r}; "
                                     f"supported: {', '.join(SOURCE_SUFFIXES)} or a `save_to_disk` folder",
                                     "invalid-source")
        if spec.upload_id is None:
            self._refuse_hardlinks(path, "source.path")
        if path.is_file() and path.stat().st_size == 0:
            raise _unprocessable("source", f"source {shown.get('path') or shown.get('upload_id')} is empty (0 bytes); "
                                 "give a file with rows", "invalid-source")
        if not path.is_file() and not path.is_dir():
            raise _unprocessable("source.path", f"source.path: {path} is not a regular file or folder", "invalid-source")
        return path, shown

    def _hub_source(self, hub) -> tuple[None, dict[str, Any]]:
        """A split of a Hub dataset that ``hub_allow`` names, resolved in the sandbox to a commit and its files (the
        cheap checks: nothing but the README is downloaded there). The job downloads the files
        (:mod:`preprocess_service.hub_fetch`): no local path yet; ``shown["fetch"]`` says what to download,
        ``shown["files"]`` every file's ``hf://`` URL and ``shown["path"]`` the one file (of several, the repository
        at that commit)."""
        if not self.settings.hub_allows(hub.repo_id):
            allowed = ", ".join(self.settings.hub_allow) or "none"
            raise ServiceError(403, "Forbidden", f"source.hub.repo_id: {hub.repo_id} is not a Hub dataset this service "
                               f"may read (hub_allow: {allowed}); ask its operator to add the repository or its "
                               "organisation to --hub-allow", kind="hub-forbidden", field="source.hub.repo_id")
        self._check_hub_revision(hub.revision, None)  # by its spelling, before anything is fetched
        answer = self._sandbox({"op": "hub", **hub.model_dump()}, what=f"Hub dataset {hub.repo_id}")
        origin = answer["hub"]
        self._check_hub_revision(hub.revision, origin["commit"])  # a short commit hash spelled as a name
        files = list(answer["files"])
        at = f"hf://datasets/{hub.repo_id}@{origin['commit']}"
        urls = [f"{at}/{name}" for name in files]
        shown = {"path": urls[0] if len(urls) == 1 else at, "files": urls}
        # the name `pf-trl pretokenize ORG/NAME` gives a split of several files (its manifest's source name)
        fetch = {**origin, "files": files, "sizes": answer["sizes"], "name": f"{hub.repo_id.split('/')[-1]}-{hub.split}"}
        return None, {**shown, "hub": origin, "fetch": fetch}

    def _check_hub_revision(self, revision: str | None, commit: str | None) -> None:
        refusal = self.settings.hub_revision_refusal(revision, commit)
        if refusal:
            raise ServiceError(403, "Forbidden", refusal, kind="hub-forbidden", field="source.hub.revision")

    def _refuse_hardlinks(self, path: Path, field: str) -> None:
        """403 for a file (or a file in a folder) with several hard links: one can carry a file from outside the
        data roots in, and its path cannot show it. ``--allow-hardlinks`` leaves that to the operator."""
        if self.settings.allow_hardlinks:
            return
        files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
        for f in files:
            links = f.stat().st_nlink
            if links > 1:
                raise ServiceError(403, "Forbidden", f"{field}: {f} has {links} hard links; a hard link can carry a "
                                   "file from outside the data roots in, so the service refuses them: copy the file "
                                   "instead (or start the service with --allow-hardlinks if every writer of the "
                                   "data roots is trusted)", kind="path-forbidden", field=field)

    def source_identity(self, path: Path | None, shown: dict[str, Any]) -> tuple[str, int, list | None]:
        """:meth:`source_sha` of a local source; of a Hub source (not downloaded yet) the sha256 of its repository,
        commit and files (a commit fixes the bytes) and the size the Hub tells (0 where it tells none)."""
        fetch = shown.get("fetch")
        if fetch is None:
            return self.source_sha(path)
        key = json.dumps([fetch["repo_id"], fetch["commit"], fetch["files"]], separators=(",", ":"))
        return hashlib.sha256(key.encode()).hexdigest(), sum(s or 0 for s in fetch["sizes"].values()), None

    def source_sha(self, path: Path) -> tuple[str, int, list]:
        """Content hash, size and the files' status when hashed (:func:`pf_trl.data.integrity.content_stat`: the
        worker hashes again only if it changed): a file's bytes streamed here (read, never parsed); a
        ``save_to_disk`` folder's in the sandbox, which first checks that every data file its state.json names lies
        inside it. Kept while the status is unchanged."""
        from pf_trl.data.integrity import content_stat
        from pf_trl.data.pretokenize import source_fingerprint

        stat = content_stat(path)
        hit = self._sha_cache.get(str(path))
        if hit is None or hit[0] != stat:
            if path.is_dir():
                answer = self._sandbox({"op": "identify", "path": str(path)}, what=f"source {path}")
                sha, size = answer["sha256"], int(answer["size"])
            else:
                sha, size = source_fingerprint(path), stat[0][1]
            if len(self._sha_cache) > 1024:
                self._sha_cache.clear()
            hit = self._sha_cache[str(path)] = (stat, sha, size)
        return hit[1], hit[2], stat

    def _sandbox(self, request: dict[str, Any], *, what: str) -> dict[str, Any]:
        try:
            return self.preflight_pool.call(request, what=what)
        except PreflightError as exc:
            title = {422: "Unprocessable Content", 503: "Service Unavailable", 507: "Insufficient Storage"}.get(
                exc.status, "Error")
            raise ServiceError(exc.status, title, exc.detail, kind=exc.kind, field=exc.field,
                               headers={"Retry-After": "5"} if exc.status == 503 else None) from exc

    # -------------------------------------------------------------------------------- tokenizer
    def tokenizer(self, raw: str) -> tuple[str, dict[str, Any]]:
        """``(name to load, fingerprint)``; fingerprinted in the sandbox, once per version of the folder's files."""
        from pf_trl.data.tokenizer import DEFAULT_TOKENIZER, EMBEDDED_TOKENIZER_NAMES, tokenizer_files_key

        if raw in EMBEDDED_TOKENIZER_NAMES:
            name = DEFAULT_TOKENIZER
        else:
            unknown = (f"tokenizer: {raw!r} is neither the embedded {DEFAULT_TOKENIZER!r} nor a tokenizer folder "
                       "under the data roots; the service loads tokenizers from its data roots only (no Hub): copy "
                       "the tokenizer files "
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
            self._refuse_hardlinks(path, "tokenizer")
            name = str(path)
        key = tokenizer_files_key(name)
        with self._lock("tok:" + name):
            hit = self._fingerprints.get(name)
            if hit is None or hit[0] != key:
                hit = self._fingerprints[name] = (key, self._sandbox({"op": "tokenizer", "name": name},
                                                                     what=f"tokenizer {raw!r}")["fingerprint"])
        return name, hit[1]

    # -------------------------------------------------------------------------------- preflight
    def enqueue(self, job_id: str, record: dict[str, Any], stands) -> tuple[dict[str, Any], bool]:
        """Queue the job (or find the one that stands); a full queue answers 503 with Retry-After."""
        try:
            return self.store.submit(job_id, record, max_queued=self.settings.max_queued, exists_ok=stands)
        except QueueFull as exc:
            raise ServiceError(503, "Service Unavailable", f"the queue is full ({exc.args[0]} jobs waiting, "
                               f"max_queued {self.settings.max_queued}); retry later", kind="queue-full",
                               headers={"Retry-After": "30"}) from exc

    def preflight(self, path: Path, shown: str, config, tokenizer: str) -> int | None:
        """The sandboxed checks of the source (files, limits, the first rows); returns its row count if known."""
        answer = self._sandbox({"op": "preflight", "path": str(path), "shown": shown, "tokenizer": tokenizer,
                                "options": config.to_dict(), "rows": self.settings.preflight_rows,
                                "limits": self.settings.limits().to_dict(),
                                # image paths of vision rows resolve against the source's folder, within the roots
                                "image_roots": [str(path.parent), *map(str, self.settings.data_roots)],
                                "count_s": self.settings.preflight_timeout_s / 3}, what=f"source {shown}")
        return answer.get("rows_total")

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
        tok_name, fingerprint = self.tokenizer(request.tokenizer)
        sha, size, stat = self.source_identity(path, shown)
        options = config.to_dict()
        hub, fetch = shown.pop("hub", None), shown.pop("fetch", None)
        job_id = dataset_id(sha, fingerprint["sha256"], options, hub)
        record = {
            "source_path": str(path) if path is not None else None, "source_shown": shown, "source_sha256": sha,
            "source_size": size, "source_stat": stat, "hub_fetch": fetch,
            "tokenizer": tok_name, "tokenizer_name": fingerprint.get("name") or tok_name,
            "tokenizer_sha256": fingerprint["sha256"], "options": options,
        }

        def stands(row: dict[str, Any]) -> bool:
            return row["state"] != "succeeded" or is_shards_dir(self.settings.datasets_dir / job_id)

        with self._lock(job_id):  # concurrent identical POSTs in this process wait for the first one
            row = self.store.get(job_id)
            if self.integrity is not None:
                row = self.integrity.ensure(row)  # a corrupt dataset is withdrawn here, and rebuilt below
            if row is not None and row["state"] not in ("failed", "cancelled") and stands(row):
                return row, False
            # known before the first progress report; a Hub source's rows are checked by the job, which downloads it
            record["rows_total"] = None if path is None else self.preflight(
                path, shown.get("path") or f"upload {shown.get('upload_id')}", config, tok_name)
            return self.enqueue(job_id, record, stands)
