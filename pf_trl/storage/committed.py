"""A prefix committed in place by a marker written last: the final model of a run (``output_dir`` in a bucket), read
back by ``--model_name_or_path s3://...``.

Layout of a committed prefix ``s3://BUCKET/runs/NAME``::

    config.json, model-0000N-of-0000M.safetensors, tokenizer.json, ...   the files, under their own names
    pf_trl_model_complete.json                                           the commit: written last, one PUT

Unlike a dataset (:mod:`pf_trl.storage.datasets`, one writer folder per commit) the files keep their names at the
prefix, as ``from_pretrained`` and every other tool expect them. So a writer (:func:`commit_prefix`) first deletes
the marker (the prefix is uncommitted from then on: a consumer refuses it instead of reading a mix of two models),
uploads the files in one batched ``put``, removes what the previous commit left that the new one does not hold (an
old third shard), and writes the marker last, listing every file with its size and checksum.

A consumer calls :func:`read_commit` (one line when there is no marker, or it is unreadable) and
:func:`fetch_committed`: the listed files downloaded into the node cache, each checked against its size and checksum
before the copy is kept, so a file changed after the commit is refused in one line too.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from pf_trl.storage.errors import RemoteNotFound, StorageError
from pf_trl.storage.uri import RemoteURI, parse_uri

MODEL_MARKER = "pf_trl_model_complete.json"
FORMAT = 1

__all__ = ["MODEL_MARKER", "commit_prefix", "fetch_committed", "read_commit", "verify_files"]


ALGORITHM = "xxh3_128"  # the shards' checksum (pf_trl.data.integrity): corruption, not an attacker, is guarded
_BLOCK = 4 * 2**20


def file_digest(path: Path, algorithm: str = ALGORITHM) -> str:
    """Hex digest of a file, read in 4 MiB blocks (constant memory for any size of weights).

    Raises:
        StorageError: an algorithm other than xxh3_128 / sha256 (a marker written by something else).
    """
    if algorithm == "xxh3_128":
        import xxhash

        hasher = xxhash.xxh3_128()
    elif algorithm == "sha256":
        import hashlib

        hasher = hashlib.sha256()
    else:
        raise StorageError(f"{path}: unknown checksum algorithm {algorithm!r} in a commit marker")
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            hasher.update(block)
    return hasher.hexdigest()


def _checksums(local: Path, files: Iterable[str]) -> dict[str, Any]:
    return {"algorithm": ALGORITHM,
            "files": {name: {"bytes": (local / name).stat().st_size, "digest": file_digest(local / name)}
                      for name in sorted(files)}}


def commit_prefix(local: str | Path, uri: str | RemoteURI, files: list[str], *, marker: str = MODEL_MARKER,
                  keep: Callable[[str], bool] = lambda name: False, what: str = "model",
                  say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Upload ``files`` (relative to ``local``) to the same names under ``uri`` and commit them: the old marker
    deleted first, the new files uploaded in one batch, stale files removed, the marker (sizes and checksums) last.

    Args:
        keep: names under ``uri`` that are not part of the commit and stay whatever it holds (a run's checkpoints).
        what: how the marker and messages name the content (``"model"``).

    Returns:
        The marker's body.

    Raises:
        StorageError: the bucket cannot be written (one line).
    """
    from pf_trl.storage.filesystem import call, filesystem, list_files, remove, write_bytes

    u = parse_uri(uri)
    local = Path(local)
    if marker in files:
        raise StorageError(f"{local}/{marker}: a file of that name is the commit marker; rename it")
    started = time.monotonic()
    sums = _checksums(local, files)  # before anything in the bucket changes: a failure here leaves the old commit
    before = list_files(u)
    if marker in before:
        remove(u.join(marker))  # uncommitted from here until the new marker: never a mix of two commits
    if files:
        fs = filesystem(u)
        sources = [str(local / name) for name in sorted(files)]
        targets = [u.join(name).path for name in sorted(files)]
        call(u, f"uploading {len(files)} files from {local}", lambda: fs.put(sources, targets))
    stale = sorted(n for n in before if n not in sums["files"] and n != marker and not keep(n))
    for name in stale:
        remove(u.join(name))
    body = {"format": FORMAT, "what": what, "committed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "checksums": sums}
    write_bytes(u.join(marker), (json.dumps(body, indent=1, sort_keys=True) + "\n").encode())  # the commit, last
    if say:
        total = sum(f["bytes"] for f in sums["files"].values())
        took = max(time.monotonic() - started, 1e-6)
        say(f"pf-trl: {what} uploaded to {u} ({len(files)} files, {total / 1e6:.1f} MB, {total / 1e6 / took:.1f} MB/s"
            f"{f', {len(stale)} stale files of the previous commit removed' if stale else ''}); committed by "
            f"{u}/{marker}")
    return body


def read_commit(uri: str | RemoteURI, *, marker: str = MODEL_MARKER, what: str = "model",
                flag: str = "--model_name_or_path") -> tuple[dict[str, dict[str, Any]], bytes]:
    """``({name: {"bytes", "digest"}}, the marker's bytes)`` of the committed prefix ``uri``: the one check every
    consumer of a committed prefix makes.

    Raises:
        StorageError: no marker (never committed, an upload cut short or still running, or written by another tool),
            or a marker that cannot be read; one line naming the prefix and the fix.
    """
    from pf_trl.storage.filesystem import read_bytes

    u = parse_uri(uri)
    try:
        raw = read_bytes(u.join(marker))
    except RemoteNotFound:
        raise StorageError(f"{flag} {u}: no {marker} there, so it is not a committed pf-trl {what} (an upload cut "
                           f"short or still running, or written by another tool); point at the output_dir of a "
                           f"finished `pf-trl train`, or copy the {what} to a local folder") from None
    try:
        body = json.loads(raw)
        files = body["checksums"]["files"]
        if body["checksums"]["algorithm"] is None or not isinstance(files, dict) or not files:
            raise ValueError("no files listed")
        for name, entry in files.items():
            if ".." in Path(name).parts or Path(name).is_absolute():
                raise ValueError(f"it names a path outside the prefix ({name!r})")
            int(entry["bytes"]), str(entry["digest"])
    except (ValueError, KeyError, TypeError) as exc:
        raise StorageError(f"{flag} {u}: its {marker} is unreadable ({type(exc).__name__}: {exc}); write the {what} "
                           "again") from None
    return files, raw


def verify_files(folder: Path, files: dict[str, dict[str, Any]], algorithm: str, uri: RemoteURI, *,
                 marker: str = MODEL_MARKER) -> None:
    """Every file of ``files`` under ``folder`` has its listed size and checksum.

    Raises:
        StorageError: one that differs (changed in the bucket after it was committed), named in one line.
    """
    for name, entry in sorted(files.items()):
        path = folder / name
        size = path.stat().st_size
        if size != int(entry["bytes"]) or file_digest(path, algorithm) != entry["digest"]:
            raise StorageError(f"{uri.join(name)} does not match its {algorithm} checksum in {uri}/{marker} (changed "
                               "in the bucket after it was committed, or corrupted); write it again")


def fetch_committed(uri: str | RemoteURI, *, marker: str = MODEL_MARKER, what: str = "model",
                    flag: str = "--model_name_or_path", select: Callable[[str], bool] | None = None) -> Path:
    """The node-cache copy of the committed prefix ``uri``: its marker read (:func:`read_commit`), its files (those
    ``select`` takes, default all) downloaded once per node and commit, each checked against the marker.

    Raises:
        StorageError: uncommitted, a listed file missing or different, the cache cannot hold it.
    """
    import hashlib

    from pf_trl.storage import cache

    u = parse_uri(uri)
    files, raw = read_commit(u, marker=marker, what=what, flag=flag)
    algorithm = json.loads(raw)["checksums"]["algorithm"]
    chosen = {n: e for n, e in files.items() if select is None or select(n)}
    names = ",".join(sorted(chosen)).encode()
    key = hashlib.sha256(str(u).encode() + b"\0" + raw + b"\0" + names).hexdigest()[:32]
    try:
        return cache.fetch(key, u, {n: int(e["bytes"]) for n, e in chosen.items()}, what=f"{flag} {u}",
                           extra={marker: raw},
                           verify=lambda folder: verify_files(folder, chosen, algorithm, u, marker=marker))
    except RemoteNotFound as exc:
        raise StorageError(f"{flag} {u}: a file its {marker} lists is missing from the bucket ({exc}); write the "
                           f"{what} again") from None
