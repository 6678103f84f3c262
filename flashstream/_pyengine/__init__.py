"""The pure-Python reference engine: ``os.preadv`` / ``os.pwrite`` on thread pools.

It implements the same contracts as the C++ SequentialReader (ordered chunks, reads in flight
across extent boundaries, O_DIRECT with buffered fallback, errors raised at the extent's turn,
in reader.py), the C++ OutputFile / read_file_into (whole-file transfers from and into caller
memory, in transfers.py) and the C++ RangeFile (scattered reads, in ranges.py), so that one
contract test suite can run against every engine. It is slower, never wrong.

It never imports the extension: the few native helpers it reuses (CRC-32C, the pacer, the
adaptive rate controller and the latency histogram's buckets) are handed in by
flashstream.engine as ``NativeHelpers``.
"""

from .common import NativeHelpers
from .ranges import PythonRangeFile
from .reader import PythonReader
from .transfers import PythonOutputFile, python_read_into

__all__ = ["NativeHelpers", "PythonOutputFile", "PythonRangeFile", "PythonReader",
           "python_read_into"]
