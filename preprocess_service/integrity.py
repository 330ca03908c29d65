"""A published dataset is checked before it is served: reused by a POST, or reported by GET as succeeded.

Its files are compared with the checksums of the manifest recorded in the job store when it was published (not
only the copy on disk, which a careless hand could rewrite along with the data), through the same
:func:`pf_trl.data.shards.verify_shards` that ``load_shards`` and ``pf-trl verify`` use. A file is re-read only
when its status changed since it last verified (a memo keyed by size, mtime, ctime, inode), so polling costs a
``stat`` per file. A corrupt or vanished dataset is never served: its job becomes ``failed`` (``corrupt``) with
the file named, its directory is moved out of ``datasets/``, and a new POST of the request rebuilds it.
"""

from __future__ import annotations

import json
import logging
import shutil
import uuid
from typing import Any

from preprocess_service.locks import KeyedLocks

logger = logging.getLogger("preprocess_service")


class DatasetIntegrity:
    def __init__(self, settings, store):
        self.settings, self.store = settings, store
        self._memo: dict[tuple, str] = {}
        self._lock = KeyedLocks()

    def problem(self, row: dict[str, Any]) -> str | None:
        """Why a succeeded job's dataset may not be served (None: intact)."""
        from pf_trl.data.shards import ShardsError, is_shards_dir, read_manifest, verify_shards

        target = self.settings.datasets_dir / row["id"]
        if not is_shards_dir(target):
            return None  # vanished: reported as such by the status, rebuilt by a new POST
        recorded = json.loads(row["manifest"]) if row["manifest"] else None
        try:
            on_disk = read_manifest(target)
            if recorded is not None and on_disk != recorded:
                return f"{target}: its pf_manifest.json differs from the manifest recorded when it was published"
            verify_shards(target, recorded or on_disk, memo=self._memo)
        except ShardsError as exc:
            return str(exc)
        return None

    def ensure(self, row: dict[str, Any]) -> dict[str, Any]:
        """``row`` itself when it is not a succeeded job or its dataset is intact; else the job marked corrupt."""
        if row is None or row["state"] != "succeeded":
            return row
        with self._lock(row["id"]):
            reason = self.problem(row)
            if reason is None:
                return row
            trash = self.settings.scratch_dir / f"corrupt-{row['id']}-{uuid.uuid4().hex[:8]}"
            target = self.settings.datasets_dir / row["id"]

            def move_away() -> None:
                if target.exists():
                    target.rename(trash)

            message = (f"the published dataset is corrupt and was withdrawn: {reason.split('; the directory')[0]}; "
                       "POST the same request again to rebuild it")
            if self.store.mark_corrupt(row["id"], message, move_away):
                logger.error("dataset %s is corrupt and was withdrawn: %s", row["id"], reason)
            shutil.rmtree(trash, ignore_errors=True)
            return self.store.get(row["id"]) or row
