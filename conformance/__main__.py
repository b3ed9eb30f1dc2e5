"""Entry point of ``python -m conformance``; see :mod:`conformance.cli`."""

import sys

from conformance.cli import main

sys.exit(main())
