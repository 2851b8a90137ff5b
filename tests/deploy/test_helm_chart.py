"""The Helm chart: lint, render, strict Kubernetes schema validation, and what users rely on."""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

if TYPE_CHECKING:
    from conftest import ChartUnderTest

Manifest = dict[str, Any]

KUBE_VERSION = "1.32.0"
RELEASE = "demo"
VALUES_FILES = ["required", "all", "existing-secrets"]
GATEWAY = f"{RELEASE}-sluicegate-gateway"
ENGINE = f"{RELEASE}-sluicegate-engine-llama-3-1-8b"
CPU_ENGINE = f"{RELEASE}-sluicegate-engine-qwen3-small"
MIGRATE = f"{RELEASE}-sluicegate-migrate"
# Prometheus Operator kinds: no schema ships with kubernetes-validate.
OPERATOR_KINDS = {("monitoring.coreos.com/v1", "PodMonitor")}
SECRET_ENV = ("SLUICEGATE_MASTER_KEY", "SLUICEGATE_DATABASE_URL", "SLUICEGATE_REDIS_URL")


def find(manifests: list[Manifest], kind: str, name: str | None = None) -> list[Manifest]:
    return [m for m in manifests if m["kind"] == kind and name in (None, m["metadata"]["name"])]


def one(manifests: list[Manifest], kind: str, name: str) -> Manifest:
    found = find(manifests, kind, name)
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def pod_spec(workload: Manifest) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def containers(workload: Manifest) -> list[dict[str, Any]]:
    spec = pod_spec(workload)
    return [*spec.get("initContainers", []), *spec["containers"]]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {var["name"]: var for var in container.get("env", [])}


def workloads(manifests: list[Manifest]) -> list[Manifest]:
    return [m for m in manifests if m["kind"] in {"Deployment", "StatefulSet", "Job"}]


def secret_data(secret: Manifest) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_lint_reports_no_warning_or_error(values_file: str, chart: ChartUnderTest) -> None:
    report = helm.lint(
        chart.directory, chart.ci_values(values_file), strict=True, kube_version=f"v{KUBE_VERSION}"
    )
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_every_manifest_validates_against_kubernetes_schemas(
    values_file: str, chart: ChartUnderTest
) -> None:
    manifests = chart.render(chart.ci_values(values_file))
    assert manifests
    for manifest in manifests:
        if (manifest["apiVersion"], manifest["kind"]) in OPERATOR_KINDS:
            continue  # not a Kubernetes kind: test_pod_monitor_* checks it
        # Strict: unknown fields fail; a kind without a schema raises instead of passing.
        kubernetes_validate.validate(manifest, KUBE_VERSION, strict=True)


def test_all_values_render_every_optional_resource(all_manifests: list[Manifest]) -> None:
    kinds = {(m["kind"], m["metadata"]["name"]) for m in all_manifests}
    for expected in [
        ("Ingress", GATEWAY),
        ("HorizontalPodAutoscaler", GATEWAY),
        ("PodDisruptionBudget", GATEWAY),
        ("Deployment", ENGINE),
        ("Deployment", CPU_ENGINE),
        ("StatefulSet", f"{RELEASE}-sluicegate-postgresql"),
        ("StatefulSet", f"{RELEASE}-sluicegate-redis"),
        ("ConfigMap", f"{RELEASE}-sluicegate-dashboard"),
        ("Secret", f"{RELEASE}-sluicegate-upstream"),
    ]:
        assert expected in kinds
    # With an HPA the Deployment leaves replicas to it.
    assert "replicas" not in one(all_manifests, "Deployment", GATEWAY)["spec"]


MASTER_KEY = {"masterKey": {"value": "sk-admin"}}
DATABASE = {"database": {"url": "postgresql+asyncpg://sluicegate:pw@db:5432/sluicegate"}}
REDIS = {"redis": {"url": "redis://redis:6379/0"}}


@pytest.mark.parametrize(
    ("values", "missing"),
    [
        ({**DATABASE, **REDIS}, "masterKey"),
        ({**MASTER_KEY, **REDIS}, "database"),
        ({**MASTER_KEY, **DATABASE}, "redis"),
        ({**MASTER_KEY, **REDIS, "postgresql": {"enabled": True}}, "postgresql.auth.password"),
    ],
)
def test_chart_refuses_to_render_without_values_a_user_must_set(
    values: dict[str, Any], missing: str, chart: ChartUnderTest
) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(f"{missing}: set")):
        chart.render_files(values)


def test_gpu_requests_land_on_engine_pods_only(
    required_manifests: list[Manifest], all_manifests: list[Manifest]
) -> None:
    def gpus(workload: Manifest) -> tuple[Any, Any]:
        resources = pod_spec(workload)["containers"][0]["resources"]
        return (
            resources.get("requests", {}).get("nvidia.com/gpu"),
            resources.get("limits", {}).get("nvidia.com/gpu"),
        )

    assert gpus(one(required_manifests, "Deployment", ENGINE)) == (1, 1)
    assert gpus(one(all_manifests, "Deployment", ENGINE)) == (2, 2)
    # Two GPUs in one pod: the worker splits the model over them; one GPU, no flag.
    assert (
        "--tensor-parallel-size"
        not in pod_spec(one(required_manifests, "Deployment", ENGINE))["containers"][0]["args"]
    )
    # An entry asking for 0 GPUs runs on the CPU, with no GPU request at all.
    assert gpus(one(all_manifests, "Deployment", CPU_ENGINE)) == (None, None)
    for workload in workloads(all_manifests):
        if workload["metadata"]["name"] not in {ENGINE, CPU_ENGINE}:
            assert gpus(workload) == (None, None), workload["metadata"]["name"]


def test_engine_pod_carries_model_flags_scheduling_shm_and_drain_time(
    all_manifests: list[Manifest],
) -> None:
    engine = one(all_manifests, "Deployment", ENGINE)
    spec = pod_spec(engine)
    container = spec["containers"][0]
    args = container["args"]
    flags = dict(zip(args[1::2], args[2::2], strict=False))
    assert args[0] == "engine"
    assert flags["--model"] == "/models/llama-3.1-8b"
    assert flags["--served-model-name"] == "llama-3.1-8b"
    assert flags["--gpu-memory-utilization"] == "0.85"
    assert flags["--max-model-len"] == "16384"
    assert flags["--metrics-port"] == "9100"
    assert flags["--max-num-seqs"] == "256"
    assert flags["--tensor-parallel-size"] == "2"
    # The Redis URL reaches the flag through Kubernetes' $(VAR) expansion of a secret env var.
    assert flags["--redis-url"] == "$(SLUICEGATE_REDIS_URL)"
    assert "secretKeyRef" in env_of(container)["SLUICEGATE_REDIS_URL"]["valueFrom"]
    assert engine["spec"]["replicas"] == 2
    # The replacement loads its model before the old worker leaves.
    assert engine["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    assert engine["metadata"]["annotations"]["sluicegate.io/served-model-name"] == "llama-3.1-8b"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert {t["key"] for t in spec["tolerations"]} == {"nvidia.com/gpu", "dedicated"}
    assert spec["terminationGracePeriodSeconds"] >= 300
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["model"]["persistentVolumeClaim"] == {
        "claimName": "model-weights",
        "readOnly": True,
    }
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["dshm"]["mountPath"] == "/dev/shm"
    assert mounts["model"] == {
        "name": "model",
        "mountPath": "/models",
        "readOnly": True,
        "subPath": "llama",
    }
    assert container["image"].endswith(":0.1.0-engine")
    # The engine never needs database credentials.
    assert "SLUICEGATE_DATABASE_URL" not in env_of(container)


@pytest.mark.parametrize("name", [ENGINE, CPU_ENGINE])
def test_engine_worker_accepts_the_chart_flags_and_drains_within_the_grace_period(
    all_manifests: list[Manifest], name: str
) -> None:
    from sluicegate.engine.worker import build_parser

    spec = pod_spec(one(all_manifests, "Deployment", name))
    args = spec["containers"][0]["args"]
    assert args[0] == "engine"
    parsed = build_parser().parse_args(args[1:])
    assert 0 < parsed.drain_timeout < spec["terminationGracePeriodSeconds"]


def test_gateway_settings_values_reach_the_gateway_as_typed_settings(
    all_manifests: list[Manifest], chart: ChartUnderTest, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sluicegate.gateway.settings import Settings

    gateway = pod_spec(one(all_manifests, "Deployment", GATEWAY))["containers"][0]
    for name, var in env_of(gateway).items():
        if name.startswith("SLUICEGATE_") and "value" in var:
            monkeypatch.setenv(name, var["value"])
    settings = Settings.from_env()
    wanted = chart.ci_values("all")["gateway"]["settings"]
    assert {name: getattr(settings, name) for name in wanted} == wanted


def test_large_numbers_reach_flags_as_integers(chart: ChartUnderTest) -> None:
    # Helm passes numbers as float64; printed plainly, 1048576 would become 1.048576e+06.
    values = {**chart.ci_values("required"), "engineDefaults": {"maxModelLen": 1048576}}
    args = pod_spec(one(chart.render(values), "Deployment", ENGINE))["containers"][0]["args"]
    assert args[args.index("--max-model-len") + 1] == "1048576"


def test_probes_and_engine_readiness_after_model_load(required_manifests: list[Manifest]) -> None:
    gateway = pod_spec(one(required_manifests, "Deployment", GATEWAY))["containers"][0]
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/health/live", "port": "http"}
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": "http"}
    assert gateway["ports"] == [
        {"name": "http", "containerPort": 8000, "protocol": "TCP"},
        {"name": "metrics", "containerPort": 9090, "protocol": "TCP"},
    ]
    env = {e["name"]: e.get("value") for e in gateway["env"]}
    assert env["SLUICEGATE_METRICS_PORT"] == "9090"

    engine = pod_spec(one(required_manifests, "Deployment", ENGINE))["containers"][0]
    assert engine["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": "metrics"}
    assert engine["livenessProbe"]["httpGet"] == {"path": "/health/live", "port": "metrics"}
    # Loading weights may take many minutes: the startup probe must allow it before liveness.
    startup = engine["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60
    assert engine["ports"] == [{"name": "metrics", "containerPort": 9100, "protocol": "TCP"}]


@pytest.mark.parametrize(
    ("values_file", "hook"),
    [("required", "pre-install,pre-upgrade"), ("all", "post-install,pre-upgrade")],
)
def test_migration_job_is_a_hook_that_waits_for_the_database(
    values_file: str, hook: str, chart: ChartUnderTest
) -> None:
    manifests = chart.render(chart.ci_values(values_file))
    job = one(manifests, "Job", MIGRATE)
    annotations = job["metadata"]["annotations"]
    # With the bundled PostgreSQL the database is part of the release, so the first install
    # migrates right after it instead of waiting before it.
    assert annotations["helm.sh/hook"] == hook
    assert "before-hook-creation" in annotations["helm.sh/hook-delete-policy"]
    spec = pod_spec(job)
    assert spec["restartPolicy"] == "Never"
    assert [c["name"] for c in spec["initContainers"]] == ["wait-for-database"]
    assert spec["containers"][0]["args"] == ["migrate"]
    # Hooks run before the release's resources exist: the URL comes from a hook Secret
    # created earlier in the same hook phase, not from the chart's main Secret.
    hook_secret = one(manifests, "Secret", f"{RELEASE}-sluicegate-migration")
    assert hook_secret["metadata"]["annotations"]["helm.sh/hook"] == hook
    assert int(hook_secret["metadata"]["annotations"]["helm.sh/hook-weight"]) < int(
        annotations["helm.sh/hook-weight"]
    )
    for container in containers(job):
        ref = env_of(container)["SLUICEGATE_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": f"{RELEASE}-sluicegate-migration", "key": "database-url"}
    # No ServiceAccount of the chart exists yet when a pre-install hook runs.
    assert "serviceAccountName" not in spec


def test_wait_for_database_init_container_waits_then_gives_up(
    required_manifests: list[Manifest],
) -> None:
    init = pod_spec(one(required_manifests, "Job", MIGRATE))["initContainers"][0]
    assert init["command"] == ["python", "-c"]
    assert env_of(init)["WAIT_TIMEOUT_SECONDS"]["value"] == "300"

    def run_init(port: int, timeout_s: str) -> subprocess.CompletedProcess[str]:
        env = {
            **os.environ,
            "SLUICEGATE_DATABASE_URL": f"postgresql+asyncpg://u:p@127.0.0.1:{port}/db",
            "WAIT_TIMEOUT_SECONDS": timeout_s,
        }
        command = [sys.executable, "-c", init["args"][0]]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        open_port = listener.getsockname()[1]
        assert run_init(open_port, "5").returncode == 0
    # The listener is closed now: nothing accepts on that port any more.
    refused = run_init(open_port, "1")
    assert refused.returncode != 0
    assert f"gave up waiting for database 127.0.0.1:{open_port}" in refused.stderr


def test_secrets_are_referenced_never_inlined(
    all_manifests: list[Manifest], chart: ChartUnderTest
) -> None:
    values = chart.ci_values("all")
    secret_values = [
        values["masterKey"]["value"],
        values["postgresql"]["auth"]["password"],
        *values["upstreamApiKeys"]["values"].values(),
    ]
    for workload in workloads(all_manifests):
        for container in containers(workload):
            for var in container.get("env", []):
                inline = str(var.get("value", ""))
                assert not any(s in inline for s in secret_values), (workload, var)
                if var["name"] in SECRET_ENV:
                    assert "secretKeyRef" in var["valueFrom"], (workload, var)
    gateway = pod_spec(one(all_manifests, "Deployment", GATEWAY))["containers"][0]
    assert {"SLUICEGATE_MASTER_KEY", "SLUICEGATE_DATABASE_URL", "SLUICEGATE_REDIS_URL"} <= set(
        env_of(gateway)
    )
    assert gateway["envFrom"] == [
        {"secretRef": {"name": f"{RELEASE}-sluicegate-upstream"}},
        {"secretRef": {"name": "more-upstream-keys"}},
    ]
    data = secret_data(one(all_manifests, "Secret", f"{RELEASE}-sluicegate"))
    assert data["master-key"] == values["masterKey"]["value"]
    # The bundled database URL escapes the password so any characters survive.
    assert data["database-url"] == (
        "postgresql+asyncpg://sluicegate:ci+p%40ss%2Fword@demo-sluicegate-postgresql:5432/sluicegate"
    )
    assert data["redis-url"] == "redis://demo-sluicegate-redis:6379/0"


def test_existing_secrets_are_referenced_and_never_copied(
    existing_secret_manifests: list[Manifest],
) -> None:
    # Nothing to render into a Secret of the chart's own.
    assert find(existing_secret_manifests, "Secret") == []
    expected = {
        "SLUICEGATE_MASTER_KEY": {"name": "sluicegate-admin", "key": "key"},
        "SLUICEGATE_DATABASE_URL": {"name": "sluicegate-db", "key": "database-url"},
        "SLUICEGATE_REDIS_URL": {"name": "sluicegate-redis", "key": "url"},
    }
    gateway = pod_spec(one(existing_secret_manifests, "Deployment", GATEWAY))["containers"][0]
    env = env_of(gateway)
    for name, ref in expected.items():
        assert env[name]["valueFrom"]["secretKeyRef"] == ref
    assert gateway["envFrom"] == [{"secretRef": {"name": "sluicegate-upstream-keys"}}]
    job = one(existing_secret_manifests, "Job", MIGRATE)
    for container in containers(job):
        ref = env_of(container)["SLUICEGATE_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
        assert ref == expected["SLUICEGATE_DATABASE_URL"]


def test_rendering_is_deterministic_across_upgrades(chart: ChartUnderTest) -> None:
    """No generated secret: an upgrade renders exactly what the install rendered."""
    values = chart.ci_values("all")
    install = chart.render_files(values, is_install=True, revision=1)
    upgrade = chart.render_files(values, is_upgrade=True, revision=2)
    assert install == upgrade


def test_routing_configmap_holds_the_routing_config_and_rolls_the_gateway(
    chart: ChartUnderTest,
) -> None:
    values = chart.ci_values("required")
    manifests = chart.render(values)
    configmap = one(manifests, "ConfigMap", f"{RELEASE}-sluicegate-routing")
    chart_defaults = yaml.safe_load((chart.directory / "values.yaml").read_text())
    assert yaml.safe_load(configmap["data"]["routing.yaml"]) == {
        "models": chart_defaults["routing"]["models"]
    }
    gateway = one(manifests, "Deployment", GATEWAY)
    pod = pod_spec(gateway)
    env = env_of(pod["containers"][0])
    assert env["SLUICEGATE_CONFIG"]["value"] == "/etc/sluicegate/routing.yaml"
    assert {"name": "routing", "configMap": {"name": f"{RELEASE}-sluicegate-routing"}} in pod[
        "volumes"
    ]

    def checksum(values: dict[str, Any]) -> str:
        deployment = one(chart.render(values), "Deployment", GATEWAY)
        return deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    before = checksum(values)
    assert re.fullmatch(r"[0-9a-f]{64}", before)
    changed_routing = {
        **values,
        "routing": {
            "models": [{"name": "m", "deployments": [{"provider": "engine", "model": "m"}]}]
        },
    }
    assert checksum(changed_routing) != before
    assert checksum({**values, "gateway": {"replicaCount": 5}}) == before


def test_grafana_dashboard_configmap_carries_the_dashboard(
    all_manifests: list[Manifest], chart: ChartUnderTest
) -> None:
    configmap = one(all_manifests, "ConfigMap", f"{RELEASE}-sluicegate-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((chart.directory / "dashboards" / "sluicegate.json").read_text())
    assert json.loads(configmap["data"]["sluicegate.json"]) == shipped


def test_pod_monitor_scrapes_the_gateway_and_every_engine(all_manifests: list[Manifest]) -> None:
    monitor = one(all_manifests, "PodMonitor", f"{RELEASE}-sluicegate")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    selector = monitor["spec"]["selector"]["matchLabels"]
    scraped_ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    assert all(e["path"] == "/metrics" for e in monitor["spec"]["podMetricsEndpoints"])
    for name in (GATEWAY, ENGINE, CPU_ENGINE):
        template = one(all_manifests, "Deployment", name)["spec"]["template"]
        assert selector.items() <= template["metadata"]["labels"].items()
        ports = {p["name"] for p in template["spec"]["containers"][0]["ports"]}
        assert ports & scraped_ports, name


def test_notes_tell_how_to_get_a_first_key(chart: ChartUnderTest) -> None:
    notes = chart.render_files(chart.ci_values("required"))["sluicegate/templates/NOTES.txt"]
    assert "/admin/keys" in notes
    assert "sluicegate keys create --name" in notes
    assert f"get secret {RELEASE}-sluicegate -o jsonpath='{{.data.master-key}}'" in notes


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"gateway": {"replicas": 3}}, "at '/gateway'"),
        (
            {"engineDefaults": {"gpuMemoryUtilization": 1.5}},
            "at '/engineDefaults/gpuMemoryUtilization'",
        ),
        ({"engineDefaults": {"gpus": -1}}, "at '/engineDefaults/gpus'"),
        (
            {"engines": [{"name": "Llama_8B", "servedModelName": "l", "model": {"path": "/m"}}]},
            "at '/engines/0/name'",
        ),
        ({"engines": [{"name": "llama", "servedModelName": "l"}]}, "at '/engines/0'"),
        (
            {
                "routing": {
                    "models": [
                        {"name": "m", "deployments": [{"provider": "openai", "model": "gpt"}]}
                    ]
                }
            },
            "at '/routing/models/0/deployments/0'",
        ),
        ({"database": {"url": "mysql://db/x"}}, "at '/database/url'"),
        ({"gateway": {"service": {"type": "Loadbalancer"}}}, "at '/gateway/service/type'"),
        ({"gateway": {"settings": {"master_key": "inline"}}}, "invalid propertyName 'master_key'"),
    ],
)
def test_values_schema_rejects_bad_values_at_install_time(
    bad: dict[str, Any], message: str, chart: ChartUnderTest
) -> None:
    values = {**chart.ci_values("required"), **bad}
    with pytest.raises(helm.HelmValuesError, match=re.escape(message)):
        chart.render_files(values)


def test_the_documented_installs_render_and_validate(chart: ChartUnderTest) -> None:
    """The deployment docs' my-values.yaml and --set trial install both work as written."""
    repo = chart.directory.parents[1]
    doc = (repo / "docs" / "operations.md").read_text()
    my_values_block = re.search(r"`my-values.yaml` like:\n+```yaml\n(.*?)```", doc, re.DOTALL)
    assert my_values_block
    my_values = yaml.safe_load(my_values_block[1])
    trial = re.search(r"helm install [^\n]*--create-namespace.*?\n\n", doc, re.DOTALL)
    assert trial
    # Unexpanded "$(openssl ...)" values stand in for the generated secrets.
    tokens = shlex.split(trial[0].replace("\\\n", " "))
    sets = [tokens[i + 1] for i, token in enumerate(tokens) if token == "--set"]
    assert len(sets) >= 4
    set_values = helm.parse_set_string(",".join(sets))
    for values in (my_values, set_values):
        for manifest in chart.render(values):
            kubernetes_validate.validate(manifest, KUBE_VERSION, strict=True)


async def test_gateway_loads_the_routing_config_the_chart_renders(
    all_manifests: list[Manifest], tmp_path: Path
) -> None:
    import redis.asyncio as aioredis

    from sluicegate.gateway.routing.router import Router
    from sluicegate.gateway.settings import Settings

    configmap = one(all_manifests, "ConfigMap", f"{RELEASE}-sluicegate-routing")
    config_file = tmp_path / "routing.yaml"
    config_file.write_text(configmap["data"]["routing.yaml"])
    # Building routes opens no connection: an unreachable Redis URL is fine here.
    redis = aioredis.Redis.from_url("redis://127.0.0.1:1/0")
    router = Router.from_settings(Settings.from_env(config=str(config_file)), redis)
    try:
        llama = await router.resolve("llama3")
        assert llama is not None and llama.name == "llama-3.1-8b"
        assert [d.kind for d in llama.deployments] == ["engine", "openai"]
        qwen = await router.resolve("qwen3-0.6b")
        assert qwen is not None and [d.model for d in qwen.deployments] == ["Qwen/Qwen3-0.6B"]
    finally:
        await router.close()
        await redis.aclose()
