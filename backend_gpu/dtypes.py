"""The torch dtype of each dtype name of the contract: one table for the backends and kernels.

Here, not beside the kernels, because importing it must not import Triton: the eager
torch backend (:mod:`backend_gpu.torch_backend`) runs where Triton is not installed
(``pip install 'paged-spec[torch]'``).

>>> TORCH_DTYPES["bfloat16"], FP8_TORCH["fp8_e4m3"]
(torch.bfloat16, torch.float8_e4m3fn)
"""

from __future__ import annotations

import torch

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
"""The torch dtype of each activation dtype (queries, new K and V, outputs)."""
FP8_TORCH = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
"""The torch dtype of each quantized KV dtype of the contract."""
