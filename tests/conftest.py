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
