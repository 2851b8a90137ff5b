"""A CPU-kernel build killed midway must not hang the next one on torch's leftover lock file;
two torch installs never share a build."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sluicegate.kernels import cpu_build

LOAD = (
    "from sluicegate.kernels import cpu_build; "
    "import sys; sys.exit(0 if cpu_build.extension() is not None else 3)"
)


def test_a_lock_left_by_a_killed_build_is_cleared(tmp_path: Path) -> None:
    if cpu_build.extension() is None:
        pytest.skip("no C++ compiler here: the CPU kernels cannot be built")
    built = cpu_build.build_directory(cpu_build.extension_name())
    # A copy of this machine's build, so the load below finds it up to date and only
    # imports it, with the lock file a build cut off by SIGKILL leaves behind.
    shutil.copytree(built, tmp_path / built.name)
    (tmp_path / built.name / "lock").touch()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", LOAD], env=env, timeout=300, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / built.name / "lock").exists()


def test_two_torch_installs_build_in_folders_of_their_own(tmp_path: Path) -> None:
    first = tmp_path / "a" / "site-packages" / "torch" / "__init__.py"
    second = tmp_path / "b" / "site-packages" / "torch" / "__init__.py"
    assert cpu_build.install_tag(first) != cpu_build.install_tag(second)
    assert cpu_build.install_tag(first) == cpu_build.install_tag(first)
    import torch

    name = cpu_build.build_directory("x").name
    assert name.endswith(cpu_build.install_tag(Path(torch.__file__)))
