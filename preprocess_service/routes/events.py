"""``GET /v1/datasets/{id}/events``: the dataset's history and progress as Server-Sent Events."""

from __future__ import annotations

import json

import anyio
from fastapi import APIRouter, Header
from fastapi.sse import EventSourceResponse, ServerSentEvent

from preprocess_service.deps import ExistingRow, StoreDep, ViewsDep
from preprocess_service.schemas import PROBLEM_RESPONSES, DatasetEvent
from preprocess_service.store import TERMINAL

router = APIRouter(tags=["datasets"])
POLL_S = 0.25


def _event(dataset_id: str, kind: str, event_id: str | None = None, **fields) -> ServerSentEvent:
    return ServerSentEvent(event=kind, id=event_id, data=DatasetEvent(id=dataset_id, kind=kind, **fields).model_dump(
        exclude_none=True))


@router.get("/v1/datasets/{dataset_id}/events", response_class=EventSourceResponse,
            responses={200: {"description": "text/event-stream of DatasetEvent: `event:` is the kind (queued, "
                             "started, downloading (a Hub source), progress, requeued, succeeded, failed, cancelled, "
                             "deleted), `id:` the resume point, `data:` a DatasetEvent. The stream ends after a "
                             "terminal event.",
                             "content": {"text/event-stream": {"schema": DatasetEvent.model_json_schema()}}},
                       404: PROBLEM_RESPONSES[404]})
async def dataset_events(dataset_id: str, _row: ExistingRow, store: StoreDep, views: ViewsDep,
                         last_event_id: str | None = Header(
                             None, alias="Last-Event-ID", max_length=20,
                             description="Resume after this event id (what EventSource sends on reconnect)")):
    """Server-Sent Events of this dataset's state changes and progress, from its creation (or after
    `Last-Event-ID`), ending with its terminal event (succeeded, failed, cancelled or deleted). A client
    that resumes after the terminal event gets it once more (without an id) and the stream ends."""
    after = int(last_event_id) if last_event_id and last_event_id.isascii() and last_event_id.isdigit() else 0
    while True:
        events = await anyio.to_thread.run_sync(store.events, dataset_id, after)
        for ev in events:
            after = int(ev["seq"])
            yield _event(dataset_id, ev["kind"], str(after), **json.loads(ev["data"]))
            if ev["kind"] in (*TERMINAL, "deleted"):
                return
        if not events:
            row = await anyio.to_thread.run_sync(store.get, dataset_id)
            if row is None:  # deleted, and its events with it
                yield _event(dataset_id, "deleted", state="deleted")
                return
            if row["state"] in TERMINAL:  # its terminal event is behind Last-Event-ID (or predates events)
                progress = views.status(row, with_manifest=False).progress
                yield _event(dataset_id, row["state"], state=row["state"],
                             **progress.model_dump(include={"rows_done", "rows_total", "tokens_done"}))
                return
        await anyio.sleep(POLL_S)
