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
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    _language = sys.modules.get("triton.language")
    _on = os.environ["TRITON_INTERPRET"].strip().lower() in ("1", "true", "yes", "on")
    if _on and _language is not None and type(_language.zeros).__name__ == "JITFunction":
        raise ImportError(
            "triton was imported before backend_gpu on a machine without CUDA, so its language "
            "was built for compiled kernels, which cannot run on CPU tensors: set "
            "TRITON_INTERPRET=1 before importing triton, or import backend_gpu first"
        )
