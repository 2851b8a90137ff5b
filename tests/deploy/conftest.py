"""The Helm chart rendered through the Helm SDK (no cluster, no `helm` binary needed)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

Manifest = dict[str, Any]


@dataclass(frozen=True)
class ChartUnderTest:
    directory: Path
    release: str = "demo"
    namespace: str = "ai"

    def ci_values(self, name: str) -> dict[str, Any]:
        """A values file of the chart's ci/ folder: ``required``, ``all``, ``existing-secrets``."""
        return yaml.safe_load((self.directory / "ci" / f"{name}-values.yaml").read_text())

    def render_files(self, values: dict[str, Any], **options: Any) -> dict[str, str]:
        options.setdefault("name", self.release)
        options.setdefault("namespace", self.namespace)
        with helm.Chart.load(self.directory) as chart:
            return chart.render(values, **options)

    def render(self, values: dict[str, Any], **options: Any) -> list[Manifest]:
        manifests: list[Manifest] = []
        for path, text in sorted(self.render_files(values, **options).items()):
            if path.endswith(".yaml"):
                manifests.extend(doc for doc in yaml.safe_load_all(text) if doc)
        return manifests


@pytest.fixture(scope="session")
def chart() -> ChartUnderTest:
    return ChartUnderTest(Path(__file__).resolve().parents[2] / "charts" / "sluicegate")


@pytest.fixture(scope="session")
def required_manifests(chart: ChartUnderTest) -> list[Manifest]:
    return chart.render(chart.ci_values("required"))


@pytest.fixture(scope="session")
def all_manifests(chart: ChartUnderTest) -> list[Manifest]:
    return chart.render(chart.ci_values("all"))


@pytest.fixture(scope="session")
def existing_secret_manifests(chart: ChartUnderTest) -> list[Manifest]:
    return chart.render(chart.ci_values("existing-secrets"))
