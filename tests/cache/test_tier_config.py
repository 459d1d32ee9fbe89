"""TierConfig: URL parsing, sizes, redaction, bad options."""

from __future__ import annotations

import pytest

from ragkv.cache.config import TierConfig, parse_size, redact_url


def test_ragkv_options_are_parsed_and_the_rest_kept_for_the_backend() -> None:
    config = TierConfig.from_url(
        "s3://bucket/kv?max_bytes=2GiB&ttl=60&timeout=1.5&write=0&policy=cost&endpoint_url=http://h:9000"
    )
    assert (config.scheme, config.location) == ("s3", "s3://bucket/kv")
    assert (config.max_bytes, config.ttl, config.timeout, config.writable, config.policy) == (
        2 << 30,
        60.0,
        1.5,
        False,
        "cost",
    )
    assert config.options == (("endpoint_url", "http://h:9000"),)
    assert config.given == {"max_bytes", "ttl", "timeout", "writable", "policy"}


@pytest.mark.parametrize(
    ("url", "scheme", "location"),
    [
        ("/var/kv", "disk", "/var/kv"),
        ("relative/kv?max_bytes=10", "disk", "relative/kv"),
        ("disk:///var/kv", "disk", "/var/kv"),
        ("memory://", "memory", "memory://"),
        ("REDIS://h:1/0", "redis", "redis://h:1/0"),
    ],
)
def test_schemes_and_locations(url: str, scheme: str, location: str) -> None:
    config = TierConfig.from_url(url)
    assert (config.scheme, config.location) == (scheme, location)


@pytest.mark.parametrize(
    ("text", "size"),
    [("0", 0), ("1048576", 1 << 20), ("512MiB", 512 << 20), ("2GB", 2 * 10**9), ("1.5 KiB", 1536), ("7b", 7)],
)
def test_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "-1", "1XB", "MiB", "1e9"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(ValueError, match="byte size"):
        parse_size(text)


@pytest.mark.parametrize("query", ["max_bytes=lots", "ttl=0", "timeout=-1", "write=maybe"])
def test_bad_option_values_name_the_option(query: str) -> None:
    with pytest.raises(ValueError, match=query.split("=")[0]):
        TierConfig.from_url(f"memory://?{query}")


def test_passwords_never_reach_names() -> None:
    assert redact_url("redis://user:hunter2@h:6379/0?x=1") == "redis://user:***@h:6379/0"
    assert redact_url("rediss://:hunter2@h") == "rediss://:***@h"
    assert redact_url("redis://hunter2@h") == "redis://***@h"
    config = TierConfig.from_url("redis://u:hunter2@h:1/0?ttl=5")
    assert "hunter2" not in config.display_url and "hunter2" in config.location


def test_empty_url_is_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        TierConfig.from_url("  ")


def test_repr_never_shows_a_password() -> None:
    cfg = TierConfig.from_url("redis://user:s3cret-pw@cache.example:6379/0?ttl=5&password=s3cret-pw&ssl=1")
    shown = repr(cfg)
    assert "s3cret-pw" not in shown
    assert "cache.example" in shown and "ttl=5.0" in shown and "('ssl', '1')" in shown
    assert "location='/tmp/kv'" in repr(TierConfig.from_url("/tmp/kv"))
