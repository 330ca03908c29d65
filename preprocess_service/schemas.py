"""Request/response models (pydantic v2) and RFC 9457 problem details.

``PretokenizeOptions`` mirrors :class:`pf_trl.data.pretokenize.PretokenizeConfig` field for field (a test
checks they stay in step); unknown fields are rejected so that a typo never silently becomes a default.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pf_trl.data.tokenizer import DEFAULT_TOKENIZER

PROBLEM_JSON = "application/problem+json"
PROBLEM_BASE = "https://pf-trl.dev/problems/"  # identifiers only; documented in docs/service.md

JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
UPLOAD_ID_PATTERN = r"^[0-9a-f]{64}\.(jsonl|json|parquet|csv)$"


def _exactly_one_schema(schema: dict[str, Any]) -> None:
    """OpenAPI: exactly one of the two fields, neither null (what the validator below enforces)."""
    for name in ("path", "upload_id"):
        prop = schema["properties"][name]
        branch = next(b for b in prop.pop("anyOf") if b.get("type") != "null")
        prop.update(branch)
        prop.pop("default", None)
    schema["oneOf"] = [{"required": ["path"]}, {"required": ["upload_id"]}]


class SourceSpec(BaseModel):
    """Where the rows come from: exactly one of ``path`` or ``upload_id``."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_exactly_one_schema)

    path: str | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="A file (JSON/JSONL/Parquet/CSV) or a `save_to_disk` folder under one of the service's "
        "data roots; a relative path is taken relative to the first data root.",
        examples=["/data/sharegpt.jsonl"],
    )
    upload_id: str | None = Field(
        None,
        pattern=UPLOAD_ID_PATTERN,
        description="The `upload_id` returned by `POST /v1/uploads`.",
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> "SourceSpec":
        if (self.path is None) == (self.upload_id is None):
            raise ValueError("give exactly one of `path` (a file under a data root) or `upload_id` (from POST /v1/uploads)")
        return self


class PretokenizeOptions(BaseModel):
    """The options of ``pf-trl pretokenize`` (PretokenizeConfig); each is part of the dataset id."""

    model_config = ConfigDict(extra="forbid", strict=True)

    input_format: Literal["auto", "pretokenized", "text", "prompt_completion", "messages",
                          "conversational_prompt_completion", "alpaca", "sharegpt"] = "auto"
    text_field: str = Field("text", min_length=1, max_length=256)
    prompt_field: str = Field("prompt", min_length=1, max_length=256)
    completion_field: str = Field("completion", min_length=1, max_length=256)
    messages_field: str = Field("messages", min_length=1, max_length=256)
    input_ids_field: str = Field("input_ids", min_length=1, max_length=256)
    labels_field: str = Field("labels", min_length=1, max_length=256)
    response_template: str | None = Field(None, min_length=1, max_length=1024,
                                          description="For input_format 'text': loss starts after its last occurrence.")
    max_seq_len: int = Field(1024, gt=0, le=1 << 20, description="Longest example kept, in tokens.")
    truncation: Literal["truncate", "drop", "error"] = "truncate"
    add_eos: bool = True
    drop_no_loss: bool = True
    shard_size: str = Field("500MB", description="Arrow shard size: 1MB .. 9999999MB (MB, GB, MiB, GiB).",
                            pattern=r"^[1-9][0-9]{0,6}(MB|GB|MiB|GiB)$")
    instruction_field: str = Field("instruction", min_length=1, max_length=256)
    input_field: str = Field("input", min_length=1, max_length=256)
    output_field: str = Field("output", min_length=1, max_length=256)
    conversations_field: str = Field("conversations", min_length=1, max_length=256)
    completion_only_loss: bool = Field(True, description="Prompt-completion formats and TRL's completion_mask: loss "
                                       "on the completion only.")


class DatasetRequest(BaseModel):
    """Body of ``POST /v1/datasets``."""

    model_config = ConfigDict(extra="forbid", strict=True,
                              json_schema_extra={"examples": [{"source": {"path": "/data/sharegpt.jsonl"},
                                                               "options": {"max_seq_len": 2048}}]})

    source: SourceSpec
    tokenizer: str = Field(DEFAULT_TOKENIZER, min_length=1, max_length=4096,
                           description="The embedded default 'pf-trl/mistral-7b-v0.1', or a local tokenizer "
                           "folder under a data root. No hub access; remote code is never executed.")
    options: PretokenizeOptions = Field(default_factory=PretokenizeOptions)


class Progress(BaseModel):
    rows_done: int = 0
    rows_total: int | None = None
    tokens_done: int = 0
    fraction: float | None = None
    rows_per_s: float | None = None
    tokens_per_s: float | None = None


class ErrorInfo(BaseModel):
    type: str = Field(description="invalid_data | disk_full | io_error | interrupted | worker_died | internal "
                      "| cancelled | corrupt (a published dataset whose files no longer match their checksums)")
    message: str


class SourceInfo(BaseModel):
    path: str | None = None
    upload_id: str | None = None
    sha256: str
    size_bytes: int


class TokenizerInfo(BaseModel):
    name: str
    sha256: str


class DatasetStatus(BaseModel):
    """The one status shape of a dataset job (a long-running operation in the sense of Google AIP-151:
    ``done`` says it ended; then ``error`` says why it failed or was cancelled, or ``manifest`` and
    ``shards_path`` are its result; ``progress`` is its metadata while it runs)."""

    id: str = Field(description="sha256 (first 32 hex digits) of the source bytes, tokenizer identity and options")
    state: JobState = Field(description="queued -> running -> succeeded | failed | cancelled")
    done: bool = Field(False, description="True once the state is succeeded, failed or cancelled (it changes no more "
                       "unless the request is POSTed again after a failure or cancel)")
    created_unix: float
    started_unix: float | None = None
    finished_unix: float | None = None
    updated_unix: float | None = None
    attempts: int = 0
    worker_pid: int | None = None
    progress: Progress
    error: ErrorInfo | None = None
    source: SourceInfo
    tokenizer: TokenizerInfo
    options: dict[str, Any]
    shards_path: str | None = Field(None, description="The shards directory (set when succeeded), for load_shards")
    manifest: dict[str, Any] | None = None
    links: dict[str, str] = Field(default_factory=dict)


class DatasetEvent(BaseModel):
    """The `data:` of one Server-Sent Event of ``GET /v1/datasets/{id}/events``."""

    id: str = Field(description="the dataset id")
    kind: Literal["queued", "started", "progress", "requeued", "succeeded", "failed", "cancelled", "deleted"]
    state: Literal["queued", "running", "succeeded", "failed", "cancelled", "deleted"]
    rows_done: int | None = None
    rows_total: int | None = Field(None, description="known from the start when the source tells it (Parquet "
                                   "metadata, JSONL line count)")
    tokens_done: int | None = None
    attempt: int | None = None
    error_type: str | None = None
    error: str | None = None
    seconds: float | None = Field(None, description="job wall time, on terminal events")
    worker_pid: int | None = None
    examples: int | None = None
    recovered: bool | None = None
    previous_state: str | None = None


class DatasetList(BaseModel):
    items: list[DatasetStatus]
    next_cursor: str | None = Field(None, description="Pass as `cursor` to get the next page; null on the last page")


class LengthStats(BaseModel):
    id: str
    examples: int
    tokens: int
    max_seq_len: int
    min: int
    mean: float
    p50: int
    p90: int
    p99: int
    max: int
    histogram: dict[str, list[int]] = Field(description="`edges` (bins+1 token counts) and `counts` (bins)")


class UploadInfo(BaseModel):
    upload_id: str
    sha256: str
    size_bytes: int
    format: Literal["jsonl", "json", "parquet", "csv"]
    last_used_unix: float | None = Field(None, description="uploaded, or last named by a POST /v1/datasets")
    expires_unix: float | None = Field(None, description="deleted after this time unless used again (null: never)")


class UploadList(BaseModel):
    items: list[UploadInfo]
    total_bytes: int
    quota_bytes: int


class Health(BaseModel):
    status: str
    checks: dict[str, Any] = Field(default_factory=dict)


class FieldError(BaseModel):
    field: str
    message: str


class Problem(BaseModel):
    """RFC 9457 problem details (``application/problem+json``)."""

    type: str
    title: str
    status: int
    detail: str
    instance: str | None = None
    errors: list[FieldError] | None = None


def problem_body(status: int, title: str, detail: str, *, kind: str, instance: str | None = None,
                 errors: list[dict[str, str]] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"type": PROBLEM_BASE + kind, "title": title, "status": status, "detail": detail}
    if instance:
        body["instance"] = instance
    if errors:
        body["errors"] = errors
    return body


PROBLEM_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": Problem, "content": {PROBLEM_JSON: {}}, "description": desc}
    for code, desc in {
        400: "malformed request (e.g. a bad Content-Length)",
        401: "missing or wrong bearer token",
        403: "path outside the data roots",
        404: "unknown dataset id or route",
        409: "the dataset is not in a state that allows this",
        413: "request body or upload too large",
        422: "invalid request: the message names the field and the fix",
        429: "too many POST/DELETE requests from this client (Retry-After)",
        503: "queue full, database unavailable or service not ready (Retry-After)",
        507: "the service's disk or upload quota is full: nothing was kept",
    }.items()
}
