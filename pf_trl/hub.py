"""Models, tokenizers and datasets named by Hugging Face Hub id (``ORG/NAME``), resolved to a local snapshot folder.

``huggingface_hub.snapshot_download`` does the downloading, with the Hub's own environment as it is: ``HF_TOKEN`` /
``hf auth login`` for private and gated repositories, ``HF_ENDPOINT`` for a mirror, ``HF_HOME`` / ``HF_HUB_CACHE``
for the cache (nothing is downloaded twice), ``HF_HUB_OFFLINE=1`` to run from the cache, and its retries of 429 /
5xx answers. The snapshot folder of a commit is then read exactly as a local folder is (``from_pretrained(folder)``,
a folder of data files with a README ``configs:``), so one code path serves both; a local path of the same spelling
wins, as transformers does.

What a snapshot is (repository, revision asked for, commit) is recorded for the folder (:func:`origin_of`): the
pretokenize cache key and the manifest carry it. Failures are one line naming the flag, the repository and the fix
(:class:`HubError`).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pf_trl.errors import PfTrlError

# ``org/name`` (or a bare ``name``, for the Hub's few un-namespaced repositories), as huggingface_hub validates ids
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")
_SNAPSHOT = re.compile(r"(?:^|/)(models|datasets)--(.+?)/snapshots/([0-9a-f]{40})(?:/|$)")
# what a model's snapshot needs (config, weights, tokenizer, templates); not every format a repository may also hold
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.jinja", "*.txt", "*.tiktoken"]
MODEL_BIN_FILES = ["*.bin", "*.bin.index.json"]  # only when the repository has no safetensors
# a repository's own Python code (its config's auto_map): downloaded only for --trust_remote_code True
MODEL_CODE_FILES = ["*.py"]


class HubError(PfTrlError, ValueError):
    """A Hub repository cannot be used (not found, gated, offline, unreachable); the message names the flag, the
    repository and the fix."""


@dataclass(frozen=True)
class HubSnapshot:
    """A repository at one commit, downloaded into ``folder`` (huggingface_hub's cache)."""

    repo_id: str
    repo_type: str  # "model" | "dataset"
    revision: str | None
    commit: str
    folder: str

    def record(self) -> dict[str, Any]:
        """What manifests and cache keys carry (the folder is where this machine's cache keeps it)."""
        out = asdict(self)
        out.pop("folder")
        return out


_RESOLVED: dict[tuple[str, str, str | None, tuple[str, ...] | None], HubSnapshot] = {}
_BY_FOLDER: dict[str, HubSnapshot] = {}


def looks_like_repo_id(name: Any) -> bool:
    """``ORG/NAME`` (or ``NAME``) that is not an existing local path: what transformers would look up on the Hub."""
    text = str(name or "")
    if not _REPO_ID.match(text) or text.endswith((".json", ".jsonl", ".parquet", ".csv", ".arrow")):
        return False
    return not Path(text).expanduser().exists()


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _message(exc: BaseException, flag: str, repo_id: str, repo_type: str, revision: str | None) -> str:
    """One line for a failure of huggingface_hub, naming the flag, the repository and the fix."""
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    kind = "dataset" if repo_type == "dataset" else "model"
    where = f"{flag} {repo_id}" + (f" (revision {revision})" if revision else "")
    at = _endpoint()
    if isinstance(exc, GatedRepoError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        return (f"{where}: the {kind} repository is gated at {at} and this request is not allowed (HTTP {status}); "
                f"accept its conditions on its page with your account, then `hf auth login` or set HF_TOKEN")
    if isinstance(exc, RepositoryNotFoundError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status == 403:
            return (f"{where}: access to the {kind} repository is forbidden at {at} (HTTP 403); use a token that may "
                    "read it (`hf auth login` or HF_TOKEN)")
        return (f"{where}: no {kind} repository {repo_id} at {at}, or it is private (HTTP {status}); check the id, "
                "or for a private repository `hf auth login` or set HF_TOKEN")
    if isinstance(exc, RevisionNotFoundError):
        return (f"{where}: the {kind} repository has no revision {revision!r} at {at}; pass a branch, tag or commit "
                "it has, or no revision for main")
    if isinstance(exc, (LocalEntryNotFoundError, OfflineModeIsEnabled)) or _offline():
        if _offline():
            return (f"{where}: HF_HUB_OFFLINE is set and the {kind} is not in the Hub cache ({_cache_dir()}); run "
                    "once online to cache it, or unset HF_HUB_OFFLINE")
        return (f"{where}: the Hub at {at} cannot be reached and the {kind} is not in the Hub cache "
                f"({_cache_dir()}); check the network or HF_ENDPOINT, or run where it is cached")
    status = getattr(getattr(exc, "response", None), "status_code", None)
    first = " ".join(str(exc).split())[:240] or type(exc).__name__
    return f"{where}: the Hub at {at} answered {f'HTTP {status}: ' if status else ''}{first}"


def _cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def snapshot(repo_id: str, *, repo_type: str = "model", revision: str | None = None, flag: str,
             allow_patterns: list[str] | None = None) -> HubSnapshot:
    """Download (or find in the Hub cache) ``repo_id`` at ``revision`` and return its snapshot; memoized per
    process, so the checks before a run and the run itself resolve one commit. ``allow_patterns``: only these files
    (default for a model: :data:`MODEL_FILES`, its ``.bin`` weights when it has no safetensors).

    Raises:
        HubError: in one line, naming ``flag``, the repository and the fix.
    """
    key = (repo_type, repo_id, revision, None if allow_patterns is None else tuple(allow_patterns))
    hit = _RESOLVED.get(key)
    if hit is not None:
        return hit
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    patterns = MODEL_FILES if repo_type == "model" and allow_patterns is None else allow_patterns
    # the weights in .bin only where a model's weights were asked for (MODEL_FILES or more) and none are safetensors
    weights = repo_type == "model" and patterns is not None and set(MODEL_FILES) <= set(patterns)
    try:
        folder = Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, allow_patterns=patterns))
        if weights and not any(folder.glob("*.safetensors")):
            folder = Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision,
                                            allow_patterns=patterns + MODEL_BIN_FILES))
    except HFValidationError as exc:
        raise HubError(f"{flag} {repo_id}: not a local path, nor a valid Hub id ({str(exc).splitlines()[0]})") from None
    except Exception as exc:  # huggingface_hub's own errors, mapped to one line
        raise HubError(_message(exc, flag, repo_id, repo_type, revision)) from None
    match = _SNAPSHOT.search(folder.as_posix())
    commit = match.group(3) if match else ""
    found = HubSnapshot(repo_id=repo_id, repo_type=repo_type, revision=revision, commit=commit, folder=str(folder))
    _RESOLVED[key] = found
    _BY_FOLDER[str(folder)] = found
    return found


def origin_of(path: Any) -> HubSnapshot | None:
    """The Hub snapshot a local path lies in (a snapshot folder, or a file inside one), else None: the revision asked
    for when this process resolved it, the repository and commit in any case (the Hub cache's layout says them)."""
    if path is None:
        return None
    text = Path(str(path)).as_posix()
    match = _SNAPSHOT.search(text)
    if match is None:
        return None
    folder = text[: match.end()].rstrip("/")
    known = _BY_FOLDER.get(folder)
    if known is not None:
        return known
    repo_type = "dataset" if match.group(1) == "datasets" else "model"
    return HubSnapshot(repo_id=match.group(2).replace("--", "/"), repo_type=repo_type, revision=None,
                       commit=match.group(3), folder=folder)
