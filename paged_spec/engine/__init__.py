"""A tiny engine: the spec's scheduler and memory serving a tiny model through any backend."""
