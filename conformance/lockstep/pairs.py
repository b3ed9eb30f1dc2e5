"""Feature x kernel path pairs: which ones matter, which a call reached, and why one cannot be.

A feature meets a kernel path only if some attention call combines them: a
layer with sinks on the split-KV decode path, say, where a kernel merges
partial softmaxes and may count the sink once per split. Left to chance, a
quick run never draws some pairs, so the suite constructs them: the feature
passes, the large pool and the KV cache groups open with a sequence long
enough to be split and a prompt that joins its decodes
(:meth:`~conformance.lockstep.machine.LockstepMachine.start`), and the
:class:`~conformance.judges.coverage.Coverage` of the run lists the pairs
reached and any that could not be, with why.

The paths are what the suite can provoke (:data:`PATHS`), whatever the
backend calls them; a backend's own ``attention_path()`` names are listed
beside them. The suite *draws* a decode as split-KV when its longest visible
context reaches :func:`split_keys` (the backend's declared
:class:`~spec.capabilities.DecodeSplit`, else a guess: 256 keys on the CPU
envelope, 1024 on a device); what path a call *ran* is observed
(:func:`path_run`): from its kernel launches, else from ``attention_path()``,
and only when neither says is it the plan's, which reports then say.

>>> from spec.backend import Capabilities
>>> wanted, why = planned_pairs(Capabilities("x", variants={"sinks", "alibi"}), "cpu")
>>> [f for f, p in wanted if p == "split-KV decode"]
['alibi', 'sinks', 'alibi+sinks', 'large pool']
>>> _, why = planned_pairs(Capabilities("x", kv_groups=True, mixed_batches=False), "cpu")
>>> why[("KV cache groups", "mixed")]
'mixed_batches is False (decodes and chunks run as separate calls)'

The latent layout (multi-head latent attention) is a feature of its own when
declared: its rows on every path, in an fp8 cache too, and a chunk after
cached latent rows (the latent feature passes open with all of them):

>>> wanted, _ = planned_pairs(Capabilities("x", kv_dtypes={"fp8_e4m3"}, latent=None), "cpu")
>>> sorted({f for f, _ in wanted if "latent" in f})
['fp8+latent', 'latent', 'latent+cached context']
"""

from __future__ import annotations

from spec.attention import VARIANTS, AttentionVariant
from spec.backend import Capabilities
from spec.batch import BatchMetadata

PATHS = ("single-pass decode", "split-KV decode", "prefill", "mixed")
"""The kernel paths the suite provokes: decodes short and long, prefill chunks, and both."""
COMBINED = (("alibi", "sinks"), ("softcap", "window"))
"""Variants that matter together: an ALiBi origin only a sink shows; a window edge under a cap."""
CACHED = "cached context"
"""A prefill chunk after tokens already in the cache (an earlier chunk or a prefix hit)."""
LARGE = "large pool"
GROUPS = "KV cache groups"
LATENT = "latent"
"""The latent layout: one row ``[c_kv, k_rope]`` a token, shared by every query head."""

Pair = tuple[str, str]


def split_keys(caps: Capabilities, device: str) -> int:
    """The visible context from which the suite draws a lone decode as split-KV: where the
    backend declares its kernel splits (``caps.decode_split``), else a guess for envelope
    ``device``.

    >>> from spec.capabilities import DecodeSplit
    >>> split_keys(Capabilities("x"), "cpu"), split_keys(Capabilities("x"), "device")
    (256, 1024)
    >>> split_keys(Capabilities("x", decode_split=DecodeSplit(1024, 512, 64)), "cpu")
    1024
    """
    if caps.decode_split is not None:
        return caps.decode_split.min_keys
    return 256 if device == "cpu" else 1024


def path_run(
    batch: BatchMetadata, parts: int | None, reported: str | None
) -> tuple[str, str] | None:
    """The path one call ran and how that is known (``"launches"``, ``"attention_path"``), or
    ``None`` when nothing says: its mix of decodes and prefill chunks is the batch's, and for
    a decode-only call, whether it split is what its launches read (``parts``) or, failing
    them, the path the backend's ``attention_path()`` named.

    >>> b = BatchMetadata(16, (0,), (0, 1), (300,), ((0,) * 19,), (0,), (299,))
    >>> path_run(b, 1, None), path_run(b, None, "split-KV decode"), path_run(b, None, "mine")
    (('single-pass decode', 'launches'), ('split-KV decode', 'attention_path'), None)
    """
    kind = call_path(batch, None, 0)
    if kind not in PATHS[:2]:
        known = parts is not None or reported in PATHS
        return (kind, "launches" if parts is not None else "attention_path") if known else None
    if parts is not None:
        return PATHS[1] if parts > 1 else PATHS[0], "launches"
    if reported in PATHS[:2]:
        return reported, "attention_path"
    return None


def call_path(batch: BatchMetadata, window: int | None, split_at: int) -> str:
    """The path of one attention call: its mix of decodes and prefill chunks, and for a
    decode-only call whether its longest visible context reaches ``split_at`` keys.

    >>> from spec.batch import BatchMetadata
    >>> b = BatchMetadata(16, (0,), (0, 1), (300,), ((0,) * 19,), (0,), (299,))
    >>> call_path(b, None, 256), call_path(b, 64, 256)
    ('split-KV decode', 'single-pass decode')
    """
    decodes = sum(batch.query_len(i) == 1 for i in range(batch.num_seqs))
    if decodes == batch.num_seqs:
        longest = max((n if window is None else min(n, window) for n in batch.seq_lens), default=0)
        return PATHS[1] if longest >= split_at else PATHS[0]
    return PATHS[2] if decodes == 0 else PATHS[3]


def call_features(
    variant: AttentionVariant,
    kv_dtype: str | None,
    batch: BatchMetadata,
    *,
    grouped: bool,
    large: bool,
    latent: bool = False,
) -> set[str]:
    """The features one layer's attention call combines (:func:`feature_names` names them)."""
    names = set(variant.features)
    names |= {f"{a}+{b}" for a, b in COMBINED if a in names and b in names}
    if kv_dtype is not None:
        names |= {kv_dtype, *(f"fp8+{v}" for v in variant.features)}
    if grouped:
        names.add(GROUPS)
    cached = any(
        batch.query_len(i) > 1 and batch.seq_lens[i] > batch.query_len(i)
        for i in range(batch.num_seqs)
    )
    if large:
        names.add(LARGE)
    if latent:
        names |= {LATENT, *(f"{LATENT}+{v}" for v in variant.features)}
        if kv_dtype is not None:
            names.add(f"fp8+{LATENT}")
    if cached:
        names.add(CACHED)
        names |= {f"{f}+{CACHED}" for f, on in ((LARGE, large), (LATENT, latent)) if on}
    return names


def feature_names(caps: Capabilities) -> list[str]:
    """The features whose pairs matter for a backend with ``caps``, in report order."""
    variants = [v for v in VARIANTS if v in caps.variants]
    names = sorted(variants)
    names += [f"{a}+{b}" for a, b in COMBINED if a in variants and b in variants]
    names += sorted(caps.kv_dtypes)
    if caps.kv_dtypes:
        names += [f"fp8+{v}" for v in sorted(variants)]
    if caps.kv_groups:
        names.append(GROUPS)
    if latent_declared(caps):
        names += [LATENT, *(f"{LATENT}+{v}" for v in sorted(variants))]
        names += [f"fp8+{LATENT}"] if caps.kv_dtypes else []
    return [*names, LARGE]


def latent_declared(caps: Capabilities) -> bool:
    """Whether ``caps`` declares the latent layout (``None``: any; a non-empty set)."""
    return caps.latent is None or bool(caps.latent)


def planned_pairs(caps: Capabilities, device: str) -> tuple[list[Pair], dict[Pair, str]]:
    """The pairs that matter, and for those the backend's capabilities rule out, why.

    Every feature with every path; a chunk after cached context (and in the
    large pool) with the prefill and mixed paths only (a decode always reads
    cached context).
    """
    wanted = [(f, p) for f in feature_names(caps) for p in PATHS]
    wanted += [(CACHED, PATHS[2]), (CACHED, PATHS[3]), (f"{LARGE}+{CACHED}", PATHS[2])]
    if latent_declared(caps):
        wanted += [(f"{LATENT}+{CACHED}", PATHS[2]), (f"{LATENT}+{CACHED}", PATHS[3])]
    split = split_keys(caps, device)
    why: dict[Pair, str] = {}
    for feature, path in wanted:
        reason = _path_reason(caps, path, split) or _feature_reason(caps, feature, path)
        if reason:
            why[(feature, path)] = reason
    return wanted, why


def _path_reason(caps: Capabilities, path: str, split: int) -> str | None:
    if path in PATHS[:2] and not caps.decode:
        return "capabilities.decode is False"
    if path in PATHS[2:] and caps.max_query_len == 1:
        return "max_query_len is 1 (decode-only)"
    if path == PATHS[3] and not caps.mixed_batches:
        return "mixed_batches is False (decodes and chunks run as separate calls)"
    if path == PATHS[1] and caps.max_context_len is not None and caps.max_context_len <= split:
        return f"max_context_len {caps.max_context_len} is below a split-KV context ({split} keys)"
    return None


def _feature_reason(caps: Capabilities, feature: str, path: str) -> str | None:
    if CACHED in feature and not caps.chunked_prefill:
        return "chunked_prefill is False: a chunk after cached context is not attended"
    return None
