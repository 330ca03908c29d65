"""k8s/ray/pretokenize-rayjob.yaml: the KubeRay RayJob of `pf-trl pretokenize --engine ray`, validated like the other
custom resources (strictly against its vendored, trimmed CRD; its pod templates against core/v1), with the same
volumes, security and image as the other Jobs, and an entrypoint that the real pretokenize parser accepts."""

from __future__ import annotations

import copy
import shlex

import pytest
import yaml
from test_deploy_k8s import K8S, _crd_validator, docs_of, load_docs, requires_kv, validate_core

RAYJOB = K8S / "ray" / "pretokenize-rayjob.yaml"


def _rayjob() -> dict:
    (job,) = load_docs(RAYJOB)
    return job


def _pods(job: dict) -> list[dict]:
    spec = job["spec"]["rayClusterSpec"]
    return [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]


@requires_kv
def test_rayjob_validates_against_its_crd_and_pods_against_core():
    crd, validator = _crd_validator("RayJob")
    validate_core(crd)
    assert crd["metadata"]["name"] == "rayjobs.ray.io" and crd["spec"]["names"]["kind"] == "RayJob"
    job = _rayjob()
    assert job["apiVersion"] == "ray.io/v1"
    errors = sorted(validator.iter_errors(job), key=str)
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)
    for i, template in enumerate(_pods(job)):
        validate_core({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"rayjob-{i}"},
                       "template": template})
    # Kueue's queue label, as the other multi-node templates carry it: commented out, valid once uncommented
    text = RAYJOB.read_text(encoding="utf-8")
    assert "    # kueue.x-k8s.io/queue-name: pf-trl-queue\n" in text
    (queued,) = [d for d in yaml.safe_load_all(text.replace("# kueue.x-k8s.io/queue-name", "kueue.x-k8s.io/queue-name"))
                 if d]
    assert queued["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "pf-trl-queue"
    assert not list(validator.iter_errors(queued))


@pytest.mark.parametrize("mutate", [
    lambda j: j["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].pop("groupName"),  # required
    lambda j: j["spec"]["rayClusterSpec"]["headGroupSpec"].pop("template"),  # required
    lambda j: j["spec"].__setitem__("entryPoint", j["spec"].pop("entrypoint")),  # a typo: unknown field
    lambda j: j["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].__setitem__("replicas", "2"),  # an integer
    lambda j: j["spec"].__setitem__("shutdownAfterJobFinishes", "yes"),  # a boolean
], ids=["no-group-name", "no-head-template", "unknown-field", "replicas-string", "shutdown-string"])
def test_rayjob_crd_validation_catches_mistakes(mutate):
    _, validator = _crd_validator("RayJob")
    bad = copy.deepcopy(_rayjob())
    mutate(bad)
    assert list(validator.iter_errors(bad))


def test_rayjob_pods_share_the_jobs_volumes_security_and_version():
    from pf_trl import __version__

    pvcs = {d["metadata"]["name"] for _, d in docs_of("PersistentVolumeClaim")}
    for template in _pods(_rayjob()):
        pod = template["spec"]
        assert pod["automountServiceAccountToken"] is False
        psc = pod["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0
        claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
        assert claims == {"pf-trl-data", "pf-trl-cache"} <= pvcs  # the data and cache volumes of the other Jobs
        assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in pod["volumes"]), "Ray's /dev/shm"
        (c,) = pod["containers"]
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert c["resources"]["requests"] and c["resources"]["limits"]
        assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/data", "/cache", "/tmp", "/dev/shm"}
        assert c["image"] == f"pf-trl-ray:{__version__}"


def test_rayjob_entrypoint_is_pretokenize_on_ray():
    from pf_trl.cli.pretokenize import build_parser
    from pf_trl.data.ray_engine import import_ray  # noqa: F401 (the module the entrypoint runs exists)

    job = _rayjob()
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["pf-trl", "pretokenize"]
    args = build_parser().parse_args(argv[2:])
    assert args.engine == "ray" and args.output_dir.startswith("/cache/") and args.source.startswith("/data/")
    with pytest.raises(Exception, match="unrecognized arguments"):
        build_parser().parse_args([*argv[2:], "--engine_ray"])
    assert job["spec"]["rayClusterSpec"]["rayVersion"] == _pinned_ray()


def _pinned_ray() -> str:
    from pathlib import Path

    constraints = (Path(__file__).resolve().parents[1] / "constraints" / "cpu.txt").read_text(encoding="utf-8")
    (line,) = [ln for ln in constraints.splitlines() if ln.startswith("ray==")]
    return line.split("==")[1]
