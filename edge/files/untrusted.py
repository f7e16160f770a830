"""Model files as untrusted input: cheap checks before a file reaches a parser that trusts it.

A GGUF, a safetensors file, config.json or a tokenizer is a file a user hands us or a bundle brings
from a download. The native libraries behind them differ in how they take damage (probed with
llama-cpp-python 0.3.36, executorch 1.5.1, gguf 0.19.0):

* llama.cpp refuses a structurally broken GGUF (bad magic, huge counts or string lengths, offsets past
  the end, truncation) with a bare "Failed to load model" that names no reason, but a well-formed file
  with hostile hyper-parameters aborts the whole process: `<arch>.block_count` of 0 or over 512
  (GGML_ASSERT n_layer_all in llama-model.cpp), a NaN or negative RMS-norm epsilon (GGML_ASSERT eps >= 0
  in ggml-cpu/ops.cpp, at the first decode).
* gguf-py's reader raises numpy reshape/index errors on damage and takes ~2 s on a 100 MB file.
* ExecuTorch with its default Minimal verification segfaults on a .pte whose flatbuffer header bytes
  are flipped; InternalConsistency verification refuses every such file (see the ExecuTorch backend).

So `check_gguf` walks the GGUF header itself: every length and count is bounded by the bytes left in
the file before anything is read or allocated (no loop runs longer than the file is long), tensor data
must lie inside the file at the declared alignment, and the hyper-parameters llama.cpp asserts on are
checked. It reads only the header (struct over an mmap, no numpy), so it costs ~35 ms on SmolLM2, once
per version of the file (a header that passed is remembered), and needs no optional dependency; gguf-py's
type table is used when installed. `read_json` is the one capped, typed JSON read for manifests,
config.json and tokenizer files; `check_hf_config` types the fields of a Hugging Face config.json before
`ModelConfig` uses them. Torch-free.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import mmap
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgefinfer.errors import UserError
from edgefinfer.files.stamped import remembered

# ---- JSON files --------------------------------------------------------------------------------------
MAX_JSON_BYTES = 16 << 20  # a manifest, config.json or tokenizer_config.json is a few KiB
MAX_TOKENIZER_BYTES = 256 << 20  # tokenizer.json: 2-35 MB for today's vocabularies


def read_json(file: Path, fix: str, kind: type = dict, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """`file` parsed as JSON of type `kind`, or a one-line UserError ending in `fix` (how to repair it)."""
    check_file_size(file, max_bytes, fix)
    try:
        value = json.loads(file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e).splitlines()[0][:120]
        raise UserError(f"{file} is malformed ({reason}); {fix}") from None
    if not isinstance(value, kind):
        raise UserError(f"{file} is malformed (a JSON {type(value).__name__}, not {_json_name(kind)}); {fix}")
    return value


def _json_name(kind: type) -> str:
    return {dict: "an object", list: "an array", str: "a string"}.get(kind, kind.__name__)


def check_file_size(file: Path, max_bytes: int, fix: str) -> None:
    """Refuse a file too big to be what it claims before a library reads it whole into memory."""
    size = file.stat().st_size
    if size > max_bytes:
        raise UserError(f"{file} is {size} bytes, more than the {max_bytes >> 20} MiB such a file can be; {fix}")


# ---- config.json -------------------------------------------------------------------------------------
_INT_LIMIT = 1 << 31
_REQUIRED_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_OPTIONAL_INTS = ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window")
_OPTIONAL_FLOATS = ("rms_norm_eps", "rope_theta")
_OPTIONAL_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def check_hf_config(hf: dict[str, Any], file: Path | str) -> None:
    """Types and ranges of the config.json fields `ModelConfig.from_hf` reads (a UserError on the first)."""
    def bad(key: str, want: str) -> UserError:
        return UserError(f"{file}: {key} is {json.dumps(hf[key])[:40]}, not {want}; fix the file or re-download it")

    for key in _REQUIRED_INTS:
        if key not in hf:
            raise UserError(f"{file} lacks the required key {key!r}")
    for key in _REQUIRED_INTS + _OPTIONAL_INTS:
        if hf.get(key) is not None and not _positive_int(hf[key]):
            raise bad(key, f"an integer in 1..{_INT_LIMIT - 1}")
    for key in _OPTIONAL_FLOATS:
        value = hf.get(key)
        if value is not None and not (_number(value) and math.isfinite(value) and value > 0):
            raise bad(key, "a positive finite number")
    for key in _OPTIONAL_BOOLS:
        if hf.get(key) is not None and not isinstance(hf[key], bool):
            raise bad(key, "true or false")
    for key in _TOKEN_IDS:
        value = hf.get(key)
        ids = value if isinstance(value, list) else [value]
        if value is not None and not all(_token_id(i) for i in ids):
            raise bad(key, "a token id (or a list of them)")
    archs = hf.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise bad("architectures", "a list of strings")
    for key in ("model_type", "hidden_act", "torch_dtype"):
        if hf.get(key) is not None and not isinstance(hf[key], str):
            raise bad(key, "a string")
    for key in ("rope_scaling", "rope_parameters", "quantization_config"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise bad(key, "an object")


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 < v < _INT_LIMIT


def _token_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < _INT_LIMIT


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# ---- GGUF --------------------------------------------------------------------------------------------
GGUF_VERSIONS = (2, 3)  # llama.cpp reads v2 and v3; v1 had 32-bit counts
MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS: more aborts the process
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 63  # GGML_MAX_NAME - 1 bytes of tensor name
# GGUF value types (gguf.GGUFValueType): fixed sizes; 8 is a string, 9 an array
_FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_LAYER = re.compile(r"blk\.(\d+)\.")


class _Damaged(Exception):
    """Why a GGUF cannot be used (becomes one UserError line)."""


class _Cursor:
    """Bounds-checked little-endian reads over a buffer: every read names what ran past the end."""

    def __init__(self, buf: Any, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def left(self) -> int:
        return self.size - self.pos

    def take(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        if n > self.left():
            raise _Damaged(f"the file ends inside {what} (truncated)")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def count(self, what: str, min_item_bytes: int) -> int:
        """A u64 count of items of at least `min_item_bytes` each: it cannot exceed what the file holds."""
        n = self.take("<Q", what)
        if n * min_item_bytes > self.left():
            raise _Damaged(f"{what} is {n}, more than the {self.left()} bytes left can hold")
        return n

    def string(self, what: str) -> str:
        n = self.count(f"the length of {what}", 1)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Damaged(f"{what} is not UTF-8") from None


@dataclass(frozen=True)
class GgufHeader:
    """What `check_gguf` read: the scalar metadata (arrays as (item type, count)) and each tensor's ggml type."""

    meta: dict[str, Any]
    tensor_types: dict[str, int]

    @property
    def float_weights(self) -> bool:
        """Every matrix is F32, F16 or BF16 (no quantized weight anywhere)."""
        return all(t in _FLOAT_TYPES for t in self.tensor_types.values())


_FLOAT_TYPES = (0, 1, 30)  # ggml's F32, F16, BF16


def check_gguf(path: str | Path) -> GgufHeader:
    """Walk a GGUF's header; return what it holds, or raise a one-line UserError saying what is wrong.

    Checks what llama.cpp or gguf-py would crash, abort, hang or fail vaguely on; the tensors' contents
    are the sha256's business (bundles) or the user's."""
    file = Path(path)
    if file.is_dir():
        raise UserError(f"{file} is a folder; pass the .gguf file itself")
    if not file.is_file():
        raise UserError(f"GGUF file {file} does not exist")
    # The walk reads a vocabulary's 100k+ strings in Python (35 ms of every start of SmolLM2's GGUF): a header
    # that passed is remembered per version of the file and of these checks (edgefinfer.files.stamped).
    return remembered(file, GGUF_HEADERS, _read_header, tag=_checker_tag(), encode=_header_to_json,
                      decode=_header_from_json)


GGUF_HEADERS = "gguf-headers.json"  # the store of headers that passed `check_gguf`


@functools.cache
def _checker_tag() -> str:
    """The checks' version: a checksum of this module's source, so that a header passed by older checks is
    walked again (CRC-32: a version tag, not a defence; zlib is loaded already where hashlib is not)."""
    import zlib

    return f"{zlib.crc32(Path(__file__).read_bytes()):08x}"


def _header_to_json(header: GgufHeader) -> dict:
    return {"meta": header.meta, "tensor_types": header.tensor_types}


def _header_from_json(data: dict) -> GgufHeader:
    meta = {k: tuple(v) if isinstance(v, list) else v for k, v in data["meta"].items()}  # arrays' (type, count)
    return GgufHeader(meta, {str(k): int(v) for k, v in data["tensor_types"].items()})


def _read_header(file: Path) -> GgufHeader:
    with file.open("rb") as f:
        magic = f.read(4)
        if magic != b"GGUF":
            raise UserError(f"{file} is not a GGUF file: it starts with {magic!r}, not b'GGUF'")
        try:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _walk(_Cursor(buf, len(buf)))
        except _Damaged as e:
            raise UserError(f"{file} is not a usable GGUF file: {e}; re-download or re-convert it") from None


def _walk(cur: _Cursor) -> GgufHeader:
    cur.pos = 4
    version = cur.take("<I", "the version")
    if version not in GGUF_VERSIONS:
        raise _Damaged(f"version {version} is not one llama.cpp reads ({', '.join(map(str, GGUF_VERSIONS))})")
    n_tensors = cur.take("<Q", "the tensor count")
    n_kv = cur.count("the metadata count", 8 + 4 + 1)  # the smallest entry: empty key, type, one byte
    if n_tensors * (8 + 4 + 4 + 8) > cur.left():  # name length, n_dims, type, offset
        raise _Damaged(f"the tensor count is {n_tensors}, more than the {cur.left()} bytes left can hold")
    meta: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        if key in meta:
            raise _Damaged(f"metadata key {key[:60]!r} appears twice")
        meta[key] = _value(cur, cur.take("<I", f"the type of {key[:60]!r}"), key[:60])
    alignment = meta.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise _Damaged(f"general.alignment is {alignment!r}, not a power of two")
    tensors = [_tensor_info(cur, i) for i in range(n_tensors)]
    data_start = -(-cur.pos // alignment) * alignment
    _check_tensors(tensors, data_start, cur.size, alignment)
    _check_hyperparameters(meta, tensors)
    return GgufHeader(meta, {name: ggml_type for name, _, ggml_type, _ in tensors})


def _value(cur: _Cursor, vtype: int, key: str) -> Any:
    """A scalar value, or (item type, count) for an array (skipped: its items are checked, not kept)."""
    if vtype in _FIXED:
        return cur.take(_FIXED[vtype], f"the value of {key!r}")
    if vtype == _STRING:
        return cur.string(f"the value of {key!r}")
    if vtype != _ARRAY:
        raise _Damaged(f"{key!r} has value type {vtype}, which GGUF does not define")
    itype = cur.take("<I", f"the item type of {key!r}")
    if itype in _FIXED:
        n = cur.count(f"the item count of {key!r}", struct.calcsize(_FIXED[itype]))
        cur.pos += n * struct.calcsize(_FIXED[itype])
    elif itype == _STRING:
        n = cur.count(f"the item count of {key!r}", 8)
        _skip_strings(cur, n, key)
    else:  # llama.cpp reads no nested arrays
        raise _Damaged(f"{key!r} is an array of value type {itype}, which llama.cpp does not read")
    return ("array", itype, n)


_U64 = struct.Struct("<Q")


def _skip_strings(cur: _Cursor, n: int, key: str) -> None:
    """Skip `n` length-prefixed strings, each bounded by the bytes left. A vocabulary holds 50k-250k of
    them, so the loop builds no message unless one is damaged (then `count` raises its usual one): per
    item, it cost 0.3-2 s of every start of a 100 MB GGUF."""
    buf, pos, size, unpack = cur.buf, cur.pos, cur.size, _U64.unpack_from
    for j in range(n):
        start = pos
        pos += 8
        if pos > size or (pos := pos + unpack(buf, start)[0]) > size:
            cur.pos = start
            cur.count(f"the length of {key!r}[{j}]", 1)  # raises, naming the item
    cur.pos = pos


def _tensor_info(cur: _Cursor, i: int) -> tuple[str, list[int], int, int]:
    name = cur.string(f"the name of tensor #{i}")
    if not name or len(name.encode()) > MAX_NAME:
        raise _Damaged(f"tensor #{i} has a name of {len(name.encode())} bytes (1..{MAX_NAME})")
    n_dims = cur.take("<I", f"the dimension count of {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise _Damaged(f"tensor {name!r} has {n_dims} dimensions (1..{MAX_DIMS})")
    dims = [cur.take("<Q", f"the shape of {name!r}") for _ in range(n_dims)]
    ggml_type = cur.take("<I", f"the type of {name!r}")
    offset = cur.take("<Q", f"the data offset of {name!r}")
    return name, dims, ggml_type, offset


def _check_tensors(tensors: list[tuple[str, list[int], int, int]], data_start: int, size: int, alignment: int) -> None:
    sizes = _quant_sizes()
    names = set()
    for name, dims, ggml_type, offset in tensors:
        if name in names:
            raise _Damaged(f"tensor {name!r} appears twice")
        names.add(name)
        if any(d < 1 for d in dims) or math.prod(dims) >= 1 << 62:
            raise _Damaged(f"tensor {name!r} has shape {dims}")
        if offset % alignment:
            raise _Damaged(f"tensor {name!r} starts at offset {offset}, not a multiple of the alignment {alignment}")
        nbytes = 0
        if sizes:
            if ggml_type not in sizes:
                raise _Damaged(f"tensor {name!r} has type {ggml_type}, which this GGUF reader does not know")
            block, type_size = sizes[ggml_type]
            if dims[0] % block:
                raise _Damaged(f"tensor {name!r} has {dims[0]} columns, not a multiple of its type's block of {block}")
            nbytes = math.prod(dims) // block * type_size
        end = data_start + offset + nbytes
        if end > size:
            raise _Damaged(f"tensor {name!r} needs bytes up to {end}, the file has {size} (truncated)")


@functools.lru_cache(maxsize=1)
def _quant_sizes() -> dict[int, tuple[int, int]]:
    """ggml type -> (block size, bytes per block), from gguf-py when installed (empty otherwise).

    Its table is read from `gguf/constants.py` alone (standard library only): `import gguf` runs the
    package's __init__, which loads its writer, vocab and metadata modules (yaml, sentencepiece,
    mistral_common, 70 ms and their memory) into every `edgefinfer run` of a GGUF."""
    if "gguf.constants" in sys.modules:
        return _sizes_of(sys.modules["gguf.constants"])
    spec = importlib.util.find_spec("gguf")
    if spec is None or not spec.submodule_search_locations:
        return {}
    path = Path(next(iter(spec.submodule_search_locations))) / "constants.py"
    try:
        loaded = importlib.util.spec_from_file_location("_edgefinfer_gguf_constants", path)
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
    except (OSError, ImportError, AttributeError):  # another layout of gguf-py: import it whole
        try:
            import gguf.constants as module
        except ImportError:
            return {}
    return _sizes_of(module)


def _sizes_of(constants) -> dict[int, tuple[int, int]]:
    return {int(t): sizes for t, sizes in constants.GGML_QUANT_SIZES.items()}


def _check_hyperparameters(meta: dict[str, Any], tensors: list[tuple[str, list[int], int, int]]) -> None:
    """The values llama.cpp asserts on (aborting the process) instead of refusing the file."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise _Damaged("it has no general.architecture string")
    layers = meta.get(f"{arch}.block_count")
    if layers is not None:
        if not isinstance(layers, int) or not 1 <= layers <= MAX_LAYERS:
            raise _Damaged(f"{arch}.block_count is {layers!r} (1..{MAX_LAYERS})")
        highest = max((int(m.group(1)) for name, *_ in tensors if (m := _LAYER.match(name))), default=-1)
        if highest >= layers:
            raise _Damaged(f"it has tensors of layer {highest} but {arch}.block_count is {layers}")
    for key in (f"{arch}.attention.layer_norm_rms_epsilon", f"{arch}.attention.layer_norm_epsilon"):
        eps = meta.get(key)
        if eps is not None and not (isinstance(eps, float) and math.isfinite(eps) and eps >= 0):
            raise _Damaged(f"{key} is {eps!r}, not a finite number >= 0")
