"""A job row as the API shows it: :class:`DatasetStatus` (state, progress, error, manifest, links), its ETag, the
404 of an unknown id, and the answer of the two POSTs that create a dataset."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from fastapi import Response

from preprocess_service.schemas import DatasetStatus
from preprocess_service.security import ServiceError
from preprocess_service.store import TERMINAL


class DatasetViews:
    """Rows of the job store -> API answers (a corrupt published dataset is withdrawn on the way)."""

    def __init__(self, settings, store, integrity):
        self.settings, self.store, self.integrity = settings, store, integrity

    def row(self, dataset_id: str) -> dict[str, Any]:
        """The job row of ``dataset_id``; 404 (problem+json) when there is none."""
        row = self.store.get(dataset_id)
        if row is None:
            raise ServiceError(404, "Not Found", f"dataset_id: no dataset {dataset_id!r}; POST /v1/datasets to create "
                               "it, or GET /v1/datasets to list the known ones", kind="unknown-dataset",
                               field="dataset_id")
        return row

    def status(self, row: dict[str, Any], *, with_manifest: bool = True) -> DatasetStatus:
        """The status of a job row; ``with_manifest=False`` (lists, streams) skips the manifest and its check."""
        from pf_trl.data.shards import is_shards_dir

        settings = self.settings
        if with_manifest:  # a corrupt dataset is withdrawn, never reported as succeeded
            row = self.integrity.ensure(row)
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
        fraction = round(row["rows_done"] / rows_total, 4) if rows_total else (1.0 if state == "succeeded" else None)
        progress = {
            "rows_done": row["rows_done"], "rows_total": rows_total, "tokens_done": row["tokens_done"],
            "fraction": fraction,
            "rows_per_s": round(row["rows_done"] / elapsed, 1) if elapsed and row["rows_done"] else None,
            "tokens_per_s": round(row["tokens_done"] / elapsed, 1) if elapsed and row["tokens_done"] else None,
        }
        manifest = json.loads(row["manifest"]) if (row["manifest"] and with_manifest) else None
        shown = req.get("source_shown", {})
        return DatasetStatus(
            id=row["id"], state=state, done=state in TERMINAL, created_unix=row["created_at"],
            started_unix=row["started_at"], finished_unix=row["finished_at"], updated_unix=row["updated_at"],
            attempts=row["attempts"], worker_pid=row["worker_pid"] if state == "running" else None,
            progress=progress, error=error,
            source={"path": shown.get("path"), "upload_id": shown.get("upload_id"), "files": shown.get("files"),
                    "sha256": req["source_sha256"],
                    "size_bytes": req["source_size"]},
            tokenizer={"name": req["tokenizer_name"], "sha256": req["tokenizer_sha256"]},
            options=req["options"],
            shards_path=settings.reported_shards_path(row["id"]) if state == "succeeded" else None,
            manifest=manifest if state == "succeeded" else None,
            links={"self": f"/v1/datasets/{row['id']}", "lengths": f"/v1/datasets/{row['id']}/lengths",
                   "events": f"/v1/datasets/{row['id']}/events", "cancel": f"/v1/datasets/{row['id']}/cancel"},
        )


def etag_of(status: DatasetStatus) -> str:
    """A strong ETag of the status as answered (any change of state, progress or manifest changes it)."""
    return '"' + hashlib.sha256(status.model_dump_json().encode()).hexdigest()[:32] + '"'


def created_answer(status: DatasetStatus, response: Response) -> DatasetStatus:
    """The answer to a POST that creates (or finds) a dataset: 200 when built, else 202; Location and ETag."""
    response.headers["Location"] = f"/v1/datasets/{status.id}"
    response.headers["ETag"] = etag_of(status)
    response.status_code = 200 if status.state == "succeeded" else 202
    return status
