"""Runnable tools built on the spec, each a module run as ``python -m tools.NAME``.

For example ``python -m tools.capacity`` (how many sequences fit) and
``python -m tools.simulate`` (static against continuous batching, contiguous
against paged memory). Private helpers start with ``_``.
"""
