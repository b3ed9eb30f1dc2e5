"""One quick-profile export shared by the vector tests (few examples: Triton is interpreted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.vectors_export import ExportSummary, export_vectors

SEED = 1  # with one example per pass, this export catches every planted bug
EXAMPLES = 1


@pytest.fixture(scope="session")
def exported(tmp_path_factory: pytest.TempPathFactory) -> ExportSummary:
    """Vectors of the quick profile with one example per pass, and what the export wrote."""
    return export_vectors(
        tmp_path_factory.mktemp("vectors") / "quick", seed=SEED, examples=EXAMPLES
    )


def manifests(root: Path) -> list[Path]:
    return sorted(root.glob("*/manifest.json"))
