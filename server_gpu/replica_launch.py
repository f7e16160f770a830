"""Starting `serve --replicas N`: the usage checks that must fail in one line before any model or Ray
starts (`preflight`), then Ray (local, or a cluster at --address), the Serve application of `replicas`,
and a drain of every replica on SIGINT/SIGTERM (`serve_replicas`).

Imports nothing of Ray until `serve_replicas`, so `preflight` can say that Ray is missing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import signal
import socket
import threading
from urllib.parse import urlparse

from edgefinfer.errors import UserError
from edgefinfer.libraries.cpus import usable_cpus
from edgefinfer.server_gpu.replica_spec import ReplicaSpec

INSTALL_HINT = "pip install 'edgefinfer[replicas]' (ray[serve])"


def preflight(n_replicas: int, address: str | None) -> None:
    """Usage errors of the replica flags, each one line naming the fix."""
    if n_replicas < 1:
        raise UserError(f"--replicas {n_replicas}: give 1 or more replicas, or drop --replicas for one process")
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        raise UserError(f"--replicas needs Ray Serve, which is not installed: {INSTALL_HINT}")
    check_address(address)


def check_address(address: str | None, timeout_s: float = 3.0) -> None:
    """A usage error unless `address` (ray://HOST:PORT or HOST:PORT) accepts a TCP connection."""
    if address is None or address == "auto":
        return
    url = urlparse(address if "://" in address else f"ray://{address}")
    try:
        host, port = url.hostname, url.port or 10001
    except ValueError:
        host, port = None, None
    if not host:
        raise UserError(f"--address {address!r} is not ray://HOST:PORT; give the Ray client address of the "
                        f"cluster's head (`ray start --head` prints it)")
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        raise UserError(f"no Ray cluster answers at {address} ({e.strerror or e}); start one with `ray start "
                        f"--head` there, fix --address, or drop --address to start a local one") from None


def check_gpus(n_replicas: int, gpu_layers: int, gpus: float) -> None:
    """With layers offloaded each replica takes a whole GPU: fewer GPUs than replicas would leave Ray
    waiting forever to place the rest, so that is a usage error."""
    if gpu_layers > 0 and gpus < n_replicas:
        raise UserError(f"--replicas {n_replicas} --gpu-layers {gpu_layers}: each replica takes one GPU and the Ray "
                        f"cluster has {gpus:g} GPU(s); give at most that many replicas, or --gpu-layers 0 for CPU replicas")


def serve_replicas(spec: ReplicaSpec, n_replicas: int, threads: int, address: str | None, host: str, port: int,
                   grace_s: float, stop: threading.Event | None = None) -> None:
    """Start (or join) Ray, deploy, serve until SIGINT/SIGTERM (or `stop`), then drain every replica
    (Serve lets each finish its requests for up to `grace_s`) and leave Ray."""
    import ray
    from ray import serve

    from edgefinfer.server_gpu.loader import _resolve
    from edgefinfer.server_gpu.replicas import APP_NAME, build_application

    _resolve(spec.opts.model)  # a model that is not there fails in one line here, not in every replica
    if address is None:
        # Ray starts its workers at nice 15 (`worker_niceness`, for batch jobs): an engine replica would
        # then lose its cores to anything else on the host. A server's replicas run at normal priority.
        ray.init(num_cpus=max(usable_cpus(), n_replicas * threads), include_dashboard=False,
                 logging_level=logging.WARNING, log_to_driver=False, _system_config={"worker_niceness": 0})
    else:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    try:
        check_gpus(n_replicas, spec.opts.gpu_layers, ray.cluster_resources().get("GPU", 0))
    except UserError:
        ray.shutdown()  # before Serve starts: nothing to delete
        raise
    try:
        serve.start(http_options={"host": host, "port": port}, proxy_location="HeadOnly")
        serve.run(build_application(spec, n_replicas, threads, grace_s), name=APP_NAME, route_prefix="/")
        logging.getLogger(__name__).warning("serving %d replicas on http://%s:%d/v1", n_replicas, host, port)
        stop.wait()
    finally:
        with contextlib.suppress(Exception):
            serve.delete(APP_NAME)  # replicas drain their requests (graceful_shutdown_timeout_s)
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
