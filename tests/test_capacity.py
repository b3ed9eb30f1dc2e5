"""The capacity calculator reproduces the worked examples, and paging never fits fewer."""

from __future__ import annotations

import doctest
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

import paged_spec.capacity
import spec.kv_budget
from paged_spec.capacity import PRESETS, ModelKV, capacity, main
from spec.errors import InvalidRequestError
from spec.kv_budget import GIB, KIB, MIB, sequence_bytes, sequences_that_fit


@pytest.mark.parametrize("module", [paged_spec.capacity, spec.kv_budget])
def test_doctests(module: object) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)  # type: ignore[arg-type]
    assert result.attempted > 0 and result.failed == 0, result


def test_llama_8b_seed_numbers() -> None:
    r = capacity(PRESETS["llama-3.1-8b"])
    assert r.kv_bytes_per_token == 128 * KIB
    assert (r.context, r.max_len) == (200, 4096)
    assert r.contiguous_waste > 0.95
    assert r.paged_seq_bytes == 13 * 16 * 128 * KIB  # ceil(200 / 16) blocks


def test_hybrid_27b_seed_numbers() -> None:
    r = capacity(PRESETS["hybrid-27b"])
    assert r.kv_bytes_per_token == 64 * KIB
    assert r.max_len * r.kv_bytes_per_token == 16 * GIB
    assert r.pool_bytes == 23_859 * MIB
    assert r.paged_seq_bytes == 2192 * MIB == 2 * GIB + 144 * MIB
    assert (r.contiguous_fit, r.paged_fit) == (1, 10)
    assert r.bytes_per_block == 1 * MIB  # "a tidy 1 MiB physical block"


def test_cli_prints_every_worked_number(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    for text in (
        "128 KiB of KV a token",
        "95.1%",
        "64 KiB of KV a token",
        "contiguous, reserve 262,144          16,528          1\n",
        "paged, context 32,768                 2,192         10  10.0x\n",
    ):
        assert text in out, f"{text!r} missing from:\n{out}"


def test_the_report_says_where_its_pool_comes_from(capsys: pytest.CaptureFixture[str]) -> None:
    """Device, utilization and weights when the pool is derived; the preset or the flag if not."""
    assert main(["--model", "llama-3.1-8b"]) == 0
    out = capsys.readouterr().out
    assert "pool from: 141 GB device x 0.9 utilization - 16 GB of weights\n" in out, out
    assert main(["--model", "hybrid-27b", "--device-gb", "80", "--utilization", "0.8"]) == 0
    assert (
        "pool from: 80 GB device x 0.8 utilization - 54 GB of weights\n" in capsys.readouterr().out
    )
    assert main(["--model", "hybrid-27b"]) == 0
    assert "pool from: the preset, an 80 GB device less 54 GB" in capsys.readouterr().out
    assert main(["--model", "gemma-style", "--pool-mib", "512"]) == 0
    assert "pool from: --pool-mib 512\n" in capsys.readouterr().out


def test_each_column_keeps_one_unit(capsys: pytest.CaptureFixture[str]) -> None:
    """Byte figures in the table are bare numbers under a header that names the unit."""
    argv = ["--model", "llama-3.1-8b", "--layers", "1", "--dtype-bytes", "1", "--context", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "MiB a sequence" in line)
    assert header.split() == ["MiB", "a", "sequence", "sequences"]
    rows = [line for line in out.splitlines() if line.startswith(("contiguous", "paged"))]
    assert [r.split()[-3 if r.startswith("paged") else -2] for r in rows] == ["8", "0.03"]
    assert not any(unit in r for r in rows for unit in ("KiB", "MiB", "GiB", " B "))


def test_cli_json_and_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "llama-3.1-8b", "--pool-mib", "512", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert (row["contiguous_fit"], row["paged_fit"]) == (1, 19)
    assert main(["--model", "llama-3.1-8b", "--device-gb", "141", "--context", "1000"]) == 0
    assert "pool" in capsys.readouterr().out


def test_cli_bad_input_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--context", "5000", "--max-len", "4096"]) == 2
    assert "context must be in 1..max_len" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # argparse: tests/test_cli_args.py has the rest
        main(["--model", "hybrid-27b", "--block-size", "0"])
    assert exc.value.code == 2
    assert "argument --block-size" in capsys.readouterr().err


def test_presets_carry_their_own_weights(capsys: pytest.CaptureFixture[str]) -> None:
    """``--device-gb`` subtracts the preset's weights: 54 GB for the 27B, 16 GB for the 8B."""
    assert main(["--model", "hybrid-27b", "--device-gb", "80", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row["pool_bytes"] == int(80e9 * 0.9) - 54 * 10**9
    assert main(["--model", "llama-3.1-8b", "--device-gb", "80", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row["pool_bytes"] == int(80e9 * 0.9) - 16 * 10**9
    assert main(["--model", "hybrid-27b", "--device-gb", "80", "--weights-gb", "27"]) == 0
    assert "pool: 42,915 MiB = 42,915 blocks\n" in capsys.readouterr().out


def test_pools_print_in_a_readable_unit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "hybrid-27b", "--device-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "pool: 17,166 MiB = 17,166 blocks\n" in out, out


def test_budget_functions_reject_bad_input() -> None:
    with pytest.raises(InvalidRequestError, match="block_size"):
        sequence_bytes(10, 2, block_size=0)
    with pytest.raises(InvalidRequestError, match="per_sequence_bytes"):
        sequences_that_fit(100, 0)


@given(
    layers=st.integers(1, 80),
    kv_heads=st.integers(1, 16),
    head_dim=st.sampled_from([64, 96, 128, 256]),
    block_size=st.integers(1, 64),
    max_len=st.integers(1, 1 << 18),
    data=st.data(),
)
def test_paging_never_fits_fewer(
    layers: int, kv_heads: int, head_dim: int, block_size: int, max_len: int, data: st.DataObject
) -> None:
    """Paged cost <= reservation whenever the context's blocks fit in the reservation."""
    context = data.draw(st.integers(1, max_len), label="context")
    pool = data.draw(st.integers(0, 1 << 40), label="pool")
    state = data.draw(st.integers(0, 1 << 28), label="state")
    model = ModelKV("m", layers, kv_heads, head_dim, 2, state, context, max_len, pool, block_size)
    r = capacity(model)
    per_token = 2 * layers * kv_heads * head_dim * 2
    assert r.paged_seq_bytes - state - context * per_token < block_size * per_token  # tail < B
    if -(-context // block_size) * block_size <= max_len:
        assert r.paged_fit >= r.contiguous_fit
    assert r.contiguous_fit * r.contiguous_seq_bytes <= pool
    assert (r.paged_fit + 1) * r.paged_seq_bytes > pool
