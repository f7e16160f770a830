"""A file's sha256, computed once per version of the file rather than on every start.

A bundle's loader checks every artefact against the sha256 its manifest names (`bundle.verify_artefact`),
and a session file names its artefact's. Hashing reads the whole file, and the runtime then maps and reads
it again: every `edgefinfer run` read the weights twice (112 MB for the linux-x86_64 bundle). `known_sha256`
remembers a digest per version of the file (`edgefinfer.files.stamped`: its identity and change stamps,
in `cache_dir() / "sha256-stamps.json"`); while they are unchanged the weights are read once, by the
runtime. A file changed less than `stamped.SETTLED_S` ago is hashed but not remembered.
"""

from __future__ import annotations

from pathlib import Path

from edgefinfer.files import stamped

STORE = "sha256-stamps.json"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    import hashlib  # here: a bundle whose files are stamped opens without it

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def known_sha256(path: str | Path) -> str:
    """`sha256_file(path)`, remembered while the file's stamps are those it was hashed under."""
    return stamped.remembered(path, STORE, lambda p: sha256_file(p))
