"""`pf-trl serve [options]`: run the preprocessing service (FastAPI + uvicorn, worker processes).

FastAPI, uvicorn and ``preprocess_service`` are imported inside :func:`main` only, so that ``pf_trl``
itself never depends on them (``pip install 'pf-trl[service]'``). Every flag has a ``PF_SERVICE_*``
environment variable; a flag wins over its variable. The token is read from ``PF_SERVICE_TOKEN`` (or
``--token-file``), never from a flag, so it does not show in ``ps``.
"""

from __future__ import annotations

import argparse
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pf-trl serve",
        description="Run the pf-trl preprocessing service: tokenize once into a shared cache that training jobs read. "
        "Flags override the PF_SERVICE_* environment variables named in brackets. The API, the settings and "
        "deployment: docs/service.md.",
        allow_abbrev=False,
    )
    add = p.add_argument
    add("--host", help="bind address [PF_SERVICE_HOST] (default 127.0.0.1)")
    add("--port", type=int, help="port [PF_SERVICE_PORT] (default 8000)")
    add("--cache-dir", "--cache_dir", dest="cache_dir",
        help="the only place the service writes: jobs.sqlite3, datasets/, uploads/, tmp/ [PF_SERVICE_CACHE_DIR] "
        "(default ./.pf-trl-cache/service)")
    add("--data-root", "--data_root", "--data-roots", dest="data_roots", action="append", metavar="DIR",
        help="directory that request paths may name (repeat for several) [PF_SERVICE_DATA_ROOTS, "
        f"'{os.pathsep}'-separated] (default none: uploads only)")
    add("--public-cache-dir", "--public_cache_dir", dest="public_cache_dir",
        help="where training pods mount the cache dir, for reported shards paths [PF_SERVICE_PUBLIC_CACHE_DIR]")
    add("--workers", type=int, help="jobs that run at once, one worker process each [PF_SERVICE_WORKERS] (default 1)")
    add("--num-proc", "--num_proc", dest="num_proc", type=int,
        help="tokenizer processes per job [PF_SERVICE_NUM_PROC] (default 1)")
    add("--max-queued", "--max_queued", dest="max_queued", type=int,
        help="waiting jobs before POST answers 503 [PF_SERVICE_MAX_QUEUED] (default 64)")
    add("--max-upload-bytes", "--max_upload_bytes", "--max-upload", dest="max_upload_bytes",
        help="upload size limit, e.g. 2GiB [PF_SERVICE_MAX_UPLOAD_BYTES]")
    add("--max-body-bytes", "--max_body_bytes", dest="max_body_bytes",
        help="JSON body size limit [PF_SERVICE_MAX_BODY_BYTES] (default 64KiB)")
    add("--max-attempts", "--max_attempts", dest="max_attempts", type=int,
        help="attempts for a job interrupted by a crash/restart [PF_SERVICE_MAX_ATTEMPTS] (default 2)")
    add("--preflight-rows", "--preflight_rows", dest="preflight_rows", type=int,
        help="rows checked synchronously by POST, 0 = off [PF_SERVICE_PREFLIGHT_ROWS] (default 64)")
    add("--preflight-procs", "--preflight_procs", dest="preflight_procs", type=int,
        help="sandboxed processes for POST's synchronous checks [PF_SERVICE_PREFLIGHT_PROCS] (default 1)")
    add("--preflight-memory", "--preflight_memory", dest="preflight_memory_bytes", metavar="SIZE",
        help="address-space limit of each preflight sandbox, 0 = none [PF_SERVICE_PREFLIGHT_MEMORY_BYTES] (default 4GiB)")
    add("--preflight-timeout-s", "--preflight_timeout_s", dest="preflight_timeout_s", type=float,
        help="longest synchronous check of one POST [PF_SERVICE_PREFLIGHT_TIMEOUT_S] (default 60)")
    add("--max-row-bytes", "--max_row_bytes", dest="max_row_bytes", metavar="SIZE",
        help="longest line (row) of a JSONL/CSV source [PF_SERVICE_MAX_ROW_BYTES] (default 32MiB)")
    add("--max-json-depth", "--max_json_depth", dest="max_json_depth", type=int,
        help="deepest nesting of a JSON row [PF_SERVICE_MAX_JSON_DEPTH] (default 64)")
    add("--max-field-bytes", "--max_field_bytes", dest="max_field_bytes", metavar="SIZE",
        help="largest single value of a row [PF_SERVICE_MAX_FIELD_BYTES] (default 16MiB)")
    add("--max-row-group-bytes", "--max_row_group_bytes", dest="max_row_group_bytes", metavar="SIZE",
        help="largest uncompressed Parquet row group [PF_SERVICE_MAX_ROW_GROUP_BYTES] (default 1GiB)")
    add("--upload-ttl-s", "--upload_ttl_s", dest="upload_ttl_s", type=float,
        help="delete uploads unused for this long, 0 = never [PF_SERVICE_UPLOAD_TTL_S] (default 604800, 7 days)")
    add("--max-uploads-bytes", "--max_uploads_bytes", dest="max_uploads_bytes", metavar="SIZE",
        help="quota of all uploads together (507 beyond) [PF_SERVICE_MAX_UPLOADS_BYTES] (default 16GiB)")
    add("--min-free-bytes", "--min_free_bytes", dest="min_free_bytes", metavar="SIZE",
        help="free space the cache dir keeps: less answers 507 to new work and 503 to /readyz "
        "[PF_SERVICE_MIN_FREE_BYTES] (default 64MiB)")
    add("--rate-limit", "--rate_limit", dest="rate_limit_per_minute", type=int,
        help="POST/DELETE requests per client address per minute, 0 = none (429 beyond) "
        "[PF_SERVICE_RATE_LIMIT_PER_MINUTE] (default 600)")
    add("--allow-hardlinks", "--allow_hardlinks", dest="allow_hardlinks", action="store_true", default=None,
        help="accept source files with several hard links (only when every writer of the data roots is trusted) "
        "[PF_SERVICE_ALLOW_HARDLINKS]")
    add("--token-file", "--token_file", dest="token_file",
        help="file holding the bearer token (else PF_SERVICE_TOKEN; neither: auth off)")
    add("--database-url", "--database_url", dest="database_url", metavar="postgresql://USER@HOST/DB",
        help="keep jobs in PostgreSQL so several replicas can share them and one cache volume "
        "[PF_SERVICE_DATABASE_URL] (default: SQLite in the cache dir, one replica). A password is refused "
        "here (it would show in ps): use PF_SERVICE_DATABASE_URL, --database-url-file or PGPASSWORD/.pgpass")
    add("--database-url-file", "--database_url_file", dest="database_url_file",
        help="file holding the database URL (a mounted Secret)")
    add("--replica-id", "--replica_id", dest="replica_id",
        help="this replica's name in the job store [PF_SERVICE_REPLICA_ID] (default: the host name)")
    add("--log-level", "--log_level", dest="log_level", help="[PF_SERVICE_LOG_LEVEL] (default info)")
    return p


def _has_password(url: str) -> bool:
    """``scheme://user:password@host`` or ``?password=``: a secret on the command line."""
    from urllib.parse import parse_qs, urlsplit

    try:
        parts = urlsplit(url)
        return bool(parts.password) or "password" in parse_qs(parts.query)
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import uvicorn

        from preprocess_service.app import create_app
        from preprocess_service.settings import Settings, SettingsError
    except ImportError as exc:
        print(f"pf-trl serve: error: {exc}; install the service extra: pip install 'pf-trl[service]'", file=sys.stderr)
        return 2
    overrides = {k: v for k, v in vars(args).items() if k not in ("token_file", "database_url_file")}
    if args.database_url and _has_password(args.database_url):
        print("pf-trl serve: error: --database-url holds a password, which every user sees in ps; pass the URL in "
              "PF_SERVICE_DATABASE_URL or --database-url-file, or the password in PGPASSWORD / ~/.pgpass",
              file=sys.stderr)
        return 2
    if args.database_url_file:
        try:
            with open(args.database_url_file, encoding="utf-8") as f:
                overrides["database_url"] = f.read().strip()
        except OSError as exc:
            print(f"pf-trl serve: error: cannot read --database-url-file: {exc}", file=sys.stderr)
            return 2
    if args.token_file:
        try:
            with open(args.token_file, encoding="utf-8") as f:
                overrides["token"] = f.read().strip()
        except OSError as exc:
            print(f"pf-trl serve: error: cannot read --token-file: {exc}", file=sys.stderr)
            return 2
    try:
        settings = Settings.load(overrides)
    except SettingsError as exc:
        print(f"pf-trl serve: error: {exc}", file=sys.stderr)
        return 2
    if settings.host not in ("127.0.0.1", "localhost", "::1") and settings.token is None:
        print(f"pf-trl serve: warning: listening on {settings.host} without a token; set PF_SERVICE_TOKEN",
              file=sys.stderr)
    app = create_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                timeout_graceful_shutdown=10)
    return 0
