"""``locks.url`` must name the same server and user (only the password hidden): operators
copy it into ``aiolock ls --url`` / ``revoke --url`` (plus the password)."""

from __future__ import annotations

import pytest

import aiolock


async def test_url_keeps_the_user(shared_url: str, request: pytest.FixtureRequest) -> None:
    if "@" not in shared_url:
        pytest.skip("no user in this URL")
    async with aiolock.connect(shared_url) as locks:
        user = shared_url.split("://", 1)[1].split("@", 1)[0].split(":", 1)[0]
        assert f"{user}@" in locks.url, locks.url
        assert "s3cret" not in locks.url
