"""The target registry: names, requirements checked up front, one-line refusals."""

import json
import subprocess
import sys
import time

import pytest

from edgefinfer.errors import UserError
from edgefinfer.targets import TARGETS, Requirement, Target, get_target


def test_every_designed_target_is_registered():
    assert set(TARGETS) == {"android", "ios", "linux-arm64", "linux-x86_64", "qnn", "coreml", "mediatek", "gpu-server"}
    assert get_target("android").backend == "executorch" and get_target("android").delegate == "xnnpack"
    assert get_target("ios").delegate == "coreml"
    assert get_target("gpu-server").format == "gguf"


def test_unknown_target():
    with pytest.raises(UserError, match="unknown target 'symbian'; choose one of: android, ios"):
        get_target("symbian")


def test_missing_sdk_names_it_and_how_to_get_it():
    t = Target("x", "", "pte", "executorch", "fp32",
               requires=(Requirement("Frobnicator SDK", "frobnicator_sdk_not_installed", how="ask Frobnicator"),))
    with pytest.raises(UserError, match=r"target 'x' cannot be built here: Frobnicator SDK is not installed \(ask"):
        t.check()


def test_mediatek_without_its_sdk_fails_fast_in_one_line():
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "edgefinfer", "targets", "--json"], capture_output=True,
                          text=True, timeout=60)
    rows = {r["target"]: r for r in json.loads(proc.stdout)}
    assert not rows["mediatek"]["buildable"] and "mtk_converter" in rows["mediatek"]["missing"][0]
    assert rows["android"]["buildable"]  # executorch and torchao are test dependencies
    with pytest.raises(UserError, match="mtk_converter"):
        get_target("mediatek").check()
    assert time.perf_counter() - t0 < 30  # generous for a loaded box; the check itself is a find_spec
