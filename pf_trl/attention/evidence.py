"""The support matrix's evidence over transformers releases: which sweep result holds for which version.

``support.json`` lists, per model type, one or more *records* (a status and reason per mode, what
:mod:`pf_trl_dev.coverage` measured), each with the transformers versions the sweep ran on and found that
record (``"transformers": ["5.24.0", "5.25.0"]``). A record measured on ``X.Y.Z`` is evidence for every patch
release ``X.Y.*``: the matrix declares the range ``>= oldest swept, < the minor after the newest`` and within it
each version reads the record of its own minor release. A version outside that range, or a type no record
names, has no evidence: :mod:`pf_trl.attention.support` then relies on the runtime self-check, using the nearest
swept release's record as advice.

``python -m pf_trl_dev.coverage --write`` sweeps the installed transformers and :func:`merge` puts its
results in, keeping the records of the other swept versions (run it once per version to add).
"""

from __future__ import annotations

import json
import re
from typing import Any

from packaging.version import Version

FORMAT = 2
MODES = ("huggingface", "internal")


def _minor(version: str) -> tuple[int, int]:
    v = Version(version)
    return v.major, v.minor


def swept_versions(matrix: dict[str, Any]) -> list[str]:
    """The transformers versions the matrix holds sweep results for, oldest first."""
    return sorted(matrix.get("swept") or [], key=Version)


def declared_range(versions: list[str]) -> str:
    """``>=oldest,<next minor of the newest`` (``""`` for no version): where the evidence is valid."""
    if not versions:
        return ""
    newest = Version(max(versions, key=Version))
    return f">={min(versions, key=Version)},<{newest.major}.{newest.minor + 1}"


def basis(matrix: dict[str, Any], version: str) -> str | None:
    """The swept version whose records hold for ``version`` (the same minor release), or ``None`` (no evidence)."""
    same = [v for v in swept_versions(matrix) if _minor(v) == _minor(version)]
    if not same:
        return None
    return version if version in same else same[-1]


def nearest(matrix: dict[str, Any], version: str) -> str | None:
    """The swept version closest below ``version`` (else the oldest): advice for an unswept release."""
    versions = swept_versions(matrix)
    if not versions:
        return None
    below = [v for v in versions if Version(v) <= Version(version)]
    return below[-1] if below else versions[0]


def record(matrix: dict[str, Any], model_type: str, version: str) -> dict[str, Any] | None:
    """The record of ``model_type`` measured on the swept ``version`` (None if the sweep did not see it there)."""
    for rec in matrix.get("models", {}).get(model_type) or []:
        if version in rec.get("transformers", ()):
            return rec
    return None


def entries(matrix: dict[str, Any], version: str) -> dict[str, dict[str, Any]]:
    """``{model_type: record}`` measured on the swept ``version``."""
    found = {}
    for model_type in matrix.get("models", {}):
        rec = record(matrix, model_type, version)
        if rec is not None:
            found[model_type] = rec
    return found


def comparable(text: str) -> str:
    """Text with its measured numbers masked: two sweeps agree when their statuses and reasons do."""
    return re.sub(r"-?\d+(\.\d+)?(e[-+]?\d+)?", "#", text)


def _verdict(entry: dict[str, Any]) -> str:
    return comparable(json.dumps({m: entry[m] for m in MODES} | {"class": entry["class"]}, sort_keys=True))


def merge(matrix: dict[str, Any] | None, version: str, fresh: dict[str, dict[str, Any]],
          header: dict[str, Any]) -> dict[str, Any]:
    """``matrix`` with the sweep of ``version`` (``fresh``: ``{model_type: entry}``) replacing what it held for
    that version; a fresh entry that agrees with a record of another version joins that record."""
    models: dict[str, list[dict[str, Any]]] = {}
    old = (matrix or {}).get("models", {}) if (matrix or {}).get("format") == FORMAT else {}
    for model_type, records in old.items():
        kept = []
        for rec in records:
            versions = [v for v in rec.get("transformers", []) if v != version]
            if versions:
                kept.append({**rec, "transformers": versions})
        if kept:
            models[model_type] = kept
    for model_type, entry in fresh.items():
        records = models.setdefault(model_type, [])
        same = next((r for r in records if _verdict(r) == _verdict(entry)), None)
        if same is not None:
            same["transformers"] = sorted({*same["transformers"], version}, key=Version)
        else:
            records.append({**entry, "transformers": [version]})
            records.sort(key=lambda r: Version(r["transformers"][0]))
    swept = sorted({v for records in models.values() for r in records for v in r["transformers"]}, key=Version)
    return {**header, "format": FORMAT, "swept": swept, "valid": declared_range(swept),
            "models": dict(sorted(models.items()))}
