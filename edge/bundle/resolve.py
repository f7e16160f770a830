"""What a user's MODEL path is: one resolver for the runtime Engine, the server and the commands.

    resolve("dist/android")                  a bundle (or its manifest.json): its model artefact
    resolve("model.pte" | "model.onnx" | "onnx_folder/" | "model.gguf")    a bare artefact
    resolve("hf_folder/")                    a Hugging Face checkpoint (eager torch)
    resolve("smollm2-135m", names="gguf")    a shipped reference model (its GGUF, or its checkpoint)

The answer, a `ModelSource`, names the backend that runs it and, for a bundle, the manifest entry and
its typed description (`edgefinfer.bundle.artefact.ArtefactSpec`). A bare file's own description is read by
its runtime when it opens the file. Foundation: this reads folders and manifests and opens no runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from edgefinfer.bundle.artefact import ArtefactSpec, read_spec
from edgefinfer.bundle.manifest import MANIFEST, Artefact, Manifest, load_manifest
from edgefinfer.errors import UserError

if TYPE_CHECKING:
    from edgefinfer.tokenization.tokenizer import Tokenizer

Kind = Literal["bundle", "artefact", "checkpoint"]
# The backend that runs each artefact file type (a bundle's entries name theirs).
SUFFIX_BACKENDS = {".pte": "executorch", ".gguf": "llamacpp", ".onnx": "onnxruntime"}
ONNX_FILE = "model.onnx"
WHAT = "a bundle folder, a .pte / .onnx / .gguf file, or a Hugging Face folder"


@dataclass(frozen=True)
class ModelSource:
    kind: Kind
    path: Path  # what the backend opens: the artefact file (a bundle's: inside it), or the folder
    folder: Path  # where the tokenizer (and config.json) live
    backend: str  # executorch | onnxruntime | llamacpp | torch
    name: str
    manifest: Manifest | None = None
    entry: Artefact | None = None  # a bundle's manifest entry for `path`
    hf_config: dict[str, Any] | None = None  # the model's config.json (a bundle's manifest copy); None: unknown

    @property
    def spec(self) -> ArtefactSpec | None:
        """A bundle artefact's typed description, from its manifest entry."""
        if self.entry is None:
            return None
        return read_spec("manifest", {**self.entry.meta, "format": self.entry.format, "recipe": self.entry.recipe})

    @property
    def eos_ids(self) -> tuple[int, ...] | None:
        """The config's EOS ids; None when no config names them (a GGUF carries its own)."""
        eos = (self.hf_config or {}).get("eos_token_id")
        if eos is None:
            return None
        from edgefinfer.model.config import normalize_eos_ids  # not at import: a bundle's `run` seldom needs it

        return normalize_eos_ids(eos)

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix == ".gguf" and self.path.is_file()

    @property
    def llama_vocab(self) -> bool:
        """Whether llama.cpp's own vocabulary tokenizes this source (`LlamaVocabTokenizer.for_source`):
        where llama.cpp runs a bundle's GGUF (its tokenizer.json describes the same vocabulary; its
        tokenizer files name the special tokens and the template) or a GGUF alone; not a GGUF with a
        tokenizer.json put beside it by hand, which is the user's choice (`tokenizer`)."""
        if self.backend != "llamacpp" or not self.is_gguf:
            return False
        beside = (self.folder / "tokenizer.json").is_file()
        return beside if self.kind == "bundle" else not beside

    def tokenizer(self) -> "Tokenizer":
        """The model's tokenizer, found one way for `run`, `serve` and the checks: a tokenizer.json in
        the model's folder (a bundle's, a HF folder's, or one put beside a bare artefact), else a
        GGUF's own vocabulary (split as llama.cpp splits it). A one-line UserError when neither is."""
        from edgefinfer.tokenization.tokenizer import Tokenizer

        if (self.folder / "tokenizer.json").is_file():
            return Tokenizer.from_dir(self.folder)
        if self.is_gguf:
            from edgefinfer.model.gguf_import import gguf_vocabulary

            return gguf_vocabulary(self.path)[0]
        raise UserError(f"no tokenizer.json next to {self.path}; put the model's tokenizer.json beside it")

    def stop_ids(self, tokenizer: "Tokenizer", llama_eog: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """The ids that end this model's generations, the one rule for `run` and `serve`: the EOS ids
        of the model's config (config.json, a bundle's manifest copy) where one names them, else a
        GGUF's own (EOS, EOT, EOM and the control tokens llama.cpp ends on: `llama_eog`, llama.cpp's
        own set, where llama.cpp runs the file; else as gguf-py reads them), then the tokenizer's EOS.
        A bare .gguf therefore stops where llama.cpp stops, whichever command runs it."""
        from edgefinfer.decoding.generation import stop_token_ids

        eos = self.eos_ids
        if eos is None and llama_eog is not None:
            eos = llama_eog
        elif eos is None and self.is_gguf:
            from edgefinfer.model.gguf_import import gguf_vocabulary

            eos = gguf_vocabulary(self.path)[1]
        return stop_token_ids(eos or (), tokenizer)


def resolve(model: str | Path, backend: str | None = None, *, format: str | None = None,
            names: Literal["checkpoint", "gguf"] | None = None) -> ModelSource:
    """What `model` is. `backend` forces the backend (for a bundle: picks its artefact for that backend);
    `format` picks a bundle's artefact of that format; `names` also accepts a shipped model's name,
    resolved to its checkpoint folder or its GGUF. Raises a one-line UserError."""
    path = Path(model)
    if not path.exists():
        return _named(str(model), names)
    if path.name == MANIFEST and path.is_file():
        path = path.parent
    if path.is_dir() and (path / MANIFEST).is_file():
        return _bundle(path, backend, format)
    if backend is None:
        backend = _guess_backend(path)
    folder = path if path.is_dir() else path.parent
    config = _read_config(folder)
    kind: Kind = "checkpoint" if backend == "torch" else "artefact"
    return ModelSource(kind, path, folder, backend, path.stem if path.is_file() else path.name, hf_config=config)


def _guess_backend(path: Path) -> str:
    if path.is_file() and path.suffix in SUFFIX_BACKENDS:
        return SUFFIX_BACKENDS[path.suffix]
    if path.is_dir() and (path / ONNX_FILE).is_file():
        return "onnxruntime"
    if path.is_dir() and (path / "config.json").is_file():
        return "torch"
    raise UserError(f"cannot tell what {path} is: expected {WHAT}")


def _bundle(folder: Path, backend: str | None, format: str | None) -> ModelSource:
    manifest = load_manifest(folder)
    entry = next((a for a in manifest.artefacts if a.role == "model" and backend in (None, a.backend)
                  and format in (None, a.format)), None)
    if entry is None:
        wanted = f" for backend {backend!r}" if backend else f" in {format} format" if format else ""
        raise UserError(f"bundle {folder} has no model artefact{wanted}"
                        + ("; build one with `edgefinfer build --target gpu-server`" if format == "gguf" else ""))
    return ModelSource("bundle", folder / entry.path, folder, entry.backend or "", manifest.model.get("name") or
                       folder.name, manifest, entry, manifest.model.get("config"))


def _named(model: str, names: Literal["checkpoint", "gguf"] | None) -> ModelSource:
    if names is not None and "/" not in model and not Path(model).suffix:  # else a mistyped path
        from edgefinfer.model import reference

        if model in reference.MODELS:
            if names == "gguf":
                path = reference.gguf_path(model)
                return ModelSource("artefact", path, path.parent, "llamacpp", model)
            folder = reference.pull(model)
            return ModelSource("checkpoint", folder, folder, "torch", model, hf_config=_read_config(folder))
        raise UserError(f"{model!r} is neither a model path nor a known model ({', '.join(reference.MODELS)}); "
                        f"give {WHAT}")
    raise UserError(f"{model} does not exist: give {WHAT}")


def _read_config(folder: Path) -> dict[str, Any] | None:
    file = folder / "config.json"
    if not file.is_file():
        return None
    from edgefinfer.files.untrusted import read_json

    return read_json(file, "fix or replace the model's config.json")
