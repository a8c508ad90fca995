"""Engine hosts shared by the token feed tests (test_feed_server, test_token_feed,
test_handles): built once per module that uses them."""

from __future__ import annotations

import pytest

from tests.cluster.engine_host.test_host import engine_host


@pytest.fixture(scope="module")
def colocated_host():
    w = engine_host("colocated", name="feed-colocated")
    yield w
    w.shutdown()


@pytest.fixture(scope="module")
def pd_hosts():
    prefill = engine_host("prefill", name="feed-prefill")
    decode = engine_host("decode", name="feed-decode")
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()
