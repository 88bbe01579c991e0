"""Every attack test ends by checking that the host kept its headroom, whatever the attack did."""

from __future__ import annotations

import pytest

from tests.sandboxes.conftest import host_is_healthy


@pytest.fixture(autouse=True)
def host_stays_healthy():
    yield
    host_is_healthy()
