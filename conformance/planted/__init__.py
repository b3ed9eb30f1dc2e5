"""Planted bugs and the selftest: the suite must catch every one.

Every deliberately wrong backend, kernel and scheduler lives here and nowhere else:
``backends``, ``variants``, ``groups``, ``device`` and ``kernels`` (Triton kernels for the
bounds checker), ``schedulers``; ``selftest`` runs them all and says which were caught.
"""
