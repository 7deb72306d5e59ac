"""Offline checks of deploy/: the KubeRay manifests, the image definition and the Grafana dashboard.

No cluster or Docker here, so each manifest is checked against what would reject it: Kubernetes' own
schemas (kubernetes-validate) for the standard objects, Ray's ServeDeploySchema + specserve's AppConfig for
serveConfigV2, KubeRay's required RayService fields, and the roles' resources against the pods. A broken copy
must fail each check. The dashboard's queries may only name series the code exports.
"""

from __future__ import annotations

import copy
import importlib
import json
import pathlib
import re
import shlex
import subprocess

import kubernetes_validate
import pytest
import yaml

from specserve.cli import build_parser
from specserve.coordinator.metrics import METRICS, exported_names
from specserve.serve.kuberay import check, pod_templates, render_file

ROOT = pathlib.Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "deploy" / "kuberay").glob("*.yaml"))
RAYSERVICES = [p for p in MANIFESTS if yaml.safe_load(p.read_text())["kind"] == "RayService"]
K8S_VERSION = "1.33.0"


def k8s_problems(obj: dict) -> list[str]:
    """Kubernetes schema validation; a kind without a schema is a failure too (standard kinds must have one)."""
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return [f"no Kubernetes schema for {obj.get('apiVersion')}/{obj.get('kind')}"]
    except kubernetes_validate.ValidationError as exc:
        return [f"{obj['metadata']['name']}: {exc.message}"]
    return []


def all_problems(manifest: dict) -> list[str]:
    return check(manifest) + [p for pod in pod_templates(manifest) for p in k8s_problems(pod)]


def test_every_cluster_config_has_a_manifest():
    clusters = {p.stem for p in (ROOT / "cluster").glob("*.yaml")}
    assert clusters and clusters == {p.stem for p in RAYSERVICES}
    assert any("num_gpus" not in p.read_text() for p in RAYSERVICES)  # the CPU-only variant


@pytest.mark.parametrize("path", RAYSERVICES, ids=lambda p: p.stem)
def test_manifest_is_the_render_of_its_cluster_config(path, monkeypatch):
    """One source of truth: the manifest is what `specserve kuberay` makes of cluster/<name>.yaml today."""
    manifest = yaml.safe_load(path.read_text())
    command = manifest["metadata"]["annotations"]["specserve.io/rendered-with"]
    args = build_parser().parse_args(["kuberay", *shlex.split(command)])
    monkeypatch.chdir(ROOT)
    fresh = render_file(args.config, args.name, image=args.image, models_claim=args.models_claim,
                        worker_memory=args.worker_memory, shm=args.shm)
    assert fresh == path.read_text(), f"re-render: specserve kuberay {command} --out {path.relative_to(ROOT)}"
    source = yaml.safe_load((ROOT / args.config).read_text())
    source["http_options"]["host"] = "0.0.0.0"  # the pod's every interface, behind the serve Service
    assert yaml.safe_load(manifest["spec"]["serveConfigV2"]) == source
    for pod in pod_templates(manifest):  # each pod's key from the Secret, which must exist
        env = pod["template"]["spec"]["containers"][0]["env"]
        assert {"name": "SPECSERVE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "specserve-api-key",
                                                                            "key": "api-key"}}} in env


@pytest.mark.parametrize("path", RAYSERVICES, ids=lambda p: p.stem)
def test_rayservice_is_valid(path):
    manifest = yaml.safe_load(path.read_text())
    assert all_problems(manifest) == []
    head = manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    ports = {p["name"]: p["containerPort"] for p in head["containers"][0]["ports"]}
    assert ports["serve"] == 8000 and ports["grpc"] == 9000 and ports["metrics"] == 8080
    for pod in pod_templates(manifest):
        spec = pod["template"]["spec"]
        shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in spec["containers"][0]["volumeMounts"]
    for group in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        container = group["template"]["spec"]["containers"][0]
        assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}


def test_heterogeneous_manifest_places_draft_and_target_on_their_gpus():
    manifest = yaml.safe_load((ROOT / "deploy/kuberay/heterogeneous.yaml").read_text())
    groups = {g["groupName"]: g for g in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert set(groups) == {"l4", "h100"}
    limits = {name: g["template"]["spec"]["containers"][0]["resources"]["limits"] for name, g in groups.items()}
    assert limits["l4"]["nvidia.com/gpu"] == 1 and limits["h100"]["nvidia.com/gpu"] == 2
    assert groups["h100"]["template"]["metadata"]["labels"]["specserve.io/roles"] == "target"
    assert groups["l4"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L4"}


def test_tensor_parallel_manifest_gives_the_target_group_all_its_ranks_gpus_on_one_pod():
    manifest = yaml.safe_load((ROOT / "deploy/kuberay/tensor-parallel.yaml").read_text())
    groups = {g["groupName"]: g for g in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    limits = {name: g["template"]["spec"]["containers"][0]["resources"]["limits"] for name, g in groups.items()}
    assert limits["h100"]["nvidia.com/gpu"] == 4 and limits["l4"]["nvidia.com/gpu"] == 1
    assert groups["h100"]["template"]["metadata"]["labels"]["specserve.io/roles"] == "target-tp4"
    assert groups["h100"]["rayStartParams"]["num-cpus"] == "9"  # 4 ranks x 2 CPUs + the proxy


def test_models_claim_is_a_valid_standard_object():
    pvc = yaml.safe_load((ROOT / "deploy/kuberay/models-pvc.yaml").read_text())
    assert k8s_problems(pvc) == []
    for path in RAYSERVICES:
        volumes = pod_templates(yaml.safe_load(path.read_text()))[0]["template"]["spec"]["volumes"]
        claims = [v["persistentVolumeClaim"]["claimName"] for v in volumes if "persistentVolumeClaim" in v]
        assert claims in ([], [pvc["metadata"]["name"]])


def _break(manifest: dict, how: str) -> dict:
    broken = copy.deepcopy(manifest)
    cluster = broken["spec"]["rayClusterConfig"]
    worker = cluster["workerGroupSpecs"][0]
    container = worker["template"]["spec"]["containers"][0]
    if how == "port-as-string":
        container["ports"][0]["containerPort"] = "8000"
    elif how == "probe-without-handler":
        container["readinessProbe"] = {"periodSeconds": "often"}
    elif how == "no-containers":
        cluster["headGroupSpec"]["template"]["spec"]["containers"] = []
    elif how == "replicas-out-of-range":
        worker["replicas"] = 5
    elif how == "numeric-start-param":
        worker["rayStartParams"]["num-cpus"] = 4
    elif how == "no-serve-config":
        del broken["spec"]["serveConfigV2"]
    elif how == "bad-serve-config":
        broken["spec"]["serveConfigV2"] = broken["spec"]["serveConfigV2"].replace("gamma: auto", "gamma: -2")
    elif how == "unknown-app-arg":
        serve_config = yaml.safe_load(broken["spec"]["serveConfigV2"])
        serve_config["applications"][0]["args"]["gama"] = 4
        broken["spec"]["serveConfigV2"] = yaml.safe_dump(serve_config)
    elif how == "too-few-gpus":
        container["resources"]["limits"]["nvidia.com/gpu"] = 1
    elif how == "wrong-gpu-product":
        worker["template"]["spec"]["nodeSelector"] = {"nvidia.com/gpu.product": "NVIDIA-T4"}
    elif how == "group-missing":
        cluster["workerGroupSpecs"] = cluster["workerGroupSpecs"][1:]
    return broken


BROKEN = {  # how to break the manifest: what the problem report must mention
    "port-as-string": "is not of type 'integer'", "probe-without-handler": "is not of type 'integer'",
    "no-containers": "headGroupSpec.template.spec.containers", "replicas-out-of-range": "minReplicas",
    "numeric-start-param": "rayStartParams", "no-serve-config": "serveConfigV2",
    "bad-serve-config": "gamma", "unknown-app-arg": "gama", "too-few-gpus": "GPU(s) per pod",
    "wrong-gpu-product": "nvidia.com/gpu.product", "group-missing": "no group",
}


@pytest.mark.parametrize("how", list(BROKEN))
def test_a_broken_manifest_fails(how, tmp_path):
    """Deliberately broken copies of the heterogeneous manifest: each is caught, and names what is wrong."""
    manifest = yaml.safe_load((ROOT / "deploy/kuberay/heterogeneous.yaml").read_text())
    assert all_problems(manifest) == []
    broken = _break(manifest, how)
    copy_path = tmp_path / "broken.yaml"
    copy_path.write_text(yaml.safe_dump(broken))
    problems = all_problems(yaml.safe_load(copy_path.read_text()))
    assert problems and BROKEN[how] in " ".join(problems), problems


def test_a_nonstandard_kind_counts_as_a_failure():
    assert k8s_problems({"apiVersion": "v1", "kind": "Podd", "metadata": {"name": "x"}})


def test_dockerfile_installs_like_the_readme():
    dockerfile = (ROOT / "Dockerfile").read_text()
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), source
    assert "bash install.sh" in dockerfile
    assert "bash install.sh" in (ROOT / "README.md").read_text()
    assert "specserve:0.1.0" in dockerfile  # the tag the manifests use
    for code in re.findall(r'python3 -c "([^"]+)"', dockerfile):  # what the image runs at build time exists
        for module, names in re.findall(r"from ([\w.]+) import ([\w, ]+)", code):
            imported = importlib.import_module(module)
            assert all(hasattr(imported, name.strip()) for name in names.split(",")), code
    refused = subprocess.run(["bash", str(ROOT / "install.sh"), "--gpu"], capture_output=True, text=True)
    assert refused.returncode == 2 and "--cpu, --cuda" in refused.stderr  # an option it does not know: nothing runs


def test_grafana_dashboard_queries_only_exported_metrics():
    dashboard = json.loads((ROOT / "deploy/grafana/specserve.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    used = {name for e in exprs for name in re.findall(r"\bray_specserve_[a-z0-9_]+", e)}
    assert used and used <= exported_names(), used - exported_names()
    # every exported metric is on the dashboard
    assert {m.name for m in METRICS if any(s in used for s in m.series())} == {m.name for m in METRICS}
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for e in exprs:
        assert e.count("(") == e.count(")") and e.count("{") == e.count("}"), e
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("acceptance", "gamma", "tokens per second", "first token", "inter-token", "sessions"):
        assert topic in titles
