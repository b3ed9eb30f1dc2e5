"""The simulator serves a DeepSeek-V3-shaped model whose KV is latent rows."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from paged_spec.sim.cost import GPU_PRESETS, MODEL_PRESETS, step_seconds
from paged_spec.simulate import main
from spec.kv_budget import GIB
from spec.kv_geometry import KVGeometry


def test_the_latent_model_is_priced_by_its_rows_and_its_arithmetic() -> None:
    mla = MODEL_PRESETS["deepseek-v3"]
    row = KVGeometry(61, 1, 1, 1, 576, "bfloat16", latent_dim=512)
    assert mla.kv_bytes_per_token == row.bytes_per_token == 61 * 576 * 2
    assert mla.attention_flops_per_pair == 2 * 61 * 128 * (576 + 512)  # scores, then c_kv sums
    llama = MODEL_PRESETS["llama-3.1-8b"]
    assert llama.attention_flops_per_pair == 4 * 32 * 32 * 128  # K and V of one width
    grouped = replace(mla, num_kv_heads=8, head_dim=128, latent_dim=None)
    gpu = GPU_PRESETS["h200"]
    for batch in (1, 8, 64):  # decodes of 8,192 tokens: the latent step is never the slower
        work = [(1, 8192)] * batch
        assert step_seconds(gpu, mla, work) <= step_seconds(gpu, grouped, work)


def test_simulate_runs_the_deepseek_v3_preset(tmp_path: Path) -> None:
    argv = ["--model", "deepseek-v3", "--num-requests", "20", "--rates", "8", "--no-plots"]
    assert main([*argv, "--jobs", "1", "--quiet", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["model"] == "deepseek-v3"
    assert results["config"]["pool_tokens"] == 4 * GIB // 70272  # the 4 GiB default pool
    assert results["main"]["runs"]["paged"]["output_tokens"] > 0
