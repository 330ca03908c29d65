"""Start olah 0.5.4 (a self-hosted Hugging Face Hub mirror) serving local git repositories offline, as the Hub
answers: run with the python of ``.venv-olah`` (``scripts/olah.sh``), ``python olah_launcher.py --config FILE``.

Two offline answers of olah 0.5.4 differ from the Hub's and are wrapped before its ``main()`` runs:

1. ``/api/{type}/{org}/{repo}`` without a revision: olah's newest-commit lookup reads only its own metadata cache,
   never the local mirror, and answers 401; the mirror's ``main`` head is the answer.
2. A tree listing of a path the repository lacks answers 401 where the Hub answers 404 with
   ``X-Error-Code: EntryNotFound`` (transformers asks for ``additional_chat_templates``).

A third difference is answered as the Hub answers it: a revision a mirrored repository lacks
(``/api/{type}/{org}/{repo}/revision/{rev}``) gets 404 ``RevisionNotFound``, not olah's 401 ``RepoNotFound``.

Two Hub behaviours olah does not have, for the error tests, read from the JSON file ``$PF_TRL_OLAH_RULES`` on each
request (the test changes it while the server runs):

- ``{"gated": {"ORG/NAME": "TOKEN"}}``: the repository answers 401 without a token and 403 (``GatedRepo``) with
  another token, as the Hub answers for a gated repository;
- ``{"busy": N}``: the next N file downloads answer 429 with ``Retry-After: 1`` (the Hub's rate limit);
- ``{"unsized": ["ORG/NAME"]}``: the repository's files are served without their size (no ``Content-Length``, no
  ``X-Linked-Size``, the body chunked), as a server or proxy that does not tell it would.

Not imported by pf-trl or by the test process (it runs in olah's own venv).
"""

from __future__ import annotations

import json
import os
import re

import git
import olah.server
import olah.server_api_routes as api_routes
import olah.server_upstream as upstream
from fastapi.responses import JSONResponse, Response
from olah.server_access import build_repo_ref
from olah.server_mirror import _mirror_git_paths

_newest_commit = upstream.get_newest_commit_hf
_tree = api_routes.tree_proxy_common


def _mirror_repo(app, repo_type: str, org: str | None, repo: str) -> git.Repo | None:
    for path in _mirror_git_paths(app, build_repo_ref(repo_type, org, repo)):
        if os.path.isdir(path):
            return git.Repo(path)
    return None


async def newest_commit(app, repo_type, org, repo, authorization=None):
    local = _mirror_repo(app, repo_type, org, repo)
    if local is not None:
        try:
            return local.commit("main").hexsha
        except (git.exc.BadName, ValueError):
            pass
    return await _newest_commit(app, repo_type, org, repo, authorization=authorization)


async def tree(app, repo_type, org, repo, commit, path, recursive, expand, method, authorization):
    local = _mirror_repo(app, repo_type, org, repo)
    clean = path.strip("/")
    if local is not None and clean:
        try:
            local.commit(commit).tree[clean]
        except KeyError:
            return Response(status_code=404, headers={"x-error-code": "EntryNotFound",
                                                      "x-error-message": f"{clean} does not exist on {commit!r}"})
        except (git.exc.BadName, ValueError):
            pass
    return await _tree(app, repo_type, org, repo, commit, path, recursive, expand, method, authorization)


upstream.get_newest_commit_hf = newest_commit
api_routes.tree_proxy_common = tree

_REPO_IN_PATH = re.compile(r"^/(?:api/)?(?:(models|datasets)/)?([^/]+)/([^/]+)")
_REVISION_INFO = re.compile(r"^/api/(models|datasets)/([^/]+)/([^/]+)/revision/(.+)$")


def _missing_revision(app, path: str) -> str | None:
    """The revision of a revision-info request that a mirrored repository lacks (None: present, or not mirrored)."""
    match = _REVISION_INFO.match(path)
    if not match:
        return None
    from urllib.parse import unquote

    local = _mirror_repo(app, match.group(1), match.group(2), match.group(3))
    revision = unquote(match.group(4))
    if local is None:
        return None
    try:
        local.commit(revision)
    except (git.exc.BadName, ValueError, git.exc.GitCommandError):
        return revision
    return None


def _rules() -> dict:
    path = os.environ.get("PF_TRL_OLAH_RULES")
    if not path or not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _take_busy(rules: dict) -> bool:
    busy = int(rules.get("busy") or 0)
    if busy <= 0:
        return False
    rules["busy"] = busy - 1
    with open(os.environ["PF_TRL_OLAH_RULES"], "w", encoding="utf-8") as fh:
        json.dump(rules, fh)
    return True


@olah.server.app.middleware("http")
async def hub_access(request, call_next):
    rules = _rules()
    match = _REPO_IN_PATH.match(request.url.path)
    if match and rules.get("gated"):
        org_repo = f"{match.group(2)}/{match.group(3)}"
        token = (rules["gated"] or {}).get(org_repo)
        if token is not None:
            given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not given:
                return JSONResponse({"error": "Invalid credentials in Authorization header"}, status_code=401,
                                    headers={"x-error-code": "GatedRepo",
                                             "x-error-message": "Invalid credentials in Authorization header"})
            if given != token:
                message = f"Access to model {org_repo} is restricted. You must have access to it and be authenticated."
                return JSONResponse({"error": message}, status_code=403,
                                    headers={"x-error-code": "GatedRepo", "x-error-message": message})
    missing = _missing_revision(request.app, request.url.path)
    if missing is not None:
        message = f"Invalid rev id: {missing}"
        return JSONResponse({"error": message}, status_code=404,
                            headers={"x-error-code": "RevisionNotFound", "x-error-message": message})
    if request.method == "GET" and "/resolve/" in request.url.path and _take_busy(rules):
        return JSONResponse({"error": "rate limited"}, status_code=429, headers={"retry-after": "1"})
    response = await call_next(request)
    if match and "/resolve/" in request.url.path and f"{match.group(2)}/{match.group(3)}" in rules.get("unsized", ()):
        for name in ("content-length", "x-linked-size"):
            if name in response.headers:
                del response.headers[name]
    return response


if __name__ == "__main__":
    olah.server.main()
