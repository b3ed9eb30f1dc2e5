"""A tiny deterministic decoder-only transformer, and its unbatched reference run.

Random fp32 weights from a seed: token and learned position embeddings, a few
pre-norm layers of grouped-query attention and a GELU MLP, a vocabulary of a
few hundred tokens. The same weights run two ways:

* :meth:`TinyModel.forward_paged` - one scheduler step: every scheduled token
  of every sequence in one flattened batch; per layer K and V are written
  through the slot mapping (``Backend.write_kv``) and attention reads them
  back through the block tables (``Backend.attention``);
* :meth:`TinyModel.forward_contiguous` - one sequence alone, every position
  at once, plain causal attention over contiguous tensors: no pages, no batch.

:func:`generate_alone` runs a request sample by itself with the second; the
engine must reproduce it token for token with the first.

Sampling draws token ``j`` of sample ``i`` with its own generator, seeded from
``(request seed, i, j)``: what a sample draws cannot depend on who shares the
batch, on chunking, or on preemption (Gumbel-max: argmax of logits / T plus
Gumbel noise, which is exact sampling from the softmax).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from spec.backend import Backend
from spec.batch import BatchMetadata
from spec.request import Request


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of the tiny model; ``num_heads`` must be a multiple of ``num_kv_heads``."""

    vocab_size: int = 256
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    d_ff: int = 128
    max_positions: int = 512
    seed: int = 0


class TinyModel:
    """Weights drawn from ``torch.Generator().manual_seed(config.seed)``; fp32 on CPU."""

    def __init__(self, config: ModelConfig | None = None) -> None:
        cfg = config or ModelConfig()
        if cfg.num_heads % cfg.num_kv_heads:
            raise ValueError(f"num_heads {cfg.num_heads} % num_kv_heads {cfg.num_kv_heads} != 0")
        self.config = cfg
        g = torch.Generator().manual_seed(cfg.seed)

        def w(*shape: int, scale: float) -> torch.Tensor:
            return torch.randn(*shape, generator=g, dtype=torch.float32) * scale

        d, hd = cfg.d_model, cfg.head_dim
        self.embed = w(cfg.vocab_size, d, scale=1.0)
        self.pos_embed = w(cfg.max_positions, d, scale=1.0)
        self.layers = [
            {
                "wq": w(d, cfg.num_heads * hd, scale=1 / math.sqrt(d)),
                "wk": w(d, cfg.num_kv_heads * hd, scale=1 / math.sqrt(d)),
                "wv": w(d, cfg.num_kv_heads * hd, scale=1 / math.sqrt(d)),
                "wo": w(cfg.num_heads * hd, d, scale=1 / math.sqrt(cfg.num_heads * hd)),
                "w1": w(d, cfg.d_ff, scale=1 / math.sqrt(d)),
                "w2": w(cfg.d_ff, d, scale=1 / math.sqrt(cfg.d_ff)),
            }
            for _ in range(cfg.num_layers)
        ]
        self.unembed = w(d, cfg.vocab_size, scale=4 / math.sqrt(d))
        self.scale = 1 / math.sqrt(hd)

    # -- the shared pieces ------------------------------------------------------------

    def _input(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if positions.numel() and int(positions.max()) >= self.config.max_positions:
            raise ValueError(f"position beyond max_positions {self.config.max_positions}")
        return self.embed[tokens] + self.pos_embed[positions]

    def _qkv(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cfg, p = self.config, self.layers[layer]
        h = _rms_norm(x)
        q = (h @ p["wq"]).view(-1, cfg.num_heads, cfg.head_dim)
        k = (h @ p["wk"]).view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = (h @ p["wv"]).view(-1, cfg.num_kv_heads, cfg.head_dim)
        return q, k, v

    def _finish_layer(self, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        p = self.layers[layer]
        x = x + attn.reshape(x.shape[0], -1) @ p["wo"]
        return x + torch.nn.functional.gelu(_rms_norm(x) @ p["w1"]) @ p["w2"]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[R, d_model]`` final hidden states to ``[R, vocab_size]`` logits."""
        return _rms_norm(hidden) @ self.unembed

    # -- two ways to run it -----------------------------------------------------------

    def forward_paged(
        self, token_ids: list[int] | tuple[int, ...], batch: BatchMetadata, backend: Backend
    ) -> torch.Tensor:
        """Hidden states ``[T, d_model]`` for one step's flattened batch, KV through ``backend``."""
        tokens = torch.tensor(token_ids, dtype=torch.long)
        x = self._input(tokens, torch.tensor(batch.positions, dtype=torch.long))
        for layer in range(self.config.num_layers):
            q, k, v = self._qkv(layer, x)
            backend.write_kv(layer, k.numpy(), v.numpy(), batch.slot_mapping)
            out = backend.attention(layer, q.numpy(), batch, self.scale)
            attn = torch.from_numpy(np.asarray(out, dtype=np.float32))
            x = self._finish_layer(layer, x, attn)
        return x

    def forward_contiguous(self, token_ids: list[int] | tuple[int, ...]) -> torch.Tensor:
        """Hidden states ``[L, d_model]`` of one sequence, plain causal attention, no paging."""
        n = len(token_ids)
        x = self._input(torch.tensor(token_ids, dtype=torch.long), torch.arange(n))
        group = self.config.num_heads // self.config.num_kv_heads
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        for layer in range(self.config.num_layers):
            q, k, v = self._qkv(layer, x)
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
            x = self._finish_layer(layer, x, torch.einsum("hqk,khd->qhd", weights, v))
        return x


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6)


def sample(logits: torch.Tensor, request: Request, sample_index: int, position: int) -> int:
    """Token ``position`` of sample ``sample_index``: greedy at temperature 0, else seeded.

    >>> r = Request(request_id=0, prompt=(1,), max_new_tokens=1, temperature=1.0, seed=5)
    >>> x = torch.zeros(8)
    >>> sample(x, r, 0, 0) == sample(x.clone(), r, 0, 0)   # same draw, however it was batched
    True
    """
    if request.temperature == 0:
        return int(torch.argmax(logits))
    g = torch.Generator().manual_seed(hash((request.seed, sample_index, position)) & (2**63 - 1))
    u = torch.rand(logits.shape[-1], generator=g, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
    gumbel = -torch.log(-torch.log(u))
    return int(torch.argmax(logits.double() / request.temperature + gumbel))


def generate_alone(model: TinyModel, request: Request, sample_index: int = 0) -> tuple[int, ...]:
    """Sample ``sample_index`` of ``request`` run by itself with contiguous attention."""
    tokens = list(request.prompt)
    out: list[int] = []
    while len(out) < request.max_new_tokens:
        hidden = model.forward_contiguous(tokens)
        token = sample(model.logits(hidden[-1:])[0], request, sample_index, len(out))
        out.append(token)
        tokens.append(token)
        if token in request.stop_tokens:
            break
    return tuple(out)
