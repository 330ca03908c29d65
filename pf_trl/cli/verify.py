"""`pf-trl verify PATH [PATH ...]`: check shards directories against their manifests' checksums.

PATH is a shards directory, or a directory of them (e.g. a service's ``cache_dir/datasets``). Each is read once as
a stream (constant memory), every file compared with the checksum recorded when it was written, then opened as
the trainer opens it. One line per directory; exit 0 when all are intact, 1 when any is corrupt, 2 on a bad
argument (a path that holds no shards directory).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from pf_trl.cli.flags import one_line
from pf_trl.errors import PfTrlError


class VerifyCLIError(PfTrlError, ValueError):
    """A bad argument; one line, exit 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pf-trl verify", description=__doc__, exit_on_error=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", metavar="PATH", help="a shards directory or a directory of them")
    parser.add_argument("--json", action="store_true", help="one JSON object per directory instead of text")

    def error(message: str):
        raise VerifyCLIError(f"{message} (see `pf-trl verify --help`)")

    parser.error = error
    return parser


def shards_dirs(path: str | Path) -> list[Path]:
    """``path`` itself when it is a shards directory, else the shards directories directly inside it."""
    from pf_trl.data.shards import is_shards_dir

    p = Path(path)
    if not p.exists():
        raise VerifyCLIError(f"{path}: no such file or directory")
    if is_shards_dir(p):
        return [p]
    found = sorted(c for c in p.iterdir() if c.is_dir() and is_shards_dir(c)) if p.is_dir() else []
    if not found:
        raise VerifyCLIError(f"{path}: neither a shards directory (no pf_manifest.json) nor a directory of them; "
                             "pass the directory `pf-trl pretokenize` wrote")
    return found


def verify_one(directory: Path) -> dict:
    """``{"path", "ok", "bytes", "files", "algorithm", "seconds", "error"}`` for one shards directory."""
    from pf_trl.data.shards import ShardsError, load_shards, read_manifest, verify_shards

    t0 = time.perf_counter()
    report = {"path": str(directory), "ok": False, "bytes": 0, "files": 0, "algorithm": None, "error": None}
    try:
        manifest = read_manifest(directory)
        checksums = manifest.get("checksums") or {}
        report["algorithm"], report["files"] = checksums.get("algorithm"), len(checksums.get("files", {}))
        report["bytes"] = verify_shards(directory, manifest)
        load_shards(directory, verify=False)  # the Arrow data opens as the trainer opens it, row counts agree
        report["ok"] = True
        if not checksums:
            report["error"] = "no checksums in its manifest (written by an older pf-trl): only opened, not verified"
    except ShardsError as exc:
        report["error"] = one_line(exc)
    report["seconds"] = round(time.perf_counter() - t0, 3)
    return report


def main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
        dirs = [d for p in args.paths for d in shards_dirs(p)]
    except (argparse.ArgumentError, VerifyCLIError) as exc:
        if os.environ.get("PF_TRL_DEBUG"):
            raise
        print(f"pf-trl verify: error: {one_line(exc)}", file=sys.stderr)
        return 2
    corrupt = 0
    for directory in dirs:
        r = verify_one(directory)
        corrupt += not r["ok"]
        if args.json:
            print(json.dumps(r), flush=True)
        elif r["ok"]:
            note = f" ({r['error']})" if r["error"] else ""
            print(f"ok       {r['path']}: {r['files']} files, {r['bytes'] / 1e9:.3f} GB verified "
                  f"({r['algorithm']}) in {r['seconds']:.2f}s{note}", flush=True)
        else:
            print(f"CORRUPT  {r['path']}: {r['error']}", flush=True)
    if corrupt:
        print(f"pf-trl verify: {corrupt} of {len(dirs)} shards directories are corrupt", file=sys.stderr)
    return 1 if corrupt else 0
