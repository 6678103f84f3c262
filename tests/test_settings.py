from __future__ import annotations

import pytest

from flashstream import parse_size, settings


@pytest.mark.parametrize("text,expected", [("4096", 4096), ("8MiB", 8 << 20),
                                           ("1.5GB", 1_500_000_000), ("64k", 64_000),
                                           ("2 GiB", 2 << 30), (123, 123)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "MiB", "12 parsecs", -1, True, 1.5])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_environment_and_override(monkeypatch):
    monkeypatch.setenv("FLASHSTREAM_ENGINE", "threads")
    monkeypatch.setenv("FLASHSTREAM_CHUNK_SIZE", "1MiB")
    monkeypatch.setenv("FLASHSTREAM_QUEUE_DEPTH", "3")
    monkeypatch.setenv("FLASHSTREAM_DIRECT", "0")
    now = settings.current()
    assert (now.engine, now.chunk_size, now.queue_depth, now.direct) == ("threads", 1 << 20, 3,
                                                                          False)
    with settings.override(engine="python", queue_depth=5) as inner:
        assert inner.engine == "python" and inner.queue_depth == 5
        assert settings.resolve(queue_depth=7).queue_depth == 7
    assert settings.current().engine == "threads"


def test_bad_environment(monkeypatch):
    monkeypatch.setenv("FLASHSTREAM_DIRECT", "maybe")
    with pytest.raises(ValueError, match="FLASHSTREAM_DIRECT"):
        settings.current()
    monkeypatch.delenv("FLASHSTREAM_DIRECT")
    with pytest.raises(ValueError, match="unknown setting"), settings.override(colour="red"):
        pass
