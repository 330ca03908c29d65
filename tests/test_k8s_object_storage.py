"""k8s/object-storage/: pf-trl on a cluster without a ReadWriteMany volume, rendered as a platform engineer applies it.

- the service side (the base with the component), the Indexed pretokenize Job, the merge and train Jobs and the three
  multi-node templates render (`kubectl kustomize`) and validate strictly on Kubernetes 1.31 and the newest schema
  (core kinds; the CRD kinds against k8s/crds/ and their pods against core/v1);
- no ReadWriteMany claim anywhere, no claim at all in a Job's pod: every training pod reads and writes the bucket with
  an emptyDir at /cache (PF_TRL_CACHE), and the command lines parse with pf-trl's own parsers, their URIs built from
  the one PF_TRL_BUCKET of bucket.env;
- credentials: the ServiceAccount pf-trl (workload identity annotations offered) or an optional Secret.

The parsers are path-agnostic (a URI is a string to them): reading and writing the bucket is the storage layer's work
and is tested there; here the rendered strings, the flags' names and the parse.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from test_deploy_k8s import (
    CRDS,
    INJECTED_BY_KIND,
    K8S,
    K8S_VERSIONS,
    OBJECT_STORAGE,
    _crd_validator,
    _kustomize_cmd,
    _torchrun_args,
    _train_argv,
    _train_module,
    argv_of,
    assert_exact_flags,
    expand_vars,
    kv,
    merge_shards,
    pretokenize_slice,
    requires_kv,
    validate_core,
    with_args_file,
)

pytestmark = requires_kv
VARIANTS = ("multinode", "trainer-v2", "jobset", "pretokenize-parts")
PLAIN_JOBS = ("jobs/train-job.yaml", "jobs/merge-shards-job.yaml")
BUCKET_ENV = OBJECT_STORAGE / "bucket.env"
URI = re.compile(r"\b(s3|gs|az|abfs)://")


def bucket_settings() -> dict[str, str]:
    """The ConfigMap pf-trl-object-storage as the pods see it (kustomize's env-file format)."""
    out = {}
    for line in BUCKET_ENV.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def _render(path: Path) -> list[dict]:
    cmd = _kustomize_cmd()
    if cmd is None:
        pytest.skip("neither kustomize nor kubectl is installed")
    proc = subprocess.run([*cmd, str(path)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """variant -> its rendered documents; "service": the base with the component, as an overlay of one's own."""
    overlay = tmp_path_factory.mktemp("overlay")
    rel = Path(os.path.relpath(K8S, overlay))
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({"resources": [str(rel)],
                                                                "components": [str(rel / "object-storage")]}))
    out = {"service": _render(overlay)}
    out |= {v: _render(OBJECT_STORAGE / v) for v in VARIANTS}
    for f in PLAIN_JOBS:  # applied with -f
        out[f] = [d for d in yaml.safe_load_all((OBJECT_STORAGE / f).read_text(encoding="utf-8")) if d]
    return out


def _one(rendered, variant: str, kind: str) -> dict:
    (found,) = [d for d in rendered[variant] if d["kind"] == kind]
    return found


def _pods(rendered) -> list[tuple[str, dict, dict, dict]]:
    """(where, the job, its pod spec, the env the platform injects) of every Job-like pod of the variant."""
    out = []
    for variant, docs in rendered.items():
        for d in docs:
            kind = d["kind"]
            if kind == "Job":
                out.append((variant, d, d["spec"]["template"]["spec"], INJECTED_BY_KIND["JobSet"]))
            elif kind == "PyTorchJob":
                out += [(variant, d, r["template"]["spec"], INJECTED_BY_KIND[kind])
                        for r in d["spec"]["pytorchReplicaSpecs"].values()]
            elif kind == "JobSet":
                out += [(variant, d, r["template"]["spec"]["template"]["spec"], INJECTED_BY_KIND[kind])
                        for r in d["spec"]["replicatedJobs"]]
            elif kind == "TrainJob":
                out.append((variant, d, _trainjob_pod(rendered, d), INJECTED_BY_KIND[kind]))
    return out


def _trainjob_pod(rendered, job: dict) -> dict:
    """The pod the Trainer makes from the runtime the TrainJob names and its trainer fields (test_deploy_k8s.py)."""
    runtime = _one(rendered, "trainer-v2", "ClusterTrainingRuntime")
    assert job["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"]
    (rjob,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    pod = copy.deepcopy(rjob["template"]["spec"]["template"]["spec"])
    trainer = job["spec"]["trainer"]
    (c,) = [c for c in pod["containers"] if c["name"] == "node"]
    c.update({k: copy.deepcopy(trainer[k]) for k in ("image", "command", "args") if k in trainer})
    c["env"] = [*c.get("env", []), *copy.deepcopy(trainer.get("env", []))]
    c["resources"] = copy.deepcopy(trainer["resourcesPerNode"])
    return pod


def _expand(args: list[str], c: dict, injected: dict[str, str]) -> list[str]:
    """$(VAR) expansion with the ConfigMap's variables (envFrom) as the kubelet does."""
    assert {"configMapRef": {"name": "pf-trl-object-storage"}} in c.get("envFrom", []), c["name"]
    return expand_vars(args, c, extra=bucket_settings(), injected={**injected, **bucket_settings()})


# ------------------------------------------------------------------------------------------------ tests


def test_every_variant_renders_and_validates_on_1_31_and_the_newest(rendered):
    assert len(K8S_VERSIONS) == 2 and K8S_VERSIONS[0] == "1.31"
    kinds = {v: sorted(d["kind"] for d in docs) for v, docs in rendered.items()}
    assert kinds["multinode"] == ["PyTorchJob"] and kinds["jobset"] == ["JobSet", "Service"]
    assert kinds["trainer-v2"] == ["ClusterTrainingRuntime", "TrainJob"] and kinds["pretokenize-parts"] == ["Job"]
    assert "ServiceAccount" in kinds["service"] and "Deployment" in kinds["service"]
    for variant, docs in rendered.items():
        for d in docs:
            if d["kind"] in CRDS:
                _, validator = _crd_validator(d["kind"])
                errors = sorted(validator.iter_errors(d), key=str)
                assert not errors, f"{variant}: " + "\n".join(f"{list(e.path)}: {e.message}" for e in errors)
            else:
                validate_core(d)
    for _variant, job, pod, _ in _pods(rendered):  # the pods inside the CRD kinds, against core/v1
        validate_core({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": job["metadata"]["name"]},
                       "template": {"spec": pod}})
    for jobset in (_one(rendered, "jobset", "JobSet"),
                   _one(rendered, "trainer-v2", "ClusterTrainingRuntime")["spec"]["template"]["spec"]):
        for rjob in jobset["spec"]["replicatedJobs"] if "spec" in jobset else jobset["replicatedJobs"]:
            spec = copy.deepcopy(rjob["template"]["spec"])
            spec["template"]["spec"]["containers"][0].setdefault("image", "x")  # the TrainJob gives it
            validate_core({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "n"}, "spec": spec})


def test_no_read_write_many_claim_and_no_claim_in_a_job(rendered):
    claims = [d for docs in rendered.values() for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert [c["metadata"]["name"] for c in claims] == ["pf-trl-cache"]  # the service's own cache, one pod's disk
    for c in claims:
        assert "ReadWriteMany" not in c["spec"]["accessModes"], c["metadata"]["name"]
    pods = _pods(rendered)
    assert len(pods) == 7  # pretokenize slices, merge, train Job, PyTorchJob x2, TrainJob, JobSet
    for variant, job, pod, _ in pods:
        where = f"{variant}: {job['kind']}/{job['metadata']['name']}"
        assert not [v for v in pod["volumes"] if "persistentVolumeClaim" in v], f"{where} mounts a claim"
        cache = next(v for v in pod["volumes"] if v["name"] == "cache")
        assert cache == {"name": "cache", "emptyDir": {"sizeLimit": cache["emptyDir"]["sizeLimit"]}}, where
        (c,) = pod["containers"]
        mount = next(m for m in c["volumeMounts"] if m["name"] == "cache")
        assert mount == {"name": "cache", "mountPath": "/cache"}, where  # read-write: downloads and staging
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["PF_TRL_CACHE"] == "/cache", where
        assert "DATASET_ID" not in env and "PF_SERVICE_TOKEN" not in env, where
        # the scheduler places the pod where the node's disk holds the emptyDirs
        size = _gi(cache["emptyDir"]["sizeLimit"])
        assert _gi(c["resources"]["requests"]["ephemeral-storage"]) >= size, where
    # the negative control: the default variant mounts ReadWriteMany claims in the same pods
    base = _render(K8S / "multinode")[0]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["volumes"]
    assert [v for v in base if "persistentVolumeClaim" in v]


def _gi(quantity: str) -> int:
    assert quantity.endswith("Gi"), quantity
    return int(quantity[:-2])


def test_training_pods_read_and_write_the_bucket_and_parse(rendered):
    train = _train_module()
    bucket = bucket_settings()["PF_TRL_BUCKET"]
    seen = {}
    for variant, job, pod, injected in _pods(rendered):
        (c,) = pod["containers"]
        if "train" not in argv_of(c):
            continue
        spec = copy.deepcopy(c)
        spec["args"] = _expand(c["args"], c, injected)
        spec["command"] = c["command"]
        argv = _train_argv(pod, spec, injected)
        if argv[:2] == ["pf-trl", "torchrun"]:
            script = _torchrun_args(argv).training_script_args
            assert script[0] == "train"
            script = script[1:]
        else:
            assert argv[:2] == ["pf-trl", "train"], argv[:2]
            script = argv[2:]
        assert_exact_flags(train.normalize_argv(script), train._parser())
        _, data_args, config = train.parse_args(script)
        assert data_args.training_data_path == f"{bucket}/datasets/big", variant
        assert config.output_dir.startswith(f"{bucket}/runs/"), variant
        assert config.resume_from_checkpoint == "auto" and config.save_strategy == "steps"
        assert data_args.dataset_service_url is None and data_args.dataset_id is None
        assert pod["serviceAccountName"] == "pf-trl" and pod["automountServiceAccountToken"] is False
        seen[job["kind"]] = config.output_dir
    assert sorted(seen) == ["Job", "JobSet", "PyTorchJob", "TrainJob"]
    assert len(set(seen.values())) == 4, "each template writes its own run prefix"


def test_pretokenize_slices_and_merge_write_the_bucket(rendered):
    from pf_trl.cli.pretokenize import build_parser, config_from_args

    bucket = bucket_settings()["PF_TRL_BUCKET"]
    job = _one(rendered, "pretokenize-parts", "Job")
    (c,) = job["spec"]["template"]["spec"]["containers"]
    argv = _expand(argv_of(c), c, {"JOB_COMPLETION_INDEX": "3"})
    assert argv[:2] == ["python", "/etc/pf-trl/scripts/pretokenize_slice.py"]
    slice_args, source, flags = pretokenize_slice.split_argv(argv[2:])
    assert slice_args.parts_dir == f"{bucket}/parts/big" and slice_args.index == 3
    assert slice_args.count == job["spec"]["completions"] == job["spec"]["parallelism"]  # still one knob
    assert source == f"{bucket}/sources/big/part-3.jsonl"
    parser = build_parser()
    pre = [source, f"{slice_args.parts_dir}/part-3", "--overwrite", *flags]
    assert_exact_flags(pre, parser)
    config_from_args(parser.parse_args(pre))
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert {"action": "FailIndex", "onExitCodes": {"containerName": "pretokenize", "operator": "In",
                                                   "values": [2]}} in rules
    (merge,) = rendered["jobs/merge-shards-job.yaml"]
    (mc,) = merge["spec"]["template"]["spec"]["containers"]
    margv = _expand(argv_of(mc), mc, {})
    assert margv[:2] == ["python", "/etc/pf-trl/scripts/merge_shards.py"]
    mparser = merge_shards.build_parser()
    assert_exact_flags(margv[2:], mparser)
    margs = mparser.parse_args(margv[2:])
    assert margs.parts_dir == slice_args.parts_dir and margs.output_dir == f"{bucket}/datasets/big"
    assert margs.expect is None  # the count comes from the run's plan, as in the default variant


def test_service_publishes_to_the_bucket(rendered):
    from pf_trl.cli.serve import build_parser

    bucket = bucket_settings()["PF_TRL_BUCKET"]
    deploy = _one(rendered, "service", "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    parser = build_parser()
    argv = argv_of(c)
    assert_exact_flags(argv[1:], parser)
    args = parser.parse_args(argv[1:])
    assert not args.data_roots and args.public_cache_dir is None  # no pod reads the service's cache
    env = {e["name"]: e for e in c["env"]}
    (publish,) = _expand([env["PF_SERVICE_PUBLISH_URI"]["value"]], c, {})
    assert publish == f"{bucket}/datasets"
    assert [v for v in pod["volumes"] if "persistentVolumeClaim" in v] == [
        {"name": "cache", "persistentVolumeClaim": {"claimName": "pf-trl-cache"}}]
    assert "replicas" not in deploy["spec"] and deploy["spec"]["strategy"] == {"type": "Recreate"}  # one, by design
    assert pod["serviceAccountName"] == "pf-trl"


def test_with_postgres_the_service_keeps_its_database_and_one_replica_on_its_one_disk(tmp_path):
    """k8s/postgres then k8s/object-storage: the job store in PostgreSQL (--database-url-file kept), one replica
    (Recreate) on the ReadWriteOnce cache; listed the other way round the render fails instead of putting two
    replicas on that disk (the negative control: that order is what the component alone would have rendered)."""
    from pf_trl.cli.serve import build_parser

    docs = {}
    for order in (("postgres", "object-storage"), ("object-storage", "postgres")):
        overlay = tmp_path / "-".join(order)
        overlay.mkdir()
        rel = Path(os.path.relpath(K8S, overlay))
        (overlay / "kustomization.yaml").write_text(yaml.safe_dump({"resources": [str(rel)],
                                                                    "components": [str(rel / o) for o in order]}))
        cmd = _kustomize_cmd()
        if cmd is None:
            pytest.skip("neither kustomize nor kubectl is installed")
        proc = subprocess.run([*cmd, str(overlay)], capture_output=True, text=True, timeout=60, check=False)
        docs[order] = proc
    bad = docs[("object-storage", "postgres")]
    assert bad.returncode != 0 and "/spec/template/spec/containers/0/args/7" in bad.stderr
    good = docs[("postgres", "object-storage")]
    assert good.returncode == 0, good.stderr
    rendered = [d for d in yaml.safe_load_all(good.stdout) if d]
    for d in rendered:
        if d["kind"] in ("Deployment", "PersistentVolumeClaim", "Service"):
            validate_core(d)
    (deploy,) = [d for d in rendered if d["kind"] == "Deployment"]
    (claim,) = [d for d in rendered if d["kind"] == "PersistentVolumeClaim"]
    assert claim["metadata"]["name"] == "pf-trl-cache" and claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert "replicas" not in deploy["spec"] and deploy["spec"]["strategy"] == {"type": "Recreate"}
    pod = deploy["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    argv = argv_of(c)
    parser = build_parser()
    assert_exact_flags(argv[1:], parser)
    args = parser.parse_args(argv[1:])
    assert args.database_url_file == "/etc/pf-trl/database/url" and args.cache_dir == "/cache"
    assert not args.data_roots and args.public_cache_dir is None
    assert {v["name"] for v in pod["volumes"]} == {"cache", "tmp", "database"}
    assert {"name": "PF_SERVICE_REPLICA_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in c["env"]


def test_the_bucket_is_named_in_one_place(rendered):
    """Every URI of the variant is built from $(PF_TRL_BUCKET), defined once in bucket.env: no other file of
    k8s/object-storage/ names a bucket, and no rendered document holds a URI except the ConfigMap."""
    assert URI.match(bucket_settings()["PF_TRL_BUCKET"])
    for path in OBJECT_STORAGE.rglob("*.yaml"):  # what kustomize reads (comments may show an example command)
        content = yaml.safe_dump_all(list(yaml.safe_load_all(path.read_text(encoding="utf-8"))))
        assert not URI.search(content), f"{path} names a bucket"
    for variant, docs in rendered.items():
        for d in docs:
            # the bucket's settings, and the scripts ConfigMap (code whose docstrings show example URIs)
            if not (d["kind"] == "ConfigMap" and d["metadata"]["name"] in ("pf-trl-object-storage", "pf-trl-scripts")):
                assert not URI.search(yaml.safe_dump(d)), f"{variant}: {d['kind']}/{d['metadata']['name']}"
    (cm,) = [d for d in rendered["service"] if d["kind"] == "ConfigMap"
             and d["metadata"]["name"] == "pf-trl-object-storage"]
    assert cm["data"] == bucket_settings()
    assert "AWS_ENDPOINT_URL" not in cm["data"]  # AWS S3 itself as shipped; set for an S3-compatible store


def test_credentials_by_workload_identity_or_an_optional_secret(rendered):
    (sa,) = [d for d in rendered["service"] if d["kind"] == "ServiceAccount"]
    assert sa["metadata"]["name"] == "pf-trl" and sa["automountServiceAccountToken"] is False
    text = (OBJECT_STORAGE / "service-account.yaml").read_text(encoding="utf-8")
    for key in ("eks.amazonaws.com/role-arn", "iam.gke.io/gcp-service-account", "azure.workload.identity/client-id"):
        assert re.search(rf"^\s*#\s+{re.escape(key)}: ", text, re.M), key  # offered, commented out
    (secret,) = [d for d in yaml.safe_load_all((OBJECT_STORAGE / "credentials.example.yaml").read_text()) if d]
    assert set(secret["stringData"]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    assert all(v.startswith("REPLACE_WITH_") for v in secret["stringData"].values())
    for kustomization in OBJECT_STORAGE.rglob("kustomization.yaml"):
        assert "credentials.example.yaml" not in yaml.safe_load(kustomization.read_text(encoding="utf-8"))["resources"]
    assert not [d for docs in rendered.values() for d in docs if d["kind"] == "Secret"]
    pods = [(v, p) for v, _, p, _ in _pods(rendered)] + [("service", _one(rendered, "service", "Deployment")["spec"][
        "template"]["spec"])]
    for variant, pod in pods:
        (c,) = pod["containers"]
        assert {"secretRef": {"name": secret["metadata"]["name"], "optional": True}} in c["envFrom"], variant
        assert pod["serviceAccountName"] == sa["metadata"]["name"], variant
        assert not any(e["name"].startswith(("AWS_ACCESS", "AWS_SECRET")) for e in c.get("env", [])), variant


def test_read_write_many_stays_the_default():
    base = yaml.safe_load((K8S / "kustomization.yaml").read_text(encoding="utf-8"))
    assert "components" not in base
    docs = _render(K8S)
    claims = {d["metadata"]["name"]: d["spec"]["accessModes"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    shared = ("pf-trl-cache", "pf-trl-data", "pf-trl-outputs", "pf-trl-hf-cache")
    assert claims == {name: ["ReadWriteMany"] for name in shared}
    assert kv is not None and with_args_file is not None
