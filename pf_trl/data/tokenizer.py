"""Tokenizer loading (an embedded name, a local folder, or a Hub id's snapshot) and the tokenizer identity recorded in
manifests.

The embedded default is the Mistral-7B v0.1 sentencepiece model shipped inside the ``mistral-common``
package (``mistral_common/data/tokenizer.model.v1``). Pitfall on transformers 5.x:
``LlamaTokenizer(vocab_file=...)`` silently ignores the file; ``from_pretrained(folder)`` on a folder
holding ``tokenizer.model`` converts it correctly, so that is what we do, once, into a local cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pf_trl.errors import PfTrlError

DEFAULT_TOKENIZER = "pf-trl/mistral-7b-v0.1"
EMBEDDED_TOKENIZER_NAMES = frozenset({DEFAULT_TOKENIZER, "default", "mistral-7b-v0.1"})  # the embedded one, by any name

# Mistral-instruct v0.1 style template. The assistant turn (with its leading space, which sentencepiece folds into
# the first answer token, and EOS) sits in a `{% generation %}` block: the spans pf-trl supervises and TRL's
# `assistant_only_loss` / `return_assistant_tokens_mask` both come from it.
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{% generation %}{{ ' ' + message['content'] + eos_token }}"
    "{% endgeneration %}"
    "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
    "{% endfor %}"
)

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


class TokenizerLoadError(PfTrlError, ValueError):
    """The tokenizer could not be loaded from local files."""


def cache_root() -> Path:
    """Local cache of pf-trl (converted tokenizers, pretokenized data): ``$PF_TRL_CACHE`` or ``~/.cache/pf-trl``."""
    return Path(os.environ.get("PF_TRL_CACHE", Path.home() / ".cache" / "pf-trl")).expanduser()


def embedded_tokenizer_file() -> Path:
    """Path of the Mistral-7B v0.1 sentencepiece model shipped inside ``mistral-common``."""
    try:
        import mistral_common
    except ImportError as exc:  # pragma: no cover - a hard dependency
        raise TokenizerLoadError(
            "the embedded default tokenizer needs the 'mistral-common' package: pip install mistral-common"
        ) from exc
    path = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
    if not path.is_file():
        raise TokenizerLoadError(f"mistral-common is installed but {path} is missing; reinstall mistral-common")
    return path


# Keys that loading writes into tokenizer_config.json from the environment of the process that saved it
# (offline flags, cache paths); they do not change tokenization, so they stay out of the fingerprint.
_VOLATILE_CONFIG_KEYS = ("local_files_only", "name_or_path", "cache_dir", "_commit_hash", "trust_remote_code", "token")


def _config_digest(path: Path) -> str:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _sha256_file(path)
    for key in _VOLATILE_CONFIG_KEYS:
        config.pop(key, None)
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def _sha256_file(path: Path) -> str:
    from pf_trl.data.integrity import unchanged_file_digest

    return unchanged_file_digest(path, "sha256")  # fingerprinted several times per command: each file read once


def _embedded_tokenizer_dir() -> Path:
    """Convert the embedded sentencepiece model once into a cached HF tokenizer folder (atomic)."""
    from transformers import LlamaTokenizer

    source = embedded_tokenizer_file()
    key = hashlib.sha256((_sha256_file(source) + MISTRAL_CHAT_TEMPLATE).encode()).hexdigest()[:16]
    target = cache_root() / "tokenizers" / f"mistral-7b-v0.1-{key}"
    if (target / "tokenizer_config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        shutil.copyfile(source, work / "tokenizer.model")
        tok = LlamaTokenizer.from_pretrained(str(work), add_bos_token=True, add_eos_token=False)
        if len(tok) != 32000:
            raise TokenizerLoadError(f"converted embedded tokenizer has {len(tok)} tokens, expected 32000")
        tok.chat_template = MISTRAL_CHAT_TEMPLATE
        out = work / "out"
        tok.save_pretrained(str(out))
        shutil.copyfile(source, out / "tokenizer.model")
        try:
            os.replace(out, target)
        except OSError:
            if not (target / "tokenizer_config.json").is_file():  # lost a race to another process: fine
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def resolve_tokenizer_path(name_or_path: str, *, revision: str | None = None,
                           flag: str = "--tokenizer_name_or_path", code: bool = False) -> tuple[str, Path]:
    """Map a tokenizer name to ``(display name, local folder)``: the embedded one, a local folder, or the snapshot of
    a Hub repository (``ORG/NAME`` at ``revision``, downloaded by huggingface_hub or found in its cache; with ``code``
    its ``*.py`` files too, for ``trust_remote_code``)."""
    if name_or_path in EMBEDDED_TOKENIZER_NAMES:
        return DEFAULT_TOKENIZER, _embedded_tokenizer_dir()
    path = Path(name_or_path).expanduser()
    if not path.exists():
        from pf_trl.hub import HubError, looks_like_repo_id, snapshot

        if not looks_like_repo_id(name_or_path):
            raise TokenizerLoadError(
                f"tokenizer {name_or_path!r} is neither a local folder, an embedded name ({DEFAULT_TOKENIZER!r}) nor "
                "a Hub id (ORG/NAME); pass a folder that holds tokenizer.json / tokenizer.model, or a Hub id")
        try:  # the tokenizer's and processor's files only, never the weights beside them
            path = Path(snapshot(name_or_path, repo_type="model", revision=revision, flag=flag, what="tokenizer",
                                 code=code).folder)
        except HubError as exc:
            raise TokenizerLoadError(str(exc)) from None
    if path.is_file():
        raise TokenizerLoadError(f"tokenizer path {path} is a file; pass the folder that contains it")
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise TokenizerLoadError(f"folder {path} holds no tokenizer files (expected tokenizer.json or tokenizer.model)")
    path = path.resolve()  # manifests record it: an absolute path works from any working directory
    from pf_trl.hub import origin_of

    hub = origin_of(path)
    return (hub.repo_id if hub else str(path)), path


def load_tokenizer(name_or_path: str = DEFAULT_TOKENIZER, *, revision: str | None = None,
                   trust_remote_code: bool = False, flag: str = "--tokenizer_name_or_path", **kwargs: Any):
    """Load a Hugging Face tokenizer: the embedded one, a local folder, or a Hub id (its snapshot folder).

    Args:
        name_or_path: ``"pf-trl/mistral-7b-v0.1"`` (the embedded default), a local folder or a Hub id.
        revision: the branch, tag or commit of a Hub id.
        trust_remote_code: run a tokenizer's or processor's own code (its ``auto_map``), as TRL's
            ``trust_remote_code`` does; without it such a tokenizer is refused in one line naming the flag.
        flag: the flag named in that refusal.
        kwargs: forwarded to ``AutoTokenizer.from_pretrained``.

    The returned tokenizer carries ``pf_trl_name`` and ``pf_trl_path`` attributes used for its manifest identity.
    """
    from transformers import AutoTokenizer

    name, path = resolve_tokenizer_path(name_or_path, revision=revision, flag=flag,
                                        code=trust_remote_code)
    kwargs.setdefault("local_files_only", True)
    kwargs["trust_remote_code"] = bool(trust_remote_code)
    if any((path / f).is_file() for f in PROCESSOR_FILES):
        return _load_processor(name, path, flag=flag, **kwargs)
    try:
        tok = AutoTokenizer.from_pretrained(str(path), **kwargs)
    except Exception as exc:
        _refuse_code(exc, name, flag)
        raise TokenizerLoadError(f"could not load tokenizer from {path}: {exc}") from exc
    if not getattr(tok, "is_fast", False):
        raise TokenizerLoadError(
            f"tokenizer at {path} loaded as a slow tokenizer; pf-trl needs a fast one (offsets for loss "
            "masks): provide tokenizer.json"
        )
    tok.pf_trl_name = name
    tok.pf_trl_path = str(path)
    return tok


# a model folder with one of these holds a multimodal processor (image processor + tokenizer + template)
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def _refuse_code(exc: BaseException, name: str, flag: str) -> None:
    """transformers refused code the tokenizer needs: one line naming ``--trust_remote_code True``."""
    from pf_trl.remote_code import tokenizer_code_error

    refusal = tokenizer_code_error(exc, name, flag)
    if refusal is not None:
        raise TokenizerLoadError(str(refusal)) from None


def _load_processor(name: str, path: Path, *, flag: str = "--tokenizer_name_or_path", **kwargs: Any):
    """The processor of a vision-language model folder (``AutoProcessor``, local files only; its own code only with
    ``trust_remote_code``)."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(str(path), **kwargs)
    except Exception as exc:
        _refuse_code(exc, name, flag)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise TokenizerLoadError(f"could not load the processor of {path}: {first[:300]}") from exc
    for obj in (processor, getattr(processor, "tokenizer", None)):
        if obj is not None:
            obj.pf_trl_name = name
            obj.pf_trl_path = str(path)
    return processor


def tokenizer_fingerprint(tokenizer) -> dict[str, Any]:
    """Identity of a tokenizer for manifests and cache keys: name, absolute path, content identity, ids.

    ``sha256`` is the identity by content (:mod:`pf_trl.data.tokenizer_content`): vocabulary, merges, added and special
    tokens, normalizer, pre-tokenizer, post-processor, decoder and chat template, so a re-saved copy of a tokenizer
    shares it and two tokenizers that would tokenize or render differently never do; ``content`` holds a digest per
    part (:func:`tokenizer_differences` names the part that differs). ``files_sha256`` is the hash of the tokenizer
    files on disk and the template, the identity manifests recorded before (``files``: a digest per file), kept so
    shards of those manifests are still matched.
    """
    from pf_trl.data.processor import is_processor, processor_fingerprint
    from pf_trl.data.tokenizer_content import content_identity

    if is_processor(tokenizer):  # its tokenizer's identity with the image processor's settings folded in
        return processor_fingerprint(tokenizer, tokenizer_fingerprint)
    digest = hashlib.sha256()
    path = getattr(tokenizer, "pf_trl_path", None) or getattr(tokenizer, "name_or_path", None)
    files: dict[str, str] = {}
    if path and Path(path).is_dir():
        path = str(Path(path).resolve())
        for fname in _TOKENIZER_FILES:
            f = Path(path) / fname
            if f.is_file():
                files[fname] = _config_digest(f) if fname == "tokenizer_config.json" else _sha256_file(f)
                digest.update(fname.encode())
                digest.update(files[fname].encode())
    if not files:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    # The chat template may be set in memory after loading; it changes the rendering of chat data.
    template = getattr(tokenizer, "chat_template", None)
    digest.update(str(template).encode())
    from pf_trl.hub import origin_of

    hub = origin_of(path)
    return {
        "name": getattr(tokenizer, "pf_trl_name", None) or getattr(tokenizer, "name_or_path", None),
        "path": str(path) if path else None,
        # the Hub repository and commit the tokenizer was downloaded from (None: a local folder or the embedded one)
        "hub": hub.record() if hub else None,
        "class": type(tokenizer).__name__,
        **content_identity(tokenizer),
        "files_sha256": digest.hexdigest(),
        "hashed_files": list(files),
        "files": files,
        "chat_template_sha256": hashlib.sha256(str(template).encode()).hexdigest() if template else None,
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def tokenizer_files_key(name_or_path: str) -> tuple:
    """What changes when a tokenizer folder's files change: each file's name, size, mtime and ctime (ctime moves on
    any write or replacement and cannot be set back), or ``("embedded",)`` for a name that is not a folder."""
    folder = Path(name_or_path)
    if not folder.is_dir():
        return ("embedded",)
    return tuple((p.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
                 for p in sorted(folder.iterdir()) if p.is_file() for st in (p.stat(),))


class TokenizerCache:
    """Loaded tokenizers and their fingerprints by name, kept while the folder's files are unchanged
    (:func:`tokenizer_files_key`: a ``stat`` per file), so a long-lived process loads and hashes a tokenizer once
    per version of its files. The preprocessing service's workers and preflight sandboxes hold one each."""

    # entries loaded before a fork (:meth:`seed`): every cache of this process starts with them
    _seeded: dict[str, tuple[tuple, Any, dict[str, Any] | None]] = {}

    def __init__(self, loader: Any = None):
        self._load = loader or load_tokenizer
        self._cache: dict[str, tuple[tuple, Any, dict[str, Any] | None]] = {} if loader else dict(self._seeded)

    @classmethod
    def seed(cls, name: str) -> None:
        """Load ``name`` and its fingerprint into every cache this process creates from now on (the service's
        template process does it once; the workers and sandboxes forked from it start with the tokenizer loaded)."""
        cache = cls()
        cache.fingerprint(name)
        cls._seeded[name] = cache._cache[name]

    def get(self, name: str):
        """The tokenizer ``name`` (loaded again when its files changed since it was cached)."""
        return self._entry(name)[1]

    def fingerprint(self, name: str) -> dict[str, Any]:
        """:func:`tokenizer_fingerprint` of :meth:`get` ``(name)``, computed once per version of its files."""
        key, tok, fingerprint = self._entry(name)
        if fingerprint is None:
            fingerprint = tokenizer_fingerprint(tok)
            self._cache[name] = (key, tok, fingerprint)
        return fingerprint

    def _entry(self, name: str) -> tuple[tuple, Any, dict[str, Any] | None]:
        key = tokenizer_files_key(name)
        hit = self._cache.get(name)
        if hit is None or hit[0] != key:
            hit = (key, self._load(name), None)
            self._cache[name] = hit
        return hit


def _template_state(sha: str | None) -> str:
    return "no chat template" if sha is None else f"chat template sha256 {sha[:12]}"


def tokenizer_differences(made_with: dict[str, Any], used: dict[str, Any]) -> list[str]:
    """What differs between two :func:`tokenizer_fingerprint` records, the data's and the model's (empty when they
    are the same tokenizer).

    Both with a content identity: the parts that differ (vocabulary, merges, added / special tokens, normalizer,
    pre-tokenizer, post-processor, decoder, chat template), whatever the files. A record from an older pf-trl (a hash
    of the tokenizer files only) is matched against the model's file hash, and a mismatch says how to record a
    content identity."""
    from pf_trl.data.tokenizer_content import CONTENT_IDENTITY, content_differences

    if made_with.get("identity") == CONTENT_IDENTITY and used.get("identity") == CONTENT_IDENTITY:
        out = content_differences(made_with, used)
        if not out and made_with.get("sha256") != used.get("sha256"):  # parts equal, identities not: never trust it
            out = [f"tokenizer identity differs (sha256 {str(made_with.get('sha256'))[:12]} vs "
                   f"{str(used.get('sha256'))[:12]})"]
        if out and made_with.get("vocab_size") != used.get("vocab_size") and not any(
                d.startswith(("vocabulary", "added tokens")) for d in out):
            out.insert(0, f"vocabulary size {made_with.get('vocab_size')} vs {used.get('vocab_size')}")
        return [_template_detail(made_with, used) if d == "chat template differs" else d for d in out]
    legacy = used.get("files_sha256", used.get("sha256"))
    if made_with.get("sha256") == legacy and made_with.get("vocab_size") == used.get("vocab_size"):
        return []  # an older manifest, the very tokenizer files it was made with
    out = []
    if made_with.get("vocab_size") != used.get("vocab_size"):
        out.append(f"vocabulary size {made_with.get('vocab_size')} vs {used.get('vocab_size')}")
    have, want = made_with.get("files"), used.get("files")
    if isinstance(have, dict) and isinstance(want, dict):
        changed = []
        for name in sorted(set(have) | set(want)):
            if name not in want:
                changed.append(f"{name} (only in the data's tokenizer)")
            elif name not in have:
                changed.append(f"{name} (only in the model's tokenizer)")
            elif have[name] != want[name]:
                changed.append(f"{name} (different content)")
        if changed:
            out.append("tokenizer files differ: " + ", ".join(changed))
    if "chat_template_sha256" in made_with and "chat_template_sha256" in used:
        if made_with["chat_template_sha256"] != used["chat_template_sha256"]:
            out.append(_template_detail(made_with, used))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in made_with and key in used and made_with[key] != used[key]:
            out.append(f"{key} {made_with[key]} vs {used[key]}")
    if made_with.get("class") and used.get("class") and made_with["class"] != used["class"]:
        out.append(f"class {made_with['class']} vs {used['class']}")
    if not out:
        out.append("their fingerprints differ (the data's manifest predates per-file identities; re-run pretokenize "
                   "to see which part)")
    if made_with.get("identity") != CONTENT_IDENTITY:
        out.append(OLD_MANIFEST_NOTE)
    return out


# what to do with shards whose manifest has only the file hash of an older pf-trl
OLD_MANIFEST_NOTE = ("the data's manifest records only the tokenizer's file hash (an older pf-trl), which a re-saved "
                     "copy of the same tokenizer does not match: train with the tokenizer folder the data was made "
                     "with, or re-run pretokenize to record an identity by content")


def _template_detail(made_with: dict[str, Any], used: dict[str, Any]) -> str:
    a, b = made_with.get("chat_template_sha256"), used.get("chat_template_sha256")
    return (f"chat template differs: the data was rendered with {_template_state(a)}, the model's tokenizer has "
            f"{_template_state(b)}")


def mismatch_fix(made_with: dict[str, Any], used: dict[str, Any]) -> str:
    """The fix for a tokenizer mismatch: the same chat template when only the template differs, else the model's
    own tokenizer."""
    differences = [d for d in tokenizer_differences(made_with, used) if d != OLD_MANIFEST_NOTE]
    if len(differences) == 1 and differences[0].startswith("chat template differs"):
        if made_with.get("chat_template_sha256") is None:
            return "train without --chat_template (the data used the tokenizer's own none), or re-run pretokenize with it"
        return ("pass the chat template the data was made with (--chat_template FILE; the manifest's options hold its "
                "text), or re-run pretokenize with the model's template")
    return "re-run pretokenize with the model's tokenizer"


def folder_has_tokenizer(path: str | Path) -> bool:
    """True when ``path`` is a folder holding tokenizer files (a model folder saved with its tokenizer)."""
    folder = Path(path).expanduser()
    return folder.is_dir() and any((folder / name).is_file() for name in _TOKENIZER_FILES[:2] + ("tokenizer_config.json",))


def default_tokenizer_for(model_name_or_path: str | None, *, trust_remote_code: bool = False) -> str:
    """The tokenizer a model trains with when none is named: the model folder's own, else the embedded one.

    The embedded Mistral tokenizer is the default only for pf-trl's embedded models (and models built in memory);
    a model folder without tokenizer files is refused, since its token ids would mean other tokens. A Hub model's
    snapshot brings its ``*.py`` files with ``trust_remote_code`` (a tokenizer of its own code).
    """
    from pf_trl.models import is_embedded_model

    if model_name_or_path is None or is_embedded_model(model_name_or_path):
        return DEFAULT_TOKENIZER
    from pf_trl.hub import HubError, looks_like_repo_id
    from pf_trl.storage import StorageError, is_remote

    if is_remote(model_name_or_path):  # a committed bucket model: its tokenizer files (and config), not its weights
        from pf_trl.models import fetch_bucket_model

        try:
            model_name_or_path = fetch_bucket_model(model_name_or_path, tokenizer_only=True)
        except StorageError as exc:
            raise TokenizerLoadError(str(exc)) from None
    elif looks_like_repo_id(model_name_or_path):  # a Hub model: the tokenizer files of its snapshot, no weights
        from pf_trl.hub import snapshot

        try:
            model_name_or_path = snapshot(model_name_or_path, repo_type="model", flag="--model_name_or_path",
                                          what="tokenizer", code=trust_remote_code).folder
        except HubError as exc:
            raise TokenizerLoadError(str(exc)) from None
    if folder_has_tokenizer(model_name_or_path):
        return str(Path(model_name_or_path).expanduser())
    raise TokenizerLoadError(
        f"model folder {model_name_or_path} holds no tokenizer (tokenizer.json / tokenizer.model); save the "
        "tokenizer with the model or pass --tokenizer_name_or_path FOLDER"
    )


def model_vocab_size(model_or_path: Any) -> int | None:
    """Rows of the model's input embeddings: from a loaded model, an embedded name, or a folder's config.json."""
    if model_or_path is None:
        return None
    if not isinstance(model_or_path, (str, os.PathLike)):
        get = getattr(model_or_path, "get_input_embeddings", None)
        emb = get() if callable(get) else None
        weight = getattr(emb, "weight", None)
        if weight is not None and weight.ndim == 2 and weight.shape[0] > 0:
            return int(weight.shape[0])
        return getattr(getattr(model_or_path, "config", None), "vocab_size", None)
    from pf_trl.models import EMBEDDED_MODELS

    name = str(model_or_path)
    if name in EMBEDDED_MODELS:
        return int(EMBEDDED_MODELS[name]["vocab_size"])
    config_path = Path(name).expanduser() / "config.json"
    if not config_path.is_file():
        return None
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    value = text.get("vocab_size", config.get("vocab_size"))
    return int(value) if isinstance(value, int) else None


def check_vocab_fits(tokenizer, vocab_size: int | None, *, model_name: str = "the model") -> None:
    """Refuse a tokenizer whose ids reach past the model's embeddings (they would index out of range or, worse,
    train rows the tokenizer never meant)."""
    if vocab_size is None:
        return
    from pf_trl.data.processor import text_tokenizer

    tokenizer = text_tokenizer(tokenizer)  # a processor's vocabulary is its tokenizer's
    if len(tokenizer) > vocab_size:
        name = getattr(tokenizer, "pf_trl_name", None) or getattr(tokenizer, "name_or_path", None) or "the tokenizer"
        raise TokenizerLoadError(
            f"tokenizer {name!r} has {len(tokenizer)} tokens but {model_name} has {vocab_size} embeddings; pass the "
            "model's own tokenizer (--tokenizer_name_or_path), or resize the model's embeddings"
        )


def apply_chat_template_file(tokenizer, path: str | Path | None) -> None:
    """Set ``tokenizer.chat_template`` from a Jinja file (``--chat_template FILE``); it enters the fingerprint."""
    if path is None:
        return
    from pf_trl.data.options import OptionError, read_template_file

    try:
        tokenizer.chat_template = read_template_file(path)
    except OptionError as exc:
        raise TokenizerLoadError(str(exc)) from exc


def with_chat_template(tokenizer, chat_template: str | None):
    """``tokenizer`` rendering chats with ``chat_template`` (a Jinja text): the tokenizer itself when the template is
    None or already its own, else a shallow copy (the caller's tokenizer, possibly shared, keeps its template)."""
    if chat_template is None or getattr(tokenizer, "chat_template", None) == chat_template:
        return tokenizer
    import copy

    templated = copy.copy(tokenizer)
    templated.chat_template = chat_template
    return templated


def resolve_tokenizer(
    model: Any = None, tokenizer: Any = None, *, chat_template_file: str | Path | None = None, check_vocab: bool = True,
    trust_remote_code: bool = False,
):
    """The tokenizer to train ``model`` with: ``tokenizer`` when given (a name, folder or loaded tokenizer), else
    the model folder's own tokenizer, else (embedded or in-memory models) the embedded default; its vocabulary must
    fit the model's embeddings.

    Args:
        model: an embedded model name, a model folder, or a loaded ``PreTrainedModel``.
        tokenizer: an embedded name, a local folder, a loaded fast tokenizer, or None.
        chat_template_file: a Jinja file that replaces the tokenizer's chat template.
        check_vocab: refuse a tokenizer with more tokens than the model has embeddings (callers that only use it
            on already tokenized data check the data's ids instead).
        trust_remote_code: run the tokenizer's own code (its ``auto_map``), as TRL's ``trust_remote_code``.
    """
    if tokenizer is None:
        if model is None or isinstance(model, (str, os.PathLike)):
            name = default_tokenizer_for(None if model is None else str(model), trust_remote_code=trust_remote_code)
        else:
            own = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
            name = str(own) if own and folder_has_tokenizer(own) else DEFAULT_TOKENIZER
        tokenizer = load_tokenizer(name, trust_remote_code=trust_remote_code, flag="--model_name_or_path")
    elif isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(str(tokenizer), trust_remote_code=trust_remote_code)
    if check_vocab:
        model_name = f"model {str(model)!r}" if isinstance(model, (str, os.PathLike)) else "the model"
        check_vocab_fits(tokenizer, model_vocab_size(model), model_name=model_name)
    apply_chat_template_file(tokenizer, chat_template_file)
    return tokenizer
