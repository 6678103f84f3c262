"""One process of the node-sharing test: no process group, the index cache shared with the
others. Creates GO_FILE.ready.PID once imported, waits for GO_FILE, builds a ShardStream,
prints JSON with the shards it scanned itself.

``python index_lock_child.py GO_FILE SHARD...``; each scanned shard takes SCAN_DELAY seconds
longer (environment), so that the processes' scans overlap.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

from flashstream import ShardStream
from flashstream.stream import index as index_module


def main() -> None:
    go, shards = sys.argv[1], sys.argv[2:]
    scanned = []
    real = index_module.scan_shards
    delay = float(os.environ.get("SCAN_DELAY", "0"))

    def recording(urls, *args, **kw):
        scanned.extend(urls)
        time.sleep(delay * len(urls))
        return real(urls, *args, **kw)

    index_module.scan_shards = recording
    # Ready (imports done): the parent starts every process at once only after all are.
    open(f"{go}.ready.{os.getpid()}", "w").close()
    while not os.path.exists(go):
        time.sleep(0.005)
    stream = ShardStream(shards, split_by_rank=False)
    digest = hashlib.sha256()
    for index in stream.index:
        digest.update(index.offsets.tobytes() + index.ends.tobytes())
    print(json.dumps({"scanned": scanned, "index": digest.hexdigest(), "samples": len(stream),
                      "info": stream.index_info["by_source"]}), flush=True)


if __name__ == "__main__":
    main()
