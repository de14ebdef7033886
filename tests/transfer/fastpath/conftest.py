"""The ``rank`` fixture of the fast-path tests (``tests.transfer.fastpath.rig``)."""

from __future__ import annotations

import pytest

from tests.transfer.fastpath.rig import shm_rank


@pytest.fixture
def rank():
    """A rank-0 server of a cp=1 layout whose pool lives in /dev/shm."""
    with shm_rank() as served:
        yield served
