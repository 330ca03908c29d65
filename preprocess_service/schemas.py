"""Request/response models (pydantic v2) and RFC 9457 problem details.

``PretokenizeOptions`` is built from :class:`pf_trl.data.options.PretokenizeConfig`, the one declaration of the data
options (the CLI flags come from it too); unknown fields are rejected so that a typo never silently becomes a default.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from pf_trl.data.options import for_service, option_specs, option_type
from pf_trl.data.pretokenize import SOURCE_SUFFIXES
from pf_trl.data.tokenizer import DEFAULT_TOKENIZER

PROBLEM_JSON = "application/problem+json"
PROBLEM_BASE = "https://pf-trl.dev/problems/"  # identifiers only; documented in docs/service.md

JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
UPLOAD_FORMATS = tuple(suffix.lstrip(".") for suffix in SOURCE_SUFFIXES)
"""What an upload may be read as: the data file suffixes pf-trl reads (:data:`pf_trl.data.pretokenize.SOURCE_SUFFIXES`)."""
UPLOAD_ID_PATTERN = rf"^[0-9a-f]{{64}}\.({'|'.join(UPLOAD_FORMATS)})$"
MAX_MIXTURE_SOURCES = 16


def _exactly_one_schema(schema: dict[str, Any]) -> None:
    """OpenAPI: exactly one of the three fields, neither null (what the validator below enforces)."""
    for name in ("path", "upload_id", "hub"):
        prop = schema["properties"][name]
        branch = next(b for b in prop.pop("anyOf") if b.get("type") != "null")
        prop.update(branch)
        prop.pop("default", None)
    schema["oneOf"] = [{"required": ["path"]}, {"required": ["upload_id"]}, {"required": ["hub"]}]


class HubSource(BaseModel):
    """A split of a Hugging Face Hub dataset, by repository id (never a URL); the service's ``hub_allow`` setting
    must name the repository or its organisation."""

    model_config = ConfigDict(extra="forbid", strict=True)

    repo_id: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$",
                         description="ORG/NAME of a dataset repository.", examples=["my-org/chat-data"])
    revision: str | None = Field(None, min_length=1, max_length=200, pattern=r"^[\w./-]+$",
                                 description="A branch, tag or commit (default: main).")
    config: str | None = Field(None, min_length=1, max_length=200, pattern=r"^[\w.-]+$",
                               description="A configuration of its README `configs:` (default: the default one).")
    split: str = Field("train", min_length=1, max_length=200, pattern=r"^[\w.-]+$", description="The split to read.")


class SourceSpec(BaseModel):
    """Where the rows come from: exactly one of ``path``, ``upload_id`` or ``hub``."""

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
    hub: HubSource | None = Field(None, description="A split of a Hugging Face Hub dataset the service allows.")

    @model_validator(mode="after")
    def _exactly_one(self) -> SourceSpec:
        if sum(v is not None for v in (self.path, self.upload_id, self.hub)) != 1:
            raise ValueError("give exactly one of `path` (a file under a data root), `upload_id` (from POST "
                             "/v1/uploads) or `hub` (a Hub dataset the service allows)")
        return self


def _options_model() -> type[BaseModel]:
    """``PretokenizeOptions``: one pydantic field per data option of :class:`pf_trl.data.options.PretokenizeConfig`
    (types, defaults, allowed values and bounds from its declaration)."""
    fields: dict[str, Any] = {}
    for name, (f, spec) in option_specs().items():
        kind = option_type(f)
        if spec.choices is not None:
            kind = Literal[spec.choices]  # type: ignore[valid-type]
        if f.default is None:
            kind = kind | None
        constraints: dict[str, Any] = {}
        if spec.positive:
            constraints["gt"] = 0
        if spec.maximum is not None:
            constraints["le"] = spec.maximum
        for key in ("min_length", "max_length", "pattern"):
            if getattr(spec, key) is not None:
                constraints[key] = getattr(spec, key)
        description = for_service(spec.help).replace(" (the CLI reads it from a FILE)", " (the template's text)")
        fields[name] = (kind, Field(f.default, description=description, **constraints))
    return create_model("PretokenizeOptions", __config__=ConfigDict(extra="forbid", strict=True),
                        __doc__="The data options of ``pf-trl pretokenize`` (PretokenizeConfig); each is part of the "
                        "dataset id.", **fields)


PretokenizeOptions = _options_model()


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


class MixtureSourceSpec(BaseModel):
    """One source of a mixture: where its rows are, its share, and its own pretokenize options (its format)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str | None = Field(None, min_length=1, max_length=256, pattern=r"^[A-Za-z0-9_.-]+$",
                             description="Unique name (reported per source in the manifest). Default: source_<i>.")
    source: SourceSpec
    weight: float | None = Field(None, ge=0, le=1e9, allow_inf_nan=False,
                                 description="Share of each epoch (weights are normalised); omit on every source for a "
                                 "plain concatenation.")
    options: PretokenizeOptions = Field(default_factory=PretokenizeOptions)


class MixtureRule(BaseModel):
    """How the sources are mixed (the data config's ``dataprocessor`` fields)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    seed: int = Field(42, ge=0, le=2**63 - 1, description="Seed of the per-epoch draws.")
    sample_by: Literal["examples", "tokens"] = Field("examples", description="What the weights are shares of.")
    stopping_strategy: Literal["all_exhausted", "first_exhausted"] = Field(
        "all_exhausted", description="all_exhausted: an epoch sees every source whole (light ones repeated); "
        "first_exhausted: no source is repeated within an epoch.")


class MixtureRequest(BaseModel):
    """Body of ``POST /v1/mixtures``: several sources, each tokenized with its own options, as one dataset."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [{"sources": [
        {"name": "alpaca", "source": {"path": "/data/alpaca.jsonl"}, "weight": 0.5},
        {"name": "chats", "source": {"path": "/data/chats.jsonl"}, "weight": 0.5,
         "options": {"input_format": "messages"}}]}]})

    sources: list[MixtureSourceSpec] = Field(min_length=1, max_length=MAX_MIXTURE_SOURCES,
                                             description="At most 16 sources; the body may be up to 32x the "
                                             "service's max body size.")
    tokenizer: str = Field(DEFAULT_TOKENIZER, min_length=1, max_length=4096,
                           description="As in POST /v1/datasets; one tokenizer for every source.")
    mixture: MixtureRule = Field(default_factory=MixtureRule)

    @model_validator(mode="after")
    def _weights_and_names(self) -> MixtureRequest:
        given = [s.weight is not None for s in self.sources]
        if any(given) and not all(given):
            raise ValueError("give every source a `weight` (a mixture) or none (a concatenation)")
        if any(given) and sum(s.weight for s in self.sources) <= 0:
            raise ValueError("the weights sum to 0; give at least one source a positive weight")
        names = [s.name or f"source_{i}" for i, s in enumerate(self.sources)]
        if len(set(names)) != len(names):
            raise ValueError(f"source names must be unique, got {names}")
        return self


class Progress(BaseModel):
    rows_done: int = 0
    rows_total: int | None = None
    tokens_done: int = 0
    fraction: float | None = None
    rows_per_s: float | None = None
    tokens_per_s: float | None = None


class ErrorInfo(BaseModel):
    type: str = Field(description="invalid_data | disk_full | io_error | interrupted | worker_died | internal "
                      "| cancelled | corrupt (a published dataset whose files no longer match their checksums) "
                      "| too_large (a Hub source over --hub-max-download-bytes) | hub (the Hub refused the "
                      "download or could not be reached)")
    message: str


class SourceInfo(BaseModel):
    path: str | None = Field(None, description="the file under a data root; of a Hub source its one file "
                             "(hf://datasets/ORG/NAME@COMMIT/PATH), or the repository at that commit when the split "
                             "has several files")
    upload_id: str | None = None
    files: list[str] | None = Field(None, description="of a Hub source: every file of the split the job downloads "
                                    "and tokenizes, in the order they are concatenated (hf:// URLs at the commit)")
    sha256: str = Field(description="the source bytes' sha256; of a Hub source (downloaded by the job), the sha256 of "
                        "its repository, commit and files (the manifest has the bytes' own)")
    size_bytes: int = Field(description="of a Hub source, its size as the Hub tells it (0: not told)")


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
    kind: Literal["queued", "started", "downloading", "progress", "requeued", "succeeded", "failed", "cancelled",
                  "deleted"]
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
    message: str | None = Field(None, description="downloading: what the job is fetching of its Hub source "
                                "(\"downloading 3 files, 12.5 MB\", then each file and every MB)")
    bytes_done: int | None = Field(None, description="downloading: bytes of the Hub source fetched so far")
    bytes_total: int | None = Field(None, description="downloading: its size as the Hub tells it (null: unknown)")
    files_done: int | None = None
    files_total: int | None = None


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
    format: Literal[UPLOAD_FORMATS]  # type: ignore[valid-type]
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
