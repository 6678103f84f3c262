"""The C++ key split and metadata filter equal webdataset's regular expressions."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from flashstream.engine import is_meta_name, split_key

WDS_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
WDS_META = re.compile(r"__[^/]*__($|/)")


def wds_split(name: str):
    match = WDS_KEY.match(name)
    return (match.group(1), match.group(2)) if match else None


def wds_meta(name: str) -> bool:
    return ("/" not in name and name.startswith("__") and name.endswith("__")) or bool(
        WDS_META.match(name))


def ours(name: str):
    got = split_key(name.encode("utf-8", "surrogateescape"))
    if got is None:
        return None
    return tuple(part.decode("utf-8", "surrogateescape") for part in got)


CASES = ["a.b", "a", ".a", "a.", "dir/.hidden", "a.b/c", "a.b/c.d", "x/y/z.tar.gz", "/a.b",
         "a/b/", "a\n/b.c", "a/\nb.c", "..", "a..b", "dir.x/.y", "über/ключ.jpg"]


def test_known_cases():
    for name in CASES:
        assert ours(name) == wds_split(name), name


@settings(max_examples=3000, deadline=None)
@given(st.text(alphabet="ab./\n_", max_size=12))
def test_split_key_matches_regex(name):
    assert ours(name) == wds_split(name)


@settings(max_examples=2000, deadline=None)
@given(st.text(alphabet="a_/.\n", max_size=10))
def test_meta_names_match_webdataset(name):
    assert is_meta_name(name.encode()) == wds_meta(name)
