"""Service settings: command-line flags override ``PF_SERVICE_*`` environment variables override defaults."""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from pf_trl.errors import PfTrlError

ENV_PREFIX = "PF_SERVICE_"
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30,
          "ti": 2**40, "tib": 2**40}


class SettingsError(PfTrlError, ValueError):
    """A flag or environment variable has a bad value; the message names it and the fix."""


def parse_size(value: str | int, name: str) -> int:
    """``"512MB"``, ``"1GiB"``, ``"1048576"`` -> bytes."""
    if isinstance(value, int):
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise SettingsError(f"{name}={value!r} is not a size; use bytes or a unit, e.g. 512MB or 1GiB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


HUB_REVISION_KINDS = ("names", "pull-requests", "commits")
_PR_REF = re.compile(r"^refs/pr/\d+$")
_COMMIT = re.compile(r"^[0-9a-f]{7,40}$")


def hub_revision_kind(revision: str | None, commit: str | None = None) -> str:
    """``names`` (a branch or tag; None is main), ``pull-requests`` (``refs/pr/N``), ``commits`` (a hash, or a name
    the resolved ``commit`` starts with) or ``other`` (another ``refs/...``, e.g. the Hub's ``refs/convert/*``)."""
    if revision is None:
        return "names"
    text = revision.replace("%2F", "/").replace("%2f", "/")
    if _PR_REF.match(text):
        return "pull-requests"
    if text.startswith("refs/"):
        return "other"
    if _COMMIT.match(text) or (commit and commit.startswith(text)):
        return "commits"
    return "names"


@dataclass
class Settings:
    """Everything the service reads at start-up (see docs/service.md for the matching flags/env vars).

    Attributes:
        cache_dir: the service's only writable place: ``jobs.sqlite3``, ``datasets/``, ``uploads/``, ``tmp/``.
        data_roots: directories whose files (and tokenizer folders) requests may name; paths are resolved,
            symlinks included, and must stay inside one of them. Empty: only uploads are accepted.
        public_cache_dir: how training pods see ``cache_dir`` (a shared volume may be mounted elsewhere
            there); reported ``shards_path`` values use it. Default: ``cache_dir``.
        token: bearer token required on every route except /healthz and /readyz (None: auth off).
        workers: worker processes, i.e. jobs that run at the same time.
        num_proc: tokenizer processes inside one job (``pretokenize(num_proc=...)``).
        max_queued: jobs waiting beyond the running ones; more -> 503 with Retry-After.
        max_upload_bytes / max_body_bytes: upload size / JSON request body size limits (413 beyond).
        max_attempts: a job interrupted by a crash or restart is re-run up to this many attempts in all.
        heartbeat_timeout_s: a running job whose worker has not written a heartbeat for this long is orphaned.
        preflight_rows: rows of a JSONL/Parquet source tokenized synchronously by POST (0: off).
        min_free_bytes: a job refuses to start (fails, "disk full") with less free space in cache_dir.
        database_url: ``postgresql://...`` to keep jobs in PostgreSQL (several replicas may share it and one
            cache volume); None: SQLite in ``cache_dir`` (one replica). A secret: read from
            ``PF_SERVICE_DATABASE_URL`` or ``--database-url-file``, passed to workers through a pipe.
        replica_id: this replica's name in the job store (default: the host name, i.e. the pod name).
        preflight_procs: sandboxed processes that run POST's synchronous checks (the API process parses nothing).
        preflight_memory_bytes: address-space limit of each sandbox (RLIMIT_AS); 0: none.
        preflight_timeout_s: longest synchronous check of one POST; past it the sandbox is replaced, POST 422.
        max_row_bytes / max_json_depth / max_field_bytes / max_row_group_bytes: per-row limits of every source
            (:class:`pf_trl.data.source_limits.SourceLimits`), checked by the preflight and by the job.
        upload_ttl_s: an upload not used by a job for this long is deleted (0: never).
        max_uploads_bytes: all uploads together; beyond it an upload answers 507 (DELETE old ones).
        allow_hardlinks: accept source files with more than one hard link (refused by default: a hard link in a
            data root can carry in a file from outside it; allow only when every writer of the roots is trusted).
        rate_limit_per_minute: POST/DELETE requests per client address per minute (a token bucket that holds
            a minute's worth); beyond it 429 with Retry-After. 0: no limit.
        publish_uri: a bucket prefix (``s3://BUCKET/datasets``; ``gs://``, ``az://``): each finished dataset is also
            uploaded to ``<publish_uri>/<id>`` (files under a writer folder, manifest last) and its reported
            ``shards_path`` is that URI, so trainers need no shared volume (credentials from the cloud's standard
            chain; ``cache_dir`` can then be a ReadWriteOnce volume or an emptyDir). None: local paths only.
        hub_allow: Hugging Face Hub datasets requests may name as a source: organisations (``org``) or repositories
            (``org/name``); empty (the default): none, and the service runs offline. Downloads use the Hub's own
            environment (``HF_ENDPOINT``, ``HF_TOKEN`` from the service's Secret); a caller never gives a URL.
        hub_revisions: the kinds of ``source.hub.revision`` requests may name: ``names`` (a branch or a tag; no
            revision is ``main``), ``pull-requests`` (``refs/pr/N``: anyone may open one on a public repository) and
            ``commits`` (a commit hash, possibly one of a pull request). Default: ``names`` only.
        hub_max_download_bytes: the most a job fetches of a Hub source (the split's files, a mixture's Hub sources
            together), downloaded by the job itself, outside the preflight's time limit: checked against the sizes
            the Hub tells before any download, and counted while downloading; beyond it the job fails and what it
            fetched is removed from the Hub cache. Default 10 GiB.
        debug_progress_delay_s: TEST-ONLY: sleep this long in every progress callback (slows jobs for
            crash tests; 0 in production).
        debug_crash_at: TEST-ONLY: a worker kills itself (SIGKILL) at this step of a job: ``claimed``,
            ``written``, ``renamed`` (published, before COMMIT) or ``committed``; empty in production.
    """

    cache_dir: Path = field(default_factory=lambda: Path(".pf-trl-cache/service"))
    data_roots: list[Path] = field(default_factory=list)
    public_cache_dir: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    token: str | None = None
    workers: int = 1
    num_proc: int = 1
    max_queued: int = 64
    max_upload_bytes: int = 2 * 2**30
    max_body_bytes: int = 64 * 2**10
    max_attempts: int = 2
    heartbeat_timeout_s: float = 10.0
    preflight_rows: int = 64
    min_free_bytes: int = 64 * 2**20
    log_level: str = "info"
    database_url: str | None = None
    replica_id: str = field(default_factory=socket.gethostname)
    preflight_procs: int = 1
    preflight_memory_bytes: int = 4 * 2**30
    preflight_timeout_s: float = 60.0
    max_row_bytes: int = 32 * 2**20
    max_json_depth: int = 64
    max_field_bytes: int = 16 * 2**20
    max_row_group_bytes: int = 2**30
    upload_ttl_s: float = 7 * 24 * 3600.0
    max_uploads_bytes: int = 16 * 2**30
    rate_limit_per_minute: int = 600
    allow_hardlinks: bool = False
    publish_uri: str | None = None
    hub_allow: list[str] = field(default_factory=list)
    hub_revisions: list[str] = field(default_factory=lambda: ["names"])
    hub_max_download_bytes: int = 10 * 2**30
    debug_progress_delay_s: float = 0.0
    debug_crash_at: str = ""

    def __post_init__(self) -> None:
        self.cache_dir = Path(self.cache_dir).expanduser().resolve()
        self.data_roots = [Path(r).expanduser().resolve() for r in self.data_roots]
        self.public_cache_dir = Path(self.public_cache_dir) if self.public_cache_dir else self.cache_dir
        if self.token is not None and not self.token:
            self.token = None
        if not self.database_url:
            self.database_url = None
        elif not self.database_url.startswith(("postgresql://", "postgres://")):
            raise SettingsError("database_url must start with postgresql:// (PostgreSQL is the only other store; "
                                "leave it unset for the embedded SQLite store)")
        if not self.publish_uri:
            self.publish_uri = None
        else:
            from pf_trl.storage import is_remote

            if not is_remote(self.publish_uri):
                raise SettingsError(f"publish_uri {self.publish_uri!r} is not a bucket URI; use s3://BUCKET/PREFIX, "
                                    "gs://BUCKET/PREFIX or az://CONTAINER/PREFIX")
            self.publish_uri = self.publish_uri.rstrip("/")
        self.replica_id = re.sub(r"[^A-Za-z0-9_.-]", "_", self.replica_id or "local")[:64]
        for name in ("workers", "num_proc", "max_attempts", "preflight_procs", "max_row_bytes", "max_json_depth",
                     "max_field_bytes", "max_row_group_bytes"):
            if getattr(self, name) < 1:
                raise SettingsError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_queued", "preflight_rows", "min_free_bytes", "preflight_memory_bytes", "upload_ttl_s",
                     "max_uploads_bytes", "rate_limit_per_minute"):
            if getattr(self, name) < 0:
                raise SettingsError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_upload_bytes", "max_body_bytes", "hub_max_download_bytes"):
            if getattr(self, name) < 1:
                raise SettingsError(f"{name} must be >= 1 byte, got {getattr(self, name)}")
        if self.preflight_timeout_s <= 0:
            raise SettingsError(f"preflight_timeout_s must be > 0, got {self.preflight_timeout_s}")
        if self.preflight_memory_bytes and self.preflight_memory_bytes < 2**30:
            raise SettingsError(f"preflight_memory_bytes must be 0 (no limit) or at least 1GiB (the sandbox's "
                                f"libraries alone map about 2.5 GB), got {self.preflight_memory_bytes}")
        if self.debug_crash_at not in ("", "claimed", "written", "renamed", "committed"):
            raise SettingsError(f"debug_crash_at must be one of claimed, written, renamed, committed, got "
                                f"{self.debug_crash_at!r}")
        for entry in self.hub_allow:
            if not re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?", entry):
                raise SettingsError(f"hub_allow entry {entry!r} is neither an organisation (org) nor a repository "
                                    "(org/name)")
        unknown = sorted(set(self.hub_revisions) - set(HUB_REVISION_KINDS))
        if unknown:
            raise SettingsError(f"hub_revisions {', '.join(unknown)}: not a kind of revision; use any of "
                                f"{', '.join(HUB_REVISION_KINDS)}")
        if not 0 < self.port < 65536:
            raise SettingsError(f"port must be in 1..65535, got {self.port}")
        for root in self.data_roots:
            if not root.is_dir():
                raise SettingsError(f"data root {root} is not a directory; create it or fix --data-root")
            if root == self.cache_dir or self.cache_dir in root.parents or root in self.cache_dir.parents:
                raise SettingsError(
                    f"data root {root} overlaps the cache dir {self.cache_dir}; keep inputs and the cache apart"
                )

    # Paths inside the cache dir (the layout is documented in docs/service.md).
    @property
    def db_path(self) -> Path:
        return self.cache_dir / "jobs.sqlite3"

    @property
    def datasets_dir(self) -> Path:
        return self.cache_dir / "datasets"

    @property
    def uploads_dir(self) -> Path:
        return self.cache_dir / "uploads"

    @property
    def tmp_dir(self) -> Path:
        return self.cache_dir / "tmp"

    @property
    def scratch_dir(self) -> Path:
        """This replica's part of ``tmp/``: with a shared cache (PostgreSQL), replicas never touch each other's."""
        return self.tmp_dir / f"r-{self.replica_id}" if self.database_url else self.tmp_dir

    @property
    def lock_path(self) -> Path:
        return self.cache_dir / "service.lock"

    def reported_shards_path(self, dataset_id: str) -> str:
        """Where trainers read a finished dataset: ``<publish_uri>/<id>`` when set, else :meth:`shards_path`."""
        if self.publish_uri:
            return f"{self.publish_uri}/{dataset_id}"
        return str(self.shards_path(dataset_id))

    def shards_path(self, dataset_id: str) -> Path:
        return Path(self.public_cache_dir) / "datasets" / dataset_id

    def limits(self):
        """The per-row limits of sources (:class:`pf_trl.data.source_limits.SourceLimits`)."""
        from pf_trl.data.source_limits import SourceLimits

        return SourceLimits(max_row_bytes=self.max_row_bytes, max_json_depth=self.max_json_depth,
                            max_field_bytes=self.max_field_bytes, max_row_group_bytes=self.max_row_group_bytes)

    def make_dirs(self) -> None:
        for d in (self.cache_dir, self.datasets_dir, self.uploads_dir, self.tmp_dir, self.scratch_dir):
            d.mkdir(parents=True, exist_ok=True)

    def hub_revision_refusal(self, revision: str | None, commit: str | None = None) -> str | None:
        """Why ``source.hub.revision`` is not a kind ``hub_revisions`` allows (None: allowed). ``commit``, once
        resolved, tells a short commit hash spelled as a name."""
        kind = hub_revision_kind(revision, commit)
        if kind in self.hub_revisions:
            return None
        what = {"pull-requests": "a pull request's ref", "commits": "a commit hash", "names": "a branch or tag",
                "other": "a ref other than a branch, tag or pull request"}[kind]
        return (f"source.hub.revision {revision}: {what}, which this service does not read (hub_revisions: "
                f"{', '.join(self.hub_revisions) or 'none'}); name a branch or tag, or ask its operator to allow "
                f"{kind if kind != 'other' else 'it'} (--hub-revisions)")

    def hub_allows(self, repo_id: str) -> bool:
        """True when ``hub_allow`` names the repository or its organisation."""
        org = repo_id.split("/", 1)[0] if "/" in repo_id else None
        return any(entry == repo_id or (org is not None and entry == org) for entry in self.hub_allow)

    def child_env(self) -> dict[str, str]:
        """Environment for the service and its workers: every cache inside ``cache_dir``; offline unless
        ``hub_allow`` names Hub datasets (then the Hub's own ``HF_ENDPOINT`` / ``HF_TOKEN`` are used)."""
        hf = self.cache_dir / "hf"
        offline = {} if self.hub_allow else {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                                               "TRANSFORMERS_OFFLINE": "1"}
        return {
            **offline,
            "HF_HOME": str(hf),
            "HF_DATASETS_CACHE": str(hf / "datasets"),
            "PF_TRL_CACHE": str(self.cache_dir / "pf-trl"),  # the converted embedded tokenizer lands here
            "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "false"),
        }

    def to_json(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = [str(p) for p in v] if f.name == "data_roots" else (str(v) if isinstance(v, Path) else v)
        return out

    def worker_json(self) -> dict[str, Any]:
        """What a worker needs (sent through its stdin pipe): everything but the bearer token."""
        return {**self.to_json(), "token": None}

    def describe(self) -> dict[str, Any]:
        """The start-up line's fields: no secret (auth on/off, the database without its password)."""
        from preprocess_service.store import describe_database

        return {"data_roots": [str(p) for p in self.data_roots], "cache_dir": str(self.cache_dir),
                "public_cache_dir": str(self.public_cache_dir), "publish_uri": self.publish_uri,
                "auth": "on" if self.token else "off",
                "workers": self.workers, "num_proc": self.num_proc, "database": describe_database(self),
                "replica": self.replica_id, "host": self.host, "port": self.port, "hub_allow": self.hub_allow,
                "hub_revisions": self.hub_revisions, "hub_max_download_bytes": self.hub_max_download_bytes}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Settings:
        return cls(**data)

    @classmethod
    def load(cls, overrides: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> Settings:
        """Defaults < ``PF_SERVICE_<NAME>`` env vars < ``overrides`` (flags; None values are ignored)."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is not None and raw != "":
                values[f.name] = _convert(f.name, raw, env_name=ENV_PREFIX + f.name.upper())
        for key, value in (overrides or {}).items():
            if value is not None:
                values[key] = _convert(key, value, env_name="--" + key.replace("_", "-")) if isinstance(value, str) else value
        return cls(**values)


def _convert(name: str, raw: str, *, env_name: str) -> Any:
    try:
        if name == "data_roots":
            return [p for p in raw.split(os.pathsep) if p]
        if name in ("hub_allow", "hub_revisions"):
            return [p for p in re.split(r"[,\s]+", raw) if p]
        if name in ("max_upload_bytes", "max_body_bytes", "min_free_bytes", "preflight_memory_bytes", "max_row_bytes",
                    "max_field_bytes", "max_row_group_bytes", "max_uploads_bytes", "hub_max_download_bytes"):
            return parse_size(raw, env_name)
        if name in ("port", "workers", "num_proc", "max_queued", "max_attempts", "preflight_rows", "preflight_procs",
                    "max_json_depth", "rate_limit_per_minute"):
            return int(raw)
        if name in ("heartbeat_timeout_s", "debug_progress_delay_s", "preflight_timeout_s", "upload_ttl_s"):
            return float(raw)
        if name == "allow_hardlinks":
            if raw.strip().lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ValueError("use true or false")
            return raw.strip().lower() in ("1", "true", "yes", "on")
    except ValueError as exc:
        raise SettingsError(f"{env_name}={raw!r}: {exc}") from exc
    return raw
