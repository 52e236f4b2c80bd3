"""Dockerfile, .dockerignore and deploy/docker-compose.yml, checked structurally: no Docker engine
runs on the CI machines, so nothing here builds or starts an image. The Dockerfile's stages, base
images, user, port, health check and commands are parsed and compared with what the server and
the Kubernetes manifests expect; the build context is worked out from .dockerignore."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from dspark_server.cli import build_parser
from dspark_server.config import ServerConfig
from dspark_server.server.app import create_app

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, instr: str) -> list[str]:
        return [a for i, a in self.instructions if i == instr]

    def last(self, instr: str) -> str:
        found = self.all(instr)
        assert found, f"stage {self.name} has no {instr}"
        return found[-1]


def parse_dockerfile(text: str) -> list[Stage]:
    lines: list[str] = []
    buf = ""
    for raw in text.splitlines():
        if not buf and (not raw.strip() or raw.lstrip().startswith("#")):
            continue
        if raw.rstrip().endswith("\\"):
            buf += raw.rstrip()[:-1] + " "
            continue
        lines.append(buf + raw)
        buf = ""
    assert not buf, "dangling line continuation"
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in lines:
        instr, _, rest = line.strip().partition(" ")
        instr, rest = instr.upper(), rest.strip()
        if instr == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name] = default
        elif instr == "FROM":
            image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], rest)
            parts = image.split()
            assert len(parts) == 3 and parts[1].upper() == "AS", f"name every stage: {line}"
            stages.append(Stage(parts[2], parts[0]))
        else:
            assert stages, f"{instr} before FROM"
            stages[-1].instructions.append((instr, rest))
    return stages


STAGES = {s.name: s for s in parse_dockerfile((ROOT / "Dockerfile").read_text())}


def _exec_form(stage: Stage, instr: str) -> list[str]:
    value = json.loads(stage.last(instr))
    assert isinstance(value, list) and all(isinstance(x, str) for x in value), f"{instr} in exec form"
    return value


def _routes() -> set[str]:
    return {getattr(r, "path", "") for r in create_app(None, ServerConfig(), "x").routes}


def test_stages_and_base_images() -> None:
    stages = parse_dockerfile((ROOT / "Dockerfile").read_text())
    assert [s.name for s in stages] == ["gpu", "cpu"]  # the last stage is what `docker build .` makes
    assert STAGES["cpu"].base == "python:3.11-slim"
    gpu = STAGES["gpu"].base
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-(cudnn-)?(devel|runtime)-ubuntu\d+\.\d+", gpu), gpu


@pytest.mark.parametrize("stage", ["cpu", "gpu"])
def test_stage_runs_dspark_serve_as_non_root(stage: str) -> None:
    s = STAGES[stage]
    # the package is installed with the stage's extra
    extra = {"cpu": "cpu", "gpu": "sglang"}[stage]
    assert any(re.search(rf"pip install .*'\.\[{extra}\]'", r) for r in s.all("RUN")), s.all("RUN")
    # a non-root user, created with the uid the Kubernetes pods run as, and switched to last
    user = s.last("USER")
    assert user not in {"root", "0"} and not user.startswith("0:")
    uid = re.search(rf"useradd .*--uid (\d+) {re.escape(user)}\b", " ".join(s.all("RUN")))
    assert uid, "the USER is created by useradd --uid"
    deployment = yaml.safe_load((DEPLOY / "k8s" / "base" / "deployment.yaml").read_text())
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == int(uid.group(1))
    kinds = [i for i, _ in s.instructions]
    assert kinds.index("USER") > max(i for i, k in enumerate(kinds) if k == "RUN"), "RUN after USER"
    assert s.last("EXPOSE").split() == ["8000"]
    # HEALTHCHECK polls /health on the exposed port
    hc = s.last("HEALTHCHECK")
    url = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", hc)
    assert url and url.group(1) == "8000" and url.group(2) == "/health" and "/health" in _routes()
    assert re.search(r"--start-period=\d+s", hc) and " CMD " in f" {hc} "
    # CMD: dspark serve on all interfaces, with flags the CLI accepts
    cmd = _exec_form(s, "CMD")
    assert cmd[:2] == ["dspark", "serve"]
    ns, unknown = build_parser().parse_known_args(cmd[1:])
    assert ns.host == "0.0.0.0" and ns.port == 8000
    if stage == "gpu":
        assert cmd[cmd.index("--backend") + 1] == "sglang"
        assert unknown in ([], ["--backend", "sglang"])  # issue H adds --backend to the CLI
    else:
        assert not unknown and "--backend" not in cmd


# ---- build context -----------------------------------------------------------------------------


def _ignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    out = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pat = line.lstrip("!").strip("/")
        glob = {"**": ".*", "*": "[^/]*", "?": "[^/]"}
        rx = "".join(glob.get(tok, re.escape(tok)) for tok in re.split(r"(\*\*|\*|\?)", pat))
        out.append((negate, re.compile(rx.replace(".*/", "(.*/)?"))))
    return out


def in_context(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; a matching directory covers its contents."""
    parts = path.split("/")
    included = True
    for negate, rx in _ignore_patterns():
        if any(rx.fullmatch("/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            included = negate
    return included


def test_build_context() -> None:
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    copied: list[str] = []
    for stage in STAGES.values():
        for arg in stage.all("COPY"):
            *sources, _dest = shlex.split(arg)
            copied += [s for s in sources if not s.startswith("--")]
    assert set(copied) == {"pyproject.toml", "README.md", "dspark_server", "profiles"}
    for src in copied:
        assert (ROOT / src).exists(), src
        assert in_context(src), f"{src} is COPY'd but excluded by .dockerignore"
        for f in files:
            if f.startswith(src + "/") and "__pycache__" not in f:
                assert in_context(f), f"{f} excluded from the image"
    # the bundled demo pair ships in the image, through the package data
    assert in_context("dspark_server/assets/demo/target/config.json")
    assert "assets/demo/*" in (ROOT / "pyproject.toml").read_text()
    for heavy in (
        ".git/HEAD",
        ".venv/bin/python",
        "work_data/x",
        "runs/x",
        "tests/test_engine.py",
        "dspark_server/__pycache__/cli.cpython-311.pyc",
        "dspark_server.egg-info/PKG-INFO",
    ):
        assert not in_context(heavy), heavy


# ---- docker compose ----------------------------------------------------------------------------


def test_compose_wires_server_prometheus_and_grafana() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"dspark", "prometheus", "grafana"}
    server = services["dspark"]
    context = (DEPLOY / server["build"]["context"]).resolve()
    assert context == ROOT and (context / server["build"]["dockerfile"]).is_file()
    assert server["build"]["target"] in STAGES
    ns = build_parser().parse_args(server["command"][1:])
    assert server["command"][:2] == ["dspark", "serve"] and ns.host == "0.0.0.0"
    assert f"{ns.port}:{ns.port}" in server["ports"]
    grace = int(server["stop_grace_period"].removesuffix("s"))
    assert ns.drain_timeout < grace

    def mounts(service: str) -> dict[str, Path]:
        out = {}
        for v in services[service]["volumes"]:
            src, dest = v.split(":")[:2]
            if src.startswith("."):
                assert (DEPLOY / src).exists(), src
                out[dest] = DEPLOY / src
        return out

    prom = services["prometheus"]
    prom_mounts = mounts("prometheus")
    config_arg = next(a for a in prom["command"] if a.startswith("--config.file="))
    config_path = Path(config_arg.split("=", 1)[1])
    config_file = prom_mounts[str(config_path.parent)] / config_path.name
    config = yaml.safe_load(config_file.read_text())
    (job,) = config["scrape_configs"]
    (static,) = job["static_configs"]
    assert static["targets"] == [f"dspark:{ns.port}"] and job["metrics_path"] in _routes()
    for pattern in config["rule_files"]:
        assert list(config_file.parent.glob(pattern)), pattern

    graf_mounts = mounts("grafana")
    prov = graf_mounts["/etc/grafana/provisioning"]
    (ds,) = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    assert "9090:9090" in prom["ports"]
    (provider,) = yaml.safe_load((prov / "dashboards" / "dspark.yml").read_text())["providers"]
    dash_dir = graf_mounts[provider["options"]["path"]]
    assert (dash_dir / "dspark.json").is_file()
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == provider["options"]["path"] + "/dspark.json"


def test_docs_say_docker_is_checked_structurally() -> None:
    text = (ROOT / "docs" / "deploy.md").read_text().lower()
    assert "no docker engine" in text and "checked structurally" in text
