"""Turning what users pass as ``urls`` into a list of local shard paths."""

from __future__ import annotations

import glob
import os
from typing import Iterable, List, Union
from urllib.parse import urlparse

import braceexpand

__all__ = ["INDEX_SUFFIX", "Urls", "expand_urls", "local_path"]

#: Suffix of a shard's sidecar index (``flashstream index``); globs never match these.
INDEX_SUFFIX = ".fsidx"

Urls = Union[str, os.PathLike, Iterable[Union[str, os.PathLike]]]

_GLOB_CHARS = set("*?[")


def _expand_one(url: str) -> List[str]:
    out: List[str] = []
    for part in url.split("::"):  # webdataset's separator for several patterns in one string
        for name in braceexpand.braceexpand(part):
            if _GLOB_CHARS & set(name) and not os.path.exists(local_path(name)):
                matches = sorted(m for m in glob.glob(local_path(name))
                                 if not m.endswith(INDEX_SUFFIX))
                if not matches:
                    raise FileNotFoundError(f"no shard matches the pattern {name!r}")
                out.extend(matches)
            else:
                out.append(name)
    return out


def expand_urls(urls: Urls) -> List[str]:
    """A list of shard urls from a list, a glob (``data/*.tar``) or a brace pattern
    (``train-{000000..000099}.tar``). Raises ``ValueError`` when nothing is left."""
    if isinstance(urls, (str, os.PathLike)):
        items = [os.fspath(urls)]
    else:
        try:
            items = [os.fspath(u) for u in urls]
        except TypeError:
            raise ValueError(
                "urls must be a path, a glob or brace pattern, or a list of paths; "
                f"got {urls!r}") from None
    expanded = [name for item in items for name in _expand_one(item)]
    if not expanded:
        raise ValueError("ShardStream needs at least one shard; the url list is empty")
    for name in expanded:
        local_path(name)  # validates the scheme early, with a clear error
    return expanded


def local_path(url: str) -> str:
    """The filesystem path of a local url (plain path or ``file://``); other schemes are
    refused because flashstream reads local drives with O_DIRECT."""
    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        return parsed.path if parsed.scheme == "file" else url
    if len(parsed.scheme) == 1:  # a Windows-style drive letter is not a scheme
        return url
    raise ValueError(f"{url!r}: only local files are supported (plain paths or file:// urls), "
                     f"not {parsed.scheme}: urls, since flashstream reads the drive with "
                     f"O_DIRECT; stage the shards on the local drive first (aws s3 cp, gsutil "
                     f"cp, curl -o, ...) and pass their paths")
