"""Language-neutral test vectors: export from the spec, check a backend against them.

``format`` is the on-disk format (JSON manifests, ``.npy`` arrays; the JSON Schema in
``schema/``); ``export`` writes vectors; ``check`` replays them on a backend. A C99 reader
with no dependencies is in ``reader_c/``.
"""
