"""The scheduler suite: any scheduler against the spec's invariants on drawn workloads.

``suite`` runs it; ``invariants`` checks each step; ``workloads`` draws request streams;
``report`` writes its reports; ``engine`` runs the scheduler under test through the engine
loop of :mod:`paged_spec.engine` with its tiny model; ``watched`` reports every call into the
scheduler to the run's watch, and ``isolation`` with ``worker`` run the suite in a child process.
"""
