"""`edgefinfer serve`: the OpenAI-compatible server from the command line.

`edgefinfer.app.cli` mounts `serve` (this click command); it also runs alone:
`python -m edgefinfer.app.serve_command MODEL ...`.
"""

from __future__ import annotations

import dataclasses
import logging
import sys

import click

from edgefinfer.app.entry_point import run_command
from edgefinfer.errors import UserError
from edgefinfer.libraries.cpus import usable_cores


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model", default="smollm2-135m")
@click.option("--backend", type=click.Choice(["llamacpp", "torch"]), default=None,
              help="Default: llamacpp for a GGUF or bundle, torch for a HF folder.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 exposes it).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--max-num-seqs", default=32, show_default=True, type=click.IntRange(1, 256),
              help="Sequences (choices) decoded together.")
@click.option("--max-model-len", default=2048, show_default=True, type=click.IntRange(16),
              help="Prompt + output tokens per sequence (capped by the model's context).")
@click.option("--max-num-batched-tokens", default=512, show_default=True, type=click.IntRange(1),
              help="Tokens per forward (the chunked-prefill budget).")
@click.option("--prefill-chunk", default=256, show_default=True, type=click.IntRange(1),
              help="Prompt chunk size; chunks start at multiples of it.")
@click.option("--block-size", default=16, show_default=True, type=click.IntRange(1), help="Paged-KV block size.")
@click.option("--no-prefix-caching", is_flag=True, help="Do not reuse computed prompt prefixes.")
@click.option("--kv-layout", type=click.Choice(["unified", "per-slot"]), default=None,
              help="llama.cpp: 'per-slot' (default, as llama-server's --parallel) gives each sequence a stream of "
                   "--max-model-len cells that only its own tokens attend over; a finished prompt stays in its "
                   "stream for the next request that starts with it. 'unified' is one cell pool that the paged-KV "
                   "manager governs: prefixes stored once, admission by real free memory, but every token attends "
                   "(masked) over every sequence's cells. See docs/SERVER.md.")
@click.option("--kv-cells", type=click.IntRange(16), default=None,
              help="Cells of a unified pool (implies --kv-layout unified; default: --max-num-seqs x --max-model-len).")
@click.option("--retain-prefixes", type=click.IntRange(0), default=None,
              help="Finished requests' prompts kept for later prefix hits, until their blocks are needed (unified "
                   "layout, default 64), or in the streams their requests left, each taken over by the next "
                   "request that starts with it (per-slot, as llama-server's slots; default --max-num-seqs, 0 "
                   "with --batch-invariant or --preemption swap); 0 = off.")
@click.option("--retain-tokens", type=click.IntRange(0), default=None,
              help="Unified layout: at most this many tokens that only retained prefixes hold, beyond what "
                   "running requests hold, of prompts no second request used; 4 times as many with prefixes that "
                   "one did (llama.cpp attends over every cell of the pool, masked, so kept cells cost every "
                   "step some compute; default 512, one unshared prompt or four shared system prompts). Past it, "
                   "requests' own questions and answers go first, then the least recently used.")
@click.option("--preemption", type=click.Choice(["recompute", "swap"]), default="recompute", show_default=True,
              help="When KV blocks run out: recompute the victim later, or park its KV in host memory (llama.cpp "
                   "with --kv-layout per-slot; restores it exactly).")
@click.option("--kv-dtype", type=click.Choice(["f16", "f32"]), default=None,
              help="KV cache precision (default f16, llama.cpp's default and half the memory of f32).")
@click.option("--flash-attn/--no-flash-attn", default=None,
              help="llama.cpp flash attention (default on, as llama-server's `auto` turns it on; "
                   "--no-flash-attn for the plain attention kernels).")
@click.option("--batch-invariant", is_flag=True,
              help="Exactly the tokens of `edgefinfer run` for every request, whatever runs beside it (per-slot "
                   "KV in the cell format `edgefinfer run` keeps for the model, aligned prompt chunks, one forward per token count; vLLM's "
                   "batch-invariant mode). Slower under concurrency.")
@click.option("--session", "sessions", multiple=True, metavar="FILE",
              help="A conversation saved on the device's llama.cpp backend (`edgefinfer chat` /save) on this GGUF: its "
                   "cache seeds the prefix cache, so a request that continues it computes only the new tokens "
                   "(repeatable; implies the unified pool in the cell format the device keeps). See docs/SERVER.md.")
@click.option("--gpu-layers", default=0, show_default=True, type=click.IntRange(0),
              help="llama.cpp layers offloaded to the GPU (CUDA build; 999 = all).")
@click.option("--device", default="cpu", show_default=True, help="torch backend device (cpu, cuda).")
@click.option("--threads", type=click.IntRange(1), default=None,
              help="CPU threads (default: one per physical core this process may run on, as llama-server's; "
                   "with --replicas, split between them).")
@click.option("--speculative", default=None, metavar="SPEC",
              help="lookup[:NGRAM][,K] (prompt lookup) or draft:GGUF[,K] (a draft model).")
@click.option("--fixed-k", is_flag=True, help="Always draft K tokens (default: adaptive, off when it does not pay).")
@click.option("--served-model-name", default=None, help="The model id clients send (default: from MODEL).")
@click.option("--api-key", envvar="EDGEFINFER_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' (or set EDGEFINFER_API_KEY).")
@click.option("--max-body-bytes", default=1 << 20, show_default=True, type=click.IntRange(1024))
@click.option("--shutdown-grace-s", default=20.0, show_default=True, type=click.FloatRange(0),
              help="On SIGTERM: new requests get 503 and running ones may finish for this long; then the rest "
                   "end with finish_reason 'abort' and the process exits 0. Keep it under the orchestrator's "
                   "kill timeout (Kubernetes: 30 s).")
@click.option("--replicas", type=int, default=None,
              help="Run N engine replicas on Ray Serve behind this endpoint, routed by prompt prefix (each with "
                   "--threads threads; needs edgefinfer[replicas]). See docs/SERVER.md.")
@click.option("--address", default=None, help="With --replicas: the Ray cluster to join (ray://HOST:PORT); "
                                               "default: start a local Ray instance.")
@click.option("--routing", type=click.Choice(["prefix", "round-robin"]), default=None,
              help="With --replicas: 'prefix' (default) sends prompts that share their leading KV blocks to one "
                   "replica; 'round-robin' sends each request to the next replica, whatever its prompt.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
def serve(model: str, backend: str | None, host: str, port: int, max_num_seqs: int, max_model_len: int,
          max_num_batched_tokens: int, prefill_chunk: int, block_size: int, no_prefix_caching: bool,
          kv_layout: str, kv_cells: int | None, retain_prefixes: int | None,
          retain_tokens: int | None, preemption: str, kv_dtype: str | None, flash_attn: bool | None,
          batch_invariant: bool, sessions: tuple[str, ...], gpu_layers: int, device: str,
          threads: int | None, speculative: str | None, fixed_k: bool, served_model_name: str | None,
          api_key: str | None, max_body_bytes: int, shutdown_grace_s: float, replicas: int | None, address: str | None,
          routing: str | None, log_level: str) -> None:
    """Serve MODEL (a .gguf, a bundle, a HF folder, or a shipped model name) with an OpenAI-compatible API."""
    from edgefinfer.server_gpu.api import ServerLimits, create_app
    from edgefinfer.server_gpu.launch import serve_forever
    from edgefinfer.server_gpu.loader import ServeOptions, build_engine

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    opts = ServeOptions(model=model, backend=backend, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                        max_num_batched_tokens=max(max_num_batched_tokens, max_num_seqs),
                        prefill_chunk=prefill_chunk, block_size=block_size,
                        enable_prefix_caching=not no_prefix_caching, kv_cells=kv_cells,
                        kv_unified=None if kv_layout is None else kv_layout == "unified",
                        batch_invariant=batch_invariant,
                        retain_prefixes=retain_prefixes, retain_tokens=retain_tokens,
                        flash_attn=flash_attn, kv_dtype=kv_dtype, threads=threads, gpu_layers=gpu_layers,
                        device=device, speculative=speculative, adaptive_speculation=not fixed_k,
                        served_model_name=served_model_name, preemption=preemption, sessions=sessions)
    if replicas is not None or address is not None:  # Ray only here: one process never imports it
        if sessions:
            raise UserError("--session seeds one process's cache; with --replicas each replica has its own: serve "
                            "the session without --replicas")
        from edgefinfer.server_gpu import replica_launch as rl
        from edgefinfer.server_gpu.prefix_router import Routing
        n = 1 if replicas is None else replicas
        rl.preflight(n, address)
        per = threads or max(1, usable_cores() // n)
        spec = rl.ReplicaSpec(dataclasses.replace(opts, threads=per), api_key,
                              ServerLimits(max_body_bytes=max_body_bytes), routing=Routing(routing or "prefix"))
        return rl.serve_replicas(spec, n, per, address, host, port, shutdown_grace_s)
    if routing is not None:
        raise UserError(f"--routing {routing} routes between replicas: add --replicas N, or drop --routing")
    engine, name = build_engine(opts)
    app = create_app(engine, name, api_key=api_key, limits=ServerLimits(max_body_bytes=max_body_bytes))
    click.echo(f"serving {name} ({engine.executor.describe()['backend']}) on http://{host}:{port}/v1", err=True)
    serve_forever(app, host, port, log_level, grace_s=shutdown_grace_s)


def main() -> int:
    return run_command(serve, prog_name="edgefinfer serve")


if __name__ == "__main__":
    sys.exit(main())
