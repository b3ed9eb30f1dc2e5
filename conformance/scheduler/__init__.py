"""The scheduler suite: any scheduler against the spec's invariants on drawn workloads.

``suite`` runs it; ``invariants`` checks each step; ``workloads`` draws request streams;
``report`` writes its reports; ``engine`` runs the scheduler under test through the engine
loop of :mod:`paged_spec.engine` with its tiny model.
"""
