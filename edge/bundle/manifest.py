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

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from edgefinfer.errors import UserError
from edgefinfer.files.hashes import known_sha256, sha256_file
from edgefinfer.files.untrusted import read_json

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


def tool_versions() -> dict[str, str | None]:
    # Only a build writes these: importlib.metadata (email, zipfile, csv: 15-60 ms) stays out of a run's start.
    import platform
    from importlib import metadata

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
        from edgefinfer.files.atomic import atomic_dir  # writers only: reading a bundle needs none of it

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
        import shutil

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


MAX_MANIFEST_BYTES = 16 << 20  # a real manifest is a few KiB; a bigger one is not read into memory
_SHA256 = re.compile(r"[0-9a-f]{64}")


def load_manifest(path: str | Path, target: str | None = None, verify: bool = True) -> Manifest:
    """Read and verify a bundle. Raises UserError naming the first problem found.

    A bundle is untrusted input (a file a phone app downloads): the manifest is schema-checked before
    any field is used, every artefact path must be relative, normalised and inside the bundle, and no
    file may resolve (through symlinks) outside it, so a manifest cannot make the runtime open, hash
    or run a file elsewhere on the device."""
    folder = Path(path)
    if not folder.is_dir():
        raise UserError(f"bundle {folder} does not exist (build one with `edgefinfer build --target ...`)")
    file = folder / MANIFEST
    if not file.is_file():
        raise UserError(f"{folder} is not a bundle: it has no {MANIFEST}")
    inside(folder, MANIFEST)
    manifest = parse_manifest(_read_manifest(file), file)
    if target is not None and manifest.target != target:
        raise UserError(f"bundle {folder} was built for target {manifest.target!r}, not {target!r}")
    if verify:
        for art in manifest.artefacts:
            verify_artefact(folder, art)
    return manifest


def _read_manifest(file: Path) -> Any:
    return read_json(file, "rebuild the bundle", kind=object, max_bytes=MAX_MANIFEST_BYTES)  # types: parse_manifest


# (key, types, required) of the manifest and of each artefact entry; everything else is refused.
_MANIFEST_FIELDS = (("format", str, True), ("format_version", int, True), ("target", str, True),
                    ("model", dict, True), ("artefacts", list, True), ("recipe", dict, False),
                    ("metrics", dict, False), ("tools", dict, False), ("created", str, False))
_ARTEFACT_FIELDS = (("path", str, True), ("format", str, True), ("role", str, True), ("size", int, True),
                    ("sha256", str, True), ("backend", (str, type(None)), False), ("recipe", (str, type(None)), False),
                    ("meta", dict, False))


def parse_manifest(raw: Any, file: Path | str = MANIFEST) -> Manifest:
    """A `Manifest` from parsed JSON, or a UserError naming the first field that is wrong."""
    def bad(what: str) -> UserError:
        return UserError(f"{file} is malformed ({what}); rebuild the bundle")

    _check_fields(raw, _MANIFEST_FIELDS, "the manifest", bad)
    if raw["format"] != FORMAT:
        raise UserError(f"{file} is not an edgefinfer bundle manifest (format {raw['format']!r})")
    if raw["format_version"] != FORMAT_VERSION:
        raise UserError(f"bundle format version {raw['format_version']} is not supported "
                        f"(this edgefinfer reads version {FORMAT_VERSION}); rebuild the bundle")
    artefacts, seen = [], set()
    for i, entry in enumerate(raw["artefacts"]):
        _check_fields(entry, _ARTEFACT_FIELDS, f"artefacts[{i}]", bad)
        rel = entry["path"]
        problem = _path_problem(rel)
        if problem:
            raise bad(f"artefacts[{i}].path {rel[:80]!r} {problem}")
        if rel in seen:
            raise bad(f"artefacts[{i}].path {rel!r} is listed twice")
        seen.add(rel)
        if entry["size"] < 0:
            raise bad(f"artefacts[{i}].size is negative")
        if not _SHA256.fullmatch(entry["sha256"]):
            raise bad(f"artefacts[{i}].sha256 is not 64 lower-case hex digits")
        artefacts.append(Artefact(**entry))
    return Manifest(**{**raw, "artefacts": artefacts})


def _check_fields(obj: Any, fields: tuple, where: str, bad) -> None:
    if not isinstance(obj, dict):
        raise bad(f"{where} is a JSON {type(obj).__name__}, not an object")
    known = {name for name, _, _ in fields}
    extra = sorted(set(obj) - known)
    if extra:
        raise bad(f"{where} has unknown key {extra[0]!r}")
    for name, types, required in fields:
        if name not in obj:
            if required:
                raise bad(f"{where} has no {name!r}")
            continue
        value = obj[name]
        # bool is an int to Python, never to a manifest
        if not isinstance(value, types) or (isinstance(value, bool) and types is int):
            raise bad(f"{where}.{name} is a JSON {type(value).__name__}")


def _path_problem(rel: str) -> str | None:
    """Why `rel` cannot name a file inside a bundle (None if it can)."""
    if not rel or "\x00" in rel or "\\" in rel:
        return "is empty or holds a NUL or backslash"
    pure = PurePosixPath(rel)
    if pure.is_absolute() or PureWindowsPath(rel).drive:
        return "is absolute"
    if any(part in ("..", ".") for part in pure.parts) or str(pure) != rel:
        return "is not a normalised relative path inside the bundle"
    return None


def inside(folder: Path, rel: str) -> Path:
    """`folder / rel`, refusing a path that resolves (through any symlink) outside `folder`."""
    root = folder.resolve()
    target = (folder / rel).resolve()
    if target != root and root not in target.parents:
        raise UserError(f"{rel} in bundle {folder} resolves outside the bundle (a symlink?); refusing to read it")
    return target


def verify_artefact(folder: Path, art: Artefact) -> Path:
    file = folder / art.path
    if not file.exists() and not file.is_symlink():
        raise UserError(f"bundle {folder} is missing {art.path}; rebuild the bundle")
    inside(folder, art.path)
    if not file.is_file():
        raise UserError(f"{art.path} in bundle {folder} is not a regular file; rebuild the bundle")
    size = os.path.getsize(file)
    if size != art.size:
        raise UserError(f"{art.path} in bundle {folder} has {size} bytes, the manifest says {art.size} "
                        f"(truncated or changed); rebuild the bundle")
    if known_sha256(file) != art.sha256:  # hashed once per version of the file (file_hash)
        raise UserError(f"{art.path} in bundle {folder} does not match its sha256 in the manifest "
                        f"(changed after the build); rebuild the bundle")
    return file
