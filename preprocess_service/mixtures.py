"""``POST /v1/mixtures``: several sources, each tokenized with its own options, published as one dataset.

The request is checked like ``POST /v1/datasets`` source by source (confinement, uploads, the preflight of each
source's first rows); its id is the content address of every source, its options and weight, the tokenizer and the
mixing rule. The job tokenizes each source (``pretokenize``) and writes them as one shards directory with
:func:`pf_trl.data.mixture.write_mixture_shards`: the same directory ``pf-trl pretokenize --data_config`` writes, so
training from the dataset id draws the same batches as training from the equivalent data config.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any

from preprocess_service.build import (
    ensure_free_space,
    ensure_source_unchanged,
    progress_reporter,
    tokenize_files,
    tokenizer_for,
)
from preprocess_service.hub_fetch import fetch_hub_sources
from preprocess_service.schemas import MixtureRequest
from preprocess_service.security import ServiceError

ID_KIND = "mixture"


def mixture_id(parts: list[dict[str, Any]], tokenizer_sha256: str, rule: dict[str, Any]) -> str:
    """Content address of a mixture: every source's bytes, options, weight and name, the tokenizer, the rule."""
    from preprocess_service.submit import content_address

    return content_address({"kind": ID_KIND, "tokenizer_sha256": tokenizer_sha256, "rule": rule, "sources": [
        {k: p[k] for k in ("name", "source_sha256", "options", "weight")} for p in parts]})


def submit_mixture(submitter, request: MixtureRequest) -> tuple[dict[str, Any], bool]:
    """Resolve and preflight every source, then create (or find) the one job of the mixture."""
    from pf_trl.data.pretokenize import PretokenizeConfig, PretokenizeError
    from pf_trl.data.shards import is_shards_dir
    from preprocess_service.schemas import DatasetRequest

    tok_name, fingerprint = submitter.tokenizer(request.tokenizer)
    parts, configs = [], []
    for i, spec in enumerate(request.sources):
        name = spec.name or f"source_{i}"
        try:
            config = PretokenizeConfig(**spec.options.model_dump())
        except PretokenizeError as exc:
            raise ServiceError(422, "Unprocessable Content", f"sources[{i}].options: {exc}", kind="invalid-options",
                               field=f"sources.{i}.options") from exc
        path, shown = submitter.resolve_source(DatasetRequest(source=spec.source))
        shown.pop("hub", None)  # a Hub part's commit is in its shown path
        sha, size, stat = submitter.source_identity(path, shown)
        fetch = shown.pop("fetch", None)  # a Hub part: downloaded by the job
        parts.append({"name": name, "source_path": str(path) if path is not None else None, "source_shown": shown,
                      "source_sha256": sha, "source_size": size, "source_stat": stat, "hub_fetch": fetch,
                      "options": config.to_dict(), "weight": spec.weight})
        configs.append((path, shown, config))
    rule = request.mixture.model_dump()
    job_id = mixture_id(parts, fingerprint["sha256"], rule)
    combined = hashlib.sha256("".join(p["source_sha256"] for p in parts).encode()).hexdigest()
    record = {
        "kind": ID_KIND, "sources": parts, "mixture": rule,
        "source_path": None, "source_shown": {"path": "mixture of " + ", ".join(p["name"] for p in parts)},
        "source_sha256": combined, "source_size": sum(p["source_size"] for p in parts),
        "tokenizer": tok_name, "tokenizer_name": fingerprint.get("name") or tok_name,
        "tokenizer_sha256": fingerprint["sha256"],
        "options": {"sources": [{"name": p["name"], "weight": p["weight"], **p["options"]} for p in parts],
                    "mixture": rule},
    }

    def stands(row: dict[str, Any]) -> bool:
        return row["state"] != "succeeded" or is_shards_dir(submitter.settings.datasets_dir / job_id)

    with submitter._lock(job_id):
        row = submitter.store.get(job_id)
        if submitter.integrity is not None:
            row = submitter.integrity.ensure(row)  # a corrupt dataset is withdrawn here, and rebuilt below
        if row is not None and row["state"] not in ("failed", "cancelled") and stands(row):
            return row, False
        counts = []
        for (path, shown, config), part in zip(configs, parts):
            if path is None:  # a Hub part: its rows are checked by the job, which downloads it
                counts.append(None)
                continue
            try:  # the sandboxed checks (files, row limits, the first rows); the row count if known
                counts.append(submitter.preflight(path, shown.get("path") or f"upload {shown.get('upload_id')}",
                                                  config, tok_name))
            except ServiceError as exc:
                exc.detail = f"source {part['name']!r}: {exc.detail}"
                raise
        record["rows_total"] = sum(counts) if all(c is not None for c in counts) else None
        return submitter.enqueue(job_id, record, stands)


def build_mixture(settings, store, job_id: str, pid: int, request: dict[str, Any], tokenizers, work: Path,
                  abandon: threading.Event | None) -> dict[str, Any]:
    """Tokenize every source into ``work/parts``, then write the mixture to ``work/out``; returns its manifest.
    Checked first, like a single source: free space for all the sources, each source and the tokenizer unchanged."""
    from pf_trl.data.data_config import DataConfig, MixtureSource
    from pf_trl.data.mixture import load_mixture, write_mixture_shards
    from pf_trl.data.pretokenize import PretokenizeConfig, pretokenize

    parts = request["sources"]
    ensure_free_space(settings, sum(p["source_size"] for p in parts))
    tok = tokenizer_for(tokenizers, request)
    for part in parts:
        if part.get("hub_fetch") is None:
            ensure_source_unchanged(Path(part["source_path"]), part["source_sha256"], part.get("source_stat"),
                                    f"source {part['name']!r} ({part['source_path']})")
    hub_parts = [p for p in parts if p.get("hub_fetch") is not None]  # downloaded first, within the one limit
    local = dict(zip((id(p) for p in hub_parts), fetch_hub_sources(
        settings, store, job_id, pid, [p["hub_fetch"] for p in hub_parts], abandon))) if hub_parts else {}
    total = request.get("rows_total") or 0
    done_rows = done_tokens = 0
    sources = []
    for i, part in enumerate(parts):
        def report(base: tuple[int, int], done=(done_rows, done_tokens)):
            return progress_reporter(store, job_id, pid, abandon, delay_s=settings.debug_progress_delay_s,
                                     base=(done[0] + base[0], done[1] + base[1]), total=total)

        out = work / "parts" / f"part-{i}"
        hub = local.get(id(part))
        options = PretokenizeConfig(**part["options"])
        if hub is not None and len(hub) > 1:  # a Hub split of several files: concatenated as the CLI does
            shown = part["source_shown"]
            manifest = tokenize_files(settings, hub, out, options, tok, name=part["hub_fetch"]["name"],
                                      shown=shown["files"], path=shown["path"], report=report)
        else:
            manifest = pretokenize(hub[0] if hub else Path(part["source_path"]), out, options, tokenizer=tok,
                                   num_proc=settings.num_proc, progress=False, progress_callback=report((0, 0)),
                                   source_fingerprint_value=None if hub else part["source_sha256"],
                                   limits=settings.limits())
        done_rows += manifest["counts"]["source_rows"]
        done_tokens += manifest["counts"]["tokens"]
        sources.append(MixtureSource(name=part["name"], data_paths=[str(out)], sampling=part["weight"],
                                     options=part["options"]))
    rule = request["mixture"]
    config = DataConfig(sources=sources, seed=rule["seed"], sample_by=rule["sample_by"],
                        stopping_strategy=rule["stopping_strategy"], path="service mixture")
    mixture = load_mixture(config, tok, PretokenizeConfig(**parts[0]["options"]), progress=False)
    for record, part in zip(mixture.pf_manifest["sources"], parts):  # name the real sources, not the scratch parts
        shown = part["source_shown"]
        record["data_paths"] = shown.get("files") or [shown.get("path") or f"upload {shown.get('upload_id')}"]
        record["shards"] = None
    return write_mixture_shards(mixture, work / "out", shard_size=PretokenizeConfig(**parts[0]["options"]).shard_size)
