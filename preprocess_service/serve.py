"""``pf-trl serve`` / ``python -m preprocess_service``: parse the flags, load the settings, run uvicorn.

FastAPI and uvicorn are imported inside :func:`main` only, so :func:`build_parser` (the flags, read by the deploy
tests and ``pf-trl serve --help``) works without the ``service`` extra. Every flag has a ``PF_SERVICE_*``
environment variable; a flag wins over its variable. The token is read from ``PF_SERVICE_TOKEN`` (or
``--token-file``), never from a flag, so it does not show in ``ps``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

PROG = "pf-trl serve"


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``pf-trl serve`` (each also spelled with underscores)."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Run the pf-trl preprocessing service: tokenize once into a shared cache that training jobs read. "
        "Flags override the PF_SERVICE_* environment variables named in brackets. The API, the settings and "
        "deployment: docs/service.md.",
        allow_abbrev=False,
    )

    def add(name: str, *aliases: str, dest: str | None = None, **kwargs: Any) -> None:
        """``--name`` and its ``--under_score`` spelling (when it differs), then any older aliases."""
        under = "--" + name[2:].replace("-", "_")
        spellings = [name, under] if under != name else [name]
        p.add_argument(*spellings, *aliases, dest=dest or under.lstrip("-"), **kwargs)

    size = {"metavar": "SIZE"}
    add("--host", help="bind address [PF_SERVICE_HOST] (default 127.0.0.1)")
    add("--port", type=int, help="port [PF_SERVICE_PORT] (default 8000)")
    add("--cache-dir", help="the only place the service writes: jobs.sqlite3, datasets/, uploads/, tmp/ "
        "[PF_SERVICE_CACHE_DIR] (default ./.pf-trl-cache/service)")
    add("--data-root", "--data-roots", dest="data_roots", action="append", metavar="DIR",
        help="directory that request paths may name (repeat for several) [PF_SERVICE_DATA_ROOTS, "
        f"'{os.pathsep}'-separated] (default none: uploads only)")
    add("--public-cache-dir",
        help="where training pods mount the cache dir, for reported shards paths [PF_SERVICE_PUBLIC_CACHE_DIR]")
    add("--publish-uri", metavar="s3://BUCKET/PREFIX",
        help="also upload each finished dataset to PREFIX/<id> (manifest last) and report that URI as its shards "
        "path; credentials from the cloud's standard chain [PF_SERVICE_PUBLISH_URI] (default: local paths only)")
    add("--workers", type=int, help="jobs that run at once, one worker process each [PF_SERVICE_WORKERS] (default 1)")
    add("--num-proc", type=int, help="tokenizer processes per job [PF_SERVICE_NUM_PROC] (default 1)")
    add("--max-queued", type=int, help="waiting jobs before POST answers 503 [PF_SERVICE_MAX_QUEUED] (default 64)")
    add("--max-upload-bytes", "--max-upload", help="upload size limit, e.g. 2GiB [PF_SERVICE_MAX_UPLOAD_BYTES]")
    add("--max-body-bytes", help="JSON body size limit [PF_SERVICE_MAX_BODY_BYTES] (default 64KiB)")
    add("--max-attempts", type=int,
        help="attempts for a job interrupted by a crash/restart [PF_SERVICE_MAX_ATTEMPTS] (default 2)")
    add("--preflight-rows", type=int,
        help="rows checked synchronously by POST, 0 = off [PF_SERVICE_PREFLIGHT_ROWS] (default 64)")
    add("--preflight-procs", type=int,
        help="sandboxed processes for POST's synchronous checks [PF_SERVICE_PREFLIGHT_PROCS] (default 1)")
    add("--preflight-memory", dest="preflight_memory_bytes", **size, help="address-space limit of each preflight "
        "sandbox, 0 = none [PF_SERVICE_PREFLIGHT_MEMORY_BYTES] (default 4GiB)")
    add("--preflight-timeout-s", type=float,
        help="longest synchronous check of one POST [PF_SERVICE_PREFLIGHT_TIMEOUT_S] (default 60)")
    add("--max-row-bytes", **size,
        help="longest line (row) of a JSONL/CSV source [PF_SERVICE_MAX_ROW_BYTES] (default 32MiB)")
    add("--max-json-depth", type=int, help="deepest nesting of a JSON row [PF_SERVICE_MAX_JSON_DEPTH] (default 64)")
    add("--max-field-bytes", **size,
        help="largest single value of a row [PF_SERVICE_MAX_FIELD_BYTES] (default 16MiB)")
    add("--max-row-group-bytes", **size,
        help="largest uncompressed Parquet row group [PF_SERVICE_MAX_ROW_GROUP_BYTES] (default 1GiB)")
    add("--upload-ttl-s", type=float,
        help="delete uploads unused for this long, 0 = never [PF_SERVICE_UPLOAD_TTL_S] (default 604800, 7 days)")
    add("--max-uploads-bytes", **size,
        help="quota of all uploads together (507 beyond) [PF_SERVICE_MAX_UPLOADS_BYTES] (default 16GiB)")
    add("--min-free-bytes", **size, help="free space the cache dir keeps: less answers 507 to new work and 503 to "
        "/readyz [PF_SERVICE_MIN_FREE_BYTES] (default 64MiB)")
    add("--rate-limit", dest="rate_limit_per_minute", type=int,
        help="POST/DELETE requests per client address per minute, 0 = none (429 beyond) "
        "[PF_SERVICE_RATE_LIMIT_PER_MINUTE] (default 600)")
    add("--allow-hardlinks", action="store_true", default=None,
        help="accept source files with several hard links (only when every writer of the data roots is trusted) "
        "[PF_SERVICE_ALLOW_HARDLINKS]")
    add("--hub-allow", dest="hub_allow", action="append", metavar="ORG[/NAME]",
        help="a Hugging Face Hub organisation or dataset requests may name as source.hub (repeat for several) "
        "[PF_SERVICE_HUB_ALLOW, comma-separated] (default none: no Hub source, offline)")
    add("--hub-revisions", dest="hub_revisions", action="append", choices=("names", "pull-requests", "commits"),
        help="a kind of source.hub.revision requests may name (repeat for several): names (branches and tags), "
        "pull-requests (refs/pr/N), commits [PF_SERVICE_HUB_REVISIONS, comma-separated] (default: names)")
    add("--hub-max-download-bytes", **size,
        help="the most a job downloads of a Hub source (a job over it fails naming the size) "
        "[PF_SERVICE_HUB_MAX_DOWNLOAD_BYTES] (default 10GiB)")
    add("--token-file", help="file holding the bearer token (else PF_SERVICE_TOKEN; neither: auth off)")
    add("--database-url", metavar="postgresql://USER@HOST/DB",
        help="keep jobs in PostgreSQL so several replicas can share them and one cache volume "
        "[PF_SERVICE_DATABASE_URL] (default: SQLite in the cache dir, one replica). A password is refused "
        "here (it would show in ps): use PF_SERVICE_DATABASE_URL, --database-url-file or PGPASSWORD/.pgpass")
    add("--database-url-file", help="file holding the database URL (a mounted Secret)")
    add("--replica-id", help="this replica's name in the job store [PF_SERVICE_REPLICA_ID] (default: the host name)")
    add("--log-level", help="[PF_SERVICE_LOG_LEVEL] (default info)")
    return p


def _has_password(url: str) -> bool:
    """``scheme://user:password@host`` or ``?password=``: a secret on the command line."""
    from urllib.parse import parse_qs, urlsplit

    try:
        parts = urlsplit(url)
        return bool(parts.password) or "password" in parse_qs(parts.query)
    except ValueError:
        return False


def _read_secret(path: str, flag: str) -> str | None:
    """The stripped contents of a mounted secret file (``--token-file``, ``--database-url-file``); None (said on
    stderr) when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError as exc:
        _error(f"cannot read {flag}: {exc}")
        return None


def _error(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Run the service until it is stopped; 2 for a usage error (bad flag, unreadable secret, missing extra)."""
    args = build_parser().parse_args(argv)
    try:
        import uvicorn

        from preprocess_service.app import create_app
        from preprocess_service.settings import Settings, SettingsError
    except ImportError as exc:
        return _error(f"{exc}; install the service extra: pip install 'pf-trl[service]'")
    overrides = {k: v for k, v in vars(args).items() if k not in ("token_file", "database_url_file")}
    if args.database_url and _has_password(args.database_url):
        return _error("--database-url holds a password, which every user sees in ps; pass the URL in "
                      "PF_SERVICE_DATABASE_URL or --database-url-file, or the password in PGPASSWORD / ~/.pgpass")
    for flag, path, key in (("--database-url-file", args.database_url_file, "database_url"),
                            ("--token-file", args.token_file, "token")):
        if path:
            overrides[key] = _read_secret(path, flag)
            if overrides[key] is None:
                return 2
    try:
        settings = Settings.load(overrides)
    except SettingsError as exc:
        return _error(str(exc))
    if settings.host not in ("127.0.0.1", "localhost", "::1") and settings.token is None:
        print(f"{PROG}: warning: listening on {settings.host} without a token; set PF_SERVICE_TOKEN", file=sys.stderr)
    app = create_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                timeout_graceful_shutdown=10)
    return 0
