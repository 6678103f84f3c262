"""A reader inherited by a forked child: the child is refused and tidies up, the parent goes on.

Run as ``python fork_check.py ENGINE FILE``; prints one line of JSON. Run in its own process
(with a timeout) because the failures it guards against are a segfault in the child and a
parent hung forever in ``next()``.
"""

from __future__ import annotations

import gc
import json
import os
import sys

from flashstream import settings
from flashstream.engine import TO_END, open_reader


def main(engine: str, path: str) -> None:
    with open(path, "rb") as f:
        expected = f.read()
    reader = open_reader([(path, 0, TO_END)],
                         settings.resolve(engine=engine, chunk_size=65536, queue_depth=16))
    got = bytearray(reader.next()[2])  # requests for the next chunks are now in flight
    pid = os.fork()
    if pid == 0:  # the child: every use is refused, closing and dropping must be harmless
        code = 0
        try:
            reader.next()
            code = 3  # used the parent's reader
        except RuntimeError as exn:
            code = 0 if "fork" in str(exn) else 4
        except BaseException:
            code = 5
        try:
            reader.close()
            del reader
            gc.collect()
        except BaseException:
            code = 6
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    while (chunk := reader.next()) is not None:
        got += chunk[2]
    reader.close()
    print(json.dumps({"child_signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0,
                      "child_exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1,
                      "parent_equal": bytes(got) == expected}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
