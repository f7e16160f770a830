"""Thread defaults follow the CPUs a process may run on, not the host's count: under `taskset` or a
container's cpuset, llama.cpp with one thread per host CPU runs spinning threads on shared cores. The
server's and `run`'s llama.cpp threads are one per physical core (SMT siblings once), llama.cpp's default."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from edgefinfer.libraries.cpus import affinity_cap, usable_cores
from tests.server_harness import ROOT, tiny_gguf

needs_two = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity") else True,
                               reason="needs an affinity mask of two or more CPUs to narrow")


@needs_two
def test_usable_cpus_reads_the_affinity_mask_not_the_host():
    one = min(os.sched_getaffinity(0))
    code = f"""
        import os
        from edgefinfer.libraries.cpus import usable_cpus
        os.sched_setaffinity(0, {{{one}}})
        print(usable_cpus(), os.cpu_count())
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[0] == "1" and int(out[1]) >= 2


def test_usable_cores_counts_smt_siblings_once(tmp_path):
    """Two cores with two SMT threads each (siblings 0,2 and 1,3, as Linux numbers them on x86)."""
    for cpu, siblings in {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}.items():
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(siblings + "\n")
    assert usable_cores({0, 1, 2, 3}, tmp_path) == 2
    assert usable_cores({0, 2}, tmp_path) == 1  # one core's two threads
    assert usable_cores({0, 1}, tmp_path) == 2
    assert usable_cores({0, 1, 7}, tmp_path) == 3  # cpu7's topology is missing: one core per CPU


@pytest.mark.skipif(shutil.which("lscpu") is None, reason="needs util-linux's lscpu as the reference")
def test_usable_cores_agrees_with_lscpu_on_this_host():
    rows = subprocess.run(["lscpu", "-p=CPU,CORE,SOCKET"], capture_output=True, text=True, check=True).stdout
    mask = os.sched_getaffinity(0)
    cores = {tuple(line.split(",")[1:]) for line in rows.splitlines()
             if line and not line.startswith("#") and int(line.split(",")[0]) in mask}
    assert usable_cores() == len(cores)


@needs_two
def test_llama_contexts_without_threads_follow_the_mask(tmp_path):
    pytest.importorskip("llama_cpp")
    gguf = tiny_gguf(tmp_path / "tiny.gguf")
    pinned = sorted(os.sched_getaffinity(0))[:2]
    code = f"""
        import os, sys
        from edgefinfer.runtime.backends.llamacpp import LlamaCppBackend
        from edgefinfer.runtime.backends.llamacpp_binding import LlamaContext, LlamaModel
        counts = []
        for cpus in ({{{pinned[0]}}}, {set(pinned)}):
            os.sched_setaffinity(0, cpus)
            model = LlamaModel(sys.argv[1])
            ctx = LlamaContext(model, 1, 64)
            backend = LlamaCppBackend(sys.argv[1], n_ctx=64)
            lib, run = model.lib, backend.ctx.ptr  # what llama.cpp holds: one-token steps, then batches
            counts.append((ctx.threads, lib.llama_n_threads(run), lib.llama_n_threads_batch(run)))
            ctx.close(); model.close()
        print(counts)
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(gguf)], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    # The runtime's decode took half the CPUs before (llama-cpp-python's default): 1 of 2 here.
    two = usable_cores(set(pinned))  # 2, unless the two CPUs are one core's SMT siblings
    assert out.strip() == str([(1, 1, 1), (two, two, two)])


@needs_two
def test_onnx_runtime_and_executorch_pools_follow_a_narrowed_mask(tmp_path):
    """Both libraries size their pools by the host whatever the mask (ExecuTorch: 2 threads under
    `taskset -c 0` here); on a narrowed mask the backends size them to it, on the whole host they
    keep the libraries' own defaults."""
    pytest.importorskip("executorch")
    pytest.importorskip("onnxruntime")
    from edgefinfer.compile.executorch_export import export_pte
    from tests.helpers import tiny_model

    pte = tmp_path / "m.pte"
    export_pte(tiny_model(), pte, recipe="fp32", max_seq_len=32, progress=False, cache=False)
    code = """
        import os, sys
        if sys.argv[2] == "one":
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        from edgefinfer.runtime.backends.executorch import ExecuTorchBackend, runtime_module
        from edgefinfer.runtime.backends.ort import session_options
        ExecuTorchBackend(sys.argv[1])
        print(runtime_module()._threadpool_get_thread_count(), session_options(None).intra_op_num_threads)
    """
    def pools(mask: str) -> str:
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(pte), mask], cwd=ROOT, env=env,
                              capture_output=True, text=True, check=True).stdout.split()

    assert pools("one") == ["1", "1"]
    cap = affinity_cap()  # not None where this process itself runs under a cpuset
    assert pools("all") == [str(cap or os.cpu_count()), str(cap or 0)]
