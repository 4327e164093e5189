import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# No test may reach a hub; the embedded world uses only packaged weights.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


def load_script(name: str):
    """A workflow/scripts/*.py entry point as a module, to drive its main() with a stand-in `snakemake`."""
    import importlib.util

    path = REPO / "workflow" / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"script_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
