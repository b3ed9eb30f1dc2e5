"""Paged KV memory and attention on torch tensors: Triton kernels and an eager PyTorch backend.

Importing this package on a machine without CUDA turns on Triton's interpreter
(``TRITON_INTERPRET=1``) unless the caller already chose, because a compiled
Triton kernel cannot run on CPU tensors; the environment variable must be set
before the first kernel is decorated, which is why it happens here.

* :mod:`backend_gpu.kernels` - the torch-native kernel API (KV write, block copy,
  slot mapping, unified paged attention), each behind a validating wrapper.
* :mod:`backend_gpu.triton_backend` - :class:`TritonBackend`, the spec's
  ``Backend`` on those kernels.
* :mod:`backend_gpu.torch_backend` - :class:`TorchBackend`, the same contract in
  plain PyTorch ops: an independent second implementation.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
