"""``/v1/datasets``: create (content-addressed, idempotent), list, read (with ETag), cancel, lengths, delete."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Header, Query, Response

from preprocess_service.deps import SettingsDep, StoreDep, SubmitterDep, SupervisorDep, ViewsDep
from preprocess_service.faults import free_space_problem
from preprocess_service.schemas import PROBLEM_RESPONSES, DatasetList, DatasetRequest, DatasetStatus, LengthStats
from preprocess_service.security import ServiceError
from preprocess_service.store import IDEMPOTENCY_TTL_S, IdempotencyMismatch
from preprocess_service.views import created_answer, etag_of

router = APIRouter(tags=["datasets"])

CREATED_RESPONSES = {200: {"model": DatasetStatus, "description": "already built: the manifest, no work"},
                     202: {"description": "queued or running (Location: the status URL)"},
                     **{k: PROBLEM_RESPONSES[k] for k in (403, 413, 429, 503, 507)}}
"""The answers of the POSTs that create a dataset (here and ``/v1/mixtures``)."""


def refuse_when_disk_full(settings) -> None:
    """507 before any work when the cache dir is below ``min_free_bytes``."""
    full = free_space_problem(settings.cache_dir, 0, settings.min_free_bytes)
    if full is not None:
        raise full


def _key_reused(key: str) -> ServiceError:
    return ServiceError(422, "Unprocessable Content", f"Idempotency-Key {key!r} was already used with another "
                        "request body; use a new key for a new request", kind="idempotency-key-reused",
                        field="header.idempotency-key")


@router.post("/v1/datasets", response_model=DatasetStatus, status_code=202, responses=CREATED_RESPONSES)
def create_dataset(body: DatasetRequest, response: Response, settings: SettingsDep, store: StoreDep,
                   submitter: SubmitterDep, views: ViewsDep,
                   idempotency_key: str | None = Header(
                       None, alias="Idempotency-Key", min_length=1, max_length=255, pattern=r"^[\x21-\x7e]+$",
                       description="IETF httpapi Idempotency-Key (a string, quoted or not): the same key with "
                       "the same body answers with the same job, even after it was deleted and rebuilt; "
                       "the same key with another body is a 422. Keys are remembered for "
                       f"{int(IDEMPOTENCY_TTL_S // 3600)} hours.")) -> DatasetStatus:
    """Tokenize a source into a shards dataset (content-addressed: the same request is the same job)."""
    key = idempotency_key.strip('"') if idempotency_key else None
    fingerprint = hashlib.sha256(json.dumps(body.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()
    if key:
        try:
            known = store.idempotent(key, fingerprint)
        except IdempotencyMismatch as exc:
            raise _key_reused(key) from exc
        row = store.get(known) if known else None
        if row is not None and row["state"] not in ("failed", "cancelled"):
            status = views.status(row)
            if status.state not in ("failed", "cancelled"):
                return created_answer(status, response)
    refuse_when_disk_full(settings)
    row, _created = submitter.submit(body)
    if key:
        try:
            store.remember_key(key, fingerprint, row["id"])
        except IdempotencyMismatch as exc:  # a concurrent request won the key with another body
            raise _key_reused(key) from exc
    return created_answer(views.status(row), response)


@router.get("/v1/datasets", response_model=DatasetList)
def list_datasets(store: StoreDep, views: ViewsDep, limit: int = Query(50, ge=1, le=200),
                  cursor: str | None = Query(None, max_length=20),
                  state: Literal["queued", "running", "succeeded", "failed", "cancelled"] | None = None) -> DatasetList:
    """Datasets in creation order, `limit` per page; follow `next_cursor`. Manifests are left out."""
    after = 0
    if cursor is not None:
        if not (cursor.isascii() and cursor.isdigit() and len(cursor) <= 18):  # "¹".isdigit() is True
            raise ServiceError(422, "Unprocessable Content", f"cursor: {cursor!r} is not a cursor; pass the "
                               "`next_cursor` of the previous page", kind="validation", field="query.cursor")
        after = int(cursor)
    rows = store.list(limit=limit + 1, after_seq=after, state=state)
    page = rows[:limit]
    return DatasetList(items=[views.status(r, with_manifest=False) for r in page],
                       next_cursor=str(page[-1]["seq"]) if len(rows) > limit else None)


@router.get("/v1/datasets/{dataset_id}", response_model=DatasetStatus,
            responses={304: {"description": "If-None-Match matched the current ETag: unchanged, no body"},
                       404: PROBLEM_RESPONSES[404]})
def get_dataset(dataset_id: str, views: ViewsDep, if_none_match: str | None = Header(
        None, alias="If-None-Match", max_length=1024,
        description="An ETag from an earlier answer: 304 Not Modified while the status is unchanged")):
    """State, progress, error (when failed or cancelled), manifest and shards path (when succeeded).
    Carries an `ETag`; send it back as `If-None-Match` to get 304 while nothing changed."""
    status = views.status(views.row(dataset_id))
    tag = etag_of(status)
    if if_none_match and (if_none_match.strip() == "*" or
                          tag in [t.strip().removeprefix("W/") for t in if_none_match.split(",")]):
        return Response(status_code=304, headers={"ETag": tag})
    return Response(status.model_dump_json(), media_type="application/json", headers={"ETag": tag})


@router.post("/v1/datasets/{dataset_id}/cancel", response_model=DatasetStatus,
             responses={404: PROBLEM_RESPONSES[404], 409: PROBLEM_RESPONSES[409]})
def cancel_dataset(dataset_id: str, store: StoreDep, supervisor: SupervisorDep, views: ViewsDep) -> DatasetStatus:
    """Stop a queued or running job: state `cancelled`, nothing published, the job kept for inspection
    (POST the request again to rebuild it). Cancelling a cancelled job is a no-op; a finished one is 409."""
    before, after = store.cancel(dataset_id)
    if before is None:
        views.row(dataset_id)  # raises the 404
    if after is None:
        if before["state"] == "cancelled":
            return views.status(before)
        raise ServiceError(409, "Conflict", f"dataset {dataset_id} already {before['state']}; only queued or "
                           "running jobs can be cancelled (DELETE removes a dataset)", kind="not-cancellable",
                           field="dataset_id")
    if before["state"] == "running" and before["replica"] == store.replica:
        supervisor.kill(before["worker_pid"])  # else its replica's worker notices within a second
    return views.status(after)


@router.get("/v1/datasets/{dataset_id}/lengths", response_model=LengthStats,
            responses={404: PROBLEM_RESPONSES[404], 409: PROBLEM_RESPONSES[409]})
def get_lengths(dataset_id: str, views: ViewsDep) -> LengthStats:
    """Example-length statistics and histogram (what the token-budget sampler plans with)."""
    status = views.status(views.row(dataset_id))
    if status.state != "succeeded" or not status.manifest:
        raise ServiceError(409, "Conflict", f"dataset {dataset_id} is {status.state}; lengths exist once it has "
                           "succeeded (poll GET /v1/datasets/{id})", kind="not-ready", field="dataset_id")
    m = status.manifest
    lengths = m["lengths"]
    return LengthStats(id=dataset_id, examples=m["counts"]["examples"], tokens=m["counts"]["tokens"],
                       max_seq_len=m["max_seq_len"], histogram=lengths["histogram"],
                       **{k: lengths[k] for k in ("min", "mean", "p50", "p90", "p99", "max")})


@router.delete("/v1/datasets/{dataset_id}", status_code=204, responses={404: PROBLEM_RESPONSES[404]})
def delete_dataset(dataset_id: str, settings: SettingsDep, store: StoreDep, supervisor: SupervisorDep,
                   views: ViewsDep) -> Response:
    """Forget a dataset: a running job is killed, a built directory removed (open readers keep their files)."""
    trash = settings.scratch_dir / f"trash-{dataset_id}-{uuid.uuid4().hex[:8]}"

    def move_away(row: dict[str, Any]) -> None:
        target = settings.datasets_dir / dataset_id
        if target.exists():
            os.rename(target, trash)  # atomic: the dataset disappears whole

    row = store.delete(dataset_id, move_away)
    if row is None:
        views.row(dataset_id)  # raises the 404
    if row["state"] == "running" and row["replica"] == store.replica:
        supervisor.kill(row["worker_pid"])
    shutil.rmtree(trash, ignore_errors=True)
    return Response(status_code=204)
