"""ExecuTorch lowering time per recipe (issue 30 item 1): SmolLM2-135M cut to its first N layers.

    python bench/lowering.py [--layers 4] [--recipes 8da4w-g32-fzp,8da4w-g32,8da8w] [--code LABEL]

Lowering is ExecuTorch's Python passes over the graph, so its cost grows with the layers and the host's
load decides the wall time: each recipe is exported in a child process of its own (imports and caches
do not carry over) and reported with that process's CPU seconds beside the wall time, the stages'
times, the number of XNNPACK delegates, the .pte size, and the load before and after. The artefact
cache is bypassed (cache=False). Writes bench/results/lowering.json: its rows measured under another
`code` label (earlier commits) are kept, this run's rows (labelled with `--code`, default the
checkout's commit) replace those with the same label.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, print_table, versions, write_results  # noqa: E402

CHILD = r"""
import dataclasses, json, sys, tempfile, time
from pathlib import Path
import torch
torch.set_num_threads(1)
from edgefinfer.model import reference
from edgefinfer.model.checkpoint import load_model
from edgefinfer.compile.et_quant import scheme_of
from edgefinfer.compile.executorch_export import export_pte, pte_delegates
from edgefinfer.compile.quant.apply import quantize_model
from edgefinfer.compile.quant.recipe import parse_recipe

recipe, layers = sys.argv[1], int(sys.argv[2])
model = load_model(reference.pull("smollm2-135m"))
model.model.layers = model.model.layers[:layers]
model.config = dataclasses.replace(model.config, num_hidden_layers=layers)
quantize_model(model, parse_recipe(recipe))  # as `edgefinfer build` does: the exporter takes it as it is
cpu, wall = time.process_time(), time.perf_counter()
with tempfile.TemporaryDirectory() as tmp:
    path = Path(tmp) / "model.pte"
    meta = export_pte(model, path, recipe=scheme_of(model), max_seq_len=1024, cache=False,
                      progress=False)
    delegates = len(pte_delegates(path)["forward"]["delegates"])
print(json.dumps({"cpu_s": round(time.process_time() - cpu, 1), "wall_s": round(time.perf_counter() - wall, 1),
                  "stages_s": meta["stages_s"], "delegates": delegates, "size_bytes": meta["size_bytes"]}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--recipes", default="8da4w-g32-fzp,8da4w-g32,8da8w")
    ap.add_argument("--code", default=None, help="label of the code measured (default: the commit)")
    args = ap.parse_args()
    code = args.code or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=Path(__file__).resolve().parent).stdout.strip()
    rows = []
    for recipe in args.recipes.split(","):
        load_before = os.getloadavg()[0]
        proc = subprocess.run([sys.executable, "-c", CHILD, recipe, str(args.layers)], capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"lowering {recipe} failed: {proc.stderr.strip().splitlines()[-1:]}")
        row = {"recipe": recipe, "layers": args.layers, **json.loads(proc.stdout.strip().splitlines()[-1]),
               "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2), "code": code,
               "measured": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
        rows.append(row)
        print(f"{recipe}: {row['cpu_s']} s CPU, {row['wall_s']} s wall, {row['delegates']} delegates", flush=True)
    print_table(rows, ["recipe", "layers", "cpu_s", "wall_s", "delegates", "size_bytes", "load_before", "load_after"])
    old = RESULTS / "lowering.json"
    kept = [r for r in json.loads(old.read_text())["rows"] if r.get("code") != code] if old.is_file() else []
    previous = json.loads(old.read_text()) if old.is_file() else {}
    write_results("lowering", {**{k: v for k, v in previous.items() if k == "note"}, "machine": machine(),
                               "versions": versions("executorch", "torchao"), "rows": kept + rows})


if __name__ == "__main__":
    main()
