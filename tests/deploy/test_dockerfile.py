"""The Dockerfile's structure, checked without a Docker engine: stages, build context, users."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", dockerfile)
    result = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def stages(dockerfile: str) -> dict[str, list[tuple[str, str]]]:
    """Each named stage's instructions, its FROM first, in file order."""
    named: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for keyword, rest in instructions(dockerfile):
        if keyword == "FROM":
            match = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", rest, re.IGNORECASE)
            assert match, f"every stage is named: FROM {rest}"
            current = named.setdefault(match[2], [])
        if current is not None:
            current.append((keyword, rest))
    return named


def closure(named: dict[str, list[tuple[str, str]]], target: str) -> set[str]:
    """The stages a target is built from: its FROM chain and every COPY --from."""
    seen: set[str] = set()
    todo = [target]
    while todo:
        stage = todo.pop()
        if stage in seen or stage not in named:
            continue
        seen.add(stage)
        for keyword, rest in named[stage]:
            if keyword == "FROM":
                todo.append(rest.split()[0])
            elif keyword == "COPY":
                todo += re.findall(r"--from=(\S+)", rest)
    return seen


def dockerignore_admits(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents wins."""

    def matches(pattern: str, candidate: str) -> bool:
        regex = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        return re.fullmatch(regex, candidate) is not None

    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    admitted = True
    for pattern in patterns:
        negated = pattern.startswith("!")
        if any(matches(pattern.lstrip("!"), c) for c in candidates):
            admitted = negated
    return admitted


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return (REPO / "Dockerfile").read_text()


@pytest.fixture(scope="module")
def ignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_gateway_and_engine_targets_with_gateway_the_default(dockerfile: str) -> None:
    named = stages(dockerfile)
    assert {"gateway", "engine"} <= set(named)
    # `docker build .` builds the last stage: the small gateway image.
    assert list(named)[-1] == "gateway"
    for target in ("gateway", "engine"):
        entrypoint = [rest for keyword, rest in named[target] if keyword == "ENTRYPOINT"]
        assert entrypoint == ['["tini", "--", "sluicegate"]']


def test_gateway_image_is_built_without_the_engine_extra(dockerfile: str) -> None:
    named = stages(dockerfile)
    installs_engine = {
        stage
        for stage, body in named.items()
        if any("['engine']" in rest for keyword, rest in body if keyword == "RUN")
    }
    assert installs_engine == {"deps-engine"}
    assert "deps-engine" in closure(named, "engine")
    assert "deps-engine" not in closure(named, "gateway")
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert not any(dep.startswith("torch") for dep in pyproject["project"]["dependencies"])
    assert any(
        dep.startswith("torch") for dep in pyproject["project"]["optional-dependencies"]["engine"]
    )
    assert pyproject["project"]["scripts"]["sluicegate"]


def test_build_context_holds_what_copy_needs_and_nothing_else(
    dockerfile: str, ignore_patterns: list[str]
) -> None:
    sources = []
    for keyword, rest in instructions(dockerfile):
        if keyword == "COPY" and "--from=" not in rest:
            sources += [s.lstrip("./") for s in rest.split()[:-1] if not s.startswith("--")]
    assert sources
    for source in sources:
        assert (REPO / source).exists(), source
        assert dockerignore_admits(ignore_patterns, source), source
    assert dockerignore_admits(ignore_patterns, "sluicegate/gateway/cli.py")
    for kept_out in (
        "tests",
        ".git",
        "charts",
        "sluicegate/gateway/__pycache__/cli.cpython-311.pyc",
    ):
        assert not dockerignore_admits(ignore_patterns, kept_out), kept_out


def test_images_run_as_the_non_root_user_the_chart_expects(dockerfile: str) -> None:
    named = stages(dockerfile)
    values = yaml.safe_load((REPO / "charts" / "sluicegate" / "values.yaml").read_text())
    uid = values["gateway"]["podSecurityContext"]["runAsUser"]
    assert values["engineDefaults"]["podSecurityContext"]["runAsUser"] == uid
    for target in ("gateway", "engine"):
        users = [rest for keyword, rest in named[target] if keyword == "USER"]
        # Numeric, so Kubernetes can verify runAsNonRoot.
        assert users == [f"{uid}:{uid}"]
