"""deploy/prometheus and deploy/grafana against a real Prometheus (Debian's `prometheus` package,
installed by .ci/run) scraping a real `dspark serve` (tiny target + tiny drafter, --spec-mode
dspark) under a short load through the openai client:

* `promtool check config` / `check rules` pass on the shipped files;
* Prometheus runs the shipped scrape jobs (the compose job, and the Kubernetes pod-annotation job
  with its service discovery swapped for a file listing the pod's labels and annotations as
  Kubernetes would report them) and the shipped recording rules, at 1 s intervals;
* every PromQL expression of the dashboard (Grafana variables replaced by concrete values), every
  recording rule, and the prometheus-adapter rule behind the HPA parse and return data.

The dashboard's structure (datasources, queries, the panels it must have) is checked without
Prometheus. Grafana itself does not run here.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from conftest import free_port
from test_api_support import LoggedServer, wait_idle

from dspark_server.testing.tiny import build_tiny_drafter, build_tiny_model, write_flat_sps_profile

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
PROM_DIR = DEPLOY / "prometheus"
RULES = PROM_DIR / "rules" / "dspark.rules.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "dspark.json"
ADAPTER_VALUES = DEPLOY / "k8s" / "prometheus-adapter" / "values.yaml"
MODEL = "demo"  # the `model` label both shipped scrape jobs give the series
NAMESPACE, POD = "default", "dspark-server-0"
# Grafana's variables, as the dashboard would fill them in for this one server
WINDOWS = {"$__rate_interval": "1m", "$__range": "5m", "$__interval": "5s"}

REQUIRED_PANELS = {  # what the dashboard must show -> words its panel titles must contain
    "output TPS over time": "output tokens/s",
    "output TPS vs concurrency": "output tps vs concurrency",
    "TPS by running-request count": "output tps by running-request count",
    "acceptance length mean": "acceptance length (mean",
    "acceptance length distribution": "acceptance length distribution",
    "verification budget per step": "verification budget: tokens admitted per step",
    "verification budget per request": "verification budget: verified drafts per request",
    "per-position acceptance": "per-position acceptance",
    "predicted vs realised acceptance": "predicted vs realised acceptance",
    "live SPS curve": "live sps curve",
    "TTFT": "time to first token",
    "ITL": "inter-token latency",
    "end-to-end latency": "end-to-end request latency",
    "queue depth": "queue depth",
    "KV usage": "kv cache usage",
    "error rates": "error rates",
}


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"`{name}` not found: install Debian's prometheus package (apt-get install -y "
            "prometheus), as .ci/run does"
        )
    return path


# ---- the dashboard, without Prometheus ----------------------------------------------------------


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dash["panels"]:
        out += [p, *p.get("panels", [])]
    return [p for p in out if p["type"] != "row"]


def test_generated_files_are_current() -> None:
    spec = importlib.util.spec_from_file_location("deploy_generate", DEPLOY / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--check"]) == 0, "run `python deploy/generate.py`"


def test_dashboard_structure() -> None:
    dash = _dashboard()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("instance", "model"):
        assert variables[name]["type"] == "query" and variables[name]["includeAll"]
    panels = _panels(dash)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["refId"], p["title"]
            assert t.get("datasource", p["datasource"]) == p["datasource"]
            # every query follows the dashboard's instance and model selection
            assert "$instance" in t["expr"] and "$model" in t["expr"], (p["title"], t["expr"])
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["h"] > 0
    titles = [p["title"].lower() for p in panels]
    missing = [what for what, words in REQUIRED_PANELS.items() if not any(words in t for t in titles)]
    assert not missing, f"no panel for: {missing}"
    # TPS against concurrency, not only against time: an XY chart with running requests on x
    xy = [p for p in panels if p["type"] == "xychart" and "concurrency" in p["title"].lower()]
    assert xy and "running" in xy[0]["options"]["dims"]["x"]
    assert any("dspark_num_requests_running" in t["expr"] for t in xy[0]["targets"])
    sps = next(p for p in panels if "sps curve" in p["title"].lower())
    assert sps["type"] == "xychart" and sps["options"]["dims"]["x"] == "batch_tokens"
    # the distribution of acceptance lengths comes from the histogram's buckets
    dist = [p for p in panels if "acceptance length distribution" in p["title"].lower()]
    assert all(
        "dspark_spec_accept_length_bucket" in t["expr"] and t["format"] == "heatmap"
        for p in dist
        for t in p["targets"]
    )


def test_metric_names_are_documented() -> None:
    """Every dspark_* name in the dashboard, rules and adapter rule is a family of docs/metrics.md
    (histograms with their _bucket/_sum/_count series)."""
    doc = (ROOT / "docs" / "metrics.md").read_text()
    families = set(re.findall(r"^\| `(dspark_\w+)`", doc, flags=re.M))
    assert len(families) > 40
    text = DASHBOARD.read_text() + RULES.read_text() + ADAPTER_VALUES.read_text()
    used = set(re.findall(r"(?<![:\w])(dspark_[a-z0-9_]+)", text))
    unknown = {
        n for n in used if n not in families and re.sub(r"_(bucket|sum|count)$", "", n) not in families
    }
    assert not unknown, unknown


# ---- promtool --------------------------------------------------------------------------------------


def _k8s_config_for_this_host(targets_file: Path) -> dict[str, Any]:
    """deploy/prometheus/prometheus-kubernetes.yml with kubernetes_sd_configs (compiled out of
    Debian's Prometheus) replaced by a file_sd list."""
    cfg = yaml.safe_load((PROM_DIR / "prometheus-kubernetes.yml").read_text())
    (job,) = cfg["scrape_configs"]
    assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
    job["file_sd_configs"] = [{"files": [str(targets_file)]}]
    return cfg


def test_promtool_checks(tmp_path: Path) -> None:
    promtool = _tool("promtool")
    # the compose config (with its rule_files, resolved next to it)
    out = subprocess.run(
        [promtool, "check", "config", "prometheus.yml"],
        cwd=PROM_DIR,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout
    # the Kubernetes config
    cfg = _k8s_config_for_this_host(tmp_path / "targets.json")
    cfg["rule_files"] = [str(PROM_DIR / p) for p in cfg["rule_files"]]
    (tmp_path / "targets.json").write_text("[]")
    (tmp_path / "k8s.yml").write_text(yaml.safe_dump(cfg))
    out = subprocess.run(
        [promtool, "check", "config", str(tmp_path / "k8s.yml")], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # the rules, and the Prometheus Operator copy of them
    rule = yaml.safe_load((DEPLOY / "k8s" / "base" / "prometheusrule.yaml").read_text())
    (tmp_path / "operator.rules.yml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    out = subprocess.run(
        [promtool, "check", "rules", str(RULES), str(tmp_path / "operator.rules.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    n = sum(len(g["rules"]) for g in yaml.safe_load(RULES.read_text())["groups"])
    assert out.stdout.count(f"SUCCESS: {n} rules found") == 2


# ---- a real Prometheus scraping a real server -------------------------------------------------------


def _pod_meta(port: int) -> dict[str, str]:
    """Kubernetes service-discovery labels of a pod of deploy/k8s/base/deployment.yaml."""
    dep = yaml.safe_load((DEPLOY / "k8s" / "base" / "deployment.yaml").read_text())
    meta = dep["spec"]["template"]["metadata"]
    labels = {"__meta_kubernetes_namespace": NAMESPACE, "__meta_kubernetes_pod_name": POD}
    for kind, items in (("label", meta["labels"]), ("annotation", meta["annotations"])):
        for k, v in items.items():
            labels[f"__meta_kubernetes_pod_{kind}_" + re.sub(r"[^a-zA-Z0-9_]", "_", k)] = v
    labels["__meta_kubernetes_pod_annotation_prometheus_io_port"] = str(port)  # the test's port
    return labels


class Prometheus:
    def __init__(self, tmp: Path, server_port: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        compose = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
        (job,) = compose["scrape_configs"]
        (static,) = job["static_configs"]
        static["targets"] = [f"127.0.0.1:{server_port}"]
        targets = tmp / "k8s-targets.json"
        targets.write_text(json.dumps([{"targets": ["127.0.0.1:1"], "labels": _pod_meta(server_port)}]))
        k8s = _k8s_config_for_this_host(targets)
        cfg = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [job, *k8s["scrape_configs"]],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        self.log_path = tmp / "prometheus.log"
        self._log = self.log_path.open("w")
        self.client = httpx.Client(base_url=self.url, timeout=10)
        self.proc = subprocess.Popen(
            [
                _tool("prometheus"),
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited:\n{self.log()}")
            try:
                if self.client.get("/-/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"prometheus not ready:\n{self.log()}")

    def query(self, expr: str) -> list[dict[str, Any]]:
        body = self.client.get("/api/v1/query", params={"query": expr}).json()
        assert body["status"] == "success", f"{expr}\n-> {body.get('errorType')}: {body.get('error')}"
        return body["data"]["result"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.client.close()
        self._log.close()


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Prometheus, LoggedServer]]:
    root = tmp_path_factory.mktemp("deploy_monitoring")
    # as in tests/test_metrics.py: a small vocabulary so random drafts are sometimes accepted, and
    # a flat SPS profile so the server does not profile at start-up; no draft gate, which would
    # switch the random drafter off and leave the speculative panels empty
    target = build_tiny_model(root / "target", layers=2, with_eos=False, seed=5, vocab_size=24)
    draft = build_tiny_drafter(target, root / "draft", gamma=4, seed=6)
    profile = write_flat_sps_profile(root / "sps.json")
    server = LoggedServer(
        [
            "--model",
            str(target),
            "--draft",
            str(draft),
            "--spec-mode",
            "dspark",
            "--no-draft-gate",
            "--profile",
            str(profile),
            "--max-model-len",
            "256",
            "--max-running",
            "3",
            "--served-model-name",
            MODEL,
        ]
    )
    (root / "prom").mkdir()
    prom: Prometheus | None = None
    try:
        # Prometheus starts while the server loads; its service discovery hands targets to the
        # scrapers only after a few seconds, so wait for the first good scrapes before the load
        prom = Prometheus(root / "prom", server.port)
        prom.wait_ready()
        server.wait_ready()
        for job in ("dspark", "dspark-server"):
            _wait_for_data(prom, f'up{{job="{job}"}} == 1', 20)
        _load(server)
        yield prom, server
    finally:
        if prom is not None:
            prom.stop()
        print(server.stop()[-3000:])


def _load(server: LoggedServer) -> None:
    """A few seconds of mixed traffic: concurrent completions (more than --max-running, so some
    wait), a streamed one, and two client errors (token ids only: the tiny model's vocabulary is
    smaller than its tokenizer's)."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60)
    # first, alone: two tokens, the second from a decoding step that may verify no draft (one token
    # left), so the panel of steps without a verified draft has a series from the start (in the
    # traffic below such a step is a coincidence of the batching: a CI run once had none)
    client.completions.create(model=MODEL, prompt=[4, 5, 6], max_tokens=2)
    started = time.monotonic()

    def one(i: int) -> None:
        client.completions.create(
            model=MODEL,
            prompt=[5 + i % 7, 6, 7, 8],
            max_tokens=24 + 6 * (i % 4),
            temperature=0 if i % 2 else 0.8,
            seed=i,
        )

    with ThreadPoolExecutor(max_workers=6) as pool:
        rounds = 0
        while rounds < 2 or (time.monotonic() - started < 5.0 and rounds < 6):
            list(pool.map(one, range(rounds * 6, rounds * 6 + 6)))
            rounds += 1
    for _ in client.completions.create(model=MODEL, prompt=[4, 5, 6], max_tokens=20, stream=True):
        pass
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=-1)
    assert httpx.get(f"{server.base_url}/v1/no-such-route", timeout=5).status_code == 404
    wait_idle(server.base_url)


def _concrete(expr: str, instance: str) -> str:
    for var, value in WINDOWS.items():
        expr = expr.replace(var, value)
    expr = expr.replace("$instance", instance).replace("$model", MODEL)
    assert "$" not in expr, f"unreplaced Grafana variable in {expr}"
    return expr


def _wait_for_data(prom: Prometheus, expr: str, timeout: float) -> list[dict[str, Any]]:
    """Query until the expression returns samples (rules need a couple of evaluations)."""
    deadline = time.monotonic() + timeout
    while True:
        result = prom.query(expr)  # a parse error fails at once
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.5)


def test_every_dashboard_query_returns_data(loaded: tuple[Prometheus, LoggedServer]) -> None:
    prom, server = loaded
    instance = f"127.0.0.1:{server.port}"
    dash = _dashboard()
    exprs = [(p["title"], t["expr"]) for p in _panels(dash) for t in p["targets"]]
    # the template variables' label_values(selector, label) queries
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", v["definition"])
            assert m, v["definition"]
            result = _wait_for_data(prom, _concrete(m.group(1), instance), 15)
            assert any(s["metric"].get(m.group(2)) for s in result), v["name"]
    empty = []
    for title, expr in exprs:
        if not _wait_for_data(prom, _concrete(expr, instance), 10):
            empty.append(f"{title}: {expr}")
    assert not empty, "queries without data:\n" + "\n".join(empty)


def test_every_recording_rule_returns_data(loaded: tuple[Prometheus, LoggedServer]) -> None:
    prom, _ = loaded
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    empty = [r["expr"] for r in rules if not _wait_for_data(prom, r["expr"], 30)]
    assert not empty, "rule expressions without data:\n" + "\n".join(empty)
    # and Prometheus evaluated them: every recorded series exists, for both scrape jobs
    for record in sorted({r["record"] for r in rules}):
        # a series per scrape job; a job whose scrapes timed out under load catches up a little later
        deadline = time.monotonic() + 30
        result = _wait_for_data(prom, record, 30)
        while {s["metric"]["job"] for s in result} != {
            "dspark",
            "dspark-server",
        } and time.monotonic() < deadline:
            time.sleep(0.5)
            result = prom.query(record)
        assert {s["metric"]["job"] for s in result} == {"dspark", "dspark-server"}, (record, result)
    # TPS by running-request count: labelled with a concurrency the server really ran at
    by_running = prom.query("dspark:output_tokens_per_second:by_running")
    assert all(0 <= int(s["metric"]["running"]) <= 3 for s in by_running)
    assert any(float(s["value"][1]) > 0 for s in prom.query("dspark:output_tokens_per_second:rate1m"))
    accept = [float(s["value"][1]) for s in prom.query("dspark:spec_accept_length:mean1m")]
    assert accept and all(1.0 <= a <= 5.0 for a in accept)  # between 1 and gamma + 1


def test_kubernetes_scrape_job_labels(loaded: tuple[Prometheus, LoggedServer]) -> None:
    """The pod-annotation job finds the port and path and sets namespace, pod and model."""
    prom, server = loaded
    result = _wait_for_data(prom, 'up{job="dspark-server"}', 10)
    assert [s["metric"] for s in result] == [
        {
            "__name__": "up",
            "job": "dspark-server",
            "instance": f"127.0.0.1:{server.port}",
            "namespace": NAMESPACE,
            "pod": POD,
            "model": MODEL,
        }
    ]
    assert result[0]["value"][1] == "1"
    up = prom.query('up{job="dspark"}')
    assert [s["value"][1] for s in up] == ["1"] and up[0]["metric"]["model"] == MODEL


def test_prometheus_adapter_rule_returns_data(loaded: tuple[Prometheus, LoggedServer]) -> None:
    prom, _ = loaded
    (rule,) = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    series = _wait_for_data(prom, rule["seriesQuery"], 10)
    assert {(s["metric"]["namespace"], s["metric"]["pod"]) for s in series} == {(NAMESPACE, POD)}
    # what the adapter sends for `kubectl get --raw .../namespaces/default/pods/*/dspark_num_requests_waiting`
    query = (
        rule["metricsQuery"]
        .replace("<<.Series>>", rule["name"]["as"])
        .replace("<<.LabelMatchers>>", f'namespace="{NAMESPACE}",pod=~"{POD}"')
        .replace("<<.GroupBy>>", "pod")
    )
    result = _wait_for_data(prom, query, 10)
    assert [s["metric"] for s in result] == [{"pod": POD}]
    assert float(result[0]["value"][1]) >= 0
