"""``python -m paged_spec.engine_demo`` prints metrics and the equivalence line; exits 0."""

from __future__ import annotations

import pytest
import torch

from paged_spec import engine_demo


def test_demo_runs_and_matches_unbatched(capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:
        code = engine_demo.main(["--backend", "reference", "--requests", "16", "--baseline"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "identical to unbatched: 16/16 requests" in out
    assert "continuous batching on reference" in out and "static batching" in out
    assert "preemptions=" in out and "prefix_hit_rate=" in out
    for cls in ("chat", "document"):
        assert f"\n{cls} " in out, out


THIRD_PARTY = "tests/third_party_backend/my_backend.py:make_backend"


def test_demo_runs_a_third_party_backend_through_the_suites_loader(
    capsys: pytest.CaptureFixture[str],
) -> None:
    threads = torch.get_num_threads()
    try:
        code = engine_demo.main(["--backend", THIRD_PARTY, "--requests", "8"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"continuous batching on {THIRD_PARTY}" in out
    assert "identical to unbatched: 8/8 requests" in out


@pytest.mark.parametrize(
    ("ref", "says"),
    [
        ("no_such_backend", "no installed backend named 'no_such_backend'"),
        ("tests/third_party_backend/my_backend.py:nothing", "has no callable 'nothing'"),
        ("tests/no_such_file.py:make_backend", "no file tests/no_such_file.py"),
    ],
)
def test_a_bad_backend_spec_is_a_usage_error_naming_it(
    ref: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        engine_demo.main(["--backend", ref, "--requests", "2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--backend {ref}" in err and says in err, err
