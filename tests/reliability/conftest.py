"""Fixtures of the reliability tests (tests/conftest.py has the session's Ray and tiny model)."""

from __future__ import annotations

import pytest


@pytest.fixture
def no_leftover_workers(ray_session):
    """After the test, every worker process and placement group its fits started is gone: a dead,
    hung or failed worker must not leak into the next test (the trainer's shutdown kills them)."""
    from reliability import runs

    before = runs.live_workers()
    yield
    runs.assert_no_new_workers(before)
