"""Each attention call's features, with the kernel path it was seen to run.

The path a call ran is observed (:func:`~conformance.lockstep.pairs.path_run`):
read from the kernels it launched (:mod:`conformance.observe`), else named by
the backend's ``attention_path()``, and only when neither says is it the
suite's plan, which the coverage then says. A decode whose observed split the
backend's declared plan (``capabilities.decode_split``) contradicts stops the
run as a setup error naming both: the suite draws by that plan.
"""

from __future__ import annotations

from collections.abc import Sequence

from conformance.errors import SetupError, SuiteStopped
from conformance.judges.paths import PathCoverage
from conformance.lockstep.example import Example
from conformance.lockstep.pairs import PATHS, call_features, call_path, path_run
from conformance.observe.launches import Launch
from conformance.observe.paths import observe
from spec.attention import AttentionVariant
from spec.batch import BatchMetadata
from spec.capabilities import Capabilities

_HOW = {
    "attention_path": "named by the backend's attention_path()",
    "plan": "the suite's plan, not observed",
}


def note_call(
    example: Example,
    paths: PathCoverage,
    caps: Capabilities,
    sub: BatchMetadata,
    variant: AttentionVariant,
    launches: Sequence[Launch],
    reported: str | None,
    layer: int,
    *,
    large: bool,
) -> str:
    """The features of this call with the path it ran, into ``paths``; the path in words, as
    a failure of this call reports it."""
    g = example.config.geometry
    features = call_features(
        variant, g.kv_dtype, sub, grouped=g.num_groups > 1, large=large, latent=g.is_latent
    )
    drawn = call_path(sub, variant.window, paths.split_keys)
    seen = observe(launches)
    run = path_run(sub, seen.parts, reported)
    if run is not None and run[0] in PATHS[:2]:
        _check_split_plan(example, caps, sub, variant, run[0] == PATHS[1], seen.parts, layer)
    ran, source = run or (drawn, "plan")
    paths.note_call(features, drawn, ran, source, seen.parts, reported)
    paths.note_launches(launches)
    parts = f" in {seen.parts} parts" if seen.parts and seen.parts > 1 else ""
    how = _HOW.get(source, f"read from its launches: {', '.join(dict.fromkeys(seen.kernels))}")
    own = f"; the backend calls it {reported!r}" if reported and reported != ran else ""
    return f"{ran}{parts} ({how}){own}"


def _check_split_plan(
    example: Example,
    caps: Capabilities,
    sub: BatchMetadata,
    variant: AttentionVariant,
    split: bool,
    parts: int | None,
    layer: int,
) -> None:
    """A decode whose observed split the declared plan (``capabilities.decode_split``)
    contradicts stops the run as a setup error naming both: the suite draws by the plan."""
    plan = caps.decode_split
    if plan is None:
        return
    w = variant.window
    keys = max(n if w is None else min(n, w) for n in sub.seq_lens)
    if split and keys < plan.min_keys:
        into = "" if parts is None else f" into {parts} parts"
        seen = f"split a decode of {keys:,} visible keys{into}"
    elif not split and sub.num_seqs == 1 and keys >= plan.min_keys:
        seen = f"ran a lone decode of {keys:,} visible keys in a single pass"
    else:
        return
    raise SuiteStopped(
        SetupError(
            f"capabilities.decode_split says the kernel {plan.describe()}, but at step "
            f"{example.step_index}, layer {layer} it {seen}: declare the plan the kernel runs"
        )
    )
