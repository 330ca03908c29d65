"""Client of the pf-trl preprocessing service (``pf-trl serve``), standard library only (urllib).

- :func:`submit_dataset`: ``POST /v1/datasets`` (what a k8s pretokenize Job runs), returns the status.
- :func:`wait_for_dataset`: poll ``GET /v1/datasets/{id}`` until it succeeded (with a progress bar),
  then return the shards directory the service reported, checked to be visible from this machine.

The bearer token defaults to ``$PF_SERVICE_TOKEN``. Connection errors and 502/503/504 are retried
until the deadline (the service may be restarting); 401/403/404/422 and failed jobs raise at once.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from pf_trl.data.shards import is_shards_dir

_RETRYABLE = {502, 503, 504}


class DatasetServiceError(RuntimeError):
    """The service refused, failed or timed out. ``status`` is the HTTP status (None: no answer)."""

    def __init__(self, message: str, *, status: int | None = None, problem: dict[str, Any] | None = None):
        super().__init__(message)
        self.status, self.problem = status, problem or {}


def _token(token: str | None) -> str | None:
    return token if token is not None else (os.environ.get("PF_SERVICE_TOKEN") or None)


def _request(method: str, url: str, *, body: Any = None, token: str | None = None,
             timeout: float = 30.0) -> tuple[int, dict[str, Any]]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Accept", "application/json, application/problem+json")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return _http_error(exc)
    except (urllib.error.URLError, OSError, ValueError) as exc:  # refused, reset, timeout, bad JSON
        raise DatasetServiceError(f"cannot reach the dataset service at {url}: {exc}", status=None) from exc


def _http_error(exc: urllib.error.HTTPError) -> tuple[int, dict[str, Any]]:
    raw = exc.read()
    try:
        payload = json.loads(raw)
    except ValueError:
        payload = {"detail": raw.decode("utf-8", "replace")[:500]}
    return exc.code, payload if isinstance(payload, dict) else {"detail": str(payload)}


def _raise_for(status: int, payload: dict[str, Any], what: str) -> None:
    detail = payload.get("detail") or payload.get("title") or str(payload)
    if status == 401:
        raise DatasetServiceError(f"{what}: unauthorized ({detail}); pass token= or set PF_SERVICE_TOKEN to the "
                                  "service's token", status=status, problem=payload)
    raise DatasetServiceError(f"{what}: HTTP {status}: {detail}", status=status, problem=payload)


def _base(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise DatasetServiceError(f"service url {url!r} must start with http:// or https://")
    return url.rstrip("/")


def submit_dataset(url: str, body: dict[str, Any], token: str | None = None) -> dict[str, Any]:
    """``POST /v1/datasets`` with ``body`` (see the README section 'Preprocessing service'); returns the dataset status (its ``id``,
    ``state``; ``manifest`` when it was already built). Raises :class:`DatasetServiceError` on 4xx/5xx."""
    status, payload = _request("POST", f"{_base(url)}/v1/datasets", body=body, token=_token(token))
    if status not in (200, 202):
        _raise_for(status, payload, "submitting the dataset")
    return payload


def get_dataset(url: str, dataset_id: str, token: str | None = None) -> dict[str, Any]:
    quoted = urllib.parse.quote(dataset_id, safe="")
    status, payload = _request("GET", f"{_base(url)}/v1/datasets/{quoted}", token=_token(token))
    if status == 404:
        raise DatasetServiceError(f"the service at {url} knows no dataset {dataset_id!r}; submit it first "
                                  "(POST /v1/datasets, or pf_trl.data.service_client.submit_dataset)",
                                  status=404, problem=payload)
    if status != 200:
        _raise_for(status, payload, f"reading dataset {dataset_id}")
    return payload


def wait_for_dataset(url: str, dataset_id: str, *, token: str | None = None, timeout_s: float = 3600,
                     poll_s: float = 2.0, progress: bool = True) -> Path:
    """Wait until the service has built ``dataset_id`` and return its local shards directory.

    Args:
        url: service base URL, e.g. ``http://pf-preprocess:8000``.
        dataset_id: the id returned by ``POST /v1/datasets``.
        token: bearer token (default ``$PF_SERVICE_TOKEN``).
        timeout_s: give up after this many seconds.
        poll_s: seconds between polls.
        progress: show a tqdm bar of rows tokenized.

    Raises:
        DatasetServiceError: unknown id, auth failure, the job failed (with its reason), timeout, or the
            reported shards directory is not visible here (mount the service's cache volume).
    """
    base, token = _base(url), _token(token)
    deadline = time.monotonic() + timeout_s
    bar = None
    last_problem = None
    try:
        while True:
            try:
                status = get_dataset(base, dataset_id, token)
                last_problem = None
            except DatasetServiceError as exc:  # not reachable (yet) or 502/503/504: retry
                if exc.status is not None and exc.status not in _RETRYABLE:
                    raise
                status, last_problem = None, str(exc)
            if status is not None:
                state = status.get("state")
                if progress and state in ("queued", "running", "succeeded"):
                    bar = _update_bar(bar, status)
                if state == "succeeded":
                    path = Path(status.get("shards_path") or "")
                    if not status.get("shards_path") or not is_shards_dir(path):
                        raise DatasetServiceError(
                            f"dataset {dataset_id} succeeded but its shards directory {path} is not visible from "
                            "this machine; mount the service's cache volume there (the service's "
                            "--public-cache-dir says where clients see it)")
                    return path
                if state == "failed":
                    error = status.get("error") or {}
                    raise DatasetServiceError(
                        f"dataset {dataset_id} failed ({error.get('type', 'error')}): {error.get('message', 'no reason')}",
                        problem=status)
            if time.monotonic() >= deadline:
                where = f"last state {status.get('state')!r}" if status else (last_problem or "no answer")
                raise DatasetServiceError(f"timed out after {timeout_s:.0f}s waiting for dataset {dataset_id} "
                                          f"({where}); raise timeout_s or check the service")
            time.sleep(max(0.05, min(poll_s, deadline - time.monotonic())))
    finally:
        if bar is not None:
            bar.close()


def _update_bar(bar, status: dict[str, Any]):
    from tqdm.auto import tqdm

    p = status.get("progress") or {}
    total = p.get("rows_total")
    if bar is None:
        bar = tqdm(total=total, desc=f"dataset {status['id'][:12]} ({status['state']})", unit="rows", file=sys.stderr)
    if total and bar.total != total:
        bar.total = total
    bar.set_description(f"dataset {status['id'][:12]} ({status['state']})")
    bar.n = p.get("rows_done") or 0
    bar.set_postfix(tokens=p.get("tokens_done") or 0, refresh=False)
    bar.refresh()
    return bar


def main(argv: list[str] | None = None) -> int:
    """``python -m pf_trl.data.service_client submit URL BODY.json [--wait]`` (for a k8s Job) or
    ``... wait URL ID``: prints the status JSON / the shards path."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pf_trl.data.service_client")
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("submit")
    s.add_argument("url")
    s.add_argument("body", help="JSON file with the POST /v1/datasets body ('-' for stdin)")
    s.add_argument("--wait", action="store_true")
    s.add_argument("--timeout_s", type=float, default=3600)
    w = sub.add_parser("wait")
    w.add_argument("url")
    w.add_argument("dataset_id")
    w.add_argument("--timeout_s", type=float, default=3600)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "submit":
            raw = sys.stdin.read() if args.body == "-" else Path(args.body).read_text(encoding="utf-8")
            status = submit_dataset(args.url, json.loads(raw))
            print(json.dumps({k: status.get(k) for k in ("id", "state", "shards_path")}))
            if args.wait:
                print(wait_for_dataset(args.url, status["id"], timeout_s=args.timeout_s))
        else:
            print(wait_for_dataset(args.url, args.dataset_id, timeout_s=args.timeout_s))
    except (DatasetServiceError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
