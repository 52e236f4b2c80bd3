"""deploy/k8s: every manifest and both overlays validate offline against the Kubernetes schemas
(kubernetes-validate, strict), and the pieces are wired to each other and to the server: probes hit
routes the app has, the HPA scales the Deployment on a metric the adapter rule serves, the flags in
the ConfigMap are real `dspark serve` flags, and the grace period covers the drain.

Overlays are built here by a small kustomize subset (`build`): `resources` (files and
directories), `patches` with a `path` (strategic-merge patches, located by kind and name) and
`images`. It refuses any other kustomization field, so the overlays cannot silently use a feature
it lacks. Where a real kustomize is on PATH (`kubectl kustomize`, or `kustomize build`), its output
must equal ours object for object; this machine image ships kubectl, so CI compares the two.
"""

from __future__ import annotations

import copy
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from dspark_server.cli import build_parser
from dspark_server.config import ServerConfig
from dspark_server.server.app import create_app

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
BASE = K8S / "base"
OVERLAYS = {name: K8S / "overlays" / name for name in ("cpu", "gpu")}
ADAPTER_VALUES = K8S / "prometheus-adapter" / "values.yaml"
K8S_VERSIONS = ("1.29", "1.37")  # oldest and newest supported minor we validate against
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}  # Prometheus Operator CRDs: no upstream schema

Obj = dict[str, Any]
Overlay = tuple[str, dict[tuple[str, str], Obj]]  # (name, objects by (kind, name))


# ---- a minimal kustomize ------------------------------------------------------------------------

# Strategic-merge keys of the lists our patches touch (from the Kubernetes OpenAPI
# x-kubernetes-patch-merge-key); every other list is replaced, as kustomize does.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "env": "name",
    "imagePullSecrets": "name",
}


def _merge_key(field: str, items: list[Any]) -> str | None:
    if field == "ports" and items and isinstance(items[0], dict):
        return "containerPort" if "containerPort" in items[0] else "port"
    return MERGE_KEYS.get(field)


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        assert not any(k.startswith("$") for k in patch), f"unsupported directive in {patch}"
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = strategic_merge(out[k], v, k)
            else:
                out[k] = copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list):
        key = _merge_key(field, base)
        if key is None or not all(isinstance(x, dict) and key in x for x in base + patch):
            return copy.deepcopy(patch)
        # kustomize (kyaml) lists the patch's items first, in patch order, then the base's others
        by_key = {x[key]: x for x in base}
        out = [strategic_merge(by_key[i[key]], i) if i[key] in by_key else copy.deepcopy(i) for i in patch]
        return out + [copy.deepcopy(x) for x in base if x[key] not in {i[key] for i in patch}]
    return copy.deepcopy(patch)


def load_docs(path: Path) -> list[Obj]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _ident(obj: Obj) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def _set_images(obj: Obj, images: list[Obj]) -> None:
    pod = obj.get("spec", {}).get("template", {}).get("spec", {})
    for c in pod.get("containers", []) + pod.get("initContainers", []):
        name = re.split(r"[:@]", c["image"], maxsplit=1)[0]
        for img in images:
            assert set(img) <= {"name", "newName", "newTag"}, img
            if img["name"] == name:
                tag = img.get("newTag") or (c["image"].split(":", 1)[1] if ":" in c["image"] else "")
                c["image"] = img.get("newName", name) + (f":{tag}" if tag else "")


def build(directory: Path) -> list[Obj]:
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unsupported = set(k) - {"apiVersion", "kind", "resources", "patches", "images"}
    assert not unsupported, f"{directory}: kustomization fields this test cannot build: {unsupported}"
    assert k.get("kind", "Kustomization") == "Kustomization"
    objs: list[Obj] = []
    for res in k.get("resources", []):
        path = (directory / res).resolve()
        objs += build(path) if path.is_dir() else load_docs(path)
    for patch in k.get("patches", []):
        assert set(patch) == {"path"}, f"only `path` patches are supported: {patch}"
        for doc in load_docs(directory / patch["path"]):
            hits = [i for i, o in enumerate(objs) if _ident(o) == _ident(doc)]
            assert len(hits) == 1, f"patch {patch['path']} matches {len(hits)} objects"
            objs[hits[0]] = strategic_merge(objs[hits[0]], doc)
    for obj in objs:
        _set_images(obj, k.get("images", []))
    idents = [_ident(o) for o in objs]
    assert len(idents) == len(set(idents)), f"duplicate objects in {directory}"
    return objs


def _real_kustomize() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def by_ident(objs: list[Obj]) -> dict[tuple[str, str], Obj]:
    return {_ident(o): o for o in objs}


@pytest.fixture(scope="module", params=sorted(OVERLAYS))
def overlay(request: pytest.FixtureRequest) -> Overlay:
    return request.param, by_ident(build(OVERLAYS[request.param]))


# ---- schema validation -------------------------------------------------------------------------


def _validate(obj: Obj, where: str) -> None:
    if obj["kind"] in CRD_KINDS:
        _check_crd(obj, where)
        return
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            raise AssertionError(
                f"{where}: {obj['kind']}/{obj['metadata']['name']} invalid for "
                f"Kubernetes {version}: {path}: {e.message}"
            ) from None


def _check_crd(obj: Obj, where: str) -> None:
    """The Prometheus Operator kinds have no schema in kubernetes-validate: check the fields we use."""
    assert obj["apiVersion"] == "monitoring.coreos.com/v1", where
    assert set(obj) == {"apiVersion", "kind", "metadata", "spec"}, where
    spec = obj["spec"]
    if obj["kind"] == "ServiceMonitor":
        assert set(spec) <= {
            "selector",
            "endpoints",
            "namespaceSelector",
            "jobLabel",
            "targetLabels",
            "podTargetLabels",
        }, where
        assert spec["selector"]["matchLabels"] and spec["endpoints"], where
        for ep in spec["endpoints"]:
            assert set(ep) <= {
                "port",
                "path",
                "interval",
                "scrapeTimeout",
                "relabelings",
                "scheme",
                "honorLabels",
                "metricRelabelings",
            }, (where, ep)
            for field in ("interval", "scrapeTimeout"):
                assert re.fullmatch(r"\d+(ms|s|m|h)", ep[field]), (where, field)
            for r in ep.get("relabelings", []):
                assert set(r) <= {"sourceLabels", "targetLabel", "regex", "replacement", "action"}, r
    else:
        for group in spec["groups"]:
            assert set(group) <= {"name", "interval", "rules"}, where
            for rule in group["rules"]:
                assert set(rule) <= {"record", "expr", "labels"} and rule["record"] and rule["expr"], rule


def test_schema_validation_is_strict() -> None:
    """A misspelt field must fail, or the validations below prove nothing."""
    dep = next(o for o in load_docs(BASE / "deployment.yaml") if o["kind"] == "Deployment")
    bad = copy.deepcopy(dep)
    bad["spec"]["template"]["spec"]["containers"][0]["livenessProb"] = {}
    with pytest.raises(AssertionError, match="livenessProb"):
        _validate(bad, "typo")
    bad = copy.deepcopy(dep)
    bad["spec"]["replicas"] = "one"
    with pytest.raises(AssertionError):
        _validate(bad, "type")


def test_base_manifests_validate() -> None:
    files = yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"]
    assert sorted(files) == sorted(p.name for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml")
    kinds = set()
    for name in files:
        for obj in load_docs(BASE / name):
            _validate(obj, f"base/{name}")
            kinds.add(obj["kind"])
    assert kinds == {
        "ConfigMap",
        "PersistentVolumeClaim",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "ServiceMonitor",
        "PrometheusRule",
    }


def test_overlay_output_validates(overlay: Overlay) -> None:
    name, objs = overlay
    for obj in objs.values():
        _validate(obj, f"overlays/{name}")


def test_overlay_patches_are_partial_objects_of_the_base() -> None:
    base = by_ident(build(BASE))
    for name, directory in OVERLAYS.items():
        k = yaml.safe_load((directory / "kustomization.yaml").read_text())
        for patch in k["patches"]:
            for doc in load_docs(directory / patch["path"]):
                assert _ident(doc) in base, f"{name}/{patch['path']} patches nothing"
                assert doc["apiVersion"] == base[_ident(doc)]["apiVersion"]


@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_overlay_build_equals_real_kustomize(name: str) -> None:
    cmd = _real_kustomize()
    if cmd is None:
        pytest.skip("no kustomize or kubectl on PATH: overlays are built by the test's own merge only")
    out = subprocess.run([*cmd, str(OVERLAYS[name])], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    theirs = by_ident([d for d in yaml.safe_load_all(out.stdout) if d])
    ours = by_ident(build(OVERLAYS[name]))
    assert sorted(theirs) == sorted(ours)
    for ident, obj in ours.items():
        assert theirs[ident] == obj, f"{name}: {ident} differs from {' '.join(cmd)}"


# ---- wiring ------------------------------------------------------------------------------------


def _one(objs: dict[tuple[str, str], Obj], kind: str) -> Obj:
    found = [o for (k, _), o in objs.items() if k == kind]
    assert len(found) == 1, f"{len(found)} {kind} objects"
    return found[0]


def _server_routes() -> set[str]:
    app = create_app(None, ServerConfig(), "x")
    return {getattr(r, "path", "") for r in app.routes}


def _serve_args(objs: dict[tuple[str, str], Obj]) -> list[str]:
    cm = _one(objs, "ConfigMap")
    return shlex.split(cm["data"]["DSPARK_SERVE_ARGS"])


def _sglang_doc_flags() -> set[str]:
    """Flags that docs/sglang.md documents for `dspark serve --backend sglang` (issue H's CLI)."""
    text = (ROOT / "docs" / "sglang.md").read_text()
    return {"--backend", *re.findall(r"^\| `(--[a-z-]+)", text, flags=re.M)}


def test_probes_hit_real_routes(overlay: Overlay) -> None:
    name, objs = overlay
    routes = _server_routes()
    assert {"/health", "/ready", "/metrics"} <= routes
    dep = _one(objs, "Deployment")
    pod = dep["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000}
    expected = {"startupProbe": "/ready", "readinessProbe": "/ready", "livenessProbe": "/health"}
    for probe, path in expected.items():
        get = c[probe]["httpGet"]
        assert get["path"] == path and get["path"] in routes, (name, probe)
        assert get["port"] in ports or get["port"] == 8000, (name, probe)
    # load-time-aware: the startup budget covers a model load (GPU: weights + CUDA graphs)
    budget = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
    assert budget >= (600 if name == "gpu" else 120), (name, budget)
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 30
    # Prometheus annotations point at the metrics route and port
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert ann["prometheus.io/path"] in routes and int(ann["prometheus.io/port"]) == 8000


def test_volumes_and_service(overlay: Overlay) -> None:
    name, objs = overlay
    dep = _one(objs, "Deployment")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    spec = dep["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    pvc = _one(objs, "PersistentVolumeClaim")
    models = volumes[mounts["/models"]["name"]]
    assert models["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert mounts["/models"]["readOnly"] is True
    shm = volumes[mounts["/dev/shm"]["name"]]
    assert shm["emptyDir"]["medium"] == "Memory"
    svc = _one(objs, "Service")
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    (sp,) = svc["spec"]["ports"]
    assert sp["targetPort"] in {p["name"] for p in c["ports"]}
    pdb = _one(objs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    sm = _one(objs, "ServiceMonitor")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] == sp["name"] and ep["path"] == "/metrics"
    # the `model` label comes from a pod label that the pods really carry
    (relabel,) = ep["relabelings"]
    assert relabel["targetLabel"] == "model"
    meta = {"__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", k) for k in pod_labels}
    assert relabel["sourceLabels"][0] in meta
    # GPU only in the gpu overlay
    gpus = {k: v for k, v in c["resources"].get("limits", {}).items() if k == "nvidia.com/gpu"}
    assert (gpus == {"nvidia.com/gpu": "1"}) == (name == "gpu")
    assert c["image"] == f"dspark-server:{name}"
    if name == "gpu":
        assert shm["emptyDir"]["sizeLimit"].endswith("Gi") and int(shm["emptyDir"]["sizeLimit"][:-2]) >= 8


def test_hpa_scales_the_deployment_on_the_adapter_metric(overlay: Overlay) -> None:
    _, objs = overlay
    hpa, dep = _one(objs, "HorizontalPodAutoscaler"), _one(objs, "Deployment")
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == (
        dep["apiVersion"],
        "Deployment",
        dep["metadata"]["name"],
    )
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    assert name == "dspark_num_requests_waiting"
    assert f"`{name}`" in (ROOT / "docs" / "metrics.md").read_text()
    (rule,) = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    assert rule["name"]["as"] == name and re.fullmatch(rule["name"]["matches"], name)
    assert rule["seriesQuery"].startswith(name + "{")
    assert rule["resources"]["overrides"] == {
        "namespace": {"resource": "namespace"},
        "pod": {"resource": "pod"},
    }
    for token in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
        assert token in rule["metricsQuery"]


def test_flags_and_grace_period(overlay: Overlay) -> None:
    name, objs = overlay
    dep = _one(objs, "Deployment")
    spec = dep["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    cm = _one(objs, "ConfigMap")
    assert {"configMapRef": {"name": cm["metadata"]["name"]}} in c["envFrom"]
    assert c["command"] == ["/bin/sh", "-c"]
    (script,) = c["args"]
    assert script.startswith("exec dspark serve ") and script.endswith("$DSPARK_SERVE_ARGS")
    fixed = shlex.split(script.removeprefix("exec ").removesuffix("$DSPARK_SERVE_ARGS"))
    args = [*fixed[1:], *_serve_args(objs)]
    ns, unknown = build_parser().parse_known_args(args)
    assert ns.command == "serve" and ns.host == "0.0.0.0" and ns.port == 8000
    if name == "gpu":
        assert args[args.index("--backend") + 1] == "sglang"
        # flags of the SGLang backend that this checkout's CLI may not have yet must be documented
        assert set(a for a in unknown if a.startswith("--")) <= _sglang_doc_flags(), unknown
        assert all(a.startswith("--") or args[args.index(a) - 1].startswith("--") for a in unknown)
    else:
        assert not unknown and "--backend" not in args
    # SIGTERM comes after the preStop sleep; the drain must then fit in the grace period
    pre = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre[0] == "sleep"
    grace = spec["terminationGracePeriodSeconds"]
    assert int(pre[1]) + ns.drain_timeout + 5 <= grace <= int(pre[1]) + ns.drain_timeout + 30, (
        name,
        grace,
        ns.drain_timeout,
    )
