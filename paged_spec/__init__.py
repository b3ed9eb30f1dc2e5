"""Tools built on the spec, each run as ``python -m paged_spec.NAME``.

``capacity`` (how many sequences fit), ``simulate`` (static against continuous batching,
contiguous against paged memory), ``sandbox`` (a toy block table, step by step),
``engine_demo`` (a tiny model served by the engine loop). ``engine`` is the engine loop and
tiny model, shared with the scheduler suite; ``cells`` runs the docs' sandbox page's cells
(in the reader's browser).
"""
