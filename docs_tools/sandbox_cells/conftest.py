"""The sandbox page's cells are run by tests/test_sandbox_cells.py, each in a namespace of
its own; collecting them as modules would run them at import (one fails on purpose, one
never ends)."""

collect_ignore_glob = ["*.py"]
