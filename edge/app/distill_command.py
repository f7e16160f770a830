"""`edgefinfer distill`: distill a student from a teacher (also runs under `torchrun`).

    edgefinfer distill smollm2-135m out/student --params 0.5 --steps 200
    torchrun --nproc_per_node 2 -m edgefinfer.distill smollm2-135m out/student --params 0.5
"""

from __future__ import annotations

import json
import sys

import click

from edgefinfer.app.entry_point import run_command
from edgefinfer.errors import UserError


def _pairs(text: str | None) -> tuple[tuple[int, int], ...]:
    """'30:30,15:10' -> ((30, 30), (15, 10)): student hidden state : teacher hidden state."""
    if not text:
        return ()
    try:
        return tuple((int(s), int(t)) for s, t in (p.split(":") for p in text.split(",")))
    except ValueError:
        raise UserError(f"--hidden-pairs must look like S:T[,S:T...] (hidden-state indices), got {text!r}") from None


@click.command(name="distill")
@click.argument("teacher")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--params", default="0.5", show_default=True,
              help="Student = the teacher pruned to this budget (fraction or count, e.g. 60M): Minitron.")
@click.option("--layers", type=int, default=None, help="Pruned student: decoder layers to keep.")
@click.option("--kv-heads", type=int, default=None, help="Pruned student: KV heads to keep.")
@click.option("--heads", type=int, default=None, help="Pruned student: query heads (a multiple of --kv-heads).")
@click.option("--multiple-of", type=int, default=32, show_default=True, help="Pruned student: MLP width granularity.")
@click.option("--calib-blocks", type=int, default=32, show_default=True, help="Pruned student: calibration blocks.")
@click.option("--calib-len", type=int, default=256, show_default=True, help="Pruned student: tokens per calibration block.")
@click.option("--student", default=None, help="Use this HF folder as the student instead (same tokenizer).")
@click.option("--student-config", default=None,
              help="Or a JSON file: a HF config, or keys overriding the teacher's (random init).")
@click.option("--corpus", default="train", show_default=True, help="A corpus split or a UTF-8 text file.")
@click.option("--steps", type=int, default=200, show_default=True, help="Optimizer steps.")
@click.option("--batch-size", type=int, default=8, show_default=True, help="Sequences per step, all processes together.")
@click.option("--block-len", type=int, default=256, show_default=True, help="Tokens per sequence.")
@click.option("--num-blocks", type=int, default=None, help="Distinct blocks (default: steps x batch size).")
@click.option("--lr", type=float, default=3e-4, show_default=True)
@click.option("--min-lr", type=float, default=3e-5, show_default=True)
@click.option("--warmup", type=int, default=0, show_default=True, help="Linear warm-up steps.")
@click.option("--weight-decay", type=float, default=0.0, show_default=True)
@click.option("--grad-clip", type=float, default=1.0, show_default=True)
@click.option("--temperature", type=float, default=1.0, show_default=True)
@click.option("--topk-tail", type=click.Choice(["bucket", "renormalize"]), default="bucket", show_default=True,
              help="Teacher mass outside the top k: one extra outcome (bucket) or renormalised away.")
@click.option("--kd-weight", type=float, default=1.0, show_default=True, help="Forward KL on the teacher's top-k.")
@click.option("--ce-weight", type=float, default=0.0, show_default=True, help="Next-token cross-entropy.")
@click.option("--hidden-weight", type=float, default=0.0, show_default=True, help="Hidden-state MSE.")
@click.option("--hidden-pairs", default=None, help="S:T pairs of hidden states (student:teacher), e.g. 20:30.")
@click.option("--projection", type=click.Choice(["learned", "fixed"]), default="learned", show_default=True,
              help="Maps student width to teacher width for the hidden loss when they differ.")
@click.option("--top-k", type=int, default=64, show_default=True, help="Teacher logits kept per token.")
@click.option("--teacher-cache", default=None, help="Folder for the teacher's top-k logits (default: under the cache).")
@click.option("--checkpoint-every", type=int, default=50, show_default=True)
@click.option("--log-every", type=int, default=10, show_default=True)
@click.option("--eval-tokens", type=int, default=4096, show_default=True, help="Test tokens for perplexities (0 = skip).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--threads", type=int, default=None, help="torch intra-op threads (per process).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def distill(teacher: str, out: str, params: str, layers: int | None, kv_heads: int | None, heads: int | None,
            multiple_of: int, calib_blocks: int, calib_len: int,
            student: str | None, student_config: str | None, corpus: str, steps: int, batch_size: int,
            block_len: int, num_blocks: int | None, lr: float, min_lr: float, warmup: int, weight_decay: float,
            grad_clip: float, temperature: float, topk_tail: str, kd_weight: float, ce_weight: float, hidden_weight: float,
            hidden_pairs: str | None, projection: str, top_k: int, teacher_cache: str | None,
            checkpoint_every: int, log_every: int, eval_tokens: int, seed: int, device: str,
            threads: int | None, as_json: bool) -> None:
    """Distill a student from TEACHER (HF folder or reference-model name) into OUT.

    OUT receives student-init/, checkpoints/, train_log.jsonl, model/ (the student, a HF folder) and
    distill_report.json. Rerunning the same command after an interruption resumes from the last checkpoint.
    """
    from edgefinfer.app.model_arg import resolve_model
    from edgefinfer.distill.pipeline import REPORT_NAME, DistillOptions, distill_checkpoint
    from edgefinfer.distill.trainer import TrainConfig

    if threads:
        import torch

        torch.set_num_threads(threads)
    train = TrainConfig(steps=steps, batch_size=batch_size, lr=lr, min_lr=min_lr, warmup_steps=warmup,
                        weight_decay=weight_decay, grad_clip=grad_clip, temperature=temperature, topk_tail=topk_tail,
                        kd_weight=kd_weight,
                        ce_weight=ce_weight, hidden_weight=hidden_weight, hidden_pairs=_pairs(hidden_pairs),
                        projection=projection, seed=seed, checkpoint_every=checkpoint_every, log_every=log_every)
    opts = DistillOptions(train, student, student_config, None if (student or student_config) else params, layers,
                          kv_heads, heads, multiple_of, corpus=corpus, block_len=block_len, num_blocks=num_blocks, top_k=top_k,
                          teacher_cache=teacher_cache, calib_blocks=calib_blocks, calib_len=calib_len,
                          eval_tokens=eval_tokens, device=device)
    opts.validate()
    report = distill_checkpoint(resolve_model(teacher), out, opts)
    if report is None:  # a non-zero rank under torchrun
        return
    if as_json:
        click.echo(json.dumps(report, indent=2))
    elif report["stopped_early"]:
        click.echo(f"stopped at step {report['steps']}; rerun the same command to resume")
    else:
        ppl = ""
        if "test_ppl_after" in report:
            ppl = (f", test ppl {report['test_ppl_before']:.3f} -> {report['test_ppl_after']:.3f} "
                   f"(teacher {report['test_ppl_teacher']:.3f})")
        click.echo(f"student {report['params_student']:,} parameters (teacher {report['params_teacher']:,}), "
                   f"{report['tokens_trained']:,} tokens in {report['train_seconds']:.0f}s "
                   f"({report['tok_s']:.0f} tok/s){ppl}; wrote {out}/model and {out}/{REPORT_NAME}")


def main(argv: list[str] | None = None) -> int:
    """`python -m edgefinfer.distill ...` (what torchrun launches): one-line errors, exit code 2."""
    return run_command(distill, argv, prog_name="edgefinfer distill")


if __name__ == "__main__":
    sys.exit(main())
