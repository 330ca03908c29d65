"""Where the Ray engine (:mod:`pf_trl.data.ray_engine`) commits its parts: a folder every Ray node sees, or a bucket.

Both hold the run's plan until the dataset is committed (a run started again with the same source and flags resumes
it), commit each part by its manifest and the dataset by a manifest written last; they differ in how a part appears
whole:

- :class:`FolderParts` (a local or shared folder): a part is written into a temporary sibling and renamed to
  ``part-<first source row>``; a second attempt at the same rows finds the name taken and discards its copy.
- :class:`BucketParts` (``s3://``, ``gs://``, ...): a bucket has no rename, so each attempt uploads into a folder of
  its own, ``<writer>/part-<first source row>-<attempt>/``, its ``pf_manifest.json`` last: that PUT commits it. An
  attempt without a manifest (a worker killed mid-upload) is never listed; when two attempts committed the same rows
  (a worker presumed dead that finished anyway) the dataset lists one. The dataset's manifest, written last at the
  prefix, names the writer folder as :mod:`pf_trl.storage.datasets` lays a committed dataset out, so the trainer
  (with its read-ahead), ``inspect`` and ``verify`` read it as any dataset in a bucket. Layout::

      pf_plan.json                                    the run's plan, until the dataset is committed
      w-<time>-<hex>/part-<12 digits>-<hex>/...       one attempt at a part, its pf_manifest.json last
      w-<time>-<hex>/pf_lengths.npy                   every row's length, in row order
      pf_manifest.json                                the dataset: written last, one PUT
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from pf_trl.data.options import PretokenizeError
from pf_trl.data.shards import MANIFEST_FILE

PLAN_FILE = "pf_plan.json"
WORK_DIR = ".work"
PART_PREFIX = "part-"
WRITER_KEY = "writer"  # the plan's writer folder (bucket destinations)


def part_name(start: int) -> str:
    """The part holding source rows from ``start``: named by its rows, so every attempt at it writes the same name."""
    return f"{PART_PREFIX}{start:012d}"


def same_run(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two plans of the same source, tokenizer and flags (the part size and writer folder are the first run's)."""
    drop = ("rows_per_part", WRITER_KEY)
    return {k: v for k, v in a.items() if k not in drop} == {k: v for k, v in b.items() if k not in drop}


INTERRUPTED_OTHER = ("holds an interrupted run of another source, tokenizer or flags; pass --overwrite to start "
                     "over, or choose a new directory")


def write_json_atomic(path: Path, data: dict) -> None:
    """Write ``data`` whole to a temporary name, then rename it: a reader sees no file or the complete one."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _part_examples(manifests: list[dict]) -> None:
    if sum(int(m["counts"]["examples"]) for m in manifests) == 0:
        raise PretokenizeError("no example left after tokenization; check max_seq_len and the loss masking options")


class FolderParts:
    """Parts committed by rename in a folder every Ray node sees (a local path or a shared volume)."""

    def __init__(self, out: str | os.PathLike) -> None:
        self.out = Path(out).absolute()

    def __str__(self) -> str:
        return str(self.out)

    def prepare(self, overwrite: bool) -> bool:
        """Before the source is opened: refuse a committed dataset; returns whether the folder was created."""
        if overwrite and self.out.exists():
            shutil.rmtree(self.out)  # not atomic with this engine: the old dataset is gone before the new one is whole
        if (self.out / MANIFEST_FILE).is_file():
            raise PretokenizeError(f"output {self.out} already exists; choose a new directory or pass overwrite=True "
                                   "(--overwrite)")
        created = not self.out.exists()
        self.out.mkdir(parents=True, exist_ok=True)
        return created

    def abandon(self, created: bool) -> None:
        """Refused before any plan: leave nothing behind."""
        if created and not (self.out / PLAN_FILE).exists():
            shutil.rmtree(self.out, ignore_errors=True)

    def work_dir(self) -> Path:
        """The source's datasets cache, shared by the driver and every worker (they see the same folder)."""
        return self.out / WORK_DIR

    def open_plan(self, plan: dict[str, Any]) -> dict[str, Any]:
        """This run's plan written whole, or the interrupted run's when it is the same source and flags."""
        path = self.out / PLAN_FILE
        if path.is_file():
            existing = json.loads(path.read_text(encoding="utf-8"))
            if not same_run(existing, plan):
                raise PretokenizeError(f"{self.out} {INTERRUPTED_OTHER}")
            return existing  # resumed: its ranges, whatever rows_per_part this run asked for
        if any(p.name != WORK_DIR for p in self.out.iterdir()):
            raise PretokenizeError(f"output {self.out} already exists and is not a pf-trl run; choose a new directory "
                                   "or pass overwrite=True (--overwrite)")
        self.save_plan(plan)
        return plan

    def save_plan(self, plan: dict[str, Any]) -> None:
        write_json_atomic(self.out / PLAN_FILE, plan)

    def committed(self, start: int, plan_id: str) -> str | None:
        """The committed part of this plan holding rows from ``start``, or None."""
        name = part_name(start)
        path = self.out / name / MANIFEST_FILE
        if not path.is_file():
            return None
        try:
            return name if (json.loads(path.read_text(encoding="utf-8")).get("part") or {}).get("plan") == plan_id \
                else None
        except (OSError, ValueError):
            return None

    def committed_parts(self, plan_id: str) -> dict[int, str]:
        """``{first source row: part}`` of every committed part of this plan."""
        found = {}
        for path in self.out.glob(f"{PART_PREFIX}*"):
            first_row = path.name[len(PART_PREFIX):]
            if first_row.isdigit() and self.committed(int(first_row), plan_id):
                found[int(first_row)] = path.name
        return found

    def attempt_dir(self, start: int) -> Path:
        """A fresh folder for one attempt at a part: a hidden sibling of the part, on the same file system."""
        tmp = self.out / f".{part_name(start)}.tmp-{uuid.uuid4().hex}"
        tmp.mkdir(parents=True)
        return tmp

    def commit(self, shards: Path, start: int, plan_id: str) -> str:
        """Rename the written part ``shards`` into place (atomic); a part already there (another attempt) wins."""
        name = part_name(start)
        try:
            os.rename(shards, self.out / name)  # atomic: the part appears whole, or not at all
        except OSError:
            if not self.committed(start, plan_id):
                raise
            # another attempt at the same rows committed it first: the part is written once
        return name

    def finish(self, names: list[str], fields: dict[str, Any]) -> dict[str, Any]:
        """Commit the dataset of ``names`` (its manifest last), then drop the plan, the cache and dead attempts."""
        from pf_trl.data.parts import write_parts_manifest
        from pf_trl.data.shards import read_manifest

        _part_examples([read_manifest(self.out / n) for n in names])
        manifest = write_parts_manifest(self.out, names, fields)
        (self.out / PLAN_FILE).unlink(missing_ok=True)
        shutil.rmtree(self.work_dir(), ignore_errors=True)
        for stale in self.out.glob(f".{PART_PREFIX}*.tmp-*"):  # attempts of workers that died mid-part
            shutil.rmtree(stale, ignore_errors=True)
        return manifest


class BucketParts:
    """Parts committed by their manifest under a bucket prefix (each attempt in a folder of its own)."""

    def __init__(self, uri: str) -> None:
        from pf_trl.storage import parse_uri

        self.uri = parse_uri(uri)
        self.writer: str | None = None  # set by open_plan; a worker gets it with this object

    def __str__(self) -> str:
        return str(self.uri)

    def prepare(self, overwrite: bool) -> bool:
        """Before the source is opened: the bucket reachable, no committed dataset there unless ``overwrite`` (then
        it stays until the new one is committed)."""
        from pf_trl.storage.datasets import check_destination

        check_destination(self.uri, MANIFEST_FILE, overwrite=overwrite)
        self.overwrite = overwrite
        return False

    def abandon(self, created: bool) -> None:
        shutil.rmtree(self.work_dir(), ignore_errors=True)

    def work_dir(self) -> Path:
        """The source's datasets cache on this node (each node's own; the same path for every process of it)."""
        from pf_trl.storage.cache import staging_dir

        return staging_dir() / f"ray-{hashlib.sha256(str(self.uri).encode()).hexdigest()[:16]}"

    def _files(self):
        return self.uri.join(self.writer)

    def open_plan(self, plan: dict[str, Any]) -> dict[str, Any]:
        """This run's plan (a new writer folder) PUT whole, or the interrupted run's when it is the same source and
        flags (``overwrite``: a new run whatever the prefix holds)."""
        from pf_trl.storage import RemoteNotFound
        from pf_trl.storage.datasets import new_writer
        from pf_trl.storage.filesystem import read_bytes

        if not self.overwrite:
            try:
                existing = json.loads(read_bytes(self.uri.join(PLAN_FILE)))
            except RemoteNotFound:
                existing = None
            except ValueError:
                raise PretokenizeError(f"{self.uri}/{PLAN_FILE} is unreadable; pass --overwrite to start over") \
                    from None
            if existing is not None:
                if not same_run(existing, plan) or not existing.get(WRITER_KEY):
                    raise PretokenizeError(f"{self.uri} {INTERRUPTED_OTHER}")
                self.writer = existing[WRITER_KEY]
                return existing
        plan = {**plan, WRITER_KEY: new_writer()}
        self.writer = plan[WRITER_KEY]
        self.save_plan(plan)
        return plan

    def save_plan(self, plan: dict[str, Any]) -> None:
        from pf_trl.storage.filesystem import write_bytes

        write_bytes(self.uri.join(PLAN_FILE), (json.dumps(plan, indent=2, sort_keys=True) + "\n").encode())

    def committed_parts(self, plan_id: str) -> dict[int, str]:
        """``{first source row: attempt folder}``: one committed attempt per part (its manifest there), from one
        listing of the writer folder; where several attempts committed, the first by name."""
        from pf_trl.storage.filesystem import list_files

        found: dict[int, str] = {}
        for path in sorted(list_files(self._files())):
            folder, _, file = path.partition("/")
            first_row = folder[len(PART_PREFIX):].split("-")[0]
            if file != MANIFEST_FILE or not folder.startswith(PART_PREFIX) or not first_row.isdigit():
                continue  # not a committed attempt of this engine
            found.setdefault(int(first_row), folder)
        return found

    def committed(self, start: int, plan_id: str) -> str | None:
        """None: a worker does not list the bucket before each part (a listing per part is quadratic in the parts).
        A retried attempt whose first attempt had committed adds a second copy; the dataset lists one and the other
        is deleted (:meth:`finish`)."""
        return None

    def attempt_dir(self, start: int) -> Path:
        from pf_trl.storage.cache import staging_dir

        staging_dir().mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{part_name(start)}.tmp-", dir=staging_dir()))

    def commit(self, shards: Path, start: int, plan_id: str) -> str:
        """Upload the written part ``shards`` into a folder of this attempt, its manifest last (the commit)."""
        from pf_trl.storage.filesystem import upload

        name = f"{part_name(start)}-{uuid.uuid4().hex[:8]}"
        files = sorted(p.relative_to(shards).as_posix() for p in shards.rglob("*") if p.is_file())
        for file in [f for f in files if f != MANIFEST_FILE] + [MANIFEST_FILE]:
            upload(shards / file, self._files().join(name, file))
        return name

    def finish(self, names: list[str], fields: dict[str, Any]) -> dict[str, Any]:
        """Commit the dataset of the attempts ``names``: their manifests and lengths read back, the dataset's lengths
        uploaded, its manifest PUT last; then the plan, other attempts and the cache removed."""
        from pf_trl.data.parts import write_parts_manifest
        from pf_trl.data.row_layout import LENGTHS_FILE
        from pf_trl.data.shards import read_manifest
        from pf_trl.storage.datasets import FILES_KEY
        from pf_trl.storage.filesystem import call, filesystem, list_files, remove, upload, write_bytes

        files = self._files()
        with tempfile.TemporaryDirectory(prefix="ray-commit-") as tmp:
            local = Path(tmp)
            wanted = [(name, file) for name in names for file in (MANIFEST_FILE, LENGTHS_FILE)]
            for name in names:
                (local / name).mkdir()
            fs = filesystem(files)
            call(files, f"downloading the manifests and lengths of {len(names)} parts",  # one batch, concurrent
                 lambda: fs.get([files.join(n, f).path for n, f in wanted], [str(local / n / f) for n, f in wanted]))
            _part_examples([read_manifest(local / n) for n in names])
            manifest = write_parts_manifest(local, names, fields)
            upload(local / LENGTHS_FILE, files.join(LENGTHS_FILE))
        manifest[FILES_KEY] = self.writer
        write_bytes(self.uri.join(MANIFEST_FILE), (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
        remove(self.uri.join(PLAN_FILE))
        kept = set(names)
        for folder in sorted({p.partition("/")[0] for p in list_files(files) if "/" in p} - kept):
            remove(files.join(folder), recursive=True)  # attempts cut short, or a second copy of a part
        shutil.rmtree(self.work_dir(), ignore_errors=True)
        return manifest


def destination(output_dir: str | os.PathLike) -> FolderParts | BucketParts:
    """The destination ``output_dir`` names: a bucket URI, else a folder."""
    from pf_trl.storage import is_remote

    return BucketParts(str(output_dir)) if is_remote(output_dir) else FolderParts(output_dir)
