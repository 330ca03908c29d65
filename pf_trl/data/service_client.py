"""Client of the pf-trl preprocessing service (``pf-trl serve``), on ``httpx`` (HTTP) and ``httpx-sse`` (the event
stream), both in the ``service`` extra: ``pip install 'pf-trl[service]'``. They are imported when a function is
called, so ``import pf_trl`` never needs them; without them each function raises one line naming the extra.

- :func:`submit_dataset`: ``POST /v1/datasets`` (what a k8s pretokenize Job runs), returns the status.
- :func:`wait_for_dataset`: follow ``GET /v1/datasets/{id}/events`` (Server-Sent Events, resumed with
  ``Last-Event-ID`` after a dropped connection; polling ``GET /v1/datasets/{id}`` with ``If-None-Match``
  when the stream is not available) until it succeeded, with a progress bar, then return the shards
  directory the service reported, checked to be visible from this machine.

The bearer token defaults to ``$PF_SERVICE_TOKEN``. 502/503/504 and dropped connections are retried
until the deadline (the service may be restarting); a service never reached within ``connect_timeout_s``,
401/403/404/422 and failed or cancelled jobs raise at once, each with one line saying what to do.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pf_trl.data.shards import is_shards_dir
from pf_trl.errors import PfTrlError

_RETRYABLE = {502, 503, 504}
_ACCEPT_JSON = "application/json, application/problem+json"


class DatasetServiceError(PfTrlError, RuntimeError):
    """The service refused, failed or timed out. ``status`` is the HTTP status (None: no answer)."""

    def __init__(self, message: str, *, status: int | None = None, problem: dict[str, Any] | None = None):
        super().__init__(message)
        self.status, self.problem = status, problem or {}


class ClientExtraMissing(DatasetServiceError, ImportError):
    """httpx / httpx-sse are not installed: the ``service`` extra is missing."""


def _http():
    """``(httpx, httpx_sse)``, or :class:`ClientExtraMissing` saying which extra installs them."""
    try:
        import httpx
        import httpx_sse
    except ImportError as exc:
        raise ClientExtraMissing(f"the dataset service client needs httpx and httpx-sse ({exc}); install the service "
                                 "extra: pip install 'pf-trl[service]'") from None
    return httpx, httpx_sse


def _token(token: str | None) -> str | None:
    return token if token is not None else (os.environ.get("PF_SERVICE_TOKEN") or None)


def _headers(token: str | None, extra: dict[str, str] | None = None, *, accept: str = _ACCEPT_JSON) -> dict[str, str]:
    headers = {"Accept": accept, **(extra or {})}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def _unreachable(url: str, exc: Exception) -> DatasetServiceError:
    return DatasetServiceError(f"cannot reach the dataset service at {url} ({exc}); check the URL "
                               "(--dataset_service_url) and that the service runs", status=None)


def _payload(resp) -> dict[str, Any]:
    """The JSON object of an answer (a problem+json for errors); text that is not one as ``{"detail": ...}``."""
    try:
        payload = resp.json()
    except ValueError:
        return {"detail": resp.text[:500]}
    return payload if isinstance(payload, dict) else {"detail": str(payload)}


def _request(method: str, url: str, *, body: Any = None, token: str | None = None, timeout: float = 30.0,
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    status, payload, _ = _request_full(method, url, body=body, token=token, timeout=timeout, headers=headers)
    return status, payload


def _request_full(method: str, url: str, *, body: Any = None, token: str | None = None, timeout: float = 30.0,
                  headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any], Any]:
    """``(status, JSON object, headers)``; :class:`DatasetServiceError` (status None) when nothing answered."""
    httpx, _ = _http()
    try:
        resp = httpx.request(method, url, json=body, headers=_headers(token, headers), timeout=timeout)
    except httpx.HTTPError as exc:  # refused, reset, timeout
        raise _unreachable(url, exc) from exc
    if resp.status_code == 304:
        return 304, {}, resp.headers
    if resp.is_success:
        try:
            payload = resp.json() if resp.content else {}
        except ValueError as exc:  # not the service (a proxy's page...)
            raise _unreachable(url, exc) from exc
        return resp.status_code, payload, resp.headers
    return resp.status_code, _payload(resp), resp.headers


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


def submit_dataset(url: str, body: dict[str, Any], token: str | None = None,
                   idempotency_key: str | None = None) -> dict[str, Any]:
    """``POST /v1/datasets`` with ``body`` (see docs/service.md); returns the dataset status (its ``id``,
    ``state``; ``manifest`` when it was already built). ``idempotency_key``: a retry with the same key and
    body is answered with the same job. Raises :class:`DatasetServiceError` on 4xx/5xx."""
    headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
    status, payload = _request("POST", f"{_base(url)}/v1/datasets", body=body, token=_token(token), headers=headers)
    if status not in (200, 202):
        _raise_for(status, payload, "submitting the dataset")
    return payload


def get_dataset(url: str, dataset_id: str, token: str | None = None) -> dict[str, Any]:
    """``GET /v1/datasets/{id}``: the status (see docs/service.md)."""
    return _get_status(url, dataset_id, token)[0]


def _get_status(url: str, dataset_id: str, token: str | None, etag: str | None = None
                ) -> tuple[dict[str, Any] | None, str | None]:
    """``(status, etag)``; status None when ``etag`` still matches (304: nothing changed)."""
    quoted = urllib.parse.quote(dataset_id, safe="")
    status, payload, headers = _request_full("GET", f"{_base(url)}/v1/datasets/{quoted}", token=_token(token),
                                             headers={"If-None-Match": etag} if etag else None)
    if status == 304:
        return None, etag
    if status == 404:
        raise DatasetServiceError(f"the service at {url} knows no dataset {dataset_id!r}; submit it first "
                                  "(POST /v1/datasets, or pf_trl.data.service_client.submit_dataset)",
                                  status=404, problem=payload)
    if status != 200:
        _raise_for(status, payload, f"reading dataset {dataset_id}")
    return payload, headers.get("ETag") or headers.get("etag")


def _events(url: str, dataset_id: str, token: str | None, last_event_id: str | None,
            timeout: float) -> Iterator[tuple[str | None, str, dict[str, Any]]]:
    """Yield ``(id, kind, data)`` from the SSE stream; returns when it ends or drops. Raises
    :class:`DatasetServiceError` (status 404/405/406 and others) when there is no stream to follow."""
    httpx, httpx_sse = _http()
    quoted = urllib.parse.quote(dataset_id, safe="")
    where = f"{_base(url)}/v1/datasets/{quoted}/events"
    headers = _headers(token, {"Last-Event-ID": last_event_id} if last_event_id else None)
    try:
        with httpx.Client(timeout=timeout) as client, httpx_sse.connect_sse(client, "GET", where,
                                                                            headers=headers) as source:
            resp = source.response
            if not resp.is_success:
                resp.read()
                _raise_for(resp.status_code, _payload(resp), f"following dataset {dataset_id}")
            if not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                raise DatasetServiceError("the service answered the event stream with "
                                          f"{resp.headers.get('Content-Type')!r}", status=406)
            try:
                for event in source.iter_sse():
                    if event.data:  # a keep-alive comment carries none
                        yield event.id or None, event.event, json.loads(event.data)
            except (httpx.HTTPError, ValueError):
                return  # dropped: the caller resumes with Last-Event-ID
    except httpx.HTTPError as exc:
        raise _unreachable(url, exc) from exc


def wait_for_dataset(url: str, dataset_id: str, *, token: str | None = None, timeout_s: float = 3600,
                     poll_s: float = 2.0, progress: bool = True, connect_timeout_s: float = 120.0,
                     follow_events: bool = True) -> Path:
    """Wait until the service has built ``dataset_id`` and return its local shards directory.

    Args:
        url: service base URL, e.g. ``http://pf-preprocess:8000``.
        dataset_id: the id returned by ``POST /v1/datasets``.
        token: bearer token (default ``$PF_SERVICE_TOKEN``).
        timeout_s: give up after this many seconds.
        poll_s: seconds between polls (when the event stream is not available).
        progress: show a tqdm bar of rows tokenized.
        connect_timeout_s: give up this soon when the service was never reached (a wrong URL, no
            service, or one still starting); once it answered, outages are retried until ``timeout_s``.
        follow_events: follow the Server-Sent Events stream (False: poll).

    Raises:
        DatasetServiceError: unknown id, auth failure, the job failed or was cancelled (with its reason),
            timeout, unreachable, or the reported shards directory is not visible here (mount the
            service's cache volume).
    """
    _http()  # a missing extra is said at once, not retried as an unreachable service
    base, token = _base(url), _token(token)
    start = time.monotonic()
    deadline = start + timeout_s
    bar = _RowsBar(dataset_id, enabled=progress)
    last_problem, reached, etag, status, last_event_id = None, False, None, None, None
    try:
        while True:
            try:
                fresh, etag = _get_status(base, dataset_id, token, etag)
                status = fresh or status
                reached, last_problem = True, None
            except DatasetServiceError as exc:  # not reachable (yet) or 502/503/504: retry
                if exc.status is not None and exc.status not in _RETRYABLE:
                    raise
                if not reached and exc.status is None:
                    if time.monotonic() - start >= min(connect_timeout_s, timeout_s):
                        raise
                    if progress and last_problem is None:  # say once why nothing happens yet
                        # a progress note (stdout), not an error: stderr carries the one error line if it ends so
                        print(f"waiting for the dataset service (up to {min(connect_timeout_s, timeout_s):.0f}s): "
                              f"{exc}", flush=True)
                last_problem = str(exc)
            if status is not None:
                bar.show(status.get("state"), status.get("progress") or {})
                done = _finished(dataset_id, status)
                if done is not None:
                    return done
                if follow_events and time.monotonic() < deadline:
                    try:
                        for event_id, kind, data in _events(base, dataset_id, token, last_event_id,
                                                            timeout=max(1.0, min(60.0, deadline - time.monotonic()))):
                            last_event_id = event_id or last_event_id
                            bar.show(data.get("state"), data)
                            if kind in ("succeeded", "failed", "cancelled", "deleted"):
                                break
                            if time.monotonic() >= deadline:
                                break
                        etag = None  # the stream ended (terminal event or dropped): read the status afresh
                        continue
                    except DatasetServiceError as exc:
                        if exc.status in (401, 403):
                            raise
                        if exc.status in (404, 405, 406):  # a service without the stream (or a proxy): poll
                            follow_events = False
                        last_problem = str(exc)
            if time.monotonic() >= deadline:
                where = f"last state {status.get('state')!r}" if status else (last_problem or "no answer")
                raise DatasetServiceError(f"timed out after {timeout_s:.0f}s waiting for dataset {dataset_id} "
                                          f"({where}); raise timeout_s or check the service")
            time.sleep(max(0.05, min(poll_s, deadline - time.monotonic())))
    finally:
        bar.close()


def _finished(dataset_id: str, status: dict[str, Any]) -> Path | None:
    """The shards path once succeeded; raises for failed / cancelled; None while it runs."""
    state = status.get("state")
    if state == "succeeded":
        from pf_trl.storage import is_remote

        if is_remote(status.get("shards_path")):  # published to a bucket (the service's publish_uri)
            from pf_trl.data.remote import fetch_shards
            from pf_trl.storage import StorageError

            try:
                return fetch_shards(status["shards_path"])
            except StorageError as exc:
                raise DatasetServiceError(f"dataset {dataset_id}: {exc}") from exc
        path = Path(status.get("shards_path") or "")
        if not status.get("shards_path") or not is_shards_dir(path):
            raise DatasetServiceError(
                f"dataset {dataset_id} succeeded but its shards directory {path} is not visible from "
                "this machine; mount the service's cache volume there (the service's "
                "--public-cache-dir says where clients see it)")
        return path
    if state in ("failed", "cancelled"):
        error = status.get("error") or {}
        raise DatasetServiceError(
            f"dataset {dataset_id} {state} ({error.get('type', 'error')}): {error.get('message', 'no reason')}",
            problem=status)
    return None


class _RowsBar:
    """A tqdm bar of rows tokenized. Its rate counts only rows seen progressing here: the first report
    sets the starting point (``initial``), so joining a half-done or finished job shows no absurd rate."""

    def __init__(self, dataset_id: str, *, enabled: bool):
        self.dataset_id, self.enabled, self.bar = dataset_id, enabled, None

    def show(self, state: str | None, p: dict[str, Any]) -> None:
        if not self.enabled or state not in ("queued", "running", "succeeded"):
            return
        from tqdm.auto import tqdm

        done, total = p.get("rows_done") or 0, p.get("rows_total")
        desc = f"dataset {self.dataset_id[:12]} ({state})"
        if self.bar is None:
            self.bar = tqdm(total=total, initial=done, desc=desc, unit="rows", file=sys.stderr)
        bar = self.bar
        if total and bar.total != total:
            bar.total = total
        bar.set_description(desc, refresh=False)
        bar.set_postfix(tokens=p.get("tokens_done") or 0, refresh=False)
        if done > bar.n:
            bar.update(done - bar.n)
        elif done < bar.n:  # a re-run after a crash starts again from 0
            bar.reset(total=total)
            bar.update(done)
        bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


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
    s.add_argument("--idempotency_key", "--idempotency-key", default=None,
                   help="Idempotency-Key header: a retried submit (e.g. a restarted Job pod) names the same job")
    s.add_argument("--timeout_s", type=float, default=3600)
    w = sub.add_parser("wait")
    w.add_argument("url")
    w.add_argument("dataset_id")
    w.add_argument("--timeout_s", type=float, default=3600)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "submit":
            raw = sys.stdin.read() if args.body == "-" else Path(args.body).read_text(encoding="utf-8")
            key = {"idempotency_key": args.idempotency_key} if args.idempotency_key else {}
            status = submit_dataset(args.url, json.loads(raw), **key)
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
