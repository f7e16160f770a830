"""The bundle: a folder with `manifest.json` and the artefacts a target runs.

    bundle/
      manifest.json        format version, target, model config, tokenizer, artefacts (path, size,
                           sha256, format, backend, recipe, KV layout, measured figures), tool versions
      model.pte | model.onnx (+ .onnx.data) | model.gguf ...
      tokenizer.json, tokenizer_config.json

A bundle is written into a temporary sibling folder and renamed into place only when complete, so an
interrupted build (Ctrl-C, SIGKILL, a full disk) never leaves a bundle at the destination. Loading
verifies every artefact's size and sha256 and refuses a bundle that does not match, with one line
saying which file and how.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from edgefinfer.atomic import atomic_dir
from edgefinfer.errors import UserError

FORMAT = "edgefinfer-bundle"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


@dataclass
class Artefact:
    path: str  # relative to the bundle folder
    format: str  # pte | onnx | onnx-data | gguf | qnn-context | tokenizer | json
    role: str  # model | draft | tokenizer | config | weights
    size: int
    sha256: str
    backend: str | None = None  # executorch | onnxruntime | llamacpp | torch
    recipe: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)  # kv layout, inputs/outputs, measured figures, ...


@dataclass
class Manifest:
    target: str
    model: dict[str, Any]  # {"name": ..., "config": HF config dict, "source": ...}
    artefacts: list[Artefact]
    recipe: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    tools: dict[str, Any] = field(default_factory=dict)
    created: str = ""
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def artefact(self, role: str, backend: str | None = None) -> Artefact | None:
        for a in self.artefacts:
            if a.role == role and (backend is None or a.backend == backend):
                return a
        return None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def tool_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("edgefinfer", "torch", "executorch", "torchao", "onnxruntime", "onnx", "onnxruntime-qnn",
                 "llama_cpp_python", "gguf", "tokenizers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


class BundleWriter:
    """Collects artefacts in a temporary folder; `commit()` writes the manifest and renames into place.

    Use as a context manager: leaving the block by an exception removes the temporary folder and
    leaves the destination as it was.

        with BundleWriter(dest, target="android", model={...}) as w:
            exporter.write(w.tmp / "model.pte")
            w.add("model.pte", format="pte", role="model", backend="executorch", recipe="8da4w-g32")
    """

    def __init__(self, dest: str | Path, target: str, model: dict[str, Any]):
        self.dest = Path(dest)
        self.manifest = Manifest(target=target, model=model, artefacts=[])
        self._ctx = atomic_dir(self.dest)
        self.tmp: Path | None = None
        self._committed = False

    def __enter__(self) -> "BundleWriter":
        self.tmp = self._ctx.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool | None:
        if exc_type is None and not self._committed:
            self._ctx.__exit__(RuntimeError, RuntimeError("bundle not committed"), None)
            raise RuntimeError("BundleWriter left without commit(); nothing was written")
        if exc_type is not None:
            return self._ctx.__exit__(exc_type, exc, tb)
        return None

    def add(self, relpath: str, format: str, role: str, backend: str | None = None, recipe: str | None = None,
            **meta: Any) -> Artefact:
        assert self.tmp is not None, "use BundleWriter as a context manager"
        file = self.tmp / relpath
        if not file.is_file():
            raise FileNotFoundError(f"artefact {relpath} was not written into the bundle folder")
        art = Artefact(relpath, format, role, file.stat().st_size, sha256_file(file), backend, recipe, meta)
        self.manifest.artefacts.append(art)
        return art

    def add_copy(self, src: str | Path, relpath: str | None = None, **kw: Any) -> Artefact:
        assert self.tmp is not None, "use BundleWriter as a context manager"
        relpath = relpath or Path(src).name
        (self.tmp / relpath).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, self.tmp / relpath)
        return self.add(relpath, **kw)

    def commit(self) -> Path:
        assert self.tmp is not None, "use BundleWriter as a context manager"
        self.manifest.created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.manifest.tools = tool_versions()
        (self.tmp / MANIFEST).write_text(self.manifest.to_json())
        self._committed = True
        self._ctx.__exit__(None, None, None)
        return self.dest


def load_manifest(path: str | Path, target: str | None = None, verify: bool = True) -> Manifest:
    """Read and verify a bundle. Raises UserError naming the first problem found."""
    folder = Path(path)
    if not folder.is_dir():
        raise UserError(f"bundle {folder} does not exist (build one with `edgefinfer build --target ...`)")
    file = folder / MANIFEST
    if not file.is_file():
        raise UserError(f"{folder} is not a bundle: it has no {MANIFEST}")
    try:
        raw = json.loads(file.read_text())
        if raw.get("format") != FORMAT:
            raise UserError(f"{file} is not an edgefinfer bundle manifest (format {raw.get('format')!r})")
        if raw.get("format_version") != FORMAT_VERSION:
            raise UserError(f"bundle format version {raw.get('format_version')} is not supported "
                            f"(this edgefinfer reads version {FORMAT_VERSION}); rebuild the bundle")
        raw["artefacts"] = [Artefact(**a) for a in raw["artefacts"]]
        manifest = Manifest(**raw)
    except (json.JSONDecodeError, TypeError, KeyError) as e:
        raise UserError(f"{file} is malformed ({e}); rebuild the bundle") from None
    if target is not None and manifest.target != target:
        raise UserError(f"bundle {folder} was built for target {manifest.target!r}, not {target!r}")
    if verify:
        for art in manifest.artefacts:
            verify_artefact(folder, art)
    return manifest


def verify_artefact(folder: Path, art: Artefact) -> Path:
    file = folder / art.path
    if not file.is_file():
        raise UserError(f"bundle {folder} is missing {art.path}; rebuild the bundle")
    size = os.path.getsize(file)
    if size != art.size:
        raise UserError(f"{art.path} in bundle {folder} has {size} bytes, the manifest says {art.size} "
                        f"(truncated or changed); rebuild the bundle")
    if sha256_file(file) != art.sha256:
        raise UserError(f"{art.path} in bundle {folder} does not match its sha256 in the manifest "
                        f"(changed after the build); rebuild the bundle")
    return file
