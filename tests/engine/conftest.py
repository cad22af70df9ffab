from __future__ import annotations

import pytest

from tests.helpers import make_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=11)
