"""The lockstep: one workload driven through the spec and a backend, step by step.

``machine`` is the Hypothesis state machine that draws the workload; ``driver`` holds
:class:`Lockstep`, which applies each step to both sides and asks the judges; ``plan``,
``envelope``, ``groups`` and ``variants`` decide what a run draws for a backend's
capabilities; ``workload`` and ``group_memory`` are the drawn configuration and the spec's
memory for KV cache groups; ``spec_side`` is the spec's bookkeeping alone (another
shard's examples); ``numpy_backend`` is the reference backend the planted bugs start from.
"""
