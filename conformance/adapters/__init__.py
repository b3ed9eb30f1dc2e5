"""Adapters of real paged-attention kernels: each another project's kernel as a suite backend.

One module per kernel family, each registered in the ``paged_spec.backends``
entry points (``paged-spec run --backend NAME``):

* ``flex`` (:mod:`~conformance.adapters.flex`): PyTorch's ``PagedAttention``
  on FlexAttention; eager on the CPU, compiled on CUDA. Needs ``paged-spec[torch]``.
* ``vllm-unified`` (:mod:`~conformance.adapters.vllm_unified`): vLLM's Triton
  unified attention (2D and 3D paths) and its KV write.
* ``vllm-mla`` (:mod:`~conformance.adapters.vllm_mla`): vLLM's Triton MLA decode.
* ``sglang-decode`` and ``sglang-extend`` (:mod:`~conformance.adapters.sglang_decode`,
  :mod:`~conformance.adapters.sglang_extend`): SGLang's Triton decode and extend kernels.

The Triton adapters need ``paged-spec[gpu]``. They import the kernels from the
installed vLLM or SGLang where it is installed; elsewhere they load the
kernel files of the pinned release's wheel, fetched once and verified by
hash (:mod:`~conformance.adapters._fetch`), beside stand-ins for the few
engine modules those files import (:mod:`~conformance.adapters._load`).
Each adapter's docstring says what it declares and cites the kernel's lines
that make it so; each has a hand check of its own against a plain float64
reference (``tests/test_adapters_*.py``).
"""

ADAPTERS = {
    "flex": "conformance.adapters.flex:make_backend",
    "vllm-unified": "conformance.adapters.vllm_unified:make_backend",
    "vllm-mla": "conformance.adapters.vllm_mla:make_backend",
    "sglang-decode": "conformance.adapters.sglang_decode:make_backend",
    "sglang-extend": "conformance.adapters.sglang_extend:make_backend",
}
"""Each adapter's entry-point name and factory (pyproject.toml registers the same)."""
