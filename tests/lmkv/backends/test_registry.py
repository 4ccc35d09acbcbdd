"""The lazily connecting backend wrapper that every remote tier goes through."""

from __future__ import annotations

import contextlib
import logging

import pytest

from lmkv.backends.base import BackendError, StorageBackend
from lmkv.backends.registry import LazyBackend, check_url, create_backend, redact_url


class Flaky(StorageBackend):
    """Every other contains fails (a store over a bad link)."""

    calls = 0

    def put(self, items):
        pass

    def get(self, keys):
        return [None] * len(keys)

    def contains(self, keys):
        Flaky.calls += 1
        if Flaky.calls % 2:
            raise BackendError("timed out")
        return [False] * len(keys)


def test_reconnects_after_failures_log_one_line(caplog):
    """Each failed call drops the connection and the next makes a new client: the "client
    made" line goes out for the first only (a soak over a lossy link logged one per
    reconnect; during an outage it read as if the store answered), while every client is
    still made."""
    made = []
    lazy = LazyBackend(lambda: made.append(1) or Flaky(), "lm://store:1")
    with caplog.at_level(logging.INFO, logger="lmkv.backends.registry"):
        for _ in range(10):
            with contextlib.suppress(BackendError):
                lazy.contains(["a"])
    ready = [r for r in caplog.records if "client for lm://store:1 made" in r.getMessage()]
    assert len(made) == 6 and len(ready) == 1
    with pytest.raises(BackendError):  # (the next call fails: Flaky's 11th)
        lazy.contains(["a"])


def test_a_password_in_remote_url_is_never_logged_nor_put_in_an_error(caplog):
    from lmkv.config import load_config
    from lmkv_server.launcher import free_port

    url = f"redis://:s3cretpw@127.0.0.1:{free_port()}"
    caplog.set_level(logging.INFO)
    backend = create_backend(url, timeout=0.3)
    with pytest.raises(BackendError) as raised:  # nothing listens there
        backend.contains(["k"])
    backend.close()
    described = load_config(env={}, remote_url=url).describe()
    with pytest.raises(ValueError) as bad:
        check_url(url.replace("127.0.0.1:", "127.0.0.1:x"))
    shown = [r.getMessage() for r in caplog.records] + [str(raised.value), described, str(bad.value)]
    assert not [m for m in shown if "s3cretpw" in m]
    assert ":***@127.0.0.1" in described
    # a TLS key's passphrase in the query too (it was logged in clear)
    assert redact_url("rediss://h:6379?ssl_password=s3cret&key_prefix=a:b") == (
        "rediss://h:6379?ssl_password=***&key_prefix=a:b")


@pytest.mark.parametrize(("url", "message"), [
    ("redis://h:1?socket_timeout=x", "socket_timeout"),
    ("redis://h:1?sockettimeout=2", r"unknown Redis URL setting\(s\): sockettimeout"),
    ("redis-cluster://h:1/2", "database 0 only"),
])
def test_a_redis_url_the_client_would_refuse_is_refused_at_start(url, message):
    """Such settings passed the start-up check and failed every call, logged forever."""
    from lmkv.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(env={}, remote_url=url)
    assert check_url("rediss://:pw@h:1/3?key_prefix=a:&socket_timeout=2&ssl_cert_reqs=none") == "rediss"
