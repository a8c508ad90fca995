"""Engine workers shared by the token feed tests (test_feed_server, test_token_feed,
test_handles): built once per module that uses them."""

from __future__ import annotations

import pytest

from tests.cluster.test_worker import worker


@pytest.fixture(scope="module")
def colocated_worker():
    w = worker("colocated", name="feed-colocated")
    yield w
    w.shutdown()


@pytest.fixture(scope="module")
def pd_workers():
    prefill, decode = worker("prefill", name="feed-prefill"), worker("decode", name="feed-decode")
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()
