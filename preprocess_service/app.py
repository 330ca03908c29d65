"""FastAPI app factory and routes (thin: the work is in submit.py, jobs.py and worker.py)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, Literal

import anyio
from fastapi import Depends, FastAPI, Header, Query, Request, Response
from fastapi import Path as FastAPIPath
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.sse import EventSourceResponse, ServerSentEvent
from starlette.exceptions import HTTPException as StarletteHTTPException

from pf_trl._version import __version__
from preprocess_service.faults import classify, fault_classes, free_space_problem, insufficient_storage
from preprocess_service.integrity import DatasetIntegrity
from preprocess_service.jobs import SECRET_ENV, Supervisor
from preprocess_service.preflight import PreflightPool
from preprocess_service.store import (
    DURATION_BUCKETS,
    IDEMPOTENCY_TTL_S,
    STATES,
    TERMINAL,
    IdempotencyMismatch,
    log_event,
    open_store,
    setup_event_log,
)
from preprocess_service.schemas import (
    PROBLEM_JSON,
    PROBLEM_RESPONSES,
    DatasetList,
    DatasetRequest,
    DatasetStatus,
    DatasetEvent,
    Health,
    LengthStats,
    MixtureRequest,
    MixtureRule,
    MixtureSourceSpec,
    PretokenizeOptions,
    SourceSpec,
    UploadInfo,
    UploadList,
    UPLOAD_ID_PATTERN,
    problem_body,
)
from preprocess_service.security import BearerAuthMiddleware, BodyLimitMiddleware, RateLimitMiddleware, ServiceError
from preprocess_service import uploads as upload_store
from preprocess_service.settings import Settings, SettingsError
from preprocess_service.submit import Submitter

logger = logging.getLogger("preprocess_service")

_MODELS_AT = {("",): DatasetRequest, ("source",): SourceSpec, ("options",): PretokenizeOptions}
_MIXTURE_MODELS_AT = {("",): MixtureRequest, ("mixture",): MixtureRule}  # sources.N.* : see _model_at


def problem(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


def _model_at(where: list[str], mixture: bool):
    """The request model whose fields an unknown field sits among (for the "allowed here" hint)."""
    if not mixture:
        return _MODELS_AT.get(tuple(where[:-1]) or ("",))
    if len(where) >= 3 and where[0] == "sources":  # sources.<i>.<field> / sources.<i>.source.<field> / ...options
        inner = tuple(where[2:-1])
        return {(): MixtureSourceSpec, ("source",): SourceSpec, ("options",): PretokenizeOptions}.get(inner)
    return _MIXTURE_MODELS_AT.get(tuple(where[:-1]) or ("",))


def _validation_message(err: dict[str, Any], mixture: bool = False) -> dict[str, str]:
    where = [str(x) for x in err.get("loc", ())]
    if where and where[0] == "body":
        where = where[1:]
    kind, msg, given = err.get("type", ""), err.get("msg", "invalid"), err.get("input")
    field = "body" if kind == "json_invalid" else (".".join(where) or "body")
    if kind == "missing":
        text = f"{field}: required field is missing; add it"
    elif kind == "extra_forbidden":
        model = _model_at(where, mixture)
        allowed = ", ".join(model.model_fields) if model else "see /openapi.json"
        text = f"{field}: unknown field; remove it (allowed here: {allowed})"
    elif kind == "json_invalid":
        text = (f"body: not valid JSON ({err.get('ctx', {}).get('error', msg)}); send a JSON object with "
                "Content-Type: application/json")
    elif kind in ("model_attributes_type", "dict_type", "model_type"):
        text = f"{field}: must be a JSON object, got {type(given).__name__}"
    elif kind == "value_error":
        text = f"{field}: {msg.removeprefix('Value error, ')}"
    else:
        shown = json.dumps(given)[:80] if isinstance(given, (str, int, float, bool, type(None))) else type(given).__name__
        text = f"{field}: {msg} (got {shown})"
    return {"field": field, "message": text}


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings.load()
    os.environ.update(settings.child_env())  # before datasets/transformers are imported in this process
    for name in SECRET_ENV:  # read into settings already: no child process (tokenizer pools...) inherits them
        os.environ.pop(name, None)
    setup_event_log(settings.log_level)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        settings.make_dirs()
        lock = open(settings.lock_path, "a+")
        if not settings.database_url:  # SQLite: one service per cache dir; PostgreSQL: replicas share it
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                raise SettingsError(f"another pf-trl service already runs on cache dir {settings.cache_dir}; "
                                    "use one service per cache dir (or PostgreSQL, --database-url, for "
                                    "several replicas)") from exc
        for leftover in settings.scratch_dir.iterdir():  # temp builds of this replica's last run: never published
            shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink(missing_ok=True)
        store = open_store(settings)
        store.clear_workers()
        actions = store.reconcile(datasets_dir=settings.datasets_dir, max_attempts=settings.max_attempts,
                                  heartbeat_timeout_s=settings.heartbeat_timeout_s, startup=True)
        for job_id, action in actions:
            logger.warning("job %s was running when the service stopped: %s", job_id, action)
        supervisor = Supervisor(settings, store)
        supervisor.start()
        # Nothing a client names is parsed in this process: the preflight runs in sandboxed processes, warm
        # from the start (imports and the default tokenizer), like the workers.
        sandbox_env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
        preflight = PreflightPool(settings, {**sandbox_env, **settings.child_env()})
        preflight.start()
        log_event("service_started", **{**settings.describe(), "version": __version__})
        app.state.store, app.state.supervisor, app.state.preflight = store, supervisor, preflight
        app.state.integrity = DatasetIntegrity(settings, store)
        app.state.submitter = Submitter(settings, store, preflight)
        app.state.submitter.integrity = app.state.integrity
        app.state.started = time.time()
        stop_janitor = threading.Event()

        def janitor() -> None:  # uploads unused for upload_ttl_s go away (checked 4 times per TTL, at most each minute)
            every = max(0.5, min(60.0, settings.upload_ttl_s / 4)) if settings.upload_ttl_s > 0 else 60.0
            while not stop_janitor.wait(every):
                try:
                    for gone in upload_store.expire_uploads(settings.uploads_dir, store, settings.upload_ttl_s):
                        log_event("upload_expired", upload_id=gone, replica=settings.replica_id)
                except Exception:
                    logger.exception("upload expiry failed")

        threading.Thread(target=janitor, daemon=True, name="pf-upload-janitor").start()
        try:
            yield
        finally:
            stop_janitor.set()
            preflight.stop()
            supervisor.stop()
            log_event("service_stopped", replica=settings.replica_id)
            if not settings.database_url:
                fcntl.flock(lock, fcntl.LOCK_UN)
            lock.close()

    app = FastAPI(
        title="pf-trl preprocessing service",
        version=__version__,
        description="Tokenize a dataset once into a shared cache of shards (with per-example lengths for the "
        "token-budget sampler); training jobs wait for it and read it. Errors are application/problem+json.",
        lifespan=lifespan,
        responses={k: PROBLEM_RESPONSES[k] for k in (400, 401, 422, 429, 503, 507)},
    )
    app.state.settings = settings

    # ----------------------------------------------------------------------------- error handlers
    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError):
        return problem(exc.status, exc.body(request.url.path), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = [_validation_message(e, request.url.path == "/v1/mixtures") for e in exc.errors()]
        detail = f"{len(errors)} invalid field(s): " + "; ".join(e["message"] for e in errors)
        return problem(422, problem_body(422, "Unprocessable Content", detail, kind="validation",
                                         instance=request.url.path, errors=errors))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 400 and "parsing the body" in str(exc.detail):  # e.g. bytes that are not UTF-8
            detail = "body: not valid JSON (could not decode it); send a UTF-8 JSON object with Content-Type: application/json"
            return problem(422, problem_body(422, "Unprocessable Content", detail, kind="validation",
                                             instance=request.url.path, errors=[{"field": "body", "message": detail}]))
        if exc.status_code == 404:
            detail = f"no route {request.method} {request.url.path}; the API is listed at /docs and /openapi.json"
            kind = "not-found"
        elif exc.status_code == 405:
            detail = f"method {request.method} is not allowed on {request.url.path}; see /openapi.json"
            kind = "method-not-allowed"
        else:
            detail, kind = str(exc.detail), "http-error"
        return problem(exc.status_code, problem_body(exc.status_code, _title(exc.status_code), detail, kind=kind,
                                                     instance=request.url.path), getattr(exc, "headers", None))

    async def _machine_fault(request: Request, exc: Exception):
        """A full disk (507) or the database down (503), answered as handled errors (the connection stays
        usable); anything else of these classes goes on to the 500 handler."""
        fault = classify(exc, settings.cache_dir)
        if fault is None:
            raise exc
        logger.warning("%s %s: %s (%s: %s)", request.method, request.url.path, fault.detail, type(exc).__name__,
                       str(exc).splitlines()[0][:200] if str(exc) else "")
        return problem(fault.status, fault.body(request.url.path), fault.headers)

    for fault_class in fault_classes():
        app.add_exception_handler(fault_class, _machine_fault)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        fault = classify(exc, settings.cache_dir)  # a full disk (507), the database down (503)
        if fault is not None:
            logger.warning("%s %s: %s (%s)", request.method, request.url.path, fault.detail, type(exc).__name__)
            return problem(fault.status, fault.body(request.url.path), fault.headers)
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return problem(500, problem_body(500, "Internal Server Error", f"internal error ({type(exc).__name__}); "
                                         "see the service log", kind="internal", instance=request.url.path))

    # ------------------------------------------------------------------------------------ helpers
    def status_of(row: dict[str, Any], *, with_manifest: bool = True) -> DatasetStatus:
        from pf_trl.data.shards import is_shards_dir

        if with_manifest:  # a corrupt dataset is withdrawn, never reported as succeeded
            row = app.state.integrity.ensure(row)
        req = json.loads(row["request"])
        state, error = row["state"], None
        if state in ("failed", "cancelled"):
            error = {"type": row["error_type"] or ("cancelled" if state == "cancelled" else "internal"),
                     "message": row["error"] or "unknown"}
        elif state == "succeeded" and not is_shards_dir(settings.datasets_dir / row["id"]):
            state, error = "failed", {"type": "io_error", "message": "the dataset directory vanished from the cache; "
                                      "POST the same request again to rebuild it"}
        end = row["finished_at"] or (row["updated_at"] if state == "running" else None)
        elapsed = (end - row["started_at"]) if (end and row["started_at"]) else None
        rows_total = row["rows_total"]
        progress = {
            "rows_done": row["rows_done"], "rows_total": rows_total, "tokens_done": row["tokens_done"],
            "fraction": round(row["rows_done"] / rows_total, 4) if rows_total else (1.0 if state == "succeeded" else None),
            "rows_per_s": round(row["rows_done"] / elapsed, 1) if elapsed and row["rows_done"] else None,
            "tokens_per_s": round(row["tokens_done"] / elapsed, 1) if elapsed and row["tokens_done"] else None,
        }
        manifest = json.loads(row["manifest"]) if (row["manifest"] and with_manifest) else None
        shown = req.get("source_shown", {})
        return DatasetStatus(
            id=row["id"], state=state, done=state in TERMINAL, created_unix=row["created_at"], started_unix=row["started_at"],
            finished_unix=row["finished_at"], updated_unix=row["updated_at"], attempts=row["attempts"],
            worker_pid=row["worker_pid"] if state == "running" else None, progress=progress, error=error,
            source={"path": shown.get("path"), "upload_id": shown.get("upload_id"), "sha256": req["source_sha256"],
                    "size_bytes": req["source_size"]},
            tokenizer={"name": req["tokenizer_name"], "sha256": req["tokenizer_sha256"]},
            options=req["options"],
            shards_path=str(settings.shards_path(row["id"])) if state == "succeeded" else None,
            manifest=manifest if state == "succeeded" else None,
            links={"self": f"/v1/datasets/{row['id']}", "lengths": f"/v1/datasets/{row['id']}/lengths",
                   "events": f"/v1/datasets/{row['id']}/events", "cancel": f"/v1/datasets/{row['id']}/cancel"},
        )

    def get_row(dataset_id: str) -> dict[str, Any]:
        row = app.state.store.get(dataset_id)
        if row is None:
            raise ServiceError(404, "Not Found", f"dataset_id: no dataset {dataset_id!r}; POST /v1/datasets to create "
                               "it, or GET /v1/datasets to list the known ones", kind="unknown-dataset", field="dataset_id")
        return row

    def existing_row(dataset_id: str) -> dict[str, Any]:
        """Dependency: the 404 comes before a stream starts."""
        return get_row(dataset_id)

    # ------------------------------------------------------------------------------------- routes
    @app.post("/v1/datasets", response_model=DatasetStatus, status_code=202, tags=["datasets"],
              responses={200: {"model": DatasetStatus, "description": "already built: the manifest, no work"},
                         202: {"description": "queued or running (Location: the status URL)"},
                         **{k: PROBLEM_RESPONSES[k] for k in (403, 413, 429, 503, 507)}})
    def create_dataset(body: DatasetRequest, response: Response,
                       idempotency_key: str | None = Header(
                           None, alias="Idempotency-Key", min_length=1, max_length=255, pattern=r"^[\x21-\x7e]+$",
                           description="IETF httpapi Idempotency-Key (a string, quoted or not): the same key with "
                           "the same body answers with the same job, even after it was deleted and rebuilt; "
                           "the same key with another body is a 422. Keys are remembered for "
                           f"{int(IDEMPOTENCY_TTL_S // 3600)} hours.")) -> DatasetStatus:
        """Tokenize a source into a shards dataset (content-addressed: the same request is the same job)."""
        store = app.state.store
        key = idempotency_key.strip('"') if idempotency_key else None
        fingerprint = hashlib.sha256(json.dumps(body.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()
        if key:
            try:
                known = store.idempotent(key, fingerprint)
            except IdempotencyMismatch as exc:
                raise _key_reused(key) from exc
            row = store.get(known) if known else None
            if row is not None and row["state"] not in ("failed", "cancelled"):
                status = status_of(row)
                if status.state not in ("failed", "cancelled"):
                    return _answer(status, response)
        full = free_space_problem(settings.cache_dir, 0, settings.min_free_bytes)
        if full is not None:
            raise full
        row, _created = app.state.submitter.submit(body)
        if key:
            try:
                store.remember_key(key, fingerprint, row["id"])
            except IdempotencyMismatch as exc:  # a concurrent request won the key with another body
                raise _key_reused(key) from exc
        return _answer(status_of(row), response)

    @app.post("/v1/mixtures", response_model=DatasetStatus, status_code=202, tags=["datasets"],
              responses={200: {"model": DatasetStatus, "description": "already built: the manifest, no work"},
                         202: {"description": "queued or running (Location: the status URL)"},
                         **{k: PROBLEM_RESPONSES[k] for k in (403, 413, 429, 503, 507)}})
    def create_mixture(body: MixtureRequest, response: Response) -> DatasetStatus:
        """Tokenize several sources, each with its own options, into one dataset that records each source and the
        mixing rule (weights, seed, sample_by); train from its id like any dataset. Content-addressed."""
        from preprocess_service.mixtures import submit_mixture

        full = free_space_problem(settings.cache_dir, 0, settings.min_free_bytes)
        if full is not None:
            raise full
        row, _created = submit_mixture(app.state.submitter, body)
        return _answer(status_of(row), response)

    def _key_reused(key: str) -> ServiceError:
        return ServiceError(422, "Unprocessable Content", f"Idempotency-Key {key!r} was already used with another "
                            "request body; use a new key for a new request", kind="idempotency-key-reused",
                            field="header.idempotency-key")

    def _answer(status: DatasetStatus, response: Response) -> DatasetStatus:
        response.headers["Location"] = f"/v1/datasets/{status.id}"
        response.headers["ETag"] = etag_of(status)
        response.status_code = 200 if status.state == "succeeded" else 202
        return status

    def etag_of(status: DatasetStatus) -> str:
        return '"' + hashlib.sha256(status.model_dump_json().encode()).hexdigest()[:32] + '"'


    @app.post("/v1/uploads", response_model=UploadInfo, status_code=201, tags=["uploads"],
              openapi_extra={"requestBody": {"required": True, "content": {
                  "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}},
              responses={200: {"model": UploadInfo, "description": "the same bytes were uploaded before"},
                         **{k: PROBLEM_RESPONSES[k] for k in (413, 429, 507)}})
    async def upload(request: Request, response: Response,
                     format: Literal["jsonl", "json", "parquet", "csv"] = Query(
                         ..., description="How to read the bytes (the upload id keeps it as its suffix)")) -> UploadInfo:
        """Upload a source file as the raw request body (at most max_upload_bytes); use its `upload_id`.
        Uploads count against `max_uploads_bytes` together (507 beyond: DELETE old ones) and are deleted when
        unused for `upload_ttl_s` (see `expires_unix`)."""
        limit = settings.max_upload_bytes
        declared = int(request.headers.get("content-length") or 0)
        used = await anyio.to_thread.run_sync(upload_store.uploads_bytes, settings.uploads_dir)
        quota = settings.max_uploads_bytes

        def over_quota(size: int) -> ServiceError:
            return insufficient_storage(f"uploads would hold {used + size} bytes, above the quota of {quota} bytes "
                                        "(--max-uploads-bytes); DELETE /v1/uploads/{upload_id} of uploads you no "
                                        "longer need (GET /v1/uploads lists them), then retry")

        if used + declared > quota:
            raise over_quota(declared)
        full = free_space_problem(settings.cache_dir, declared, settings.min_free_bytes)
        if full is not None:
            raise full
        part = settings.scratch_dir / f"upload-{uuid.uuid4().hex}.part"
        digest, size = hashlib.sha256(), 0
        try:
            with open(part, "wb") as f:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise ServiceError(413, "Content Too Large", f"upload is more than {limit} bytes (the limit); "
                                           "split the data, or ask the operator to raise --max-upload-bytes "
                                           "(PF_SERVICE_MAX_UPLOAD_BYTES)", kind="too-large", field="body",
                                           headers={"Connection": "close"})
                    if used + size > quota:
                        raise over_quota(size)
                    digest.update(chunk)
                    await anyio.to_thread.run_sync(f.write, chunk)
            if size == 0:
                raise ServiceError(422, "Unprocessable Content", "body: the upload is empty (0 bytes); send the file's "
                                   "bytes as the request body", kind="invalid-source", field="body")
            sha = digest.hexdigest()
            upload_id = f"{sha}.{format}"
            target = settings.uploads_dir / upload_id
            if target.exists():
                response.status_code = 200
                upload_store.touch(target)  # used again: its expiry starts over
            else:
                os.replace(part, target)
            last = target.stat().st_mtime
            return UploadInfo(upload_id=upload_id, sha256=sha, size_bytes=size, format=format, last_used_unix=last,
                              expires_unix=last + settings.upload_ttl_s if settings.upload_ttl_s > 0 else None)
        except OSError as exc:
            fault = classify(exc, settings.cache_dir)
            if fault is not None:
                raise fault from exc
            raise
        finally:
            part.unlink(missing_ok=True)

    @app.get("/v1/uploads", response_model=UploadList, tags=["uploads"])
    def list_uploads() -> UploadList:
        """Every upload, least recently used first, with its size and expiry, and the quota they share."""
        items = upload_store.list_uploads(settings.uploads_dir, settings.upload_ttl_s)
        return UploadList(items=[UploadInfo(**i) for i in items if i["format"] in ("jsonl", "json", "parquet", "csv")],
                          total_bytes=sum(i["size_bytes"] for i in items), quota_bytes=settings.max_uploads_bytes)

    @app.delete("/v1/uploads/{upload_id}", status_code=204, tags=["uploads"],
                responses={404: PROBLEM_RESPONSES[404], 409: PROBLEM_RESPONSES[409]})
    def delete_upload(upload_id: str = FastAPIPath(..., pattern=UPLOAD_ID_PATTERN)) -> Response:
        """Delete an upload (409 while a queued or running job reads it; datasets built from it stay)."""
        upload_store.delete_upload(settings.uploads_dir, app.state.store, upload_id)
        return Response(status_code=204)

    @app.get("/v1/datasets", response_model=DatasetList, tags=["datasets"])
    def list_datasets(limit: int = Query(50, ge=1, le=200), cursor: str | None = Query(None, max_length=20),
                      state: Literal["queued", "running", "succeeded", "failed", "cancelled"] | None = None) -> DatasetList:
        """Datasets in creation order, `limit` per page; follow `next_cursor`. Manifests are left out."""
        after = 0
        if cursor is not None:
            if not (cursor.isascii() and cursor.isdigit() and len(cursor) <= 18):  # "¹".isdigit() is True
                raise ServiceError(422, "Unprocessable Content", f"cursor: {cursor!r} is not a cursor; pass the "
                                   "`next_cursor` of the previous page", kind="validation", field="query.cursor")
            after = int(cursor)
        rows = app.state.store.list(limit=limit + 1, after_seq=after, state=state)
        page = rows[:limit]
        return DatasetList(items=[status_of(r, with_manifest=False) for r in page],
                           next_cursor=str(page[-1]["seq"]) if len(rows) > limit else None)

    @app.get("/v1/datasets/{dataset_id}", response_model=DatasetStatus, tags=["datasets"],
             responses={304: {"description": "If-None-Match matched the current ETag: unchanged, no body"},
                        404: PROBLEM_RESPONSES[404]})
    def get_dataset(dataset_id: str, if_none_match: str | None = Header(
            None, alias="If-None-Match", max_length=1024,
            description="An ETag from an earlier answer: 304 Not Modified while the status is unchanged")):
        """State, progress, error (when failed or cancelled), manifest and shards path (when succeeded).
        Carries an `ETag`; send it back as `If-None-Match` to get 304 while nothing changed."""
        status = status_of(get_row(dataset_id))
        tag = etag_of(status)
        if if_none_match and (if_none_match.strip() == "*" or
                              tag in [t.strip().removeprefix("W/") for t in if_none_match.split(",")]):
            return Response(status_code=304, headers={"ETag": tag})
        return Response(status.model_dump_json(), media_type="application/json", headers={"ETag": tag})

    @app.get("/v1/datasets/{dataset_id}/events", response_class=EventSourceResponse, tags=["datasets"],
             responses={200: {"description": "text/event-stream of DatasetEvent: `event:` is the kind (queued, "
                              "started, progress, requeued, succeeded, failed, cancelled, deleted), `id:` the "
                              "resume point, `data:` a DatasetEvent. The stream ends after a terminal event.",
                              "content": {"text/event-stream": {"schema": DatasetEvent.model_json_schema()}}},
                        404: PROBLEM_RESPONSES[404]})
    async def dataset_events(dataset_id: str, _row: dict = Depends(existing_row), last_event_id: str | None = Header(
            None, alias="Last-Event-ID", max_length=20,
            description="Resume after this event id (what EventSource sends on reconnect)")):
        """Server-Sent Events of this dataset's state changes and progress, from its creation (or after
        `Last-Event-ID`), ending with its terminal event (succeeded, failed, cancelled or deleted). A client
        that resumes after the terminal event gets it once more (without an id) and the stream ends."""
        store = app.state.store
        after = int(last_event_id) if last_event_id and last_event_id.isascii() and last_event_id.isdigit() else 0
        while True:
            events = await anyio.to_thread.run_sync(store.events, dataset_id, after)
            for ev in events:
                after = int(ev["seq"])
                data = json.loads(ev["data"])
                yield ServerSentEvent(event=ev["kind"], id=str(after), data=DatasetEvent(
                    id=dataset_id, kind=ev["kind"], **data).model_dump(exclude_none=True))
                if ev["kind"] in (*TERMINAL, "deleted"):
                    return
            if not events:
                row = await anyio.to_thread.run_sync(store.get, dataset_id)
                if row is None:  # deleted, and its events with it
                    yield ServerSentEvent(event="deleted", data=DatasetEvent(id=dataset_id, kind="deleted",
                                                                              state="deleted").model_dump(exclude_none=True))
                    return
                if row["state"] in TERMINAL:  # its terminal event is behind Last-Event-ID (or predates events)
                    status = status_of(row, with_manifest=False)
                    yield ServerSentEvent(event=row["state"], data=DatasetEvent(
                        id=dataset_id, kind=row["state"], state=row["state"], **status.progress.model_dump(
                            include={"rows_done", "rows_total", "tokens_done"})).model_dump(exclude_none=True))
                    return
            await anyio.sleep(0.25)

    @app.post("/v1/datasets/{dataset_id}/cancel", response_model=DatasetStatus, tags=["datasets"],
              responses={404: PROBLEM_RESPONSES[404], 409: PROBLEM_RESPONSES[409]})
    def cancel_dataset(dataset_id: str) -> DatasetStatus:
        """Stop a queued or running job: state `cancelled`, nothing published, the job kept for inspection
        (POST the request again to rebuild it). Cancelling a cancelled job is a no-op; a finished one is 409."""
        before, after = app.state.store.cancel(dataset_id)
        if before is None:
            get_row(dataset_id)  # raises the 404
        if after is None:
            if before["state"] == "cancelled":
                return status_of(before)
            raise ServiceError(409, "Conflict", f"dataset {dataset_id} already {before['state']}; only queued or "
                               "running jobs can be cancelled (DELETE removes a dataset)", kind="not-cancellable",
                               field="dataset_id")
        if before["state"] == "running" and before["replica"] == app.state.store.replica:
            app.state.supervisor.kill(before["worker_pid"])  # else its replica's worker notices within a second
        return status_of(after)

    @app.get("/v1/datasets/{dataset_id}/lengths", response_model=LengthStats, tags=["datasets"],
             responses={404: PROBLEM_RESPONSES[404], 409: PROBLEM_RESPONSES[409]})
    def get_lengths(dataset_id: str) -> LengthStats:
        """Example-length statistics and histogram (what the token-budget sampler plans with)."""
        status = status_of(get_row(dataset_id))
        if status.state != "succeeded" or not status.manifest:
            raise ServiceError(409, "Conflict", f"dataset {dataset_id} is {status.state}; lengths exist once it has "
                               "succeeded (poll GET /v1/datasets/{id})", kind="not-ready", field="dataset_id")
        m = status.manifest
        lengths = m["lengths"]
        return LengthStats(id=dataset_id, examples=m["counts"]["examples"], tokens=m["counts"]["tokens"],
                           max_seq_len=m["max_seq_len"], histogram=lengths["histogram"],
                           **{k: lengths[k] for k in ("min", "mean", "p50", "p90", "p99", "max")})

    @app.delete("/v1/datasets/{dataset_id}", status_code=204, tags=["datasets"],
                responses={404: PROBLEM_RESPONSES[404]})
    def delete_dataset(dataset_id: str) -> Response:
        """Forget a dataset: a running job is killed, a built directory removed (open readers keep their files)."""
        trash = settings.scratch_dir / f"trash-{dataset_id}-{uuid.uuid4().hex[:8]}"

        def move_away(row: dict[str, Any]) -> None:
            target = settings.datasets_dir / dataset_id
            if target.exists():
                os.rename(target, trash)  # atomic: the dataset disappears whole

        row = app.state.store.delete(dataset_id, move_away)
        if row is None:
            get_row(dataset_id)  # raises the 404
        if row["state"] == "running" and row["replica"] == app.state.store.replica:
            app.state.supervisor.kill(row["worker_pid"])
        shutil.rmtree(trash, ignore_errors=True)
        return Response(status_code=204)

    @app.get("/healthz", response_model=Health, tags=["ops"])
    def healthz() -> Health:
        """Liveness: the process answers (no auth)."""
        return Health(status="ok")

    @app.get("/readyz", response_model=Health, tags=["ops"], responses={503: PROBLEM_RESPONSES[503]})
    def readyz():
        """Readiness: database reachable, cache dir writable with at least min_free_bytes free, a warm worker and a
        preflight sandbox (no auth). 503 (problem+json, Retry-After) with every check's result otherwise."""
        checks: dict[str, Any] = {}
        try:
            app.state.store.query("SELECT 1")
            checks["database"] = "ok"
        except Exception as exc:
            checks["database"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        checks["cache_dir_writable"] = os.access(settings.cache_dir, os.W_OK)
        try:
            checks["free_bytes"] = shutil.disk_usage(settings.cache_dir).free
        except OSError as exc:
            checks["free_bytes"] = f"error: {exc}"
        checks["min_free_bytes"] = settings.min_free_bytes
        live = app.state.supervisor.live_pids()
        try:
            ready = app.state.store.ready_worker_pids() & live if checks["database"] == "ok" else set()
        except Exception:
            ready = set()
        checks["workers_alive"], checks["workers_ready"] = len(live), len(ready)
        checks["preflight_ready"] = app.state.preflight.ready()
        enough_space = isinstance(checks["free_bytes"], int) and checks["free_bytes"] >= settings.min_free_bytes
        ok = (checks["database"] == "ok" and checks["cache_dir_writable"] and enough_space and ready
              and checks["preflight_ready"] > 0)
        if not ok:
            return problem(503, problem_body(503, "Service Unavailable", f"not ready: {checks}", kind="not-ready",
                                             instance="/readyz"), {"Retry-After": "2"})
        return Health(status="ready", checks=checks)

    @app.get("/metrics", response_class=PlainTextResponse, tags=["ops"])
    def metrics() -> PlainTextResponse:
        """Prometheus text format: jobs by state, rows and tokens tokenized, job durations."""
        store = app.state.store
        counts, counters = store.counts_by_state(), store.counters()
        running = store.query("SELECT COALESCE(SUM(rows_done),0) AS r, COALESCE(SUM(tokens_done),0) AS t "
                              "FROM jobs WHERE state='running'")[0]
        lines = ["# HELP pf_service_jobs Jobs in the store, by state.", "# TYPE pf_service_jobs gauge"]
        lines += [f'pf_service_jobs{{state="{s}"}} {counts[s]}' for s in STATES]
        lines += ["# HELP pf_service_jobs_finished_total Jobs that ended, by result.",
                  "# TYPE pf_service_jobs_finished_total counter",
                  *[f'pf_service_jobs_finished_total{{result="{r}"}} {int(counters.get(f"jobs_{r}_total", 0))}'
                    for r in ("succeeded", "failed", "cancelled", "deleted")],
                  "# HELP pf_service_datasets_withdrawn_total Published datasets found corrupt and withdrawn.",
                  "# TYPE pf_service_datasets_withdrawn_total counter",
                  f"pf_service_datasets_withdrawn_total {int(counters.get('jobs_corrupt_total', 0))}",
                  "# HELP pf_service_rows_tokenized_total Source rows of succeeded jobs.",
                  "# TYPE pf_service_rows_tokenized_total counter",
                  f"pf_service_rows_tokenized_total {int(counters.get('rows_tokenized_total', 0))}",
                  "# HELP pf_service_tokens_tokenized_total Tokens written by succeeded jobs.",
                  "# TYPE pf_service_tokens_tokenized_total counter",
                  f"pf_service_tokens_tokenized_total {int(counters.get('tokens_tokenized_total', 0))}",
                  "# HELP pf_service_rows_in_progress Rows done so far by running jobs.",
                  "# TYPE pf_service_rows_in_progress gauge",
                  f"pf_service_rows_in_progress {running['r']}",
                  "# HELP pf_service_job_duration_seconds Wall time of ended jobs (claim to succeeded, failed, "
                  "cancelled or deleted while running).",
                  "# TYPE pf_service_job_duration_seconds histogram"]
        lines += [f'pf_service_job_duration_seconds_bucket{{le="{le}"}} {int(counters.get(f"duration_bucket:{le}", 0))}'
                  for le in DURATION_BUCKETS]
        total = int(counters.get("duration_bucket:+Inf", 0))
        lines += [f'pf_service_job_duration_seconds_bucket{{le="+Inf"}} {total}',
                  f"pf_service_job_duration_seconds_sum {counters.get('duration_sum', 0.0):.3f}",
                  f"pf_service_job_duration_seconds_count {total}",
                  "# HELP pf_service_workers Worker processes alive.", "# TYPE pf_service_workers gauge",
                  f"pf_service_workers {len(app.state.supervisor.live_pids())}",
                  "# HELP pf_service_uptime_seconds Seconds since the service started.",
                  "# TYPE pf_service_uptime_seconds gauge",
                  f"pf_service_uptime_seconds {time.time() - app.state.started:.1f}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    # The last added middleware is the outermost: auth runs first, so an unauthenticated client
    # cannot make the service buffer a body.
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes,
                       max_upload_bytes=settings.max_upload_bytes)
    app.add_middleware(BearerAuthMiddleware, token=settings.token)
    app.add_middleware(RateLimitMiddleware, per_minute=settings.rate_limit_per_minute)  # before auth: guessing too
    return app


def _title(status: int) -> str:
    from http import HTTPStatus

    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"
