"""Models, tokenizers and datasets named by Hugging Face Hub id (``ORG/NAME``), resolved to a commit and to the
files a run reads, in huggingface_hub's cache.

A revision is resolved to its commit once (:func:`resolve`: ``HfApi.repo_info``, which also lists the files), and
everything is downloaded at that commit, so a model and its tokenizer can never come from two commits. Within a
``pf-trl`` command (:func:`one_commit_per_repository`) each repository resolves once; a long-lived service resolves
every request again (a moved ``main`` is followed; the same commit is a cache hit, the files being there).

Only what is read is downloaded (:func:`snapshot`'s ``what``): a tokenizer its files (:func:`tokenizer_files`), a
model what transformers loads (:func:`model_files`: the config, the generation config, the weight index and the
shards it names, the tokenizer; its code only with ``trust_remote_code``), a dataset the files ``datasets`` resolves
for a configuration's splits (:mod:`pf_trl.data.hub_datasets`).

huggingface_hub does the downloading with the Hub's own environment: ``HF_TOKEN`` / ``hf auth login``,
``HF_ENDPOINT`` for a mirror, ``HF_HOME`` / ``HF_HUB_CACHE`` for the cache, ``HF_HUB_OFFLINE=1`` to run from the
cache (the commit the cache recorded for the revision, the files earlier runs downloaded), and its retries of 429 /
5xx answers. A snapshot folder is then read exactly as a local folder is; a local path of the same spelling wins, as
transformers does.

What a snapshot is (repository, revision asked for, commit) is recorded for the folder (:func:`origin_of`): the
pretokenize cache key and the manifest carry it. Failures are one line naming the flag, the repository and the fix
(:class:`HubError`), a disk error under the cache told apart from a file that is not cached.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pf_trl.errors import PfTrlError

# ``org/name`` (or a bare ``name``, for the Hub's few un-namespaced repositories), as huggingface_hub validates ids
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")
# errors of the disk under the Hub cache (full, read-only, no permission, not a directory), told apart from "not cached"
_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR,
                          errno.EIO})
_SNAPSHOT = re.compile(r"(?:^|/)(models|datasets)--(.+?)/snapshots/([0-9a-f]{40})(?:/|$)")
# a tokenizer's or processor's files at a repository's root: configs, vocabularies, chat templates
_TOKENIZER_SUFFIXES = (".json", ".model", ".txt", ".tiktoken", ".jinja")


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


# the revision each snapshot folder was asked for (a folder is one commit: what was asked is all it adds)
_BY_FOLDER: dict[str, HubSnapshot] = {}
# commits resolved within the current one_commit_per_repository() block (None outside one)
_PINNED: ContextVar[dict[tuple[str, str, str | None], Resolved] | None] = ContextVar("pf_trl_hub_pins", default=None)


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
    if isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS:  # the machine's disk, not the Hub nor the network
        target = getattr(exc, "filename", None) or _cache_dir()
        return (f"{where}: the Hub cache cannot be written or read at {target} ({os.strerror(exc.errno)}); free "
                "space or fix the permissions of HF_HOME / HF_HUB_CACHE, or point them at a writable volume")
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
    missing = isinstance(exc, (LocalEntryNotFoundError, OfflineModeIsEnabled)) or (
        _offline() and isinstance(exc, FileNotFoundError))
    if _offline() and not missing:  # offline, and something else than a missing file went wrong
        first = " ".join(str(exc).split())[:240] or type(exc).__name__
        return (f"{where}: HF_HUB_OFFLINE is set and reading the {kind} from the Hub cache ({_cache_dir()}) "
                f"failed: {first}")
    if missing or _offline():
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


def _pins() -> dict | None:
    return _PINNED.get()


@contextmanager
def one_commit_per_repository() -> Iterator[None]:
    """Within this block each (repository, revision) resolves to a commit once: the checks before a run, its model
    and its tokenizer all read that commit even if the branch moves meanwhile. ``pf-trl`` runs each command in one,
    :func:`pf_trl.pretokenize` each call, the service each request and each job; outside such a block every call
    resolves the revision again. A block inside another one keeps the outer block's commits."""
    if _PINNED.get() is not None:  # inside an outer block (a command calling the Python API): its commits hold
        yield
        return
    token = _PINNED.set({})
    try:
        yield
    finally:
        _PINNED.reset(token)


def _repo_info(repo_id: str, repo_type: str, revision: str | None, flag: str):
    """huggingface_hub's ``repo_info`` of ``repo_id`` at ``revision`` (its commit and file list); None when the Hub
    cannot be reached (then the cache answers, as huggingface_hub's own downloads fall back to it); HubError."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HFValidationError

    try:
        return HfApi().repo_info(repo_id, repo_type=repo_type, revision=revision)
    except _unreachable_errors():
        return None
    except HFValidationError as exc:
        raise HubError(f"{flag} {repo_id}: not a local path, nor a valid Hub id ({str(exc).splitlines()[0]})") from None
    except Exception as exc:  # huggingface_hub's own errors, mapped to one line
        raise HubError(_message(exc, flag, repo_id, repo_type, revision)) from None


def _unreachable_errors() -> tuple[type[BaseException], ...]:
    """The HTTP client's errors for a Hub that cannot be reached (the ones huggingface_hub falls back to its cache
    on): no connection, a timeout."""
    try:
        import httpx2 as http  # huggingface_hub >= 1.x's client
    except ImportError:  # pragma: no cover - older huggingface_hub
        import httpx as http
    return (http.ConnectError, http.TimeoutException)


@dataclass(frozen=True)
class Resolved:
    """A revision resolved to its commit; ``files``: the repository's files at that commit (offline: those of its
    snapshot folder, what earlier runs downloaded)."""

    commit: str
    files: tuple[str, ...]
    online: bool = True


def resolve(repo_id: str, *, repo_type: str = "model", revision: str | None = None, flag: str) -> Resolved:
    """The commit ``revision`` (a branch, tag or commit; None: main) of ``repo_id`` names now (once per
    :func:`one_commit_per_repository` block). Offline, the commit the Hub cache recorded for it.

    Raises:
        HubError: in one line, naming ``flag``, the repository and the fix.
    """
    pins = _pins()
    key = (repo_type, repo_id, revision)
    if pins is not None and key in pins:
        return pins[key]
    info = None if _offline() else _repo_info(repo_id, repo_type, revision, flag)
    if info is None:  # offline or unreachable: the commit the cache recorded for the revision, the files it holds
        folder = _download(repo_id, repo_type=repo_type, revision=revision, flag=flag, allow_patterns=[])
        match = _SNAPSHOT.search(folder.as_posix())
        cached = tuple(sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()))
        found = Resolved(commit=match.group(3) if match else "", files=cached, online=False)
    else:
        found = Resolved(commit=info.sha, files=tuple(s.rfilename for s in info.siblings or ()))
    if pins is not None:
        pins[key] = found
    return found


_AS_ASKED = object()  # _download's shown_revision default: the revision it downloads


def _download(repo_id: str, *, repo_type: str, revision: str | None, flag: str,
              allow_patterns: list[str] | None, shown_revision: Any = _AS_ASKED) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, allow_patterns=allow_patterns))
    except HFValidationError as exc:
        raise HubError(f"{flag} {repo_id}: not a local path, nor a valid Hub id ({str(exc).splitlines()[0]})") from None
    except Exception as exc:  # huggingface_hub's own errors, mapped to one line
        shown = revision if shown_revision is _AS_ASKED else shown_revision  # the revision the user gave
        raise HubError(_message(exc, flag, repo_id, repo_type, shown)) from None


def _exact(names: Iterable[str]) -> list[str]:
    """File names as huggingface_hub patterns that match those files only (fnmatch's ``*`` crosses ``/``)."""
    return [glob.escape(n) for n in names]


def tokenizer_files(files: Iterable[str], *, code: bool = False) -> list[str]:
    """The files ``AutoTokenizer`` / ``AutoProcessor.from_pretrained`` read of a repository's file list: the root's
    configs and vocabularies (``.json``, ``.model``, ``.txt``, ``.tiktoken``, ``.jinja``), transformers' extra chat
    templates folder, and (``code``) the root's Python files; never a weight or a subfolder's file."""
    from transformers.utils import CHAT_TEMPLATE_DIR

    keep = []
    for name in files:
        if "/" not in name:
            if name.endswith(_TOKENIZER_SUFFIXES) or (code and name.endswith(".py")):
                keep.append(name)
        elif name.startswith(CHAT_TEMPLATE_DIR + "/") and name.count("/") == 1 and name.endswith(".jinja"):
            keep.append(name)
    return keep


def _weight_index(repo_id: str, commit: str, index_name: str, flag: str) -> list[str]:
    """The shard files an index (``model.safetensors.index.json``) names, as transformers loads them."""
    folder = _download(repo_id, repo_type="model", revision=commit, flag=flag, allow_patterns=_exact([index_name]))
    try:
        weight_map = json.loads((folder / index_name).read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError):
        raise HubError(f"{flag} {repo_id}: {index_name} at {commit[:12]} is not a weight index (no weight_map); "
                       "fix the repository or pin a revision whose index is whole") from None
    return sorted(set(weight_map.values()))


def model_files(repo_id: str, commit: str, files: Iterable[str], *, code: bool, flag: str) -> list[str]:
    """What ``AutoModelForCausalLM.from_pretrained`` (and the tokenizer beside it) reads of a repository at
    ``commit``: the config, the generation config, the safetensors weights (the index and the shards it names)
    or, where there are none, the ``.bin`` ones; the tokenizer's files; the root's code only with ``code``. Never
    another format's weights (``consolidated.safetensors``) nor a subfolder (``checkpoint-*/``)."""
    from transformers.utils import (
        CONFIG_NAME,
        GENERATION_CONFIG_NAME,
        SAFE_WEIGHTS_INDEX_NAME,
        SAFE_WEIGHTS_NAME,
        WEIGHTS_INDEX_NAME,
        WEIGHTS_NAME,
    )

    present = set(files)
    keep = [n for n in (CONFIG_NAME, GENERATION_CONFIG_NAME) if n in present]
    for index, single in ((SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME), (WEIGHTS_INDEX_NAME, WEIGHTS_NAME)):
        if index in present:
            keep += [index, *_weight_index(repo_id, commit, index, flag)]
            break
        if single in present:
            keep.append(single)
            break
    return sorted(set(keep) | set(tokenizer_files(present, code=code)))


def snapshot(repo_id: str, *, repo_type: str = "model", revision: str | None = None, flag: str,
             what: str = "all", code: bool = False, files: Iterable[str] = ()) -> HubSnapshot:
    """``repo_id`` at the commit ``revision`` names now (:func:`resolve`), with the files ``what`` needs downloaded
    (or found in the Hub cache): ``"model"`` (:func:`model_files`), ``"tokenizer"`` (:func:`tokenizer_files`),
    ``"config"`` (config.json alone), ``"files"`` (``files``, repository paths) or ``"all"`` (every file: a dataset
    saved whole); ``code``: the root's Python files too. Offline, the cached snapshot of that commit as it is.

    Raises:
        HubError: in one line, naming ``flag``, the repository and the fix.
    """
    found = resolve(repo_id, repo_type=repo_type, revision=revision, flag=flag)
    patterns: list[str] | None = None
    if what == "all" and not found.online:  # offline: what the cache holds (huggingface_hub checks every file)
        patterns = _exact(found.files)
    elif what != "all":
        if what == "model":
            names = model_files(repo_id, found.commit, found.files, code=code, flag=flag)
            if not found.online and not any(n.endswith((".safetensors", ".bin")) for n in names):
                raise HubError(_message(FileNotFoundError("weights"), flag, repo_id, repo_type, revision))
        elif what == "tokenizer":
            names = tokenizer_files(found.files, code=code)
        elif what == "files":
            names = list(files)
        else:
            names = [n for n in found.files if n == "config.json"]
        patterns = _exact(names)
    folder = _download(repo_id, repo_type=repo_type, revision=found.commit or revision, flag=flag,
                       allow_patterns=patterns, shown_revision=revision)
    if found.online:
        _remember_ref(folder, revision or "main", found.commit)
    return register(repo_id, repo_type, revision, folder)


def _remember_ref(folder: Path, revision: str, commit: str) -> None:
    """Record in the Hub cache that ``revision`` named ``commit`` (``refs/REVISION``, huggingface_hub's cache layout),
    as a download by revision name does: an offline run of the same revision finds this commit. Downloads here name
    the commit itself, which records no ref."""
    if not commit or revision == commit:
        return
    ref = folder.parent.parent / "refs" / revision
    try:
        if ref.is_file() and ref.read_text(encoding="utf-8") == commit:
            return
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(f".{ref.name}.{os.getpid()}.tmp")
        tmp.write_text(commit, encoding="utf-8")
        os.replace(tmp, ref)
    except OSError:  # a read-only shared cache: the run goes on, an offline run of this name will not find it
        pass


def register(repo_id: str, repo_type: str, revision: str | None, folder: Path) -> HubSnapshot:
    """Record which repository and revision asked for the snapshot folder ``folder`` (see :func:`origin_of`)."""
    match = _SNAPSHOT.search(Path(folder).as_posix())
    commit = match.group(3) if match else ""
    found = HubSnapshot(repo_id=repo_id, repo_type=repo_type, revision=revision, commit=commit, folder=str(folder))
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


class HubDownloadTooLarge(HubError):
    """The files a run would fetch from a repository are larger than the caller's download limit."""


@dataclass(frozen=True)
class DownloadProgress:
    """Where a :func:`fetch_files` stands: ``bytes_total`` (None: a size the Hub did not tell), the files so far."""

    message: str
    bytes_done: int
    bytes_total: int | None
    files_done: int
    files_total: int


def file_sizes(repo_id: str, names: Iterable[str], *, repo_type: str, commit: str, flag: str) -> dict[str, int | None]:
    """The size of each file ``names`` of ``repo_id`` at ``commit``, as the Hub tells it (the metadata request a
    download starts with: no file is fetched); None where it does not. A file already in the Hub cache: its size."""
    from huggingface_hub import hf_hub_download

    out: dict[str, int | None] = {}
    for name in names:
        try:
            info = hf_hub_download(repo_id, name, repo_type=repo_type, revision=commit, dry_run=True)
        except Exception as exc:  # huggingface_hub's own errors, mapped to one line
            raise HubError(_message(exc, flag, repo_id, repo_type, commit)) from None
        out[name] = info.file_size
    return out


def _megabytes(n: int | None) -> str:
    return "an unknown size" if n is None else f"{n / 1e6:.1f} MB"


def fetch_files(repo_id: str, names: list[str], *, repo_type: str, commit: str, flag: str,
                max_bytes: int | None = None, limit_name: str = "the download limit",
                on_progress: Callable[[DownloadProgress], None] | None = None,
                progress_every: int = 1 << 20) -> Path:
    """Download the files ``names`` of ``repo_id`` at ``commit`` into the Hub cache (those cached already are kept),
    with at most ``max_bytes`` in all: checked against the sizes the Hub tells (:func:`file_sizes`) before any
    download, and counted while downloading where it tells none (the download under way stops; huggingface_hub
    drops its partial file). Over the limit, the files this call downloaded are removed again, so the cache holds
    nothing of a refused fetch. ``on_progress`` hears of the plan, every ``progress_every`` bytes and each file done
    (every hundredth of the size where it is known, if that is more; it may raise to stop the fetch). Returns the
    snapshot folder.

    Raises:
        HubDownloadTooLarge: over ``max_bytes``, in one line naming the size, the limit and ``limit_name``.
        HubError: the Hub refused or could not be reached (one line).
    """
    from huggingface_hub import hf_hub_download

    sizes = file_sizes(repo_id, names, repo_type=repo_type, commit=commit, flag=flag)
    known = sum(s for s in sizes.values() if s is not None)
    unknown = [n for n, s in sizes.items() if s is None]
    total = None if unknown else known

    def too_large(size: int, *, at_least: bool) -> HubDownloadTooLarge:
        return HubDownloadTooLarge(
            f"{flag} {repo_id}: its {len(names)} file(s) at commit {commit[:12]} are {'over ' if at_least else ''}"
            f"{size:,} bytes ({_megabytes(size)}), over the download limit of {max_bytes:,} bytes "
            f"({_megabytes(max_bytes)}, {limit_name}); read a smaller configuration or split, or raise the limit")

    if max_bytes is not None and known > max_bytes:
        raise too_large(known, at_least=bool(unknown))
    if total:  # about a hundred reports at most where the size is known
        progress_every = max(progress_every, total // 100)
    state = {"done": 0, "files": 0, "reported": 0}
    stopped: list[BaseException] = []  # what on_progress raised: passed on as it is

    def report(message: str) -> None:
        if on_progress is not None:
            try:
                on_progress(DownloadProgress(message, state["done"], total, state["files"], len(names)))
            except BaseException as exc:
                stopped.append(exc)
                raise

    report(f"downloading {len(names)} file{'s' if len(names) != 1 else ''}, "
           f"{_megabytes(known) if not unknown else f'{_megabytes(known)} known and {len(unknown)} of unknown size'}")

    class _Meter:
        """The byte counter huggingface_hub's download drives (its ``tqdm_class``): the limit and the reports."""

        def __init__(self, *args: Any, initial: int = 0, **kwargs: Any):
            self.n = initial

        def __enter__(self) -> _Meter:
            return self

        def __exit__(self, *exc: Any) -> None:
            return None

        def update(self, n: int = 1) -> None:
            self.n += n
            state["done"] += n
            if max_bytes is not None and state["done"] + pending() > max_bytes:
                raise too_large(state["done"] + pending(), at_least=True)
            if state["done"] - state["reported"] >= progress_every:
                state["reported"] = state["done"]
                report(f"downloaded {_megabytes(state['done'])}")

        def close(self) -> None:
            return None

    def pending() -> int:  # the known sizes of the files not fetched yet (the one under way excluded)
        return sum(sizes[n] or 0 for n in names[state["files"] + 1:])

    fetched: list[Path] = []
    folder: Path | None = None
    try:
        for name in names:
            before = state["done"]
            path = Path(hf_hub_download(repo_id, name, repo_type=repo_type, revision=commit, tqdm_class=_Meter))
            if state["done"] == before:  # cached already: nothing fetched, its size counts all the same
                state["done"] += sizes[name] or path.stat().st_size
                if path.resolve() in {f.resolve() for f in fetched}:  # the bytes of a file this call fetched
                    fetched.append(path)  # (the same content twice): its link goes with that blob
            else:
                fetched.append(path)
            folder = Path(str(path)[: -len(name) - 1])
            state["files"] += 1
            if max_bytes is not None and state["done"] > max_bytes:
                raise too_large(state["done"], at_least=False)
            report(f"downloaded {name} ({state['files']}/{len(names)} files, {_megabytes(state['done'])})")
    except HubDownloadTooLarge:
        _forget(fetched)
        raise
    except Exception as exc:  # huggingface_hub's own errors, mapped to one line
        if isinstance(exc, HubError) or exc in stopped:
            raise
        raise HubError(_message(exc, flag, repo_id, repo_type, commit)) from None
    if folder is None:
        raise HubError(f"{flag} {repo_id}: no file to fetch at commit {commit[:12]}")
    return folder


def _forget(fetched: list[Path]) -> None:
    """Remove files this process downloaded into the Hub cache: the snapshot's link and the blob it points at."""
    for link in fetched:
        blob = link.resolve()
        for path in (link, blob):
            try:
                path.unlink()
            except OSError:
                pass
