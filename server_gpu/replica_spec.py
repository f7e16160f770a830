"""What every replica of `serve --replicas` builds (its own module: the launcher and the Ray Serve
application both need it, and the launcher imports the application only once Ray is wanted)."""

from __future__ import annotations

from dataclasses import dataclass

from edgefinfer.server_gpu import prefix_router
from edgefinfer.server_gpu.api import ServerLimits
from edgefinfer.server_gpu.loader import ServeOptions


@dataclass(frozen=True)
class ReplicaSpec:
    """The single-process server's options and limits, and how the replicas are routed."""
    opts: ServeOptions
    api_key: str | None
    limits: ServerLimits
    prefix_blocks: int = prefix_router.DEFAULT_PREFIX_BLOCKS
    routing: prefix_router.Routing = prefix_router.Routing.PREFIX
