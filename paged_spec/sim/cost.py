"""A roofline cost model of one forward step: the simulator's clock.

A step takes as long as the slower of its two demands on the GPU: moving bytes
through HBM (the weights once, plus the KV it reads and writes) and doing
arithmetic (two FLOPs per parameter per token, plus attention's score and
value products). A decode step has one token per sequence, so its arithmetic
is small and its time is the weights' streaming time, flat in the batch size
until the batch is large enough to be compute-bound. Prefill has many tokens
per sequence and costs by tokens. The defaults are an 8B model in bf16 on an
H200-class GPU: 16 GB of weights, 4.8 TB/s (the H200's datasheet HBM
bandwidth) and 790 TFLOP/s, a measured bf16 matrix-product rate on the H200
(the datasheet's dense bf16 peak is about 989 TFLOP/s; a real kernel reaches
less, so the clock uses the measured rate).

>>> gpu, model = GPU_PRESETS["h200"], MODEL_PRESETS["llama-3.1-8b"]
>>> decode = lambda n: step_seconds(gpu, model, [(1, 1)] * n)     # n one-token sequences
>>> round(decode(1) * 1e3, 1), round(decode(150) * 1e3, 1)        # ms: flat while memory-bound
(3.3, 3.3)
>>> round(decode(400) * 1e3, 2)                                   # compute-bound past the ridge
8.1
>>> round(ridge_batch(gpu, model))                                # tokens per step at the ridge
165
>>> round(step_seconds(gpu, model, [(2048, 2048)]) * 1e3, 1)      # one 2,048-token prefill
42.9

A hybrid model (a 27B: 16 full-attention layers, 48 DeltaNet
layers with 144 MiB of float32 state a sequence) also reads and writes each
scheduled sequence's state once a step: ten 32,768-token sessions decode in
11.25 ms of weights, 4.5 ms of KV and 0.6 ms of state:

>>> hybrid = MODEL_PRESETS["hybrid-27b"]
>>> [round(step_seconds(gpu, hybrid, [(1, 32_768)] * n) * 1e3, 1) for n in (1, 10)]
[11.8, 16.4]

A DeepSeek-V3-shaped model keeps latent KV (multi-head latent attention),
68.6 KiB a token: 64 decodes of 8,192 tokens read 36.8 GB of it a step, where
8 grouped KV heads of 128 would read 131 GB. The absorbed form computes more
per key (each of its 128 heads takes a 576-wide score and a 512-wide sum),
which this clock counts too: the latent step is bound by arithmetic, at half
the grouped step's time. Its weights are an assumption: the 37 GB of its 37B
activated parameters in fp8, the least a step streams.

>>> from dataclasses import replace
>>> mla = MODEL_PRESETS["deepseek-v3"]
>>> gqa = replace(mla, num_kv_heads=8, head_dim=128, latent_dim=None)
>>> [round(64 * 8192 * m.kv_bytes_per_token / 1e9, 1) for m in (mla, gqa)]   # GB of KV read
[36.8, 131.0]
>>> [round(step_seconds(gpu, m, [(1, 8192)] * 64) * 1e3, 1) for m in (mla, gqa)]
[17.3, 35.0]
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from spec.kv_budget import kv_bytes_per_token, latent_bytes_per_token


@dataclass(frozen=True)
class Gpu:
    """The clock's HBM bandwidth (bytes/s) and bf16 matrix-product rate (FLOP/s)."""

    name: str
    hbm_bytes_per_s: float
    flops_per_s: float


@dataclass(frozen=True)
class ModelCost:
    """What a step of this model moves and computes."""

    name: str
    weight_bytes: float
    params: float
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    state_bytes: int = 0  # a fixed-size state per sequence (linear-attention layers), float32
    latent_dim: int | None = None  # latent KV (MLA): rows of head_dim, latent_dim of them c_kv

    @property
    def kv_bytes_per_token(self) -> int:
        if self.latent_dim is not None:
            rope = self.head_dim - self.latent_dim
            return latent_bytes_per_token(self.num_layers, self.latent_dim, rope, self.dtype_bytes)
        return kv_bytes_per_token(
            self.num_layers, self.num_kv_heads, self.head_dim, self.dtype_bytes
        )

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs of one (query, visible key) pair over every layer and head: a multiply and an
        add per score element (``head_dim``) and per value element (``head_dim``, or a latent
        row's ``latent_dim``)."""
        value_dim = self.head_dim if self.latent_dim is None else self.latent_dim
        return 2 * self.num_layers * self.num_heads * (self.head_dim + value_dim)


GPU_PRESETS = {"h200": Gpu("h200", hbm_bytes_per_s=4.8e12, flops_per_s=790e12)}
"""H200: datasheet bandwidth; measured (not datasheet, about 989e12) bf16 matrix products."""
MODEL_PRESETS = {
    "llama-3.1-8b": ModelCost(
        "llama-3.1-8b", weight_bytes=16e9, params=8e9, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128,
    ),
    "hybrid-27b": ModelCost(
        "hybrid-27b", weight_bytes=54e9, params=27e9, num_layers=16, num_heads=16,
        num_kv_heads=4, head_dim=256, state_bytes=144 * 2**20,
    ),
    "deepseek-v3": ModelCost(
        "deepseek-v3", weight_bytes=37e9, params=37e9, num_layers=61, num_heads=128,
        num_kv_heads=1, head_dim=576, dtype_bytes=2, latent_dim=512,
    ),
}  # fmt: skip
"""Llama 3.1 8B, and a hybrid 27B: ``num_layers`` counts the layers that keep K
and V (16; 64 KiB a token), ``state_bytes`` the other 48 layers' state; its 16 query heads
are an assumption of this model (the worked example gives only the KV bill). ``deepseek-v3``
keeps DeepSeek-V3's latent KV (61 layers of 512 + 64 in bf16, 128 query heads); its weights
are the 37B activated parameters in fp8 (a real MoE step streams more experts as its batch
grows, and the whole model spans several devices): the clock compares KV layouts, not the
model's absolute speed."""


def step_seconds(gpu: Gpu, model: ModelCost, work: Iterable[tuple[int, int]]) -> float:
    """Time of one step that computes, for each ``(new_tokens, context)``, ``new_tokens`` tokens
    of a sequence whose context is ``context`` tokens once they are in (so ``new <= context``).

    Bytes: weights, plus every context token's K/V read and every new token's K/V written,
    plus, with a fixed-size state, each sequence's state read and written once.
    FLOPs: ``2 x params`` per new token, plus :attr:`ModelCost.attention_flops_per_pair`
    (``4 x layers x heads x head_dim`` with K and V of one width) per (query, visible key)
    pair, plus ``4`` per state element per new token (a
    linear-attention layer reads and updates its whole state for each token).
    """
    tokens = kv_read = pairs = seqs = 0
    for new, context in work:
        seqs += 1
        if not 0 < new <= context:
            raise ValueError(f"need 0 < new_tokens <= context, got ({new}, {context})")
        tokens += new
        kv_read += context
        past = context - new
        pairs += new * past + new * (new + 1) // 2  # causal: query i sees past + i + 1 keys
    if tokens == 0:
        return 0.0
    bytes_moved = model.weight_bytes + (kv_read + tokens) * model.kv_bytes_per_token
    bytes_moved += 2 * seqs * model.state_bytes
    flops = (
        2 * model.params * tokens
        + model.attention_flops_per_pair * pairs
        + 4 * tokens * model.state_bytes // 4
    )
    return max(bytes_moved / gpu.hbm_bytes_per_s, flops / gpu.flops_per_s)


def ridge_batch(gpu: Gpu, model: ModelCost) -> float:
    """Tokens per step at which the weights' arithmetic takes as long as streaming them."""
    return model.weight_bytes / gpu.hbm_bytes_per_s * gpu.flops_per_s / (2 * model.params)


def idle_step_seconds(gpu: Gpu, model: ModelCost) -> float:
    """How long a step that computes nothing lasts: the shortest real step, one decode token.

    A static batch waiting to fill runs such steps; the engine looks at its queue
    once a tick. Tying the tick to a lone decode step (the weights' streaming time)
    makes a step of waiting last about as long as a step of a small batch.
    """
    return step_seconds(gpu, model, [(1, 1)])
