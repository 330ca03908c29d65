"""One identity check for every way shards arrive: a path, ``load_shards``, ``datasets.load_from_disk``, a
``concatenate_datasets`` of parts, a ``select`` / ``map`` of any of these.

Shards carry their identity (the tokenizer fingerprint and input format of the manifest) in two places that survive
what users do with a ``datasets.Dataset``:

- ``Dataset.info.description``: pretokenize writes one line ``pf-trl-shards {json}`` into it, so ``load_from_disk``
  reads it back, and ``select`` / ``map`` / ``shuffle`` / ``select_columns`` keep it; ``concatenate_datasets`` joins
  the descriptions of its parts, one identity line per distinct part;
- ``Dataset.cache_files``: the Arrow files of a shards directory sit next to its ``pf_manifest.json`` (this also
  covers shards written before identities were stamped).

:func:`check_dataset_identity` refuses any part made with another tokenizer than the model's (the same comparison as
a shards path in :func:`pf_trl.data.shards.load_shards`), naming the part.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pf_trl._compat import stream_ex_iterable
from pf_trl.errors import PfTrlError

IDENTITY_PREFIX = "pf-trl-shards "
MANIFEST_FILE = "pf_manifest.json"
# the fields of a tokenizer fingerprint a dataset carries: enough for pf_trl.data.tokenizer.tokenizer_differences
TOKENIZER_KEYS = ("name", "sha256", "vocab_size", "identity", "content", "content_sizes", "files_sha256", "files",
                  "chat_template_sha256", "bos_token_id", "eos_token_id", "pad_token_id", "class")


class IdentityError(PfTrlError, ValueError):
    """A part of the data was made with another tokenizer than the model's; the message names the part."""


def identity_of_manifest(manifest: dict[str, Any], where: str | None = None) -> dict[str, Any]:
    """The identity fields of a manifest: tokenizer (name, identity by content or, older, by files, vocab size,
    template and special ids) and input format."""
    tok = manifest.get("tokenizer") or {}
    source = manifest.get("source") or {}
    return {
        "tokenizer": {k: tok[k] for k in TOKENIZER_KEYS if k in tok},
        "input_format": source.get("input_format"),
        "source_sha256": source.get("sha256"),
        "where": where or source.get("path"),
    }


def identity_line(identity: dict[str, Any]) -> str:
    """The line written into ``Dataset.info.description``."""
    return IDENTITY_PREFIX + json.dumps(identity, sort_keys=True)


def stamp(dataset, manifest: dict[str, Any], where: str | None = None):
    """Write the manifest's identity into ``dataset.info.description`` (in place; returns the dataset)."""
    line = identity_line(identity_of_manifest(manifest, where))
    kept = [ln for ln in (dataset.info.description or "").split("\n\n") if ln and not ln.startswith(IDENTITY_PREFIX)]
    dataset.info.description = "\n\n".join([*kept, line])
    return dataset


def identities(dataset) -> list[dict[str, Any]]:
    """Every identity a dataset carries (description lines, then manifests next to its Arrow files), deduplicated."""
    found: list[dict[str, Any]] = []
    info = getattr(dataset, "info", None)
    for chunk in (getattr(info, "description", None) or "").split("\n"):
        chunk = chunk.strip()
        if chunk.startswith(IDENTITY_PREFIX):
            try:
                found.append(json.loads(chunk[len(IDENTITY_PREFIX):]))
            except json.JSONDecodeError:
                continue
    manifest = getattr(dataset, "pf_manifest", None)
    if isinstance(manifest, dict) and "tokenizer" in manifest:
        found.append(identity_of_manifest(manifest))
    seen_dirs: set[str] = set()
    for entry in _cache_files(dataset):
        directory = Path(entry).parent
        if str(directory) in seen_dirs:
            continue
        seen_dirs.add(str(directory))
        path = directory / MANIFEST_FILE
        if path.is_file():
            try:
                found.append(identity_of_manifest(json.loads(path.read_text(encoding="utf-8")), str(directory)))
            except (OSError, ValueError):
                continue
    for shard in _stream_shards(dataset):  # a stream made by Dataset.to_iterable_dataset(): its Arrow shards
        found.extend(identities(shard))
    unique: dict[str, dict[str, Any]] = {}
    for ident in found:
        key = json.dumps({k: ident.get(k) for k in ("tokenizer", "input_format", "source_sha256")}, sort_keys=True)
        unique.setdefault(key, ident)
    return list(unique.values())


def _stream_shards(dataset) -> list:
    """The ``Dataset`` shards behind an ``IterableDataset`` made by ``to_iterable_dataset()`` (which drops the
    description): datasets keeps them in the examples iterable's ``kwargs["shards"]``, behind any map / split."""
    found, ex = [], stream_ex_iterable(dataset)
    for _ in range(64):  # a chain of wrapped iterables (map, filter, split...), never a cycle in practice
        if ex is None:
            break
        shards = (getattr(ex, "kwargs", None) or {}).get("shards")
        if isinstance(shards, list):
            found.extend(d for d in shards if hasattr(d, "info"))
        ex = getattr(ex, "ex_iterable", None)
    return found


def _cache_files(dataset) -> list[str]:
    try:
        files = dataset.cache_files or []
    except Exception:  # an IterableDataset or a custom object: no files to look at
        return []
    return [f["filename"] for f in files if isinstance(f, dict) and f.get("filename")]


def tokenizer_mismatch(have: dict[str, Any], expected: dict[str, Any]) -> bool:
    """True when ``have`` (from a manifest) is not the tokenizer ``expected`` (its fingerprint); the same rule as
    :func:`pf_trl.data.shards.load_shards` (:func:`pf_trl.data.tokenizer.tokenizer_differences`)."""
    from pf_trl.data.tokenizer import tokenizer_differences

    return bool(tokenizer_differences(have, expected))


def check_dataset_identity(dataset, expected_tokenizer: dict[str, Any] | Callable[[], dict[str, Any]], *,
                           what: str = "training") -> list[dict]:
    """Refuse a dataset any part of which was tokenized with another tokenizer; returns the identities found.

    ``expected_tokenizer``: the model tokenizer's fingerprint, or a function returning it, called only when the
    dataset carries an identity (hashing a tokenizer's content takes a large vocabulary's time).

    Raises:
        IdentityError: naming the part (its shards directory or source), what differs and the fix.
    """
    from pf_trl.data.tokenizer import mismatch_fix, tokenizer_differences

    found = identities(dataset)
    if found and callable(expected_tokenizer):
        expected_tokenizer = expected_tokenizer()
    for ident in found:
        have = ident.get("tokenizer") or {}
        differences = tokenizer_differences(have, expected_tokenizer)
        if differences:
            where = ident.get("where") or "a part of it"
            raise IdentityError(
                f"{what} data: {where} was tokenized with another tokenizer than the model's: {'; '.join(differences)} "
                f"(data: {have.get('name')!r}, model: {expected_tokenizer.get('name')!r}); the same token ids would "
                f"mean other tokens or another chat rendering: {mismatch_fix(have, expected_tokenizer)}"
            )
    return found
