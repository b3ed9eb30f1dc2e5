"""The torch-native kernel API: validating wrappers around Triton kernels.

Every function takes torch tensors on one device (CUDA: compiled; CPU: Triton's
interpreter) in the layout ``[num_blocks, block_size, num_kv_heads, head_dim]``
per layer for K and for V (a latent cache: one ``[num_blocks, block_size,
latent_dim + rope_dim]`` tensor of rows a layer), and the int32/int64 batch
metadata of :mod:`spec.batch`.
"""

from backend_gpu.kernels.attention import choose_num_splits, paged_attention
from backend_gpu.kernels.block_copy import copy_blocks
from backend_gpu.kernels.kv_write import reshape_and_cache
from backend_gpu.kernels.latent_attention import paged_latent_attention
from backend_gpu.kernels.latent_write import write_latent
from backend_gpu.kernels.slot_mapping import compute_slot_mapping

__all__ = [
    "choose_num_splits",
    "compute_slot_mapping",
    "copy_blocks",
    "paged_attention",
    "paged_latent_attention",
    "reshape_and_cache",
    "write_latent",
]
