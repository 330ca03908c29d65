"""``/v1/uploads``: a source file sent as the request body, content-addressed, listed, deleted, expired."""

from __future__ import annotations

import os
import uuid
from typing import Literal

import anyio
from fastapi import APIRouter, Query, Request, Response
from fastapi import Path as FastAPIPath

from preprocess_service import uploads as upload_store
from preprocess_service.deps import SettingsDep, StoreDep
from preprocess_service.faults import classify, free_space_problem, insufficient_storage
from preprocess_service.schemas import PROBLEM_RESPONSES, UPLOAD_FORMATS, UPLOAD_ID_PATTERN, UploadInfo, UploadList
from preprocess_service.security import ServiceError

router = APIRouter(tags=["uploads"])
UploadFormat = Literal[UPLOAD_FORMATS]  # type: ignore[valid-type]  (built from the one suffix list)


def _upload_info(upload_id: str, sha: str, size: int, fmt: str, last: float, ttl_s: float) -> UploadInfo:
    return UploadInfo(upload_id=upload_id, sha256=sha, size_bytes=size, format=fmt, last_used_unix=last,
                      expires_unix=last + ttl_s if ttl_s > 0 else None)


@router.post("/v1/uploads", response_model=UploadInfo, status_code=201,
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}},
             responses={200: {"model": UploadInfo, "description": "the same bytes were uploaded before"},
                        **{k: PROBLEM_RESPONSES[k] for k in (413, 429, 507)}})
async def upload(request: Request, response: Response, settings: SettingsDep,
                 format: UploadFormat = Query(
                     ..., description="How to read the bytes (the upload id keeps it as its suffix)")) -> UploadInfo:
    """Upload a source file as the raw request body (at most max_upload_bytes); use its `upload_id`.
    Uploads count against `max_uploads_bytes` together (507 beyond: DELETE old ones) and are deleted when
    unused for `upload_ttl_s` (see `expires_unix`)."""
    from pf_trl.data.integrity import HASHERS

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
    digest, size = HASHERS["sha256"](), 0  # the sha256 of pf_trl.data's source fingerprints: the same id
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
        return _upload_info(upload_id, sha, size, format, target.stat().st_mtime, settings.upload_ttl_s)
    except OSError as exc:
        fault = classify(exc, settings.cache_dir)
        if fault is not None:
            raise fault from exc
        raise
    finally:
        part.unlink(missing_ok=True)


@router.get("/v1/uploads", response_model=UploadList)
def list_uploads(settings: SettingsDep) -> UploadList:
    """Every upload, least recently used first, with its size and expiry, and the quota they share."""
    items = upload_store.list_uploads(settings.uploads_dir, settings.upload_ttl_s)
    return UploadList(items=[UploadInfo(**i) for i in items if i["format"] in UPLOAD_FORMATS],
                      total_bytes=sum(i["size_bytes"] for i in items), quota_bytes=settings.max_uploads_bytes)


@router.delete("/v1/uploads/{upload_id}", status_code=204,
               responses={404: PROBLEM_RESPONSES[404], 409: PROBLEM_RESPONSES[409]})
def delete_upload(settings: SettingsDep, store: StoreDep,
                  upload_id: str = FastAPIPath(..., pattern=UPLOAD_ID_PATTERN)) -> Response:
    """Delete an upload (409 while a queued or running job reads it; datasets built from it stay)."""
    upload_store.delete_upload(settings.uploads_dir, store, upload_id)
    return Response(status_code=204)
