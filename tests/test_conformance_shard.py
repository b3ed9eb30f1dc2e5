"""``--shard K/N`` and ``--database``: shards partition a run's examples; a shared database
makes every later run, on any shard, replay a saved failure first."""

from __future__ import annotations

import hashlib
import importlib.util
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from conformance.cli import main
from conformance.lockstep.numpy_backend import NumpyPagedBackend
from conformance.planted.backends import WritesPaddingSlot
from conformance.run.control import RunControl
from conformance.run.database import database_location, open_database
from conformance.run.result import RunResult
from conformance.run.runner import run_suite
from conformance.run.shard import Shard, parse_shard
from spec.backend import Capabilities, FloatArray, KVGeometry

BROKEN = "conformance.planted.backends:WritesPaddingSlot"
PASSES = ("short", "large pool")  # two passes, so that the index restarts per pass


class Recording(NumpyPagedBackend):
    """A correct float32 backend that records each example it ran: every write, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.examples: list[str] = []
        self._digest = hashlib.sha256()

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(name="recording", dtypes=frozenset({"float32"}))

    def create_cache(self, geometry: KVGeometry) -> None:
        self._close()
        self._digest.update(repr(geometry).encode())
        super().create_cache(geometry)

    def write_kv(
        self, layer: int, key: FloatArray, value: FloatArray, slot_mapping: Sequence[int]
    ) -> None:
        self._digest.update(repr((layer, list(slot_mapping))).encode())
        self._digest.update(np.ascontiguousarray(key, dtype=np.float32).tobytes())
        super().write_kv(layer, key, value, slot_mapping)

    def done(self) -> list[str]:
        self._close()
        return self.examples

    def _close(self) -> None:
        if self._digest.digest() != hashlib.sha256().digest():
            self.examples.append(self._digest.hexdigest())
        self._digest = hashlib.sha256()


def _run(shard: Shard | None, seed: int = 11) -> tuple[RunResult, list[str]]:
    backend = Recording()
    result = run_suite(
        backend,
        "recording",
        run_seed=seed,
        database=None,
        max_examples=6,
        passes=PASSES,
        shard=shard,
    )
    assert result.passed, result.difference
    return result, backend.done()


@pytest.fixture(scope="module")
def whole() -> tuple[RunResult, list[str]]:
    return _run(None)


def test_shards_1_of_2_and_2_of_2_partition_the_examples_of_the_run(
    whole: tuple[RunResult, list[str]],
) -> None:
    run, everything = whole
    first, ones = _run(Shard(1, 2))
    second, twos = _run(Shard(2, 2))
    assert len(everything) == run.stats.examples > 4
    assert ones and twos and not set(ones) & set(twos), "no example runs on both shards"
    assert Counter(ones) + Counter(twos) == Counter(everything), "every example runs once"
    assert first.stats.examples + second.stats.examples == run.stats.examples
    assert first.shard == Shard(1, 2) and first.passes == run.passes


def test_one_shard_of_one_is_the_whole_run(whole: tuple[RunResult, list[str]]) -> None:
    assert _run(Shard(1, 1))[1] == whole[1]


def test_a_failure_saved_by_one_shard_replays_first_on_every_shard(tmp_path: Path) -> None:
    db = str(tmp_path / "shared")
    first = run_suite(
        WritesPaddingSlot(), BROKEN, run_seed=7, database=db, shrink=False, shard=Shard(1, 2)
    )
    assert first.difference is not None and any(Path(db).iterdir())
    for shard in (Shard(2, 2), Shard(1, 2), None):  # another seed: a fresh draw would differ
        again = run_suite(WritesPaddingSlot(), BROKEN, run_seed=99, database=db, shard=shard)
        assert again.difference is not None and again.stats.first_failure_example == 1
        assert again.difference.what == first.difference.what


def test_a_shard_finds_and_shrinks_a_failure_among_examples_drawn_through_the_spec() -> None:
    """The first example of shard 3/3 is the run's third: two were drawn through the spec alone,
    and the failure, shrunk among them (for at most a few seconds), is the same kind as an
    unsharded run's."""
    quick = RunControl(shrink_time_s=3.0)
    runs = [
        run_suite(
            WritesPaddingSlot(),
            BROKEN,
            run_seed=5,
            database=None,
            passes=["short"],
            control=quick,
            shard=shard,
        )
        for shard in (None, Shard(3, 3))
    ]
    whole, one = runs
    assert one.difference is not None and whole.difference is not None
    assert one.shrunk and not one.flaky and one.nondeterminism is None
    assert one.difference.what == whole.difference.what
    assert one.stats.first_failure_example == 1


def test_the_shard_is_in_every_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "r.json"
    argv = ["run", "--backend", BROKEN, "--seed", "7", "--shard", "2/3", "--no-shrink"]
    assert main([*argv, "--database", str(tmp_path / "db"), "--report", str(report)]) == 1
    out = capsys.readouterr().out
    assert "(profile quick, seed 7, shard 2/3): FAILED" in out
    assert "--seed 7 --shard 2/3" in out, "the reproduce command names the shard"
    assert '"shard": "2/3"' in report.read_text()


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--shard", "1/2"], "--shard K/N needs --seed"),
        (["--seed", "1", "--shard", "0/2"], "needs 1 <= K <= N, got K=0, N=2"),
        (["--seed", "1", "--shard", "3/2"], "needs 1 <= K <= N, got K=3, N=2"),
        (["--seed", "1", "--shard", "1-2"], "'1-2' is not a shard: expected K/N"),
        (["--seed", "1", "--shard", "1/0"], "needs 1 <= K <= N, got K=1, N=0"),
        (["--database", "d", "--no-database"], "not allowed with argument --database"),
        (["--database", "s3://bucket"], "not a directory nor a Redis URL"),
    ],
)
def test_bad_shards_and_databases_are_usage_errors_naming_the_problem(
    argv: list[str], problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--backend", "reference", *argv])
    assert exit_.value.code == 2
    assert problem in capsys.readouterr().err


def test_a_database_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        database_location(str(tmp_path / "f"))


def test_redis_without_the_redis_package_is_a_clear_error() -> None:
    url = "redis://localhost:6379/0"
    if importlib.util.find_spec("redis") is None:  # this project's environment: no redis
        with pytest.raises(ValueError, match="redis package is not installed"):
            database_location(url)
    else:
        assert database_location(url) == url


def test_each_backend_and_pass_has_its_own_directory(tmp_path: Path) -> None:
    db = open_database(tmp_path, "my_pkg.mod:make-long")
    assert db is not None
    db.save(b"k", b"v")
    assert [p.name for p in tmp_path.iterdir()] == ["my_pkg.mod_make-long"]
    assert open_database(None, "x") is None
    assert parse_shard(" 2 / 5 ") == Shard(2, 5)
