"""One rank of the shared-scan test: joins a gloo group, builds a ShardStream, prints JSON.

``python index_share_rank.py RANK WORLD INIT_FILE SHARD...``
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch.distributed as dist

from flashstream import ShardStream


def main() -> None:
    rank, world, init = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    shards = sys.argv[4:]
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    stream = ShardStream(shards, split_by_rank=False)
    digest = hashlib.sha256()
    for index in stream.index:
        digest.update(index.offsets.tobytes() + index.ends.tobytes())
    scan = stream.index_info["by_source"]["scan"]
    print(json.dumps({"rank": rank, "index": digest.hexdigest(), "scanned": scan["shards"],
                      "bytes": scan["bytes"], "samples": len(stream),
                      "keys": [s["__key__"] for s in stream][:5]}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
