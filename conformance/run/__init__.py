"""The run: plan a run, drive it in a child process under a watchdog, and collect its result.

``runner`` holds the profiles and :func:`run_suite`; ``control`` the run's options;
``isolation``, ``worker``, ``protocol`` and ``watchdog`` keep a crashing, hanging or
exiting backend from taking the suite down with it; ``calls`` splits a step into the
attention calls a backend accepts; ``discovery`` loads a backend by name; ``shard`` splits
a run's examples over machines and ``database`` opens the (shared) example database;
``terminate`` handles SIGTERM as SIGINT.
"""
