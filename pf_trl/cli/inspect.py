"""`pf-trl inspect SHARDS_DIR [--samples N]`: manifest summary, how well the token-budget sampler packs it, and
decoded examples with the supervised spans marked (what the loss sees)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from pf_trl.batching.packing import IGNORE_INDEX
from pf_trl.cli.flags import normalize_flags, one_line
from pf_trl.data.shards import load_shards
from pf_trl.errors import PfTrlError

LOSS_OPEN, LOSS_CLOSE = "⟦", "⟧"


class InspectCLIError(PfTrlError, ValueError):
    """A bad flag; one line."""


def _bool(value: str) -> bool:
    from pf_trl.data.options import parse_bool

    return parse_bool(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pf-trl inspect", description=__doc__, exit_on_error=False, allow_abbrev=False)
    parser.add_argument("shards_dir")
    parser.add_argument("--max_tokens", "--max_tokens_per_batch", dest="max_tokens", type=int, nargs="*",
                        default=[4096, 8192, 16384], help="token budgets to report packing for")
    parser.add_argument("--samples", type=int, default=0, help="print N decoded examples, supervised spans marked")
    parser.add_argument("--tokenizer_name_or_path", default=None,
                        help="tokenizer to decode with (default: the one recorded in the manifest)")
    parser.add_argument("--trust_remote_code", type=_bool, nargs="?", const=True, default=False,
                        help="run the tokenizer's own code (its auto_map), as TRL's --trust_remote_code True does; "
                        "without it such a tokenizer is refused")
    parser.add_argument("--json", action="store_true", help="print the full manifest as JSON")

    def error(message: str):
        raise InspectCLIError(f"{message} (see `pf-trl inspect --help`)")

    parser.error = error
    return parser


def marked_text(tokenizer, input_ids: list[int], labels: list[int]) -> str:
    """The example decoded run by run, supervised runs (labels != -100) between ⟦ and ⟧."""
    parts, start = [], 0
    supervised = [label != IGNORE_INDEX for label in labels]
    for i in range(1, len(input_ids) + 1):
        if i == len(input_ids) or supervised[i] != supervised[start]:
            text = tokenizer.decode(input_ids[start:i])
            parts.append(f"{LOSS_OPEN}{text}{LOSS_CLOSE}" if supervised[start] else text)
            start = i
    return "".join(parts)


def _manifest_tokenizer(manifest: dict, override: str | None, trust_remote_code: bool = False):
    """The tokenizer the shards were made with: ``override``, else the manifest's (the embedded name, or the absolute
    folder it records), with the chat template the data was rendered with. A tokenizer that is not the one recorded
    is said so, with what differs."""
    from pf_trl.data.tokenizer import (
        TokenizerLoadError,
        load_tokenizer,
        tokenizer_differences,
        tokenizer_fingerprint,
        with_chat_template,
    )

    info = manifest["tokenizer"]
    name = override or (info.get("name") if str(info.get("name", "")).startswith("pf-trl/") else info.get("path"))
    try:
        # a Hub tokenizer at the very commit the shards were made with (found in the Hub cache, or downloaded)
        commit = None if name else (info.get("hub") or {}).get("commit")
        tokenizer = load_tokenizer(name or info.get("name"), revision=commit, trust_remote_code=trust_remote_code,
                                   flag="--tokenizer_name_or_path" if override else "tokenizer")
    except TokenizerLoadError as exc:
        from pf_trl.remote_code import FLAG

        if override or FLAG in str(exc):  # its own code, refused: the flag is the way out, not another folder
            raise
        raise InspectCLIError(
            f"the tokenizer the shards were made with, {name!r}, cannot be loaded ({exc}); pass its folder with "
            "--tokenizer_name_or_path FOLDER"
        ) from exc
    tokenizer = with_chat_template(tokenizer, (manifest.get("options") or {}).get("chat_template"))
    differences = tokenizer_differences(info, tokenizer_fingerprint(tokenizer))
    if differences:
        print(f"note: decoding with a tokenizer other than the data's: {'; '.join(differences)}")
    return tokenizer


def print_samples(ds, manifest: dict, count: int, override: str | None, trust_remote_code: bool = False) -> None:
    from pf_trl.data.processor import text_tokenizer

    # a processor decodes with its tokenizer
    tokenizer = text_tokenizer(_manifest_tokenizer(manifest, override, trust_remote_code))
    source = manifest.get("source", {})
    print(f"format {source.get('input_format')}; chat mask: {source.get('chat_mask') or 'n/a'}; "
          f"decoded with {getattr(tokenizer, 'pf_trl_name', tokenizer.name_or_path)}")
    template = getattr(tokenizer, "chat_template", None)
    if source.get("input_format") in ("messages", "sharegpt", "conversational_prompt_completion") and template:
        print("chat template:")
        print("  " + template.replace("\n", "\n  "))
    print(f"supervised tokens are shown between {LOSS_OPEN} and {LOSS_CLOSE}")
    for i in range(min(count, ds.num_rows)):
        row = ds[i]
        n = sum(1 for label in row["labels"] if label != IGNORE_INDEX)
        images = f", {len(row['images'])} images" if "images" in row else ""
        print(f"--- example {i}: {row['length']} tokens, {n} supervised{images}")
        print(marked_text(tokenizer, row["input_ids"], row["labels"]))


def source_lines(manifest: dict, lengths: np.ndarray) -> list[str]:
    """One line per source of a mixture or a merge (its format, rows and share), then the mixing rule and the share
    each source gets in an epoch."""
    records = manifest.get("sources") or []
    if not records:
        return []
    lines = []
    for r in records:
        c, weight = r.get("counts", {}), r.get("weight")
        lines.append(f"source {r['name']}: format {r.get('input_format')}, rows {r['rows'][0]}..{r['rows'][1] - 1}, "
                     f"{c.get('examples')} examples ({r.get('share_of_rows', 0):.3f}), {c.get('tokens')} tokens "
                     f"({r.get('share_of_tokens', 0):.3f})" + (f", weight {weight:.3f}" if weight is not None else ""))
    rule = manifest.get("mixture")
    if not rule:
        lines.append("sources concatenated (no sampling weights): each example once per epoch")
        return lines
    from pf_trl.batching.mixture_sampler import MixtureSchedule

    schedule = MixtureSchedule(lengths, [tuple(r["rows"]) for r in records], rule["weights"], seed=rule["seed"],
                               sample_by=rule["sample_by"], stopping_strategy=rule["stopping_strategy"])
    shares = schedule.shares(0)
    size = sum(s["examples"] for s in shares)
    lines.append(f"mixture by {rule['sample_by']} ({rule['stopping_strategy']}, seed {rule['seed']}): an epoch draws "
                 f"{size} examples, {sum(s['tokens'] for s in shares)} tokens")
    for r, s in zip(records, shares):
        lines.append(f"  {r['name']}: {s['examples']} examples ({s['share_of_examples']:.3f}), {s['tokens']} tokens "
                     f"({s['share_of_tokens']:.3f}) per epoch")
    return lines


def main(argv: list[str]) -> int:
    argv = normalize_flags(argv)
    try:
        args = build_parser().parse_args(argv)
        if args.samples < 0:
            raise InspectCLIError(f"--samples must be >= 0, got {args.samples}")
        if any(b <= 0 for b in args.max_tokens):
            raise InspectCLIError("--max_tokens values must be positive integers")
        from pf_trl.data.remote import local_path

        ds = load_shards(local_path(args.shards_dir))  # a bucket URI: its node-cache copy, verified
        manifest = ds.pf_manifest
        if args.json:
            print(json.dumps(manifest, indent=2))
            return 0
        from pf_trl.batching.sampler import TokenBudgetBatchSampler

        lengths = np.asarray(ds.data.column("length"))
        c, s = manifest["counts"], manifest["lengths"]
        source = manifest.get("source", {})
        print(f"{args.shards_dir}: {c['examples']} examples, {c['tokens']} tokens ({c['loss_tokens']} supervised), "
              f"{c['truncated']} truncated ({c.get('loss_tokens_lost', 'n/a')} supervised tokens lost), {c['dropped']} dropped")
        print(f"format {source.get('input_format')} (chat mask: {source.get('chat_mask') or 'n/a'}), tokenizer "
              f"{manifest['tokenizer']['name']} (vocab {manifest['tokenizer']['vocab_size']}), "
              f"max_seq_len {manifest['max_seq_len']}, truncation {manifest['truncation']} "
              f"({(manifest.get('options') or {}).get('truncation_mode', 'keep_start')})")
        print(f"lengths: min {s['min']} mean {s['mean']} p50 {s['p50']} p90 {s['p90']} p99 {s['p99']} max {s['max']}")
        if manifest.get("parts"):  # a dataset of many parts (pf_trl.data.parts), read without a merge copy
            parts = manifest["parts"]
            engine = (manifest.get("engine") or {}).get("name")
            print(f"{len(parts)} parts ({parts[0]['name']} .. {parts[-1]['name']})"
                  + (f", written by {engine}" if engine else ""))
        for line in source_lines(manifest, lengths):
            print(line)
        for budget in args.max_tokens:
            if budget < lengths.max():
                print(f"budget {budget}: smaller than the longest example ({lengths.max()})")
                continue
            sampler = TokenBudgetBatchSampler(lengths, budget, seed=0)
            print(f"budget {budget}: {len(sampler)} batches, fill {sampler.efficiency:.4f}")
        if args.samples:
            print_samples(ds, manifest, args.samples, args.tokenizer_name_or_path, args.trust_remote_code)
    except (argparse.ArgumentError, PfTrlError) as exc:  # InspectCLIError, ShardsError, SamplerError, ...
        if os.environ.get("PF_TRL_DEBUG"):
            raise
        print(f"pf-trl inspect: error: {one_line(exc)}", file=sys.stderr)
        return 2
    return 0
