"""bench/kernels.py runs end to end on tiny shapes under the interpreter (its GPU run is manual)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_cpu_smoke_run_ends_with_json(repo_root) -> None:
    result = subprocess.run(
        [sys.executable, "bench/kernels.py", "--cpu-smoke"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert {p["batch"] for p in summary["decode"]} == {1, 4}
    for point in summary["decode"]:
        assert point["max_abs_err_vs_reference"] < 1e-4
        assert point["max_abs_err_vs_sdpa"] < 1e-4
    assert summary["prefill"][0]["max_abs_err_vs_sdpa"] < 1e-4
    assert summary["prefill_tflops"] >= 0
