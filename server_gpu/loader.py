"""From `edgefinfer serve MODEL` to an engine: resolve the model input, load the executor and tokenizer.

MODEL is a GGUF file, a bundle folder (its GGUF artefact), a Hugging Face folder, or the name of a
shipped reference model. The llama.cpp backend runs GGUF; the torch backend runs a HF folder, or a
GGUF imported into our `Transformer`.

Tokenizer: always ours (`edgefinfer.tokenization.tokenizer.Tokenizer`), found as `edgefinfer run` finds it
(`ModelSource.tokenizer`): the folder's tokenizer.json (a bundle's, a HF folder's, one beside a bare
GGUF), else rebuilt from the GGUF (`gguf_import.tokenizer_from_gguf`, which splits text exactly as
llama.cpp does; checked at load against llama.cpp's own tokenizer).
Token ids go to llama.cpp as ids, so both backends see the same tokens for the same text.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from edgefinfer.errors import UserError
from edgefinfer.bundle.resolve import ModelSource, resolve
from edgefinfer.server_gpu import session_seed
from edgefinfer.server_gpu.batched_speculation import SpeculationConfig
from edgefinfer.server_gpu.engine import ServingEngine, ServingEngineConfig
from edgefinfer.server_gpu.interface import Executor
from edgefinfer.server_gpu.scheduler import SchedulerConfig
from edgefinfer.tokenization.tokenizer import Tokenizer

if TYPE_CHECKING:
    from edgefinfer.runtime.backends.llamacpp_binding import CellFormat

log = logging.getLogger(__name__)

_CHECK_TEXTS = ("Hello, world! 12345", " The quick brown fox\n\tjumps — naïve café 你好")


@dataclass(frozen=True)
class ServeOptions:
    model: str
    backend: str | None = None  # llamacpp | torch; default: llamacpp for GGUF, torch for a HF folder
    max_num_seqs: int = 32
    max_model_len: int = 2048
    max_num_batched_tokens: int = 512
    prefill_chunk: int = 256
    block_size: int = 16
    enable_prefix_caching: bool = True
    # llama.cpp's KV settings; None picks the default (`kv_settings`): llama-server's f16 KV, flash
    # attention and per-slot streams, or, with batch_invariant, what `edgefinfer run` computes exactly.
    kv_unified: bool | None = None  # True: one cell pool the manager governs; False: one stream per sequence
    kv_cells: int | None = None
    retain_prefixes: int | None = None  # None: per-slot, max_num_seqs (0 if exact or swapping); 64 with kv_unified
    retain_tokens: int | None = None  # cap on the tokens only retained prefixes hold (None: DEFAULT_RETAIN_TOKENS)
    flash_attn: bool | None = None
    kv_dtype: str | None = None
    # Each request's tokens exactly as `edgefinfer run` and as alone, whatever runs beside it (vLLM's
    # batch-invariant mode): per-slot streams in run's cell format, aligned prompt chunks, one
    # llama_decode per token count. Slower at concurrency, so off by default.
    batch_invariant: bool = False
    threads: int | None = None
    gpu_layers: int = 0
    device: str = "cpu"
    speculative: str | None = None  # lookup[:NGRAM][,K] | draft:PATH[,K] (as `edgefinfer generate`)
    adaptive_speculation: bool = True
    served_model_name: str | None = None
    preemption: str = "recompute"  # or "swap" (llama.cpp, one stream per sequence)
    kv_blocks: int | None = None  # cap the KV manager's pool below what the storage holds (forces preemption)
    sessions: tuple[str, ...] = ()  # llama.cpp session files whose cells seed the prefix cache (session_seed)


@dataclass(frozen=True)
class KVSettings:
    unified: bool
    dtype: str
    flash_attn: bool


def kv_settings(opts: ServeOptions, run: CellFormat) -> KVSettings:
    """The llama.cpp KV settings `opts` asks for, its None fields filled with the defaults of its mode;
    `run`: the cells `edgefinfer run` keeps for this GGUF (`runtime_cells`).

    Default: f16 KV, flash attention and one stream per sequence (per-slot), as llama-server runs
    them with --parallel N: each sequence attends over its own stream, where in the unified pool every
    token attends (masked) over every sequence's cells; 16 one-token decodes cost 81 ms a step there
    against 73 ms per-slot (docs/SERVER.md). Finished prompts stay in their streams for the next
    request that starts with them. --batch-invariant: per-slot streams in `edgefinfer run`'s cell format,
    the only settings under which a request's tokens equal `edgefinfer run`'s whatever its neighbours;
    a flag that contradicts it is a usage error rather than a silently inexact server.

    --session: the unified pool (retained prefixes live there) in the runtime's cell format, which is
    all llama.cpp restores a device's cells into (`session_seed`)."""
    def contradicting(*extra: tuple[str, bool]) -> list[str]:
        dtype, flash = opts.kv_dtype, opts.flash_attn
        return [flag for flag, bad in (*extra, (f"--kv-dtype {dtype}", dtype is not None and dtype != run.dtype),
                                       ("--flash-attn" if flash else "--no-flash-attn",
                                        flash is not None and flash != run.flash_attn)) if bad]

    if opts.sessions:
        clash = contradicting(("--batch-invariant", opts.batch_invariant),
                              ("--kv-layout per-slot", opts.kv_unified is False))
        if clash:
            raise UserError(f"--session restores the device's llama.cpp cells, which need the unified pool with "
                            f"{run.describe()} (as `edgefinfer run` keeps them for this model); drop "
                            f"{' and '.join(clash)}")
        return KVSettings(True, run.dtype, run.flash_attn)
    if not opts.batch_invariant:
        # --kv-cells sizes a unified pool, so it asks for one.
        unified = opts.kv_cells is not None if opts.kv_unified is None else opts.kv_unified
        return KVSettings(unified, opts.kv_dtype or "f16", True if opts.flash_attn is None else opts.flash_attn)
    clash = contradicting(("--kv-layout unified", bool(opts.kv_unified)))
    if clash:
        raise UserError(f"--batch-invariant computes exactly what `edgefinfer run` does (per-slot KV, "
                        f"{run.describe()} for this model); drop {' and '.join(clash)}, or drop --batch-invariant")
    return KVSettings(False, run.dtype, run.flash_attn)


def build_engine(opts: ServeOptions) -> tuple[ServingEngine, str]:
    """The engine (not started) and the model name clients must send."""
    src = _resolve(opts.model)
    backend = opts.backend or ("llamacpp" if src.is_gguf else "torch")
    sessions = []
    if opts.sessions:  # checked before the model loads: a wrong file costs no load
        if backend != "llamacpp" or not src.is_gguf:
            raise UserError("--session seeds llama.cpp's cache: serve a GGUF (or a bundle with one) on the llamacpp "
                            "backend")
        known = src.entry.sha256 if src.entry is not None else None  # a bundle's manifest names its GGUF's
        sessions = session_seed.check(opts.sessions, session_seed.file_sha256(src.path, known))
        if opts.retain_tokens is None:  # room for the conversations beside one system prompt's worth
            from edgefinfer.server_gpu.executor_llamacpp import DEFAULT_RETAIN_TOKENS

            opts = dataclasses.replace(opts, retain_tokens=DEFAULT_RETAIN_TOKENS + sum(len(s.tokens) for s in sessions))
    if backend == "llamacpp":
        executor, tokenizer, eos = _llamacpp(src, opts)
    elif backend == "torch":
        executor, tokenizer, eos = _torch(src, opts)
    else:
        raise UserError(f"unknown backend {backend!r}: use llamacpp or torch")
    max_len = executor.max_model_len
    sched = SchedulerConfig(max_num_seqs=opts.max_num_seqs, max_model_len=max_len,
                            max_num_batched_tokens=opts.max_num_batched_tokens,
                            prefill_chunk=min(opts.prefill_chunk, opts.max_num_batched_tokens),
                            preemption=opts.preemption)
    speculation = _speculation(opts, src, backend, executor)
    config = ServingEngineConfig(sched, opts.enable_prefix_caching)
    engine = ServingEngine(executor, tokenizer, eos, config, speculation)
    for number, session in enumerate(sessions):
        kept = session_seed.seed(engine.manager, executor.storage, session, number, executor.max_model_len)
        log.info("seeded the prefix cache with %s: %d of its %d tokens", session.path, kept, len(session.tokens))
    return engine, opts.served_model_name or src.name


def _resolve(model: str) -> ModelSource:
    """MODEL (see `edgefinfer.bundle.resolve`) as the server runs it: a GGUF (bare, a bundle's, a shipped
    model's) or a HF folder. Its tokenizer and stop ids are `ModelSource.tokenizer` / `stop_ids`, the
    same probe and rule as `edgefinfer run`'s."""
    src = resolve(model, format="gguf", names="gguf")
    if src.kind != "checkpoint" and src.backend != "llamacpp":
        raise UserError(f"{src.path} is not a .gguf file; give a GGUF, a bundle folder or a HF folder")
    return src


def routing_tokenizer(model: str) -> Tokenizer:
    """The tokenizer `serve` splits MODEL's prompts with, without loading its weights (the replicas'
    ingress, which only needs a prompt's leading blocks): llama.cpp's vocabulary read alone where the
    server tokenizes with it (`ModelSource.llama_vocab`), else `ModelSource.tokenizer`."""
    src = _resolve(model)
    if not src.llama_vocab:
        return src.tokenizer()
    from edgefinfer.runtime.backends.llamacpp_binding import LlamaModel
    from edgefinfer.runtime.backends.llamacpp_tokenizer import LlamaVocabTokenizer

    return LlamaVocabTokenizer.for_source(src, LlamaModel(src.path, vocab_only=True))


def _tokenizer(src: ModelSource) -> tuple[Tokenizer, tuple[int, ...]]:
    """The tokenizer and the stop ids."""
    tokenizer = src.tokenizer()
    return tokenizer, src.stop_ids(tokenizer)


def _llamacpp(src: ModelSource, opts: ServeOptions) -> tuple[Executor, Tokenizer, tuple[int, ...]]:
    from edgefinfer.files.untrusted import check_gguf
    from edgefinfer.runtime.backends.llamacpp_binding import runtime_cells, tokenizer_matches
    from edgefinfer.server_gpu.executor_llamacpp import LlamaCppExecutor

    if not src.is_gguf:
        raise UserError(f"the llama.cpp backend runs GGUF files; {src.path} is a HF folder: build a GGUF "
                        f"(`edgefinfer build --target gpu-server`) or use --backend torch")
    kv = kv_settings(opts, runtime_cells(check_gguf(src.path)))
    tokenizer = None if src.llama_vocab else src.tokenizer()
    executor = LlamaCppExecutor(src.path, max_num_seqs=opts.max_num_seqs, max_model_len=opts.max_model_len,
                                max_batch_tokens=opts.max_num_batched_tokens, block_size=opts.block_size,
                                kv_unified=kv.unified, kv_cells=opts.kv_cells, flash_attn=kv.flash_attn,
                                kv_dtype=kv.dtype, batch_invariant=opts.batch_invariant,
                                threads=opts.threads, gpu_layers=opts.gpu_layers,
                                num_blocks=opts.kv_blocks, retain_prefixes=opts.retain_prefixes,
                                retain_tokens=opts.retain_tokens, swap=opts.preemption == "swap")
    if tokenizer is None:  # llama.cpp's own vocabulary, read with the weights: as llama-server tokenizes
        from edgefinfer.runtime.backends.llamacpp_tokenizer import LlamaVocabTokenizer

        tokenizer = LlamaVocabTokenizer.for_source(src, executor.model)
    else:  # a tokenizer.json put beside the GGUF
        if tokenizer.vocab_size > executor.vocab_size:
            raise UserError(f"the tokenizer has {tokenizer.vocab_size} tokens but {src.path} only "
                            f"{executor.vocab_size}")
        if not tokenizer_matches(executor.model, tokenizer, _CHECK_TEXTS):
            log.warning("the tokenizer of %s splits text differently from llama.cpp's own; outputs stay valid "
                        "(ids are passed as ids) but may differ from llama.cpp's server", src.path)
    stop_ids = src.stop_ids(tokenizer, executor.model.end_of_generation() if src.eos_ids is None else None)
    return executor, tokenizer, stop_ids


def _torch(src: ModelSource, opts: ServeOptions) -> tuple[Executor, Tokenizer, tuple[int, ...]]:
    import torch

    from edgefinfer.server_gpu.executor_torch import TorchExecutor

    if opts.threads:
        torch.set_num_threads(opts.threads)
    if src.is_gguf:
        from edgefinfer.model.gguf_import import import_gguf

        model = import_gguf(src.path)[0]
    else:
        from edgefinfer.model.checkpoint import load_model

        model = load_model(src.path)
    tokenizer, stop_ids = _tokenizer(src)
    if opts.batch_invariant:
        raise UserError("--batch-invariant needs the llama.cpp backend (torch pads batches, and padding changes "
                        "its kernels' rounding); serve a GGUF, or drop --batch-invariant")
    kv_dtype = {"f32": torch.float32, "f16": torch.float16, None: None}.get(opts.kv_dtype, "bad")
    if kv_dtype == "bad":
        raise UserError(f"unknown KV dtype {opts.kv_dtype!r}: use f32 or f16")
    executor = TorchExecutor(model, max_num_seqs=opts.max_num_seqs, max_model_len=opts.max_model_len,
                             block_size=opts.block_size, num_blocks=opts.kv_blocks, device=opts.device,
                             kv_dtype=kv_dtype)
    return executor, tokenizer, stop_ids


def _speculation(opts: ServeOptions, src: ModelSource, backend: str, executor: Executor) -> SpeculationConfig | None:
    if not opts.speculative:
        return None
    from edgefinfer.runtime.engine import SpeculativeOption
    from edgefinfer.runtime.speculative.proposers import PromptLookupProposer

    spec = SpeculativeOption.parse(opts.speculative)
    if spec.kind == "lookup":
        return SpeculationConfig(lambda seq_id: PromptLookupProposer(max_ngram=spec.ngram), k_max=spec.k,
                                 adaptive=opts.adaptive_speculation, name=f"lookup:{spec.ngram}")
    if backend != "llamacpp":
        raise UserError("a draft model is supported with the llama.cpp backend; with torch use --speculative lookup")
    from edgefinfer.server_gpu.executor_llamacpp import LlamaDraft

    draft_src = _resolve(spec.path)
    if not draft_src.is_gguf:
        raise UserError(f"the draft model must be a GGUF (or a bundle with one), got {spec.path}")
    draft = LlamaDraft(draft_src.path, executor.max_num_seqs, executor.max_model_len, opts.threads)
    if draft.model.vocab_size != executor.vocab_size:
        raise UserError(f"the draft's vocabulary ({draft.model.vocab_size}) differs from the target's "
                        f"({executor.vocab_size}); a draft must share the target's tokenizer")
    return SpeculationConfig(draft.proposer, k_max=spec.k, adaptive=opts.adaptive_speculation,
                             release=draft.release, name=f"draft:{draft_src.name}")
