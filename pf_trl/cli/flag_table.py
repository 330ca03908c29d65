"""The flags of ``pf-trl train`` as a table, so a mistyped flag or value is refused in a fraction of a second.

``pf-trl train`` takes every ``TrainingArguments`` / ``SFTConfig`` / ``PaddingFreeConfig`` flag through transformers'
``HfArgumentParser``, and building that parser imports transformers, TRL and torch (tens of seconds on a busy
machine). This module writes the parser's flags (names, value types, choices, ``nargs``) to JSON once and builds a
plain ``argparse`` parser from it, which checks a command line before anything heavy is imported.

The table is exact for the versions it was made with: it carries a stamp (the transformers and TRL versions and a
hash of the pf-trl sources that declare the flags). With another stamp it is not used, and the full parser (slower,
always right) decides; that run then writes a table for its own stamp into the user cache, so the next one is fast.

    python -m pf_trl.cli.flag_table --write     # regenerate the shipped table (tests check it is current)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from pf_trl._compat import is_help_action, is_store_bool_action, parser_actions

PACKAGE = Path(__file__).resolve().parents[1]
SHIPPED_TABLE = Path(__file__).with_name("train_flags.json")
# The pf-trl files whose dataclasses declare train flags (their bytes enter the stamp).
SOURCES = ("cli/train_args.py", "cli/trl_fields.py", "trainer/script_parity.py", "data/options.py", "data/formats.py",
           "trainer/config.py", "trainer/loss.py")


def stamp() -> dict[str, str]:
    """What the flags depend on: transformers' and TRL's versions and the pf-trl sources that declare them."""
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode())
        digest.update((PACKAGE / name).read_bytes())
    versions = {}
    for dist in ("transformers", "trl"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = "missing"
    return {**versions, "pf_trl_sources": digest.hexdigest()[:16]}


def _kind(action: argparse.Action) -> str:
    if is_store_bool_action(action):
        return "flag"
    if action.choices is not None:
        return "choice"
    kind = getattr(action.type, "__name__", "")
    return {"int": "int", "float": "float", "string_to_bool": "bool"}.get(kind, "str")


def table_from_parser(parser: argparse.ArgumentParser) -> list[dict[str, Any]]:
    """One row per option of ``parser`` (help excluded): its spellings, value kind, choices and ``nargs``."""
    rows = []
    for action in parser_actions(parser):
        if is_help_action(action) or not action.option_strings:
            continue
        row: dict[str, Any] = {"flags": list(action.option_strings), "dest": action.dest, "kind": _kind(action)}
        if action.choices is not None:
            row["choices"] = [str(getattr(c, "value", c)) for c in action.choices]
        if action.nargs is not None:
            row["nargs"] = action.nargs
        rows.append(row)
    return rows


def write(path: Path, parser: argparse.ArgumentParser) -> None:
    """Write the table of ``parser`` with the current stamp (atomically)."""
    body = {"stamp": stamp(), "flags": table_from_parser(parser)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    rows = ",\n".join(f"  {json.dumps(row)}" for row in body["flags"])  # one flag a line: a readable diff
    tmp.write_text(f'{{"stamp": {json.dumps(body["stamp"])},\n "flags": [\n{rows}\n]}}\n', encoding="utf-8")
    os.replace(tmp, path)


def cached_table_path(current: dict[str, str]) -> Path:
    from pf_trl.data.tokenizer import cache_root

    key = hashlib.sha256(json.dumps(current, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "cli" / f"train_flags-{key}.json"


def load() -> list[dict[str, Any]] | None:
    """The flag rows valid for the installed versions and sources (shipped, else cached), or None."""
    current = stamp()
    for path in (SHIPPED_TABLE, cached_table_path(current)):
        try:
            body = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if body.get("stamp") == current:
            return body["flags"]
    return None


def remember(parser: argparse.ArgumentParser) -> None:
    """After the full parser was built: keep its table in the user cache when none fits (best effort)."""
    from pf_trl.cli import help_table

    try:
        current = stamp()
        path = cached_table_path(current)
        if load() is None:
            write(path, parser)
        if help_table.load(current, help_table.cached_path(path)) is None:
            help_table.write(help_table.cached_path(path), parser, current)
    except OSError:
        pass


def print_help(full_parser) -> None:
    """``pf-trl train --help``: from the help table when one fits the installed versions and sources, else from
    ``full_parser()`` (imports transformers), whose table is then kept for the next time."""
    from pf_trl.cli import help_table

    current = stamp()
    body = help_table.load(current, help_table.cached_path(cached_table_path(current)))
    if body is not None:
        help_table.help_parser(body).print_help()
        return
    parser = full_parser()
    remember(parser)
    parser.print_help()


def _bool(value: str) -> bool:
    # transformers.hf_argparser.string_to_bool, without importing transformers
    if isinstance(value, bool):
        return value
    if value.lower() in ("yes", "true", "t", "y", "1"):
        return True
    if value.lower() in ("no", "false", "f", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(
        f"Truthy value expected: got {value} but expected one of yes/no, true/false, t/f, y/n, 1/0 (case insensitive)."
    )


def light_parser(rows: list[dict[str, Any]], *, error) -> argparse.ArgumentParser:
    """A plain argparse parser with the flags of ``rows`` (values checked for type and choice, no defaults)."""
    parser = argparse.ArgumentParser(prog="pf-trl train", add_help=False, allow_abbrev=False, exit_on_error=False,
                                     argument_default=argparse.SUPPRESS)
    parser.error = error
    for row in rows:
        kwargs: dict[str, Any] = {"dest": row["dest"]}
        if row["kind"] == "flag":
            kwargs["action"] = "store_const"
            kwargs["const"] = False
        else:
            kwargs["type"] = {"int": int, "float": float, "bool": _bool}.get(row["kind"], str)
            if row["kind"] == "choice":
                kwargs["choices"] = row["choices"]
            if "nargs" in row:
                kwargs["nargs"] = row["nargs"]
                if row["nargs"] == "?":
                    kwargs["const"] = True
        parser.add_argument(*row["flags"], **kwargs)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pf_trl.cli.flag_table", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write {SHIPPED_TABLE.name} for the installed versions")
    args = parser.parse_args(argv)
    from pf_trl.cli.train_args import full_parser

    if args.write:
        from pf_trl.cli import help_table

        parser = full_parser()
        write(SHIPPED_TABLE, parser)
        help_table.write(help_table.SHIPPED_HELP, parser, stamp())  # `pf-trl train --help` reads it
        print(f"wrote {SHIPPED_TABLE} and {help_table.SHIPPED_HELP.name} ({stamp()})")
    else:
        print(json.dumps({"stamp": stamp(), "current": load() is not None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
