from __future__ import annotations

import pytest
from fake_openai import FakeOpenAI  # tests/load is on sys.path (rootdir-relative "prepend" imports)


@pytest.fixture(scope="module")
def fake_server():
    server = FakeOpenAI().start()
    yield server
    server.stop()
