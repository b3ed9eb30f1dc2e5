"""The matrix page says only what its runs' reports say, grouped by cause, dated, on a machine.

``benchmarks.matrix`` is run here from reports written in the test (no adapter
runs): each adapter's verdict, what it declares, each distinct cause with its
passes and first failure, the adapter's line for a cause it explains and a plain
"not explained" for one it does not, and the machine and the date.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path
from typing import Any

import pytest

from benchmarks import matrix

CAPS = {
    "name": "vllm-unified", "dtypes": ["bfloat16", "float16"], "kv_dtypes": ["fp8_e4m3"],
    "block_sizes": list(range(16, 1025, 16)), "head_dims": list(range(32, 513)),
    "variants": ["alibi", "sinks"], "latent": [], "products": "tf32", "table_width": 256,
    "decode_split": None, "max_query_len": None,
}  # fmt: skip
FAILED: dict[str, Any] = {
    "verdict": "FAILED",
    "examples": 22,
    "wall_time_s": 76.0,
    "capabilities": CAPS,
    "distinct_failures": 2,
    "causes": [
        {"cause": "the ALiBi origin", "isolated": True, "passes": ["feature (alibi)", "short"]},
        {"cause": "something new", "isolated": True, "passes": ["long"]},
    ],
    "failures": [
        {"pass": "feature (alibi)", "cause": "the ALiBi origin", "summary": "output differs\nmore"},
        {"pass": "long", "cause": "something new", "summary": "K differs at step 3"},
    ],
}


def test_a_page_lists_each_cause_with_the_adapters_line_for_it() -> None:
    passed: dict[str, Any] = {"verdict": "PASSED"}
    runs = [(matrix.Run("vllm-unified"), FAILED), (matrix.Run("flex"), passed)]
    when = dt.datetime(2026, 12, 6, 8, 0)
    text = matrix.page(runs, {"vllm-unified": "vllm 0.33.0 (wheel)"}, ["CPU: x"], when, "quick", 1)
    assert "on 2026-12-06 08:00 UTC, profile `quick`, seed 1" in text
    assert "* CPU: x" in text and "| vllm-unified | FAILED | 2 |" in text
    assert "| flex | PASSED | 0 |" in text
    assert "* release: vllm 0.33.0 (wheel)" in text
    assert "block sizes 16, 32, ..., 1024 (every 16); head dims 32..512" in text
    assert "products tf32; table width 256; decode split undeclared" in text
    assert "* verdict: **FAILED** (22 examples, 76 s)" in text
    assert "  * cause: the ALiBi origin (passes: feature (alibi); short)" in text
    assert "    * first: output differs\n" in text
    assert "`apply_alibi_to_score`" in text  # vllm_unified.EXPLAINED's line
    assert "  * cause: something new (passes: long)\n    * first: K differs at step 3\n" in text
    assert "    * why: not explained by the adapter" in text


def test_the_page_is_written_again_from_kept_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reports = tmp_path / "reports"
    reports.mkdir()
    for run in matrix.RUNS:
        (reports / run.file).write_text(json.dumps(FAILED if run.adapter != "flex" else {}))
    ended = 1_800_000_000  # 2027-01-15 08:00 UTC: the run's last report, not the writing
    for i, run in enumerate(matrix.RUNS):
        os.utime(reports / run.file, (ended - i * 600, ended - i * 600))
    monkeypatch.setattr(matrix, "release", lambda adapter: f"{adapter} release")
    out = tmp_path / "matrix.md"
    args = ["--out", str(out), "--reports", str(reports), "--from-reports"]
    assert matrix.main(args) == 0
    text = out.read_text()
    assert "| flex --poison finite | no verdict | 0 |" in text
    assert text.count("* release: vllm-mla release") == 1
    assert "platform: " in text and "Python " in text
    assert "on 2027-01-15 08:00 UTC, profile `quick`" in text
    with pytest.raises(SystemExit):
        matrix.main([*args[:2], "--reports", str(tmp_path / "none"), "--from-reports"])


def test_declared_sets_read_in_a_few_words() -> None:
    assert matrix._ints([1, 2, 3]) == "1, 2, 3"
    assert matrix._ints(range(32, 513)) == "32..512"
    assert matrix._ints([1, 2, 4, 8, 16, 32, 64]) == "1, 2, 4, 8, ... (7 values)"
    caps: dict[str, Any] = {"dtypes": ["float16"], "latent": None, "max_query_len": 1}
    assert "latent any" in matrix.declared(caps) and "decode only" in matrix.declared(caps)
