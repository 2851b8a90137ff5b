"""bench/kv_concurrency.py meets the issue's targets for the article's scenario."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "kv_concurrency.py"


def test_paged_scheduler_beats_static_reservation_on_the_article_scenario() -> None:
    run = subprocess.run(
        [sys.executable, str(BENCH)], capture_output=True, text=True, check=True, timeout=120
    )
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["finished"] == 1_000
    assert result["reserved_8192_max_seqs"] == 52
    assert result["reserved_131072_max_seqs"] == 3
    assert result["peak_running"] >= 200
    assert result["peak_kv_utilization"] >= 0.99
    assert result["peak_running"] / result["reserved_8192_max_seqs"] >= 3.8
    assert result["ratio_vs_8192"] >= 3.8
    assert isinstance(result["preemptions"], int)
    assert "static reservation, 8,192" in run.stdout
