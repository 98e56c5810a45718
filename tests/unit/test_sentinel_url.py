"""``redis+sentinel://`` URLs: what they name, and one clear error for each malformed part."""

from __future__ import annotations

import pytest

from pipeline.errors import ConfigurationError
from pipeline.transport.redis.client import parse_sentinel_url

pytestmark = pytest.mark.unit


def test_sentinels_service_database_and_passwords() -> None:
    address = parse_sentinel_url(
        "redis+sentinel://:s3cret@10.0.0.1:26379,10.0.0.2,[::1]:26380/orders/2"
        "?sentinel_password=watch"
    )
    assert address.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26379), ("::1", 26380))
    assert (address.service, address.db) == ("orders", 2)
    assert (address.username, address.password, address.sentinel_password) == (
        None,
        "s3cret",
        "watch",
    )


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+sentinel://h:x/svc", "Sentinel URL: port 'x' is not a number"),
        ("redis+sentinel://h:70000/svc", "Sentinel URL: port 70000 is out of range"),
        ("redis+sentinel://h:26379", "Sentinel URL: the path must be /service_name"),
        ("redis+sentinel://h:26379/svc/db", "Sentinel URL: database 'db' is not a number"),
        ("redis+sentinel://:pw@h:26379/a/1/2", "Sentinel URL: the path must be /service_name"),
    ],
)
def test_malformed_urls_are_named_without_the_password(url: str, message: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        parse_sentinel_url(url)
    assert str(caught.value).startswith(message)
    assert "pw" not in str(caught.value)
