"""Optional compaction: the per-index parts of the Indexed pretokenize Job copied into one single-part directory.

    python merge_shards.py PARTS_DIR OUTPUT_DIR [--expect N] [--overwrite]

Not needed to train: the Indexed Job commits PARTS_DIR itself as a dataset of many parts (``pf_trl.data.parts``)
that ``pf-trl train --training_data_path PARTS_DIR`` reads directly. Compact only to hand the data to a tool that
reads one ``save_to_disk`` directory, or to turn many small parts into one.

PARTS_DIR holds ``part-0``, ``part-1``, ... (each written by ``pf-trl pretokenize``). The parts are concatenated in
index order with
``datasets.concatenate_datasets`` and written as a new shards directory with a manifest that
``pf_trl.load_shards`` accepts: same format version, tokenizer, options and truncation policy in every
part (refused otherwise), every count of the parts' manifests kept (:func:`merge_counts`: numbers summed,
lower-bound flags such as ``loss_tokens_lost_at_least`` true when one part's is), length statistics
recomputed over all examples. Written atomically (a
temporary sibling directory renamed into place), like pretokenize itself, its manifest last.

Parts written by ``pretokenize_slice.py`` (the Indexed Job) carry a plan (``slices.json``) and one
completion marker per slice (``part-I.done.json``): then every planned slice must have its marker, and
the marker must describe the part next to it, else the merge is refused (a slice that did not finish).

PARTS_DIR and OUTPUT_DIR may be bucket prefixes (``s3://``, ``gs://``, ``az://``; the cloud's standard credential
chain): each committed part is fetched into the node cache (``$PF_TRL_CACHE/remote``, verified against its
manifest), the plan and markers beside them, the same checks run on that local view, and the merged dataset is
written into ``$PF_TRL_CACHE/staging`` and uploaded, its manifest last.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

PART_RE = re.compile(r"^part-(\d+)$")


class MergeError(ValueError):
    pass


def merge_counts(manifests: list[dict]) -> dict:
    """The ``counts`` of the merged manifest (:func:`pf_trl.data.parts.merge_counts`, its refusal a MergeError)."""
    from pf_trl.data.parts import merge_counts as counts_of_parts
    from pf_trl.data.shards import ShardsError

    try:
        return counts_of_parts(manifests)
    except ShardsError as exc:
        raise MergeError(str(exc)) from None


def find_parts(parts_dir: Path, expect: int | None = None) -> list[Path]:
    if not parts_dir.is_dir():
        raise MergeError(f"{parts_dir} is not a directory")
    parts = sorted((int(m.group(1)), p) for p in parts_dir.iterdir() if (m := PART_RE.match(p.name)) and p.is_dir())
    indexes = [i for i, _ in parts]
    if not parts:
        raise MergeError(f"{parts_dir} has no part-N directories")
    if indexes != list(range(len(parts))):
        raise MergeError(f"{parts_dir}: part indexes {indexes} are not 0..{len(parts) - 1}; an index is missing")
    if expect is not None and len(parts) != expect:
        raise MergeError(f"{parts_dir}: {len(parts)} parts, expected {expect} (did every index of the Job succeed?)")
    return [p for _, p in parts]


def check_markers(parts_dir: Path, parts: list[Path], expect: int | None) -> None:
    """With a slice plan: every slice 0..count-1 finished (its marker) and no part beyond the plan."""
    from pf_trl.data.shards import read_manifest

    plan_path = parts_dir / "slices.json"
    if not plan_path.exists():
        return  # parts written some other way (by hand, or by pf-trl pretokenize directly)
    count = json.loads(plan_path.read_text(encoding="utf-8"))["count"]
    if expect is not None and count != expect:
        raise MergeError(f"{parts_dir}: the run planned {count} slices, --expect says {expect}")
    if len(parts) != count:
        raise MergeError(f"{parts_dir}: {len(parts)} part directories, the run planned {count} slices")
    for i, part in enumerate(parts):
        marker = parts_dir / f"part-{i}.done.json"
        if not marker.exists():
            raise MergeError(f"slice {i} has no completion marker {marker.name}: it did not finish; re-run that "
                             "index of the Job")
        done = json.loads(marker.read_text(encoding="utf-8"))
        if done["count"] != count or done["source_sha256"] != read_manifest(part)["source"]["sha256"]:
            raise MergeError(f"{marker.name} does not describe {part.name} (another run or source); re-run index {i}")


def part_records(parts: list[Path], manifests: list[dict]) -> list[dict]:
    """The manifest's ``sources``: each part's name, format, row range and counts (``pf-trl inspect`` prints them)."""
    records, start = [], 0
    examples = sum(int(m["counts"]["examples"]) for m in manifests) or 1
    tokens = sum(int(m["counts"]["tokens"]) for m in manifests) or 1
    for part, m in zip(parts, manifests):
        n = int(m["counts"]["examples"])
        records.append({"name": part.name, "input_format": m["source"].get("input_format"), "rows": [start, start + n],
                        "counts": merge_counts([m]), "weight": None,
                        "share_of_rows": round(n / examples, 6),
                        "share_of_tokens": round(int(m["counts"]["tokens"]) / tokens, 6)})
        start += n
    return records


def local_view(parts_uri: str, staging: Path) -> Path:
    """A local folder standing for the bucket prefix ``parts_uri``: each committed ``part-N`` (fetched into the node
    cache, verified) linked as ``part-N``, the plan and the completion markers downloaded beside them. A part whose
    upload was cut short has no manifest and is left out (then an index is missing, and the merge is refused)."""
    from pf_trl.data.remote import fetch_shards
    from pf_trl.storage import parse_uri
    from pf_trl.storage.filesystem import download, list_files

    root = parse_uri(parts_uri)
    view = staging / "parts"
    view.mkdir(parents=True)
    for name in sorted(list_files(root)):
        top, _, rest = name.partition("/")
        if PART_RE.match(top) and rest == "pf_manifest.json":
            (view / top).symlink_to(fetch_shards(str(root.join(top))), target_is_directory=True)
        elif not rest and (name == "slices.json" or re.fullmatch(r"part-\d+\.done\.json", name)):
            download(root.join(name), view / name)
    return view


def merge(parts_dir: str | Path, output_dir: str | Path, *, expect: int | None = None,
          overwrite: bool = False) -> dict:
    """Merge the parts (see the module docstring); either side may be a bucket prefix."""
    from pf_trl.storage import is_remote

    if not (is_remote(str(parts_dir)) or is_remote(str(output_dir))):
        return merge_local(parts_dir, output_dir, expect=expect, overwrite=overwrite)
    from pf_trl.data.remote import publish_through_staging
    from pf_trl.storage.cache import staging_dir

    staging_dir().mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="merge-", dir=staging_dir()))
    try:
        parts = local_view(str(parts_dir), work) if is_remote(str(parts_dir)) else Path(parts_dir)
        if not is_remote(str(output_dir)):
            return merge_local(parts, output_dir, expect=expect, overwrite=overwrite)
        return publish_through_staging(str(output_dir), lambda local: merge_local(parts, local, expect=expect),
                                       overwrite=overwrite)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def merge_local(parts_dir: str | Path, output_dir: str | Path, *, expect: int | None = None,
                overwrite: bool = False) -> dict:
    import datasets
    import numpy as np

    from pf_trl._version import __version__
    from pf_trl.data.parts import combined_source
    from pf_trl.data.shards import length_stats, load_shards, write_manifest

    parts_dir, out = Path(parts_dir), Path(output_dir)
    if out.exists() and not overwrite:
        raise MergeError(f"{out} exists; pass --overwrite to replace it")
    parts = find_parts(parts_dir, expect)
    check_markers(parts_dir, parts, expect)
    loaded = [load_shards(p) for p in parts]
    manifests = [ds.pf_manifest for ds in loaded]
    first = manifests[0]
    if any("vision" in m for m in manifests):
        raise MergeError("the parts hold images (a vision manifest): merging them is not supported; pretokenize the "
                         "source in one run")
    for p, m in zip(parts[1:], manifests[1:]):
        for key in ("format_version", "options", "max_seq_len", "truncation"):
            if m.get(key) != first.get(key):
                raise MergeError(f"{p}: {key} {m.get(key)!r} differs from part-0's {first.get(key)!r}")
        for key in ("sha256", "vocab_size"):
            if m["tokenizer"].get(key) != first["tokenizer"].get(key):
                raise MergeError(f"{p} was tokenized with another tokenizer than part-0 ({key} differs)")
    merged = datasets.concatenate_datasets(loaded) if len(loaded) > 1 else loaded[0]
    lengths = np.asarray(merged.data.column("length")) if len(loaded) == 1 else np.concatenate(
        [np.asarray(ds.data.column("length")) for ds in loaded])
    manifest = {
        "format_version": first["format_version"],
        "pf_trl_version": __version__,
        "created_unix": round(time.time(), 3),
        "source": combined_source(str(parts_dir.resolve()), manifests),
        "tokenizer": first["tokenizer"],
        "options": first["options"],
        "max_seq_len": first["max_seq_len"],
        "truncation": first["truncation"],
        "counts": merge_counts(manifests),
        "lengths": length_stats(lengths, first["max_seq_len"]),
        "columns": first.get("columns"),
        "merged_from": [str(p) for p in parts],
        "sources": part_records(parts, manifests),  # one record per part: its format, rows and counts
        "mixture": None,
    }
    if manifest["counts"]["examples"] != merged.num_rows:
        raise MergeError(f"part manifests count {manifest['counts']['examples']} examples, data has {merged.num_rows}")
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        shards = work / "shards"
        merged.save_to_disk(str(shards), max_shard_size=first["options"].get("shard_size", "500MB"))
        write_manifest(shards, manifest)  # last: a directory with a manifest is complete
        if out.exists():
            old = work / "old"
            out.rename(old)
        shards.rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_shards(out)  # what the trainer will do: fail here, not in a GPU pod
    return manifest


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="merge_shards.py", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("parts_dir")
    ap.add_argument("output_dir")
    ap.add_argument("--expect", type=int, help="number of parts there must be (the Job's completions)")
    ap.add_argument("--overwrite", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        manifest = merge(args.parts_dir, args.output_dir, expect=args.expect, overwrite=args.overwrite)
    except (MergeError, ValueError, OSError) as exc:
        print(f"merge_shards: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"output_dir": args.output_dir, "parts": len(manifest["merged_from"]),
                      "counts": manifest["counts"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
