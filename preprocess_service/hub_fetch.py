"""A job's Hub sources, downloaded by the job itself (outside the preflight sandbox's time limit) with the service's
own size limit (``hub_max_download_bytes``), its progress in the job's events.

The request was checked and resolved to a commit and its files by the preflight (:mod:`preprocess_service.preflight`,
which downloads nothing but the README); here huggingface_hub downloads those files at that commit
(:func:`pf_trl.hub.fetch_files`): the sizes the Hub tells are checked against the limit before any download, and the
bytes are counted while downloading. Over the limit the job fails in one line naming the size, the limit and the
setting, and what it downloaded is removed from the Hub cache. Each step is a ``downloading`` event of the job
(``"downloading 3 files, 12.5 MB"``, then every MB and each file done).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from preprocess_service.build import JobAbandoned, JobError

LIMIT_NAME = "hub_max_download_bytes, --hub-max-download-bytes / PF_SERVICE_HUB_MAX_DOWNLOAD_BYTES"


def fetch_hub_sources(settings, store, job_id: str, pid: int, fetches: list[dict[str, Any]],
                      abandon: threading.Event | None) -> list[list[Path]]:
    """The local files of each Hub source ``fetches`` (what the submit recorded: repository, revision, commit,
    files, sizes), in their order, downloaded into the service's Hub cache within ``settings.hub_max_download_bytes``
    in all (a split's files together: their sizes summed before any download).

    Raises:
        JobError: ``too_large`` over the limit, ``hub`` when the Hub refused or could not be reached (one line).
        JobAbandoned: the job is no longer ours (cancelled, deleted).
    """
    from pf_trl.hub import HubDownloadTooLarge, HubError, fetch_files, register

    limit = settings.hub_max_download_bytes
    known = sum(s or 0 for fetch in fetches for s in fetch["sizes"].values())
    if len(fetches) > 1 and known > limit:  # several Hub sources: the limit holds for them together
        names = ", ".join(fetch["repo_id"] for fetch in fetches)
        raise JobError("too_large", f"the Hub sources {names} are {known:,} bytes together, over the download limit "
                       f"of {limit:,} bytes ({LIMIT_NAME}); mix fewer or smaller sources, or raise the limit")

    def on_progress(step) -> None:
        if not store.download_progress(job_id, pid, message=step.message, bytes_done=used + step.bytes_done,
                                       bytes_total=step.bytes_total, files_done=step.files_done,
                                       files_total=step.files_total) or (abandon and abandon.is_set()):
            raise JobAbandoned(job_id)

    paths, used = [], 0
    for fetch in fetches:
        try:
            folder = fetch_files(fetch["repo_id"], list(fetch["files"]), repo_type="dataset", commit=fetch["commit"],
                                 flag="source.hub", max_bytes=limit - used, limit_name=LIMIT_NAME,
                                 on_progress=on_progress)
        except HubDownloadTooLarge as exc:
            raise JobError("too_large", str(exc)) from None
        except HubError as exc:
            raise JobError("hub", str(exc)) from None
        register(fetch["repo_id"], "dataset", fetch.get("revision"), folder)  # the manifest names the revision
        files = [folder / name for name in fetch["files"]]
        used += sum(f.stat().st_size for f in files)
        paths.append(files)
    return paths
