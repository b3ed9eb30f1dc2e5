"""The suite's choice of oracle: the spec for small steps, the fast reference for large ones.

The fast reference (:mod:`conformance.judges.fast_reference`) is itself
checked against the spec in ``tests/test_fast_reference.py``; here: that the
suite picks it by size and by device, says which oracle judged each output,
judges a correct backend as passing with it (tolerances widened by its known
differences only on its steps), and turns every problem of its own (a device
this machine lacks, a memory limit too small for one tile, an out-of-memory
error) into a setup error naming what to change.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conformance.cli import main
from conformance.errors import SetupError
from conformance.judges import oracle as oracle_module
from conformance.judges.fast_reference import paged_attention as fast_attention
from conformance.judges.numerics import FAST_SLACK_ULPS, FLOOR_ULPS, output_errors
from conformance.judges.oracle import (
    FAST,
    FAST_THRESHOLD,
    ORACLE_NAMES,
    SPEC,
    OracleChoice,
    memory_limit_from,
    oracle_for_run,
    reference_outputs,
    step_cost,
)
from conformance.judges.tile_plan import DEFAULT_MEMORY_LIMIT
from conformance.lockstep.numpy_backend import NumpyPagedBackend
from conformance.run.control import RunControl
from conformance.run.runner import run_suite
from spec.attention import AttentionVariant
from spec.batch import BatchMetadata, build_batch
from spec.block_manager import BlockManager
from spec.kv_memory import KVMemory


def _step() -> tuple[np.ndarray, BatchMetadata, KVMemory]:
    """A prefill of 7 and a decode at 13 tokens, 4 query heads on 2 KV heads, blocks of 4."""
    manager = BlockManager(num_blocks=12, block_size=4)
    memory = KVMemory(1, 12, 4, num_kv_heads=2, head_dim=16)
    rng = np.random.default_rng(5)

    def append(seq: int, n: int) -> None:
        slots = manager.append_slots(seq, list(range(n)))
        memory.write(0, rng.normal(size=(n, 2, 16)), rng.normal(size=(n, 2, 16)), slots)

    manager.add_sequence(1, list(range(12)))
    append(1, 12)
    build_batch(manager, [(1, 12)])
    manager.add_sequence(0, list(range(7)))
    append(0, 7)
    append(1, 1)
    batch = build_batch(manager, [(0, 7), (1, 1)])
    return rng.normal(size=(batch.num_tokens, 4, 16)), batch, memory


def test_the_choice_goes_by_step_size_and_by_the_backends_device() -> None:
    _, batch, _ = _step()
    assert step_cost(batch, 4) == (7 * 7 + 1 * 13) * 4
    choice = OracleChoice("cpu", DEFAULT_MEMORY_LIMIT)
    assert choice.choose(FAST_THRESHOLD - 1, "cpu") == SPEC
    assert choice.choose(FAST_THRESHOLD, "cpu") == FAST
    assert choice.choose(1, "cuda:0") == FAST  # off the CPU every step, however small


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize(
    "variant", [AttentionVariant(), AttentionVariant(window=3, sinks=(0.5,) * 4)]
)
def test_both_oracles_give_the_same_references(dtype: str, variant: AttentionVariant) -> None:
    query, batch, memory = _step()
    choice = OracleChoice("cpu", DEFAULT_MEMORY_LIMIT)
    kw = dict(scale=0.3, variant=variant, group=0, dtype=dtype, quantized_kv=False)
    spec = reference_outputs(choice, query, batch, memory, 0, oracle=SPEC, **kw)  # type: ignore[arg-type]
    fast = reference_outputs(choice, query, batch, memory, 0, oracle=FAST, **kw)  # type: ignore[arg-type]
    np.testing.assert_allclose(fast[0], spec[0], rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(fast[1], spec[1], rtol=1e-3, atol=1e-3)


def test_the_fast_oracles_slack_is_added_to_its_steps_only() -> None:
    exact = np.linspace(0.1, 0.9, 64)
    spec = output_errors(exact, exact, exact, "float16")
    fast = output_errors(exact, exact, exact, "float16", oracle=ORACLE_NAMES[FAST])
    assert spec.floor_ulps == FLOOR_ULPS["float16"]
    assert fast.floor_ulps == FLOOR_ULPS["float16"] + FAST_SLACK_ULPS["float16"]
    assert "judged by: the fast reference" in "\n".join(fast.describe())
    assert "judged by: the spec's numpy" in "\n".join(spec.describe())


def test_a_run_judged_by_the_fast_oracle_passes_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every step to the fast reference: a correct backend passes, and the counts name it."""
    monkeypatch.setattr(oracle_module, "FAST_THRESHOLD", 0)
    result = run_suite(
        NumpyPagedBackend(), "numpy", run_seed=3, database=None, max_examples=3, passes=("short",)
    )
    assert result.passed
    fast = [k for k in result.stats.checks if k.startswith("attention outputs judged by the fast")]
    assert fast and result.stats.checks[fast[0]] > 0
    assert not any("judged by the spec" in k for k in result.stats.checks)


def test_a_memory_limit_too_small_for_one_tile_is_a_setup_error_naming_it() -> None:
    with pytest.raises(SetupError, match="reference memory 64 bytes"):
        oracle_for_run("cpu", 64)
    assert main(["run", "--backend", "reference", "--reference-memory", "64", "--in-process"]) == 2


def test_a_device_the_machine_lacks_is_a_setup_error_naming_it() -> None:
    device = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(SetupError, match=device.replace(":", ".")):
        oracle_for_run(device)
    with pytest.raises(SetupError, match="cpu or cuda"):
        oracle_for_run("mps")


def test_a_fast_reference_that_disagrees_at_start_up_is_a_setup_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def off_by_a_little(*args: object, **kwargs: object) -> torch.Tensor:
        return fast_attention(*args, **kwargs) + 1e-9  # type: ignore[arg-type]

    monkeypatch.setattr(oracle_module, "paged_attention", off_by_a_little)
    with pytest.raises(SetupError, match="disagrees with the spec on the start-up check"):
        oracle_module.startup_check(OracleChoice("cpu", DEFAULT_MEMORY_LIMIT))


def test_an_out_of_memory_error_in_the_suites_reference_names_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Raised mid-run, it stops the run as a setup error: not the backend's failure, no replay."""

    def out_of_memory(*args: object, **kwargs: object) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(oracle_module, "FAST_THRESHOLD", 0)
    oracle_for_run("cpu")  # the start-up check runs (and is cached) before the patch
    monkeypatch.setattr(oracle_module, "paged_attention", out_of_memory)
    with pytest.raises(SetupError, match="--reference-memory"):
        run_suite(NumpyPagedBackend(), "numpy", run_seed=3, database=None, max_examples=2)


def test_reference_memory_parses_sizes_and_names_a_bad_one() -> None:
    assert memory_limit_from("512M") == 512 << 20 and memory_limit_from("4096") == 4096
    with pytest.raises(ValueError, match="not a byte count"):
        memory_limit_from("lots")
    with pytest.raises(SetupError, match="reference memory must be positive"):
        RunControl(reference_memory=0)
