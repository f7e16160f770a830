"""What retained prefixes cost over a server's lifetime (llama.cpp's unified layout).

    python bench/server_retention.py --kv-layout unified                     # the default cap
    python bench/server_retention.py --kv-layout unified --retain-tokens 2048   # a larger cap
    python bench/server_retention.py --kv-layout unified --retain-prefixes 0    # no retention

One server (extra arguments are passed to `edgefinfer serve`) serves bench/server.py's workloads
in a fixed sequence, each run with prompts no earlier run has seen: shared-system, short, short,
shared-system, short, short, shared-system, all at C = 16 with 48 tokens. In the unified pool every
token attends over the pool up to its highest used cell, so whatever the retained prefixes keep
shows up as later runs getting slower. Prints one line per run and the server's prefix-cache
figures at the end; the same client, prompts and counting as bench/server.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench.server as sb  # noqa: E402
from edgefinfer.model import reference  # noqa: E402
from edgefinfer.model.gguf_import import open_gguf, tokenizer_from_gguf  # noqa: E402

SEQUENCE = ("shared-system", "short", "short", "shared-system", "short", "short", "shared-system")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    args, serve_args = ap.parse_known_args()
    gguf = reference.gguf_path("smollm2-135m")
    tokenizer = tokenizer_from_gguf(open_gguf(gguf))
    by_name = {w.name: w for w in sb.workloads(tokenizer, quick=False)}
    port = sb.free_port()
    argv = sb.ours_argv(gguf, port, args.threads) + serve_args
    label = " ".join(serve_args) or "defaults"
    with sb.ServerProcess("edgefinfer", label, argv, port, env=sb.OURS_ENV) as server:
        sb.warm_up(server)
        for i, name in enumerate(SEQUENCE):
            sb.measure(server, sb.fresh_prefix(by_name[name], i), 16, 48, tokenizer)
        print(label, sb.kv_stats(server))


if __name__ == "__main__":
    main()
