"""Teacher folder in, distilled student folder + JSON report out: what `edgefinfer distill` runs.

Layout of the output folder:

    <out>/student-init/        the student before training (HF folder), derived once, reused on resume
    <out>/checkpoints/         resumable training state (see trainer.py)
    <out>/train_log.jsonl      one line per step: losses, lr, tokens/s
    <out>/model/               the distilled student (HF folder, with the teacher's tokenizer)
    <out>/distill_report.json  parameters, perplexities before/after, tokens, wall time

Under torchrun, rank 0 derives the student and builds the teacher cache while the others wait, then
every rank reads both from disk, so all processes start from the same bytes.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from edgefinfer.model.checkpoint import load_config, load_model, save_model
from edgefinfer.distill import distributed
from edgefinfer.distill.student import (check_compatible, config_from_json, student_from_config,
                                        student_from_pruning)
from edgefinfer.distill.teacher_cache import TeacherCache, build_teacher_cache, fingerprint
from edgefinfer.distill.trainer import TokenSource, Trainer, TrainConfig
from edgefinfer.errors import UserError
from edgefinfer.model.transformer import Transformer
from edgefinfer.prune.structured import Shape, parameter_count

REPORT_NAME = "distill_report.json"


@dataclass(frozen=True)
class DistillOptions:
    train: TrainConfig = field(default_factory=TrainConfig)
    student: str | None = None  # an existing student HF folder
    student_config: str | None = None  # a JSON file: a HF config, or HF keys overriding the teacher's
    params: str | None = "0.5"  # otherwise: prune the teacher to this budget (Minitron)
    layers: int | None = None
    kv_heads: int | None = None
    heads: int | None = None
    multiple_of: int = 32
    corpus: str = "train"  # a split name or a UTF-8 text file
    block_len: int = 256
    num_blocks: int | None = None  # None: steps * batch_size blocks (every sample new)
    top_k: int = 64
    teacher_cache: str | None = None  # None: $EDGEFINFER_CACHE/distill/teacher-<fingerprint>
    calib_blocks: int = 32
    calib_len: int = 256
    eval_tokens: int = 4096  # test-split tokens for perplexities in the report; 0 skips them
    device: str = "auto"

    def validate(self) -> None:
        self.train.validate()
        if sum(x is not None for x in (self.student, self.student_config)) > 1:
            raise UserError("give at most one of --student and --student-config")
        if self.block_len < 2:
            raise UserError(f"blocks need at least 2 tokens, got --block-len {self.block_len}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise UserError(f"--num-blocks must be positive, got {self.num_blocks}")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def corpus_text(corpus: str) -> str:
    from edgefinfer.data.corpora import SPLITS, load_text

    if corpus in SPLITS:
        return load_text(corpus)
    path = Path(corpus)
    if not path.is_file():
        raise UserError(f"corpus {corpus!r} is neither a split ({', '.join(SPLITS)}) nor a text file")
    return path.read_text(encoding="utf-8")


def training_blocks(tokenizer, opts: DistillOptions) -> torch.Tensor:
    """Random blocks of the corpus, [N, block_len]: N = num_blocks, or as many as the run consumes."""
    from edgefinfer.data.corpora import token_blocks

    ids = tokenizer.encode(corpus_text(opts.corpus))
    if not ids:
        raise UserError(f"the corpus {opts.corpus!r} is empty; pass a non-empty text file or split")
    wanted = opts.num_blocks or opts.train.steps * opts.train.batch_size
    available = len(ids) // opts.block_len
    return token_blocks(ids, opts.block_len, min(wanted, available) if available else None, seed=opts.train.seed)


def derive_student(teacher_dir: Path, teacher: Transformer, tokenizer, opts: DistillOptions) -> tuple[Transformer, dict]:
    if opts.student is not None:
        check_compatible(teacher_dir, opts.student, teacher.config, load_config(opts.student))
        return load_model(opts.student).train(), {"student_source": str(opts.student)}
    if opts.student_config is not None:
        try:
            spec = json.loads(Path(opts.student_config).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"student config {opts.student_config} could not be read as JSON: {e}") from None
        return student_from_config(config_from_json(spec, teacher.config), opts.train.seed), \
            {"student_source": f"config {opts.student_config} (random init)"}
    if opts.params is None:
        raise UserError("say how to make the student: --params (prune the teacher), --student-config or --student")
    from edgefinfer.prune.calibration import calibration_blocks

    calib = calibration_blocks(tokenizer, opts.calib_blocks, opts.calib_len, opts.train.seed)
    student, kept = student_from_pruning(teacher, calib, opts.params, opts.layers, opts.kv_heads, opts.heads,
                                         opts.multiple_of)
    return student, {"student_source": f"structured pruning of the teacher to {opts.params}",
                     "kept_layers": kept.layers}


def test_perplexity(model: Transformer, ids: list[int]) -> float | None:
    from edgefinfer.data.evaluate import perplexity

    if len(ids) < 2:
        return None
    was_training = model.training
    ppl = perplexity(model.eval(), ids, window=512, stride=512).ppl
    model.train(was_training)
    return ppl


def distill_checkpoint(teacher_dir: str | Path, out_dir: str | Path, opts: DistillOptions) -> dict | None:
    """Distill; returns the report on rank 0 (None on the other ranks)."""
    from edgefinfer.files.user_cache import cache_dir
    from edgefinfer.tokenization.tokenizer import Tokenizer

    opts.validate()
    t0 = time.perf_counter()
    teacher_dir, out = Path(teacher_dir), Path(out_dir)
    info, device = distributed.init(opts.device)
    say = log if info.is_main else None
    try:
        teacher = load_model(teacher_dir).to(device)
        tokenizer = Tokenizer.from_dir(teacher_dir)
        blocks = training_blocks(tokenizer, opts)
        eval_ids = tokenizer.encode(corpus_text("test"))[:opts.eval_tokens] if opts.eval_tokens and info.is_main else []
        report: dict = {"teacher": str(teacher_dir), "options": _jsonable(asdict(opts)), "world_size": info.world,
                        "device": str(device), "train_blocks": list(blocks.shape)}

        init_dir = out / "student-init"
        if info.is_main and not (init_dir / "config.json").is_file():
            student, how = derive_student(teacher_dir, teacher, tokenizer, opts)
            save_model(student, init_dir, tokenizer_dir=teacher_dir,
                       extra_files={"derivation.json": json.dumps(how, indent=2) + "\n"})
        distributed.barrier(info)
        student = load_model(init_dir).to(device).train()
        report.update(json.loads((init_dir / "derivation.json").read_text()))

        uses_teacher = opts.train.kd_weight > 0 or opts.train.hidden_weight > 0
        if uses_teacher:
            layers = tuple(sorted({t for _, t in opts.train.hidden_pairs})) if opts.train.hidden_weight > 0 else ()
            key = fingerprint(teacher, blocks, opts.top_k, layers, opts.train.temperature)
            cache_path = Path(opts.teacher_cache) if opts.teacher_cache else cache_dir() / "distill" / f"teacher-{key[:16]}"
            if info.is_main:
                build_teacher_cache(teacher, blocks, cache_path, opts.top_k, layers, opts.train.temperature,
                                    log=say, key=key)
            distributed.barrier(info)
            source = TeacherCache(cache_path)
            report["teacher_cache"] = {"path": str(cache_path), "top_k": opts.top_k,
                                       "coverage": source.meta.coverage, "build_seconds": source.meta.seconds}
        else:
            source = TokenSource(blocks)
        if info.is_main and eval_ids:
            report["test_ppl_teacher"] = test_perplexity(teacher, eval_ids)
            report["test_ppl_before"] = test_perplexity(student, eval_ids)
        teacher_width = teacher.config.hidden_size
        report["params_teacher"] = parameter_count(teacher)
        del teacher  # the cache holds everything training needs

        trainer = Trainer(student, source, opts.train, out, teacher_width, device, info)
        result = trainer.run()
        distributed.barrier(info)
        if not info.is_main:
            return None
        student = result.student.eval()
        report.update(
            params_student=parameter_count(student), shape=asdict(Shape.of(student.config)),
            steps=result.step, stopped_early=result.stopped_early, tokens_trained=result.tokens,
            train_seconds=round(result.seconds, 2), final_losses=result.last,
            tok_s=round(result.tok_s, 1),
        )
        if result.stopped_early:
            return report
        if eval_ids:
            report["test_ppl_after"] = test_perplexity(student, eval_ids)
        report["wall_seconds"] = round(time.perf_counter() - t0, 2)
        text = json.dumps(report, indent=2) + "\n"
        save_model(student.cpu(), out / "model", tokenizer_dir=teacher_dir, extra_files={REPORT_NAME: text})
        (out / REPORT_NAME).write_text(text)
        return report
    finally:
        distributed.shutdown(info)


def _jsonable(d: dict) -> dict:
    return json.loads(json.dumps(d, default=str))
