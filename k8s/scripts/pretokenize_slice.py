"""One index of the Indexed pretokenize Job: slice INDEX of COUNT into PARTS_DIR/part-INDEX, then its
completion marker.

    python pretokenize_slice.py PARTS_DIR --index I --count N -- SOURCE [pf-trl pretokenize flags]

1. ``PARTS_DIR/slices.json`` is the run's plan (slice count and the pretokenize flags); the first index
   to get there creates it (written whole under a temporary name, then linked into place: never visible
   half-written), every other index checks it: a run with another slice count (or
   other flags) on the same parts directory is refused, since its parts could not be merged with these.
2. ``PARTS_DIR/part-I.done.json`` present and matching the part: the slice is already done (a retried
   index, or the whole Job applied again), nothing is redone.
3. Else ``pf-trl pretokenize SOURCE PARTS_DIR/part-I --overwrite ...``: written to a temporary sibling and
   renamed into place, so a slice killed mid-way leaves no part (or the previous complete one) and its
   re-run replaces it whole (no duplicated rows); then the marker (temp file + rename).

4. When every index 0..N-1 has its marker, PARTS_DIR itself is committed as a dataset of many parts
   (:mod:`pf_trl.data.parts`: its ``pf_manifest.json``, written last, lists every part with its rows, lengths
   and checksums): ``pf-trl train --training_data_path PARTS_DIR`` reads it as is. The last index to finish
   commits it. ``merge_shards.py`` is only an optional compaction into one part.

Exit status 2 with a one-line reason on a refused run.

PARTS_DIR may be a bucket prefix (``s3://BUCKET/parts/NAME``, ``gs://``, ``az://``; credentials from the cloud's
standard chain): the plan and the markers are objects there, and each part is a dataset committed by its manifest
(``pf-trl pretokenize SOURCE s3://.../part-I``: written in the pod's ``$PF_TRL_CACHE/staging``, uploaded, manifest
last), so a slice killed mid-upload leaves no committed part and no marker. SOURCE may be a bucket URI too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import uuid
from pathlib import Path

PLAN = "slices.json"


class SliceError(ValueError):
    pass


def marker_path(parts_dir: Path, index: int) -> Path:
    return Path(parts_dir) / f"part-{index}.done.json"


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _same_plan(parts_dir, existing: dict, count: int, flags: list[str]) -> dict:
    if existing["count"] != count:
        raise SliceError(f"{parts_dir} holds a run of {existing['count']} slices, this run has {count}: their "
                         "parts cannot be merged; use a new parts directory (or delete this one)")
    if existing["pretokenize_flags"] != flags:
        raise SliceError(f"{parts_dir} holds a run with other pretokenize flags ({existing['pretokenize_flags']}); "
                         "use a new parts directory (or delete this one)")
    return existing


def check_plan(parts_dir: Path, count: int, flags: list[str]) -> dict:
    """Create the plan or check it: the same slice count and pretokenize flags as the run that made it.

    The plan is written whole to a temporary name, then linked to ``slices.json`` (``os.link`` fails when the name
    exists): exactly one index creates it and no index ever reads it half-written."""
    plan = {"count": count, "pretokenize_flags": flags}
    path = Path(parts_dir) / PLAN
    if not path.exists():
        tmp = path.with_name(f".{PLAN}.tmp-{os.getpid()}-{uuid.uuid4().hex}")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(plan, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # atomic and exclusive: the complete plan appears, or another index's did
            return plan
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    return _same_plan(parts_dir, json.loads(path.read_text(encoding="utf-8")), count, flags)


def commit_dataset(parts_dir: Path, count: int) -> dict | None:
    """When every slice 0..count-1 has its marker, commit PARTS_DIR as one dataset of many parts (its manifest
    written last, :mod:`pf_trl.data.parts`): the trainer reads it as is, no merge copy. Every index calls it after
    its own marker, so the last to finish commits (two finishing at once write the same manifest, atomically).
    Returns the dataset manifest, or None while a slice is still running."""
    from pf_trl.data.parts import combined_source, write_parts_manifest
    from pf_trl.data.shards import read_manifest

    names = [f"part-{i}" for i in range(count)]
    if not all(marker_path(parts_dir, i).exists() for i in range(count)):
        return None
    manifests = [read_manifest(parts_dir / n) for n in names]
    return write_parts_manifest(parts_dir, names, {"source": combined_source(str(parts_dir), manifests),
                                                   "engine": {"name": "indexed-job", "slices": count}})


def read_marker(parts_dir: Path, index: int) -> dict | None:
    path = marker_path(parts_dir, index)
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def run_remote_slice(parts_uri: str, index: int, count: int, source: str, flags: list[str]) -> dict:
    """:func:`run_slice` into a bucket prefix: the plan and markers are objects, the part a committed dataset."""
    from pf_trl.cli.pretokenize import main as pretokenize_main
    from pf_trl.data.remote import read_remote_manifest
    from pf_trl.storage import StorageError, parse_uri
    from pf_trl.storage.filesystem import exists, read_bytes, remove, write_bytes

    root = parse_uri(parts_uri)
    if not 0 <= index < count:
        raise SliceError(f"--index {index} is outside 0..{count - 1} (--count {count})")
    plan, plan_uri = {"count": count, "pretokenize_flags": flags}, root.join(PLAN)
    if exists(plan_uri):
        _same_plan(root, json.loads(read_bytes(plan_uri)), count, flags)
    else:  # every index writes the same plan; a different one written meanwhile is caught by the check after
        write_bytes(plan_uri, json.dumps(plan, indent=2, sort_keys=True).encode())
        _same_plan(root, json.loads(read_bytes(plan_uri)), count, flags)
    part, marker_uri = root.join(f"part-{index}"), root.join(f"part-{index}.done.json")
    if exists(marker_uri):
        done = json.loads(read_bytes(marker_uri))
        try:
            if read_remote_manifest(str(part))["source"]["sha256"] == done["source_sha256"]:
                return done  # already complete: a retry does nothing
        except (StorageError, KeyError):
            pass
    remove(marker_uri)  # about to rewrite the part: not done until the end
    rc = pretokenize_main([source, str(part), "--overwrite", *flags])
    if rc != 0:
        raise SliceError(f"pf-trl pretokenize failed on slice {index} (exit {rc}); see its message above")
    manifest = read_remote_manifest(str(part))
    marker = {"index": index, "count": count, "source": source, "source_sha256": manifest["source"]["sha256"],
              "examples": manifest["counts"]["examples"], "source_rows": manifest["counts"]["source_rows"]}
    write_bytes(marker_uri, json.dumps(marker, indent=2, sort_keys=True).encode())  # last: the slice is done
    return marker


def run_slice(parts_dir: str | Path, index: int, count: int, source: str, flags: list[str]) -> dict:
    """Tokenize one slice (or find it done); returns its marker."""
    from pf_trl.cli.pretokenize import main as pretokenize_main
    from pf_trl.data.shards import ShardsError, read_manifest
    from pf_trl.storage import is_remote

    if is_remote(str(parts_dir)):
        return run_remote_slice(str(parts_dir), index, count, source, flags)

    parts_dir = Path(parts_dir)
    if not 0 <= index < count:
        raise SliceError(f"--index {index} is outside 0..{count - 1} (--count {count})")
    parts_dir.mkdir(parents=True, exist_ok=True)
    check_plan(parts_dir, count, flags)
    part = parts_dir / f"part-{index}"
    done = read_marker(parts_dir, index)
    if done is not None and part.is_dir():
        try:
            if read_manifest(part)["source"]["sha256"] == done["source_sha256"]:
                return done  # already complete: a retry does nothing
        except (ShardsError, KeyError, OSError):
            pass
    marker_path(parts_dir, index).unlink(missing_ok=True)  # about to rewrite the part: not done until the end
    for stale in parts_dir.glob(f".part-{index}.tmp-*"):  # a killed attempt's temporary output
        shutil.rmtree(stale, ignore_errors=True)
    rc = pretokenize_main([source, str(part), "--overwrite", *flags])
    if rc != 0:
        raise SliceError(f"pf-trl pretokenize failed on slice {index} (exit {rc}); see its message above")
    manifest = read_manifest(part)
    marker = {"index": index, "count": count, "source": source, "source_sha256": manifest["source"]["sha256"],
              "examples": manifest["counts"]["examples"], "source_rows": manifest["counts"]["source_rows"]}
    write_json_atomic(marker_path(parts_dir, index), marker)  # the slice counts as done from here
    commit_dataset(parts_dir, count)  # the last slice to finish commits the dataset of all parts
    return marker


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pretokenize_slice.py", description=__doc__.split("\n\n")[0],
                                 allow_abbrev=False)
    ap.add_argument("parts_dir")
    ap.add_argument("--index", type=int, required=True, help="this slice ($JOB_COMPLETION_INDEX)")
    ap.add_argument("--count", type=int, required=True, help="slices in the run (the Job's completions)")
    ap.epilog = "After `--`: SOURCE and the pf-trl pretokenize flags (not the output dir, which is PARTS_DIR/part-I)."
    return ap


def split_argv(argv: list[str]) -> tuple[argparse.Namespace, str, list[str]]:
    """``PARTS --index I --count N -- SOURCE [flags]`` -> (slice args, source, pretokenize flags)."""
    if "--" not in argv:
        raise SliceError("give the source after `--`: pretokenize_slice.py PARTS --index I --count N -- SOURCE [flags]")
    cut = argv.index("--")
    args = build_parser().parse_args(argv[:cut])
    rest = argv[cut + 1:]
    if not rest or rest[0].startswith("-"):
        raise SliceError("give the source after `--`: pretokenize_slice.py PARTS --index I --count N -- SOURCE [flags]")
    return args, rest[0], rest[1:]


def main(argv: list[str] | None = None) -> int:
    try:
        args, source, flags = split_argv(sys.argv[1:] if argv is None else argv)
        marker = run_slice(args.parts_dir, args.index, args.count, source, flags)
    except (SliceError, OSError, ValueError) as exc:  # StorageError (a bucket refused, in one line) is an OSError
        print(f"pretokenize_slice: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(marker))
    return 0


if __name__ == "__main__":
    sys.exit(main())
