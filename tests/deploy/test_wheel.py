"""What a user installs: the wheel holds one import name (``sluicegate``), so Hugging Face's
``kernels`` (which transformers imports) is never shadowed nor overwritten, from the repo root
or from site-packages; and the wheel alone, in a fresh virtualenv, serves a chat completion."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # The build backend (setuptools) is the one installed beside the tests: no download.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(REPO),
        ],
        check=True,
        cwd=out,
    )
    (built,) = out.glob("sluicegate-*.whl")
    return built


def test_the_wheel_installs_only_the_sluicegate_import_name(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/", 1)[0] for name in names}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"sluicegate"}
    assert len([top for top in tops if top.endswith(".dist-info")]) == 1
    # What the installed product reads from inside the package.
    for needed in (
        "sluicegate/gateway/db/migrations/env.py",
        "sluicegate/kernels/csrc/",
        "sluicegate/gateway/ui/templates/",
    ):
        assert any(name.startswith(needed) for name in names), needed
    # Every C++ source and header, the stage folders' included: the kernels build from them.
    csrc = REPO / "sluicegate" / "kernels" / "csrc"
    sources = {p.relative_to(REPO).as_posix() for p in csrc.rglob("*") if p.is_file()}
    assert sources - set(names) == set()
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert (
        "sluicegate = sluicegate.gateway.cli:main"
        in zipfile.ZipFile(wheel).read(entry_points).decode()
    )


def test_from_the_repo_root_hugging_faces_kernels_and_ours_both_import(tmp_path: Path) -> None:
    """The root first on ``sys.path`` (``python -c`` run there, as ./scripts/* do): transformers'
    hub-kernels integration finds Hugging Face's ``kernels`` and a transformers model loads."""
    script = textwrap.dedent(
        f"""
        import sys
        assert sys.path[0] in ("", {str(REPO)!r}), sys.path[0]
        import transformers.integrations.hub_kernels
        import kernels
        assert hasattr(kernels, "CUDAProperties"), kernels.__file__
        from sluicegate.kernels import reference
        from sluicegate.kernels import cpu_ops
        from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
        config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
        LlamaForCausalLM(config).save_pretrained({str(tmp_path)!r})
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})
        print("loaded", type(model).__name__, kernels.__file__)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "loaded LlamaForCausalLM" in done.stdout
    assert str(REPO / "kernels") not in done.stdout


@pytest.fixture(scope="module")
def fresh_venv(wheel: Path) -> Iterator[Path]:
    # Not under pytest's basetemp (0700): the embedded PostgreSQL runs as another user and
    # needs to traverse the venv (its binaries) and the data directory.
    scratch = Path(tempfile.mkdtemp(prefix="sg-wheel-"))
    scratch.chmod(0o755)
    venv = scratch / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "-q"]
    # As ./scripts/up does: the CPU build of torch first, the rest as constraints.txt pins it.
    subprocess.run([*pip, "torch==2.13.0"], check=True, timeout=900)
    subprocess.run(
        [*pip, "-c", str(REPO / "constraints.txt"), f"{wheel}[engine,embedded]"],
        check=True,
        timeout=900,
    )
    try:
        yield venv
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_wheel_in_a_fresh_venv_serves_from_outside_the_repo(fresh_venv: Path) -> None:
    python = fresh_venv / "bin" / "python"
    outside = fresh_venv.parent / "elsewhere"
    outside.mkdir()
    checked = subprocess.run(
        [str(python), "-m", "pip", "check"], capture_output=True, text=True, cwd=outside
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    hf = subprocess.run(
        [str(python), "-c", "import kernels; kernels.CUDAProperties; print(kernels.__file__)"],
        capture_output=True,
        text=True,
        cwd=outside,
    )
    assert hf.returncode == 0, hf.stderr
    assert "site-packages/kernels/" in hf.stdout

    data_dir = outside / "sg-data"
    port = _free_port()
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("SLUICEGATE_", "VIRTUAL_ENV", "PYTHON"))
    }
    env["PATH"] = f"{fresh_venv / 'bin'}:{env.get('PATH', '')}"
    up = subprocess.Popen(
        [
            str(fresh_venv / "bin" / "sluicegate"),
            "up",
            "--data-dir",
            str(data_dir),
            "--port",
            str(port),
        ],
        cwd=outside,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    try:
        assert up.stdout is not None
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Press Ctrl-C" in line:
                break
        output = "".join(lines)
        assert "Press Ctrl-C" in output, output
        api_key = re.search(r"API key:\s+(\S+)", output)
        model = re.search(r"model:\s+(\S+)", output)
        assert api_key and model, output
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            headers={"Authorization": f"Bearer {api_key.group(1)}"},
            json={
                "model": model.group(1),
                "messages": [{"role": "user", "content": "Hello!"}],
                "max_tokens": 4,
            },
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait(10)
