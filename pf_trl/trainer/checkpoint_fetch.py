"""A bucket checkpoint fetched for a resume: only the files this node's ranks read, concurrently, checked against
the checkpoint's marker.

- **What a node reads.** Files named for a rank (``rng_state_<rank>.pth``, a stream's ``..._rank<rank>.json`` /
  ``.npz``, DeepSpeed's ``zero_pp_rank_<rank>_...``, torch DCP's ``__<rank>_<n>.distcp``) are read by that rank
  only; every other file (model, optimizer, scheduler, trainer and sampler state, the marker) by all. A node fetches
  the shared files and those of its own ranks; when the checkpoint was written by another number of ranks, all of
  them (a resharding load may read any shard).
- **Concurrently**: one batched fsspec ``get`` of the list.
- **Checked.** A marker written by :mod:`pf_trl.trainer.checkpoint_uploads` lists every file with its size and
  xxh3-128 digest and the attempt that wrote it; each fetched file is compared, and one that differs (a straggling
  earlier attempt that overwrote it after the marker was written) is refused in one line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pf_trl.errors import ResumeError
from pf_trl.storage import RemoteURI
from pf_trl.trainer.checkpoints import COMPLETE_MARKER

__all__ = ["fetch_checkpoint", "files_for_ranks", "rank_of"]

_RANK_FILES = (
    re.compile(r"(?:^|/)rng_state_(\d+)\.pth$"),
    re.compile(r"(?:^|/)pf_trl_stream_(?:state|buffer)_rank(\d+)\.\w+$"),
    re.compile(r"(?:^|/)(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_(?:optim|model)_states\.pt$"),
    re.compile(r"(?:^|/)__(\d+)_\d+\.distcp$"),
)


def rank_of(name: str) -> int | None:
    """The rank that reads checkpoint file ``name`` alone, or None for a file every rank reads."""
    for pattern in _RANK_FILES:
        m = pattern.search(name)
        if m:
            return int(m.group(1))
    return None


def files_for_ranks(names, ranks: set[int] | None) -> list[str]:
    """The files of ``names`` that ranks ``ranks`` read (all of them when ``ranks`` is None)."""
    return sorted(n for n in names if ranks is None or rank_of(n) is None or rank_of(n) in ranks)


def fetch_checkpoint(folder: RemoteURI, local: Path, ranks: set[int] | None, world_size: int) -> list[str]:
    """Download into ``local`` the files of bucket checkpoint ``folder`` that ``ranks`` read, check them against
    its marker, and return their names.

    Raises:
        ResumeError: a file differs from the marker (size or checksum), in one line naming it.
        StorageError: the bucket cannot be read.
    """
    from pf_trl.data.integrity import file_digest
    from pf_trl.storage.filesystem import call, filesystem, list_files, read_bytes

    marker = json.loads(read_bytes(folder.join(COMPLETE_MARKER)))
    if marker.get("world_size") not in (None, world_size):
        ranks = None  # written by another number of ranks: a resharding load may read any rank's file
    names = files_for_ranks(list_files(folder), ranks)
    for name in names:
        (local / name).parent.mkdir(parents=True, exist_ok=True)
    fs = filesystem(folder)
    rpaths, lpaths = [folder.join(n).path for n in names], [str(local / n) for n in names]
    call(folder, f"downloading {len(names)} checkpoint file(s) to {local}", lambda: fs.get(rpaths, lpaths))
    sums = marker.get("checksums") or {}
    listed = sums.get("files") or {}
    for name in names:
        entry = listed.get(name)
        if entry is None:
            continue  # the marker itself, or a marker from before checksums (its sizes are checked on listing)
        size = (local / name).stat().st_size
        digest = file_digest(local / name, sums.get("algorithm", "xxh3_128")) if size == entry["bytes"] else None
        if size != entry["bytes"] or digest != entry["digest"]:
            raise ResumeError(
                f"cannot resume from {folder}: {name} does not match its marker ({size} bytes, "
                f"{sums.get('algorithm')} {str(digest)[:16]}; attempt {entry.get('attempt', marker.get('attempt'))} "
                f"wrote {entry['bytes']} bytes, {entry['digest'][:16]}): another attempt's save overwrote it; resume "
                "from an earlier checkpoint's URI or delete this checkpoint")
    return names
