"""The artefact cache: what a target's expensive step wrote (an ExecuTorch program, an ONNX graph, QNN
context binaries), keyed by a content hash of everything that decides its bytes.

    key = content_key("onnx", model, options, sources)   # tensors, module types, config, options,
                                                         # tool versions, the exporter's source
    cache = ArtefactCache()                              # $EDGEFINFER_CACHE/artefacts
    entry = cache.get("onnx", key)                       # Entry(files, meta) or None
    cache.put("onnx", key, {"model.onnx": path, ...}, meta)
    cached_figures("float-ppl", model, options, sources, compute)   # a measurement, no files

    @cached_export("onnx", SOURCES)                      # or around a whole exporter that writes
    def export_onnx(model, out_dir, **options): ...      # `meta["files"]` into `out_dir`

An entry is a folder `<root>/<kind>/<key>/` holding the files and `entry.json` (the exporter's metadata,
and the sha256 of it and of each file). It is written with `atomic_dir`, so an interrupted write leaves only a
dot-named temporary that no lookup ever reads. Every read checks the sizes and hashes: a corrupt or
truncated entry is discarded with one line and the step runs again. A cache that cannot be written (full
disk, read-only or missing folder) warns once and the build goes on without it: the cache only ever saves
time, it never fails a build.

The store is beside the build (`$EDGEFINFER_CACHE`), not beside the output: the build pipeline writes
every bundle into a fresh temporary folder.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import shutil
import sys
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from edgefinfer.bundle import artefact
from edgefinfer.files.atomic import atomic_dir, copy_file
from edgefinfer.errors import UserError

ENTRY_FILE = "entry.json"
# Tools whose version is part of every key: a new exporter or runtime may lower the same graph differently.
TOOLS = ("torch", "executorch", "torchao", "onnx", "onnx-ir", "onnxruntime", "onnxruntime-qnn")
Say = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def default_root() -> Path:
    from edgefinfer.files.user_cache import cache_dir

    return cache_dir() / "artefacts"


# ---- the key ------------------------------------------------------------------------------------------

def content_key(kind: str, model: nn.Module, options: Mapping[str, Any], sources: Iterable[str | Path]) -> str:
    """Content hash of the model (tensors, module types, config), the options, the tool versions and the
    source of the exporter (`sources`: module files; this cache and edgefinfer.bundle.artefact always count)."""
    h = hashlib.blake2b(digest_size=20)
    h.update(f"{kind};".encode())
    h.update(json.dumps(options, sort_keys=True, default=_option_text).encode())
    config = getattr(model, "config", None)
    if config is not None:
        # Every field, not to_hf(): a test or exporter may hold a config no family writes (a window on Llama).
        h.update(repr(config).encode())
    for name in TOOLS:
        h.update(f"{name}={_version(name)};".encode())
    for src in (*sources, __file__, artefact.__file__):  # artefact writes the programs' constant methods
        h.update(Path(src).read_bytes())
    for name, module in model.named_modules():  # a quantized layer and a float one can share tensor names
        # ... and two quantized ones their tensors: extra_repr names what is not a tensor (int8 activations,
        # split or not), which changes the program as much as a weight does
        h.update(f"{name}:{type(module).__module__}.{type(module).__qualname__}({module.extra_repr()});".encode())
    seen: set[int] = set()
    for name, t in sorted(model.state_dict().items()):
        if t.data_ptr() in seen and t.numel():  # tied weights are hashed once (their names still are)
            h.update(f"{name}=tied;".encode())
            continue
        seen.add(t.data_ptr())
        t = t.detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        if t.numel():
            h.update(t.view(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def _option_text(value: Any) -> str:
    """A callable option (the runtime's calibration recorder) counts by its name and its module's source."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().contiguous().numpy()
    if hasattr(value, "tobytes"):  # an array: str() would abbreviate it
        return f"{getattr(value, 'dtype', '')}{getattr(value, 'shape', '')}:{hashlib.sha256(value.tobytes()).hexdigest()}"
    if callable(value):
        source = inspect.getsourcefile(value)
        digest = hashlib.sha256(Path(source).read_bytes()).hexdigest() if source else ""
        return f"{value.__module__}.{value.__qualname__}@{digest}"
    return str(value)


def _version(name: str) -> str:
    try:
        return importlib_metadata.version(name)
    except importlib_metadata.PackageNotFoundError:
        return "absent"


# ---- the store ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Entry:
    key: str
    files: dict[str, Path]  # name -> path inside the entry, checked against its recorded sha256
    meta: dict[str, Any]

    @property
    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.files.values())


class ArtefactCache:
    """One store for every target's expensive step. `say` gets the one-line notes (hit, discarded
    entry, cache disabled)."""

    # Why writes to a root stopped, after its first failure: for the whole process, so that a build whose
    # steps each open the cache (float score, quantized model, artefact) warns once, not once per step.
    _disabled: dict[Path, str] = {}

    def __init__(self, root: str | Path | None = None, say: Say = _stderr):
        self.root = Path(root) if root is not None else default_root()
        self.say = say

    @property
    def disabled(self) -> str | None:
        return self._disabled.get(self.root)

    def get(self, kind: str, key: str) -> Entry | None:
        """The entry, or None when absent, unreadable or damaged (a damaged one is removed)."""
        folder = self.root / kind / key
        try:
            record = json.loads((folder / ENTRY_FILE).read_text())
            files = {name: folder / name for name in record["files"]}
            problem = _damage(files, record["files"])
            if problem is None and _meta_sha256(record["meta"]) != record["meta_sha256"]:
                problem = f"{ENTRY_FILE}: its metadata's sha256 differs from the recorded one"
        except (FileNotFoundError, NotADirectoryError, PermissionError):  # absent, or a cache we cannot read
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:  # a torn or foreign entry.json
            problem = f"{ENTRY_FILE} unreadable ({type(e).__name__})"
        if problem is not None:
            self.say(f"[cache] discarded the damaged {kind} entry {key[:12]} ({problem}); building it again")
            shutil.rmtree(folder, ignore_errors=True)
            return None
        return Entry(key, files, record["meta"])

    def put(self, kind: str, key: str, files: Mapping[str, Path], meta: Mapping[str, Any]) -> bool:
        """Store `files` (name -> path) and `meta` as one entry; False (after one warning) when the
        cache cannot be written: the build goes on without it."""
        if self.disabled is not None:
            return False
        try:
            with atomic_dir(self.root / kind / key) as tmp:
                meta = json.loads(json.dumps(meta, default=str))  # as a reader will see it
                record = {"meta": meta, "meta_sha256": _meta_sha256(meta), "files": {}}
                for name, src in files.items():
                    copy_file(src, tmp / name, durable=False)  # atomic_dir fsyncs the whole entry
                    record["files"][name] = {"size": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
                (tmp / ENTRY_FILE).write_text(json.dumps(record, indent=1))
        except (OSError, UserError) as e:  # UserError: atomic_dir's full-disk line
            reason = self._disabled[self.root] = str(e).splitlines()[0] if str(e) else type(e).__name__
            self.say(f"[cache] warning: cannot write the artefact cache at {self.root} ({reason}); "
                     f"going on without it (set EDGEFINFER_CACHE to a writable folder with free space)")
            return False
        return True

    def restore(self, entry: Entry, dest: Mapping[str, Path]) -> None:
        """Copy the entry's files to `dest` (name -> destination path), each written atomically."""
        for name, path in dest.items():
            copy_file(entry.files[name], path, durable=False)  # the bundle writer fsyncs what it commits


def _damage(files: Mapping[str, Path], recorded: Mapping[str, Mapping[str, Any]]) -> str | None:
    """What is wrong with an entry's files, or None: sizes first (cheap: catches truncation), then hashes."""
    for name, path in files.items():
        size = path.stat().st_size if path.is_file() else None
        if size != recorded[name]["size"]:
            return f"{name}: {size} bytes, recorded {recorded[name]['size']}"
    for name, path in files.items():
        if _sha256(path) != recorded[name]["sha256"]:
            return f"{name}: sha256 differs from the recorded one"
    return None


def _meta_sha256(meta: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---- figures: a costly measurement of a model (the build's float perplexity) ---------------------------

def cached_figures(kind: str, model: nn.Module, options: Mapping[str, Any], sources: Iterable[str | Path],
                   compute: Callable[[], dict[str, Any]], cache_dir: str | Path | None = None
                   ) -> tuple[dict[str, Any], bool]:
    """(figures, reused): `compute()`'s JSON-able result, from the cache when the same model was measured
    with the same options and code (`sources`) before."""
    store = ArtefactCache(cache_dir)
    key = content_key(kind, model, options, sources)
    if (entry := store.get(kind, key)) is not None:
        return entry.meta, True
    figures = compute()
    store.put(kind, key, {}, figures)
    return figures, False


# ---- an exporter that writes its files into a folder ----------------------------------------------------

def cached_export(kind: str, sources: Iterable[str | Path], *, ignore: tuple[str, ...] = ("progress",),
                  bypass: tuple[str, ...] = ()) -> Callable:
    """Decorate `export(model, out_dir, **options) -> meta`, whose `meta["files"]` names what it wrote into
    `out_dir`, with the artefact cache. The decorated function takes two more keywords: `cache` (False:
    always run) and `cache_dir` (default `$EDGEFINFER_CACHE/artefacts`).

    ignore: options that do not change the files (progress callbacks); bypass: options that make the
    output depend on something outside the key (a folder to copy files from): when set, no cache."""
    sources = tuple(sources)

    def wrap(export: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
        signature = inspect.signature(export)

        @functools.wraps(export)
        def cached(model, out_dir, *args, cache: bool = True, cache_dir: str | Path | None = None, **kwargs):
            bound = signature.bind(model, out_dir, *args, **kwargs)
            bound.apply_defaults()
            options = {k: v for k, v in list(bound.arguments.items())[2:] if k not in ignore}
            if not cache or any(options.get(k) is not None for k in bypass):
                return export(model, out_dir, *args, **kwargs)
            progress = bound.arguments.get("progress")
            store = ArtefactCache(cache_dir, say=progress if callable(progress) else _stderr)
            key = content_key(kind, model, options, sources)
            out = Path(out_dir)
            if (entry := store.get(kind, key)) is not None:
                out.mkdir(parents=True, exist_ok=True)
                store.restore(entry, {name: out / name for name in entry.files})
                store.say(f"[cache] reused {kind} {key[:12]}: {len(entry.files)} file(s), "
                          f"{entry.size_bytes / 2**20:.1f} MiB")
                return dict(entry.meta, cached=True, cache_key=key)
            meta = export(model, out_dir, *args, **kwargs)
            store.put(kind, key, {name: out / name for name in meta["files"]}, meta)
            return dict(meta, cached=False, cache_key=key)

        return cached

    return wrap
