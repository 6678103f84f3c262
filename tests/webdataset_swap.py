"""Run webdataset's own test suite with flashstream's names swapped in.

    cd third_party/webdataset-1.0.2 && python ../../tests/webdataset_swap.py [pytest args]

Before the suite imports, ``WebDataset`` and ``WebLoader`` in ``webdataset`` and
``webdataset.compat``, and ``DataPipeline`` in ``webdataset``, ``webdataset.compat`` and
``webdataset.pipeline``, are replaced by flashstream's; the test files are not edited
(third_party/webdataset-1.0.2/README.md). ``tests/test_webdataset_suite.py`` runs this and
fails on any failure not listed there as internal.
"""

from __future__ import annotations

import sys

import pytest
import webdataset
import webdataset.compat
import webdataset.pipeline

import flashstream


def swap() -> None:
    for module in (webdataset, webdataset.compat):
        module.WebDataset = flashstream.WebDataset
        module.WebLoader = flashstream.WebLoader
    for module in (webdataset, webdataset.compat, webdataset.pipeline):
        module.DataPipeline = flashstream.DataPipeline


if __name__ == "__main__":
    swap()
    sys.exit(pytest.main(sys.argv[1:]))
