"""The capacity calculator prices latent KV (multi-head latent attention) beside grouped heads."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from paged_spec.capacity import (
    COMPARED_DEVICES_GB,
    PRESETS,
    ModelKV,
    capacity,
    latent_comparison,
    main,
)
from spec.errors import ArgumentValueError
from spec.kv_geometry import KVGeometry


def test_the_deepseek_v3_preset_costs_one_row_a_layer() -> None:
    model = PRESETS["deepseek-v3"]
    r = capacity(model)
    geometry = KVGeometry(61, 8, 64, 1, 576, "bfloat16", latent_dim=512)
    assert r.kv_bytes_per_token == geometry.bytes_per_token == 61 * (512 + 64) * 2
    latent, grouped, multi = latent_comparison(model)
    assert (grouped.bytes_per_token, multi.bytes_per_token) == (
        61 * 2 * 8 * 128 * 2,
        61 * 2 * 128 * 128 * 2,
    )
    for cost in (latent, grouped, multi):
        for gb, tokens in zip(COMPARED_DEVICES_GB, cost.tokens, strict=True):
            pool = int(gb * 1e9 * 0.9)
            assert tokens % 64 == 0 and tokens <= pool // cost.bytes_per_token < tokens + 64
    assert latent.tokens[1] > 3.5 * grouped.tokens[1] and latent.tokens[1] > 56 * multi.tokens[1]


def test_the_report_prints_the_comparison_and_the_devices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--model", "deepseek-v3"]) == 0
    out = capsys.readouterr().out
    assert "== deepseek-v3: 68.62 KiB of KV a token" in out, out
    assert "tokens, 80 GB  tokens, 141 GB" in out
    assert "latent 512 + 64                  68.62 KiB      1,024,576       1,805,824" in out
    assert main(["--model", "deepseek-v3", "--utilization", "0.5", "--weights-gb", "20"]) == 0
    out = capsys.readouterr().out
    assert "tokens in 0.5 of a device less 20 GB of weights" in out
    assert "latent 512 + 64                  68.62 KiB        284,608" in out, (
        out
    )  # 20 GB / 70,272 B


def test_a_latent_model_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    """DeepSeek-V2-Lite's shape from flags: 27 layers of 512 + 64."""
    argv = ["--model", "llama-3.1-8b", "--layers", "27", "--kv-heads", "1", "--head-dim", "576"]
    assert main([*argv, "--latent-dim", "512", "--json"]) == 0
    assert '"kv_bytes_per_token": 31104' in capsys.readouterr().out  # 27 x 576 x 2
    assert main(["--model", "llama-3.1-8b", "--head-dim", "576", "--latent-dim", "512"]) == 2
    assert "num_kv_heads must be 1 for a latent layout" in capsys.readouterr().err


def test_a_grouped_model_has_no_latent_comparison() -> None:
    with pytest.raises(ValueError, match="not a latent model"):
        latent_comparison(PRESETS["llama-3.1-8b"])
    with pytest.raises(ArgumentValueError, match="latent_dim must be in"):
        dataclasses.replace(PRESETS["deepseek-v3"], latent_dim=576)


@given(
    layers=st.integers(1, 80),
    latent=st.integers(1, 1024),
    rope=st.integers(1, 128),
    block_size=st.sampled_from([1, 16, 64]),
    context=st.integers(1, 1 << 17),
    pool=st.integers(0, 1 << 40),
)
def test_latent_paging_never_fits_fewer_and_costs_one_row_a_layer(
    layers: int, latent: int, rope: int, block_size: int, context: int, pool: int
) -> None:
    max_len = max(context, 1 << 17)
    model = ModelKV("m", layers, 1, latent + rope, 2, 0, context, max_len, pool, block_size,
                    latent_dim=latent)  # fmt: skip
    r = capacity(model)
    assert r.kv_bytes_per_token == layers * (latent + rope) * 2
    if -(-context // block_size) * block_size <= max_len:
        assert r.paged_fit >= r.contiguous_fit
    assert (r.paged_fit + 1) * r.paged_seq_bytes > pool
