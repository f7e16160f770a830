"""Prefix-aware replica choice: which replica should run a prompt, so that prompts sharing a prefix meet
the KV blocks that already hold it (pure functions; `replicas.PrefixAffinityRouter` plugs them into Ray
Serve's request router).

The key is a hash of the prompt's leading *full* KV blocks, cut at the paged-KV manager's block size:
the prefix cache shares whole blocks, so two prompts that agree on their first `blocks` blocks share
exactly those blocks on one replica. Replicas are ranked for a key by rendezvous hashing (highest
random weight), a consistent hash: a replica that joins or leaves moves only the keys it wins or held.
A load bound (consistent hashing with bounded loads, Mirrokni et al. 2018) keeps one hot prefix from
queueing everything on one replica: the first replica in the key's order whose load is under the bound
wins; with no key, or every replica over the bound, the least loaded one does. The bound is never
below a replica's batch (--max-num-seqs): a request that would join a running batch stays with its
prefix.

`Routing.ROUND_ROBIN` is the plain balancer to compare against (`serve --replicas N --routing
round-robin`, bench/server_scale.py): every replica in turn, whatever the prompt.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping, Sequence
from enum import Enum

DEFAULT_PREFIX_BLOCKS = 4  # 64 tokens at the default block size: a chat template's header and more
DEFAULT_LOAD_FACTOR = 1.5  # a replica may carry 1.5x the mean load (plus one) before its keys spill


class Routing(str, Enum):
    """How `serve --replicas` picks a replica (`--routing`)."""
    PREFIX = "prefix"  # `choose`: a prompt's leading blocks pick its replica, under a load bound
    ROUND_ROBIN = "round-robin"  # `round_robin`: each replica in turn


def prefix_key(ids: Sequence[int], block_size: int, blocks: int = DEFAULT_PREFIX_BLOCKS) -> str | None:
    """A hash of the first min(`blocks`, full blocks) blocks of `ids`, or None when the prompt fills no
    block (nothing a replica could share)."""
    full = min(len(ids) // block_size, blocks)
    if full == 0:
        return None
    head = ids[: full * block_size]
    return hashlib.blake2b(struct.pack(f"<{len(head)}q", *head), digest_size=8).hexdigest()


def rendezvous_order(key: str, replicas: Sequence[str]) -> list[str]:
    """`replicas` ranked for `key`, best first; the same key and replica set always rank the same."""
    def weight(replica: str) -> bytes:
        return hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8).digest()
    return sorted(replicas, key=weight, reverse=True)


def load_bound(loads: Mapping[str, int], n_replicas: int, factor: float = DEFAULT_LOAD_FACTOR) -> int:
    """The most requests a replica may hold and still take its keys: `factor` x the mean load once this
    request is placed, rounded up."""
    return math.ceil(factor * (sum(loads.values()) + 1) / max(n_replicas, 1))


def choose(key: str | None, replicas: Sequence[str], loads: Mapping[str, int],
           factor: float = DEFAULT_LOAD_FACTOR, batch: int = 0) -> list[str]:
    """`replicas` in the order to try them for a request with prefix `key` (missing loads count as 0):
    the key's replicas under the load bound in rendezvous order, then the rest by load.

    `batch` (the replicas' --max-num-seqs) is a floor under the bound: a replica with fewer requests
    than that decodes the new one in its running batch, without queueing it, so moving the request
    elsewhere would only cost the prefix (as SGLang's router, which balances only past an absolute
    imbalance too, and Ray's prefix-affinity router, which by default never does)."""
    by_load = sorted(replicas, key=lambda r: (loads.get(r, 0), r))
    if key is None:
        return by_load
    bound = max(load_bound(loads, len(replicas), factor), batch)
    fits = [r for r in rendezvous_order(key, replicas) if loads.get(r, 0) < bound]
    return fits + [r for r in by_load if r not in fits]


def round_robin(turn: int, replicas: Sequence[str]) -> list[str]:
    """`replicas` in the order to try them for the `turn`-th request: sorted by id (so every call agrees on
    the cycle), rotated by one each turn; the next ones are where Ray goes when the first is full."""
    ring = sorted(replicas)
    if not ring:
        return []
    k = turn % len(ring)
    return ring[k:] + ring[:k]
