"""The ``slimspec`` command line: thin wrappers that parse, call the library, and print."""

from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import click
import torch
import torch.distributed as dist

from slimspec import __version__, choices
from slimspec.checkpoint import load_drafter
from slimspec.checkpoint.target_model import target_of
from slimspec.checkpoint.writer import nearest_existing_parent
from slimspec.convert.pipeline import ConvertResult, model_name
from slimspec.convert.rank import RankError, parse_rank
from slimspec.distill.pipeline import distill as run_distill
from slimspec.distill.scratch import train_from_scratch
from slimspec.errors import OptionError, SlimSpecError, SlimSpecWarning
from slimspec.evaluate.acceptance import evaluate
from slimspec.evaluate.plane import plane_report
from slimspec.hardware import resolve_device
from slimspec.hub import resolve_model
from slimspec.inspection import inspect_drafter
from slimspec.workflows import convert as conversion
from slimspec.workflows import publish
from slimspec.workflows.batch import plan_batch, run_batch
from slimspec.workflows.bench import (
    PAY_MARGIN,
    HeadShape,
    ScreenOptions,
    bench_head,
    bench_screen,
    checkpoint_head,
    kappa_and_speedup,
    stops_paying,
)
from slimspec.workflows.job import ConvertJob, conversion_job, data_options_from, distill_config_from
from slimspec.workflows.plan import conversion_plan
from slimspec.workflows.plane import AUTO_SCREENS, build_plane, convert_rank_auto, parse_screen
from slimspec.workflows.recipes import UNDISTILLED_EXAMPLE, brief_command, default_note, screen_tip


class FiniteFloat(click.FloatRange):
    """A float in range that is also finite (click's FloatRange lets nan through every bound)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if number != number or number in (float("inf"), float("-inf")):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


NON_NEGATIVE = FiniteFloat(min=0.0)
POSITIVE = FiniteFloat(min=0.0, min_open=True)  # (--lr, --teacher-temperature: DistillConfig says it in its words)


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


class SlimSpecGroup(click.Group):
    """Turns SlimSpec errors and bad options into one line on stderr and exit code 2 (no traceback)."""

    def invoke(self, ctx: click.Context):
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):  # ours: one line, no source excerpt
            if issubclass(category, SlimSpecWarning):
                click.echo(f"warning: {message}", err=True)
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        try:
            return super().invoke(ctx)
        except OptionError as exc:  # the library names options; the CLI shows its flags
            _fail(exc.render(flag))
        except SlimSpecError as exc:
            _fail(str(exc))
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else "slimspec"
            _fail(f"{exc.format_message()} (see {where} --help)")
        except KeyboardInterrupt:  # outputs are written atomically: a finished one is whole, a cut one is gone
            _fail("interrupted: finished jobs are kept, the one running left nothing; run the batch again to go on"
                  if ctx.invoked_subcommand == "batch" else "interrupted (no half-written output is left)")
        except OSError as exc:  # an output that cannot be made, a file that cannot be read: one line, not a trace
            if os.environ.get("SLIMSPEC_DEBUG"):
                raise
            where = f"{exc.filename}: " if exc.filename else ""
            _fail(f"{where}{exc.strerror or exc} (SLIMSPEC_DEBUG=1 shows the traceback)")
        finally:
            warnings.showwarning = shown


@click.group(cls=SlimSpecGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="slimspec")
def main() -> None:
    """SlimSpec: give a published EAGLE-3 drafter a low-rank LM head (W_up @ W_down).

    Models are Hub ids (owner/name), local folders, or embedded:smollm2-135m (target) and
    embedded:smollm2-135m-eagle3 (drafter), which work with no network.
    """


def data_options(func):
    """Options that say where teacher data comes from (shared by convert and distill)."""
    options = [
        click.option("--data", multiple=True, help="Prompts: jsonl/json/parquet files or globs (field `turns`), or a "
                     "datasets id. Repeatable. Default: the calibration set shipped with slimspec."),
        click.option("--num-prompts", type=click.IntRange(min=1),
                     help="Use at most this many prompts (a seeded random sample)."),
        click.option("--responses", type=click.Choice(choices.RESPONSES), default="regenerate",
                     show_default=True, help="What follows each prompt: the target's own answer (EAGLE-3 practice), "
                     "the data set's reference answer (no generation), or nothing."),
        click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True,
                     help="Length of regenerated answers."),
        click.option("--temperature", type=NON_NEGATIVE, default=0.0, show_default=True,
                     help="0: greedy answers; > 0: sampled."),
        click.option("--generation-engine", type=click.Choice(choices.GENERATION_ENGINES), default="transformers",
                     show_default=True,
                     help="How regenerated answers and teacher features are computed. transformers: `generate`, "
                          "then one float32 forward per sequence. static: one batched static-cache loop gives "
                          "answers and features in the same passes (2.45x faster on 2 CPU cores, `make bench` "
                          "section teacher; Llama/Mistral/Qwen2/Qwen3 targets, others fall back). vllm: a vLLM "
                          "engine (tensor parallel over the visible GPUs) answers and writes the hidden states, in "
                          "the generation dtype; $SLIMSPEC_VLLM_TEACHER_URL names a running server to use instead "
                          "(docs/distillation.md, \"Teacher data from vLLM\"; Llama/Mistral/Qwen2/Qwen3 targets)."),
        click.option("--generation-dtype", type=click.Choice(choices.GENERATION_DTYPES),
                     default="auto", show_default=True,
                     help="dtype of the target copy that writes the answers (and, with the static engine, the "
                          "features). auto: bfloat16 on a CUDA GPU or where the CPU multiplies bf16 natively "
                          "(AVX512-BF16, AMX), else float32 (emulated bf16 decodes 3-4x slower); "
                          "$SLIMSPEC_GENERATION_DTYPE sets it."),
        click.option("--device", default="auto", show_default=True,
                     help="Where the target computes the teacher data (answers and features) and the head is "
                          "distilled: auto ($SLIMSPEC_DEVICE if set, else a CUDA GPU when PyTorch sees one, else the "
                          "CPU), cpu, cuda or cuda:N. The data is cached on the CPU; the static engine is CPU-only "
                          "(on a GPU, generate does the work); torchrun runs distil on the CPU. auto also shards a "
                          "target too large for the first GPU (or the CPU) over every visible GPU, then the CPU, then "
                          "disk; cpu and cuda:N keep it whole there."),
        click.option("--max-memory", metavar="BUDGETS",
                     help="Shard the target (accelerate device_map=auto) within these budgets, e.g. "
                          "cuda:0=70GiB,cuda:1=70GiB,cpu=100GiB (a GPU as N or cuda:N; B, MB/GB or MiB/GiB); the "
                          "weights beyond them go to --offload-folder. Answers and features come out the same."),
        click.option("--offload-folder", type=click.Path(file_okay=False, path_type=Path),
                     help="Where a sharded target's weights beyond the memory budgets go [default: a folder of the "
                          "slimspec cache, removed after use]."),
        click.option("--feature-dtype", type=click.Choice(choices.FEATURE_DTYPES), default="auto",
                     show_default=True,
                     help="dtype of the target copy the teacher features are read from (transformers engine; the "
                          "static engine reads them from the answering copy). auto: float32 where a float32 copy "
                          "fits the devices and host memory the target may use, else the target's own 16-bit dtype "
                          "(docs/distillation.md, \"Targets beyond one device\": the error it brings)."),
        click.option("--aux-layers", help="Target hidden-state indices feeding fc, e.g. 2,15,27 (default: the "
                     "drafter's config, else EAGLE-3's {2, L//2, L-3})."),
        click.option("--aux-convention", type=click.Choice(["input", "output"]),
                     help="How --aux-layers / the config count: index of the layer a state enters (vLLM) or leaves "
                          "(SpecForge/ModelOpt). Default: by the drafter's layout."),
        click.option("--teacher", type=click.Choice(choices.TEACHERS), default="target", show_default=True,
                     help="What the head is distilled against. target: the target's next-token distribution "
                          "(full-vocabulary KL; learns beyond the source drafter, needs data). drafter: the source "
                          "drafter's own full-rank head on the same states (recovers the original's acceptance "
                          "from little data; every position counts)."),
        click.option("--teacher-temperature", type=float, default=1.0, show_default=True,
                     help="Distil against softmax(teacher logits / T): below 1 sharpens the teacher toward its "
                          "argmax (the token greedy verification accepts); the reported held-out KL stays at T=1."),
        click.option("--screen-train-share", type=POSITIVE, default=0.5, show_default=True,
                     help="A screen-and-rescore head (--shortlist K) is distilled as if its shortlist were this share "
                          "of K: the teacher's tokens are pulled into the pair's top share x K, a margin at the K "
                          "it serves (held-out numbers stay at K); 1: at K."),
        click.option("--ttt-steps", type=click.IntRange(min=1), default=3, show_default=True,
                     help="Training-time-test unroll."),
        click.option("--lr", type=float, default=2e-3, show_default=True, help="Peak AdamW learning rate."),
        click.option("--warmup-steps", type=int, default=10, show_default=True,
                     help="Linear warmup to --lr, then cosine decay to a tenth of it."),
        click.option("--batch-tokens", type=click.IntRange(min=1), default=2048, show_default=True,
                     help="Drafter positions per step."),
        click.option("--seed", type=int, default=0, show_default=True,
                     help="Seed of the distillation (batch draws, held-out split) and, with --temperature > 0, "
                          "of the sampled answers."),
        click.option("--bf16", is_flag=True,
                     help="Mixed-precision distillation: the drafter's forward under bf16 autocast and the KL's "
                          "logit/gradient matmuls in bf16 (softmax, KL and sums stay fp32). Faster where bf16 "
                          "matmuls are (scripts/bench.py --only train-step measures it); logits rounded to bf16 "
                          "(docs/distillation.md: what it costs)."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _int_list(text: str, hint: str) -> list[int]:
    """Comma-separated integers (e.g. ``2,15,27``), or a usage error naming the option."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers such as 2,15,27, got {text!r}",
                                 param_hint=hint) from None


def _given(ctx: click.Context, name: str) -> bool:
    return ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE


def _given_options(ctx: click.Context, wanted) -> list[click.Parameter]:
    """The command's parameters named on the command line whose name ``wanted(name)`` accepts, in --help order."""
    return [p for p in ctx.command.params if wanted(p.name) and _given(ctx, p.name)]


def flag(option: str) -> str:
    """The CLI flag of an option name (``distill_steps`` -> ``--distill-steps``)."""
    return "--" + option.replace("_", "-")


RANK_AUTO_OPTIONS = {"drafter", "target", "rank", "kappa", "vocab", "out", "overwrite", "distill_steps", "no_distill",
                     "num_prompts", "push_to", "as_json", "quiet", "device"}
"""The convert options --rank auto honours; it refuses the others rather than ignore them."""


@main.command()
@click.argument("drafter")
@click.option("--target", "-t", help="Target model the drafter serves (Hub id, folder or embedded: name). Needed by "
              "--vocab full and by distillation (the default) [default: the target the drafter names, else the one "
              "SlimSpec's table of published drafters lists].")
@click.option("--rank", "-r", default="d/8", show_default=True,
              help="d/N, an integer, energy:F (smallest r keeping share F of the head's squared singular values), "
                   "or auto (measure nu and tau at d/4..d/32, each briefly distilled with --distill-steps [60] on "
                   "--num-prompts [64] shipped prompts; keep the best predicted rho_TPS at --kappa).")
@click.option("--kappa", type=POSITIVE, default=0.5, show_default=True,
              help="--rank auto: the head's share of a draft+verify cycle (measure it with slimspec bench --kappa).")
@click.option("--vocab", type=click.Choice(choices.VOCABS), default="full", show_default=True,
              help="full: head over the whole target vocabulary (draft rows from the drafter, the rest from the "
                   "target's head); draft: keep the drafter's draft vocabulary and its d2t (the default recipe's).")
@click.option("--out", "-o", type=click.Path(path_type=Path),
              help="Output folder [default: ./<drafter-name>-slimspec-r<r>; --rank auto: -slimspec-auto].")
@click.option("--dtype", type=click.Choice(choices.OUTPUT_DTYPES), help="Output dtype [default: the source's].")
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
@click.option("--revision", help="Hub revision (branch, tag or commit) of the drafter.")
@click.option("--target-revision", help="Hub revision (branch, tag or commit) of the target.")
@click.option("--stitch", type=click.Choice(choices.STITCHES), default="target", show_default=True,
              help="--vocab full: rows outside the draft vocab from the target's head, zeros, or the target's rows "
                   "rescaled to the drafter's row norm.")
@click.option("--init", type=click.Choice(choices.INITS), default="auto", show_default=True,
              help="svd: optimal for ||W - W_up W_down||; whitened: optimal for ||(W - W_up W_down) X|| over the "
                   "drafter's real activations X (needs the target and calibration data); auto: whitened when "
                   "--distill-steps > 0 (half the starting KL on the reference drafter), else svd.")
@click.option("--distill-steps", type=click.IntRange(min=0),
              help="Then distil the pair for N steps under full-vocabulary KL (against --teacher); 0: the plain SVD "
                   "head, not distilled [default: --recipe brief's 200 steps; --rank auto: 60].")
@click.option("--no-distill", is_flag=True, help="The plain SVD head, not distilled: --distill-steps 0.")
@click.option("--shortlist", type=click.IntRange(min=0), default=0, show_default=True,
              help="Screen and rescore (--vocab draft): the pair scores every draft token, the drafter's own head "
                   "rows rescore its top K, and the draft is the exact argmax over them; the checkpoint keeps those "
                   "rows beside the pair. 0: the plain pair.")
@click.option("--hot-rows", type=click.IntRange(min=0), default=0, show_default=True,
              help="With --shortlist: also rescore the N draft tokens most frequent in the target's answers to the "
                   "calibration prompts, always.")
@click.option("--head-budget",
              help="Pick the screen-and-rescore head (rank, --shortlist, --hot-rows; --vocab draft) whose greedy "
                   "token agrees most often with the source head's on held-out calibration states, among those "
                   "whose multiply-adds fit this budget: d/N (the cost of a plain rank-d/N pair) or a share of the "
                   "full head's (0.06). Says what it picked and what the runners-up and the plain pair measured.")
@click.option("--serve-batch", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --head-budget: the batch size you serve at. Each sequence rescores its own shortlist, so "
                   "the rows read grow with the batch: candidates must fit the budget in rows read too (shortlists "
                   "shrink), and the plain pair is picked where it agrees more than every screen that fits "
                   "(`slimspec bench head --shortlist K` times where the screen stops paying on your device).")
@click.option("--recipe", type=click.Choice(choices.RECIPES),
              help="brief (the default when neither --recipe nor --distill-steps is given): the demo's brief "
                   "distillation for every option not given (--vocab draft, 200 steps against the drafter's own "
                   "head on the shipped calibration prompts' 64-token answers, lr 5e-3; 0.90 of tau kept at d/8 on "
                   "the embedded drafter, against 0.61 undistilled); options given here override it.")
@data_options
@click.option("--push-to", help="After a successful conversion, push the folder to this Hub repo id.")
@click.option("--dry-run", is_flag=True,
              help="Plan the conversion from the inputs' configs and file sizes, reading and downloading no weight "
                   "and writing nothing: rank, head parameters and FLOPs, bytes to download, peak memory of each "
                   "stage; refuse a plan that does not fit the free memory.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object on stdout.")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines on stderr.")
def convert(drafter: str, target: str | None, rank: str, vocab: str, out: Path | None, dtype: str | None,
            overwrite: bool, revision: str | None, target_revision: str | None, stitch: str, init: str,
            distill_steps: int | None, no_distill: bool, push_to: str | None, as_json: bool, quiet: bool,
            kappa: float, recipe: str | None, dry_run: bool, **kw) -> None:
    """Replace DRAFTER's LM head by a low-rank pair, distil it briefly, and write a vLLM-ready folder.

    By default the pair starts from the head's SVD (whitened on the drafter's activations) and is distilled with
    --recipe brief: the target answers the shipped calibration prompts, and the pair learns the drafter's own
    head on those states for 200 steps (docs/distillation.md; on an 8B drafter see BENCHMARKS.md for the time).
    Options left out then take the recipe's values (under --recipe), not the defaults shown below; options given
    override them. --distill-steps N sets up a distillation of your own (the defaults below), and --distill-steps 0
    (or --no-distill) writes the plain SVD head at once, which can lose much of the drafter's acceptance.

    \b
    Example:
      slimspec convert yuhuili/EAGLE3-LLaMA3.1-Instruct-8B --rank d/8
    """
    ctx = click.get_current_context()
    given = {p.name for p in _given_options(ctx, lambda name: True)} - {"no_distill"}
    distill_steps = _no_distill(distill_steps, no_distill, recipe)
    if no_distill:
        given.add("distill_steps")
    if kw.get("aux_layers"):
        kw["aux_layers"] = _int_list(kw["aux_layers"], "--aux-layers")
    options = {**kw, "drafter": drafter, "target": target, "rank": rank, "vocab": vocab, "out": out, "dtype": dtype,
               "overwrite": overwrite, "revision": revision, "target_revision": target_revision, "stitch": stitch,
               "init": init, "distill_steps": distill_steps, "push_to": push_to, "recipe": recipe}
    if _given(ctx, "kappa") and rank != "auto":
        raise click.UsageError("--kappa weighs the candidates of --rank auto; give --rank auto or drop it")
    if dry_run:
        if rank == "auto":
            raise click.UsageError("--dry-run plans one conversion; --rank auto measures several")
        plan = conversion_plan(_convert_job(options, given - {"dry_run"}, quiet))
        click.echo(json.dumps(plan.report) if as_json else plan.text())
        plan.check()
        return
    if rank == "auto":
        result = _convert_rank_auto(ctx, options, kappa, quiet)
    else:
        result = conversion.run_conversion(_convert_job(options, given, quiet))
    report = {"out": str(result.out), **result.report}
    if "distill" not in report:
        warnings.warn(f"{result.out} is not distilled (--distill-steps 0): an undistilled pair can lose most of the "
                      f"drafter's acceptance ({UNDISTILLED_EXAMPLE}). Without --distill-steps, convert distils with "
                      f"the demo's brief recipe, that is {brief_command(drafter, str(result.rank))}",
                      SlimSpecWarning, stacklevel=1)
    if report.get("vocab_mode") == "draft" and "screen" not in report and rank != "auto" and not quiet \
            and not kw.get("head_budget"):
        click.echo(f"[slimspec] {screen_tip(drafter, rank, report['head_flop_ratio'])}", err=True)
    if push_to:
        try:
            plan = publish.push(result.out, push_to)
        except SlimSpecError as exc:  # the conversion is done: say where it is and how to push it alone
            raise SlimSpecError(f"{exc} (the conversion is kept in {result.out}: `slimspec push {result.out} "
                                f"{push_to}` pushes it)") from None
        report["pushed_to"] = plan.url or push_to
    if as_json:
        click.echo(json.dumps(report))
        return
    _print_convert_report(report)
    if push_to:
        click.echo(f"pushed to {report['pushed_to']}")


def _convert_job(options: dict, given: set[str], quiet: bool) -> ConvertJob:
    """The validated job of convert's options; one line on stderr when it distils by default."""
    job = conversion_job(options, given, progress=not quiet)
    job.validate()
    if job.distils_by_default and not quiet:
        click.echo(f"[slimspec] {default_note('--distill-steps 0', '--recipe brief')}", err=True)
    return job


def _no_distill(distill_steps: int | None, no_distill: bool, recipe: str | None) -> int | None:
    """``--distill-steps`` once ``--no-distill`` (its 0) is folded in; the two, or it and a recipe, contradicting
    each other are refused."""
    if not no_distill:
        return distill_steps
    if distill_steps:
        raise click.UsageError(f"--no-distill and --distill-steps {distill_steps} contradict each other; give one")
    if recipe is not None:
        raise click.UsageError(f"--no-distill and --recipe {recipe} contradict each other; give one")
    return 0


def _convert_rank_auto(ctx: click.Context, options: dict, kappa: float, quiet: bool) -> ConvertResult:
    """``--rank auto``: the plane's own recipe at each candidate rank; options it would ignore are refused."""
    fixed = [p.opts[0] for p in _given_options(ctx, lambda name: name not in RANK_AUTO_OPTIONS)]
    if fixed:
        raise click.UsageError(f"--rank auto runs the plane's own recipe (drafter teacher, shipped calibration "
                               f"prompts) and takes no {', '.join(fixed)}")
    job = conversion_job({**options, "rank": "d/8"}, ())
    job.validate()  # the push target and the device, as every conversion checks them
    drafter = options["drafter"]
    target = options["target"] or target_of(drafter)
    out = options["out"] or Path(f"{model_name(drafter)}-slimspec-auto")
    convert_rank_auto(drafter, target, out, kappa=kappa, vocab=options["vocab"],
                      screens=AUTO_SCREENS if options["vocab"] == "draft" else (),
                      distill_steps=60 if options["distill_steps"] is None else options["distill_steps"],
                      calibration_prompts=job.data_options.num_prompts or 64,
                      overwrite=options["overwrite"], progress=not quiet, device=job.data_options.device)
    saved = json.loads((out / "slimspec.json").read_text())
    return ConvertResult(out=out, rank=saved["rank"], report=saved)


def _print_convert_report(report: dict) -> None:
    rows = [
        ("output", report["out"]),
        ("source layout", report["source"]["drafter_layout"]),
        ("rank", f"{report['rank']} (d={report['hidden_size']}, spec {report['rank_spec']})"),
        ("head vocabulary", f"{report['head_vocab']} ({report['vocab_mode']}; {report['rows_from_drafter']} rows "
                            f"from the drafter, {report['rows_from_target']} from the target)"),
        ("head params", f"{report['head_params_source']:,} -> {report['head_params']:,}"),
        ("head FLOP ratio", f"{report['head_flop_ratio']:.4f}"),
        ("energy kept", f"{report['energy_kept']:.4f} (rows centred, the part softmax sees: "
                        f"{report['energy_kept_centered']:.4f})"),
        ("relative Frobenius error", f"{report['relative_frobenius_error']:.4f}"),
        ("time", f"{report['timings']['total']:.1f}s"),
    ]
    if "distill" not in report:  # random states say nothing of a head distilled on the drafter's real ones
        rows.insert(-1, ("argmax agreement (random h)", f"{report['verification']['argmax_agreement_vs_full']:.3f}"))
    for name, kl in report.get("init_kl", {}).items():
        top1 = kl.get("step0_top1")
        rows.insert(-1, (f"step-0 KL, {name} init", _kl_text(kl["step0_kl"]) + (
            f" (top-1 agreement {top1:.3f})" if top1 is not None else "")))
    if "distill" in report:
        d = report["distill"]
        rows.insert(-1, ("distillation", f"{d['steps']} steps: step-0 KL {_kl_text(d['kl_before'])} -> "
                                         f"{_kl_text(d['kl_after'])} ({d['tokens_per_second']:.0f} tokens/s)"))
        if d.get("top1_before") is not None and d.get("top1_after") is not None:
            rows.insert(-1, ("top-1 agreement", f"{d['top1_before']:.3f} -> {d['top1_after']:.3f} (held-out "
                                                "tokens, step 0: the teacher's argmax drafted)"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key:<{width}}  {value}")


@main.command()
@click.argument("checkpoint", required=False)
@click.option("--target", "-t", help="Target model (default: the one recorded in the checkpoint).")
@click.option("--from-scratch", is_flag=True, help="Train a whole new EAGLE-3 drafter for --target (no CHECKPOINT).")
@click.option("--draft-vocab", type=click.IntRange(min=1), default=8192, show_default=True,
              help="--from-scratch: draft vocabulary size (most frequent tokens of the target's answers).")
@click.option("--head-rank", type=click.IntRange(min=1),
              help="--from-scratch: a SlimSpec head of this rank instead of a full one.")
@click.option("--layers", type=click.IntRange(min=1), default=1, show_default=True,
              help="--from-scratch: decoder layers (the EAGLE-3 layer, then plain ones over its hidden state, as "
                   "speculators' multi-layer drafters; vLLM serves them all).")
@click.option("--steps", type=click.IntRange(min=1), default=100, show_default=True, help="Optimizer steps.")
@click.option("--train-backbone", is_flag=True, help="Train the whole drafter, not only the head (with --teacher "
              "drafter the source drafter's own states stay the teacher's).")
@click.option("--backbone-lr", type=float, help="--train-backbone: peak lr of the backbone [default: --lr].")
@click.option("--save-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="Write a resumable checkpoint every M steps (0: off).")
@click.option("--resume", is_flag=True, help="Continue from the last checkpoint of an interrupted run (same options).")
@click.option("--shortlist", type=click.IntRange(min=1),
              help="Distil and write a screen-and-rescore head rescoring the pair's top K: a screen CHECKPOINT "
                   "changes its K; a plain SlimSpec pair over the draft vocabulary takes its source drafter's head "
                   "rows as the exact rows. [default: a screen's own K]")
@click.option("--hot-rows", type=click.IntRange(min=0),
              help="With a screen: always rescore the N draft tokens most frequent in the target's answers "
                   "[default: a screen's own].")
@click.option("--out", "-o", type=click.Path(path_type=Path),
              help="Output folder [default: ./<checkpoint-name>-distilled]. It may be CHECKPOINT itself: the "
                   "distilled head then replaces it, only once the run has succeeded.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
@data_options
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object on stdout.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
def distill(checkpoint: str | None, target: str | None, from_scratch: bool, draft_vocab: int, head_rank: int | None,
            layers: int, steps: int, train_backbone: bool, backbone_lr: float | None, save_every: int, resume: bool,
            shortlist: int | None, hot_rows: int | None, out: Path | None, overwrite: bool, as_json: bool,
            quiet: bool, **kw) -> None:
    """Distil CHECKPOINT's head (or whole drafter) against the target under full-vocabulary KL.

    Teacher data (target features and final hidden states on prompt + answer) is cached on disk, so
    repeated runs skip the target. Works under torchrun (gloo) for data parallelism.
    """
    ctx = click.get_current_context()
    if not from_scratch:
        scratch_only = [p.opts[0] for p in _given_options(ctx, {"draft_vocab", "head_rank", "layers"}.__contains__)]
        if scratch_only:
            raise click.UsageError(f"{', '.join(scratch_only)} go with --from-scratch (a CHECKPOINT keeps its own)")
        if (shortlist is not None or hot_rows is not None) and train_backbone:
            raise click.UsageError("--shortlist and --hot-rows shape a head distilled alone: drop --train-backbone")
        if backbone_lr is not None and not train_backbone:
            raise click.UsageError("--backbone-lr is the backbone's lr: add --train-backbone (the head trains alone "
                                   "without it)")
    if kw.get("aux_layers"):
        kw["aux_layers"] = _int_list(kw["aux_layers"], "--aux-layers")
    options = data_options_from(kw)
    resolve_device(options.device)  # an unusable --device fails now, not after the teacher data
    options.placement()  # so do malformed --max-memory budgets
    if backbone_lr is not None and backbone_lr <= 0:
        raise OptionError(f"{{backbone_lr}} must be > 0, got {backbone_lr:g}", "backbone_lr")
    cfg = replace(distill_config_from(kw, steps), train_backbone=train_backbone, backbone_lr=backbone_lr,
                  save_every=save_every)
    _init_distributed()
    if from_scratch:
        if shortlist is not None or hot_rows is not None:
            raise click.UsageError("--shortlist and --hot-rows give a CHECKPOINT's pair a screen; --from-scratch "
                                   "trains a head of its own")
        if checkpoint is not None or target is None or out is None:
            raise click.UsageError("--from-scratch takes no CHECKPOINT and needs --target and --out")
        path, result = train_from_scratch(target, out, draft_vocab=draft_vocab, rank=head_rank, num_layers=layers,
                                          data_options=options, config=cfg, overwrite=overwrite or resume,
                                          resume=resume, progress=not quiet)
    else:
        if checkpoint is None:
            raise click.UsageError("CHECKPOINT is required (or use --from-scratch)")
        path, result = run_distill(checkpoint, target, out=out, overwrite=overwrite or resume, config=cfg,
                                   data_options=options, resume=resume, progress=not quiet, shortlist=shortlist,
                                   hot_rows=hot_rows)
    summary = {"out": str(path), **result.summary()}

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    if as_json:
        click.echo(json.dumps(summary))
        return
    click.echo(f"output           {path}")
    click.echo(f"steps            {result.steps} ({result.seconds:.0f}s, {result.tokens_per_second:.0f} tokens/s)")
    if summary["kl_before"] is None:
        click.echo("step-0 KL        n/a (no held-out sequence with answer tokens: give more prompts)")
    else:
        click.echo(f"step-0 KL        {result.kl_before:.4f} -> {result.kl_after:.4f} (held-out tokens)")
    if summary["top1_before"] is not None and summary["top1_after"] is not None:
        click.echo(f"top-1 agreement  {summary['top1_before']:.3f} -> {summary['top1_after']:.3f} (held-out tokens, "
                   "step 0: the student drafts the teacher's argmax)")
    click.echo("per TTT step     " + ", ".join(f"{a:.3f}->{b:.3f}" for a, b in
                                               zip(result.kl_before_per_step, result.kl_after_per_step, strict=True)))


def _kl_text(value: float | None) -> str:
    """A held-out KL, or why there is none (no held-out sequence with answer tokens)."""
    return "n/a (no held-out answers)" if value is None else f"{value:.4f}"


def _init_distributed() -> None:
    """Join a torchrun process group (gloo: CPU) when launched by torchrun."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if not dist.is_initialized():  # other ranks wait while rank 0 builds the teacher data: hours, not 30 min

            dist.init_process_group("gloo", timeout=timedelta(hours=8))


@main.command()
@click.argument("folder", type=click.Path(path_type=Path))
@click.argument("repo_id")
@click.option("--private", is_flag=True, help="Create the repo as private.")
@click.option("--revision", help="Branch to push to (created if missing).")
@click.option("--commit-message", help="Commit message.")
@click.option("--dry-run", is_flag=True, help="Validate and show what would be uploaded; send nothing.")
def push(folder: Path, repo_id: str, private: bool, revision: str | None, commit_message: str | None,
         dry_run: bool) -> None:
    """Validate FOLDER (a SlimSpec drafter) and upload it to the Hub as REPO_ID in one commit.

    The token comes from HF_TOKEN or the saved `hf auth login`; it is never printed or written.
    """
    plan = publish.push(folder, repo_id, private=private, revision=revision, commit_message=commit_message,
                    dry_run=dry_run)
    _print_push(plan, dry_run)


def _print_push(plan, dry_run: bool) -> None:
    verb = "would upload (dry run)" if dry_run else "uploaded"
    click.echo(f"{verb} to {plan.repo_id}{'@' + plan.revision if plan.revision else ''}"
               f"{' (private)' if plan.private else ''}:")
    for name, size in plan.files.items():
        click.echo(f"  {name:<24} {size:>14,} bytes")
    if plan.extra.get("not_pushed"):
        click.echo(f"not pushed (not checkpoint files): {', '.join(plan.extra['not_pushed'])}")
    click.echo(f"card metadata: {json.dumps(plan.metadata)}")
    if plan.url:
        click.echo(f"url: {plan.url}")


@main.command()
@click.argument("manifest", type=click.Path(path_type=Path))
@click.option("--continue-on-error", is_flag=True, help="Run every job even after one fails.")
@click.option("--report", type=click.Path(path_type=Path), help="Write the JSON-lines report here (default: stdout).")
@click.option("--dry-run", is_flag=True, help="Plan every job as convert --dry-run does (one JSON line each) and run "
              "none; exit code 1 when a job is refused.")
def batch(manifest: Path, continue_on_error: bool, report: Path | None, dry_run: bool) -> None:
    """Run the conversions listed in MANIFEST (YAML, JSON or JSON lines).

    \b
    MANIFEST: {defaults: {target: ..., recipe: brief}, jobs: [{drafter: ..., out: ..., push_to: ...}, ...]}
    Job options: drafter, target, rank, vocab, out, overwrite, dtype, stitch, init, distill_steps, data, num_prompts,
    responses, max_new_tokens, generation_engine, generation_dtype, revision (the drafter's), target_revision, device,
    max_memory, offload_folder (where the teacher data is computed and the head distilled; not part of what makes a
    job's output), feature_dtype, push_to, eval_prompts (measure tau on that many mt_bench prompts); shortlist,
    hot_rows, head_budget, serve_batch; the distillation's teacher, lr, warmup_steps, batch_tokens, ttt_steps, seed,
    bf16, teacher_temperature, screen_train_share, temperature, aux_layers (a list), aux_convention, as convert's
    options; recipe: brief (convert --recipe brief: the demo's distillation, under any key the job or the defaults
    give). Jobs without distillation are named in a warning at the end. A job whose output already holds the same
    conversion is skipped, one holding another batch job's is replaced (any other existing folder only with
    overwrite: true; never the drafter's own); outputs are written atomically, so a killed batch can simply be run
    again. Exit code 1 when any job failed.
    """
    if dry_run:
        if any(line["status"] in ("refused", "failed") for line in plan_batch(manifest, report_path=report)):
            sys.exit(1)
        return
    results = run_batch(manifest, continue_on_error=continue_on_error, report_path=report)
    failed = [r for r in results if r.status in ("failed", "not run")]
    if failed:
        sys.exit(1)


class BenchGroup(click.Group):
    """`slimspec bench [CHECKPOINT] [options]` runs the head bench; `slimspec bench plane ...` the plane."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and (args[0] in self.commands or args[0] in ("-h", "--help")):
            return super().parse_args(ctx, args)
        return super().parse_args(ctx, ["head", *args])


@main.group(name="bench", cls=BenchGroup)
def bench_group() -> None:
    """Head latency (`slimspec bench [CHECKPOINT]`) and the acceptance-cost plane (`slimspec bench plane`).

    \b
    `slimspec bench [CHECKPOINT] [--kappa] [--dtype ...] [--batch ...]` is `slimspec bench head`:
    see `slimspec bench head --help` for its options.
    """


@bench_group.command(name="plane")
@click.argument("drafter")
@click.option("--target", "-t", help="The drafter's target (default: the one it names; embedded drafters: "
                                     "embedded:smollm2-135m).")
@click.option("--ranks", default="d/4,d/8,d/16", show_default=True, help="SlimSpec ranks (comma separated).")
@click.option("--vocab", "vocabs", default="full,draft", show_default=True,
              help="SlimSpec head vocabularies (comma separated): full (stitched target vocabulary) and/or draft "
                   "(the drafter's own; skipped if it has none).")
@click.option("--trim-sizes", default="1024,4096", show_default=True, help="Vocabulary-trimming sizes.")
@click.option("--screens", default="16:240", show_default=True,
              help="Screen-and-rescore points over the draft vocabulary (comma separated rank:shortlist[:hot_rows]; "
                   "'' for none), each distilled like the ranks under its two-level KL.")
@click.option("--distill-steps", type=click.IntRange(min=0), default=60, show_default=True,
              help="Head-only distillation steps of each SlimSpec point (the drafter teacher).")
@click.option("--num-prompts", type=click.IntRange(min=1), default=8, show_default=True,
              help="mt_bench prompts for tau.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=96, show_default=True,
              help="Tokens generated per prompt.")
@click.option("--kappa", "kappas", default="0.25,0.5,1.0", show_default=True, help="Iso-speedup curves.")
@click.option("--calibration-prompts", type=click.IntRange(min=1), default=64, show_default=True,
              help="Shipped prompts (answers regenerated) for distillation and VocabTrim counts.")
@click.option("--out", "-o", type=click.Path(path_type=Path), default=Path("out/plane"), show_default=True,
              help="Folder for the converted and trimmed drafters, plane.json, plane.md and plane.png.")
@click.option("--device", default="auto", show_default=True,
              help="Where the teacher data, the distillations and the tau measurements run: auto ($SLIMSPEC_DEVICE "
                   "if set, else a CUDA GPU when PyTorch sees one, else the CPU), cpu, cuda or cuda:N; the head "
                   "latencies (nu) are timed there too.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
def bench_plane(drafter: str, target: str | None, ranks: str, vocabs: str, trim_sizes: str, screens: str,
                distill_steps: int, num_prompts: int, max_new_tokens: int, kappas: str, calibration_prompts: int,
                out: Path, device: str, as_json: bool) -> None:
    """Points (nu, rho_tau) for the full head, SlimSpec ranks and vocabulary trims; PNG + markdown table."""
    from slimspec.plotting import pyplot

    pyplot()  # before the hour of measurements, not after
    resolve_device(device)
    if any(v not in choices.VOCABS for v in vocabs.split(",")):
        raise click.BadParameter(f"expected full and/or draft, got {vocabs!r}", param_hint="--vocab")
    sizes = _number_list(trim_sizes, int, "--trim-sizes")
    curves = _number_list(kappas, float, "--kappa")
    _check_ranks(drafter, ranks.split(","))
    screen_specs = [spec for spec in screens.split(",") if spec]
    for spec in screen_specs:
        _check_ranks(drafter, [parse_screen(spec)[0]])
    if target is None:
        target = target_of(drafter)
    points = build_plane(drafter, target, out, ranks=tuple(ranks.split(",")), vocabs=tuple(vocabs.split(",")),
                         trim_sizes=tuple(sizes), screens=tuple(screen_specs), distill_steps=distill_steps,
                         num_prompts=num_prompts, max_new_tokens=max_new_tokens,
                         calibration_prompts=calibration_prompts, device=device)
    report = plane_report(points, tuple(curves), out, f"{drafter} on {target}")
    if as_json:
        click.echo(json.dumps(report))
        return
    click.echo("\n".join(report["table"]))
    click.echo("\n".join(["", *report["share_table"]]))
    click.echo(f"plot: {report['png']}")


def _png_path(path: Path, hint: str) -> Path:
    """A PNG file path that can be written (``.png`` added when it has no suffix), checked before any work."""
    if path.suffix == "":
        path = path.with_suffix(".png")
    if path.suffix.lower() != ".png":
        raise click.BadParameter(f"{path} is not a .png path (the plot is a PNG)", param_hint=hint)
    if path.is_dir():
        raise click.BadParameter(f"{path} is a folder", param_hint=hint)

    parent = nearest_existing_parent(path)
    if not parent.is_dir():
        raise click.BadParameter(f"cannot write {path}: {parent} is a file", param_hint=hint)
    return path


def _number_list(text: str, kind: type, hint: str) -> list:
    """Comma-separated positive numbers, or a usage error naming the option (checked before any measurement)."""
    try:
        values = [kind(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(0 < v < float("inf") for v in values):
        raise click.BadParameter(f"expected comma-separated positive numbers, got {text!r}", param_hint=hint)
    return values


def _check_ranks(drafter: str, ranks: list[str]) -> None:
    """Every rank spec must resolve against the drafter's hidden size before the plane spends an hour measuring."""
    hidden = load_drafter(resolve_model(drafter, "drafter")).config.hidden_size
    for spec in ranks:
        try:
            parse_rank(spec, hidden, torch.ones(hidden))  # energy:F is checked for its form (the spectrum comes later)
        except RankError as exc:
            raise click.BadParameter(str(exc), param_hint="--ranks") from None


@bench_group.command(name="head")
@click.argument("checkpoint", required=False)
@click.option("--vocab", type=click.IntRange(min=1), help="Head rows V (without CHECKPOINT).")
@click.option("--hidden", type=click.IntRange(min=1), help="Hidden size d (without CHECKPOINT).")
@click.option("--rank", type=click.IntRange(min=1), help="Rank r (without CHECKPOINT).")
@click.option("--source-vocab", type=click.IntRange(min=1), help="Rows of the full head compared against [default: V].")
@click.option("--batch", "batches", type=click.IntRange(min=1), multiple=True, help="Batch sizes [default: 1 and 64].")
@click.option("--dtype", "dtypes", type=click.Choice(["fp32", "bf16", "fp16"]), multiple=True,
              help="Dtypes [default: fp32].")
@click.option("--kappa", "with_kappa", is_flag=True,
              help="Also measure kappa (head time / rest of a draft+verify cycle) with CHECKPOINT on its target, "
                   "in the first --dtype.")
@click.option("--target", "-t", help="Target for --kappa (default: the checkpoint's).")
@click.option("--rho-tau", type=POSITIVE, help="Acceptance ratio for the predicted end-to-end speed-up [default: the "
              "checkpoint's recorded rho_tau (--rank auto), else 1].")
@click.option("--device", default="auto", show_default=True,
              help="Where the heads (and, with --kappa, the drafter and the target) are timed: auto ($SLIMSPEC_DEVICE "
                   "if set, else a CUDA GPU when PyTorch sees one, else the CPU), cpu, cuda or cuda:N. Time where "
                   "you serve.")
@click.option("--shortlist", type=click.IntRange(min=1),
              help="Also time the screen-and-rescore head with this shortlist K (the pair screens every token, the "
                   "exact rows of its top K are rescored), and a trimmed head; default batches 1, 8 and 64.")
@click.option("--hot-rows", type=click.IntRange(min=0), default=0, show_default=True,
              help="With --shortlist: N hot tokens always rescored.")
@click.option("--trim-rows", type=click.IntRange(min=1),
              help="With --shortlist: rows of the trimmed head [default: the screen's multiply-add share of V].")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def bench_command(checkpoint: str | None, vocab: int | None, hidden: int | None, rank: int | None,
                  source_vocab: int | None, batches: tuple[int, ...], dtypes: tuple[str, ...], with_kappa: bool,
                  target: str | None, rho_tau: float | None, device: str, shortlist: int | None, hot_rows: int,
                  trim_rows: int | None, as_json: bool) -> None:
    """Head latency of the low-rank head vs the full one (nu), the FLOP floor, kappa and predicted rho_TPS.

    With --shortlist, the full head, the pair, the screen and rescore and a trimmed head are timed side by side
    (interleaved rounds, medians; on the CPU with one torch thread, e.g. OMP_NUM_THREADS=1, the clock is the
    thread's CPU time, which other jobs on a shared machine do not inflate), each as nu beside its multiply-add
    share, and the batch size from which the screen stops paying is named.
    """
    if shortlist is not None:
        if checkpoint or with_kappa:
            raise click.UsageError("--shortlist times a head shape: give --vocab, --hidden and --rank, not a "
                                   "CHECKPOINT or --kappa")
        if vocab is None or hidden is None or rank is None:
            raise click.UsageError("--shortlist needs --vocab, --hidden and --rank")
        _bench_screen(HeadShape(vocab, hidden, rank), ScreenOptions(shortlist, hot_rows, trim_rows),
                      batches or (1, 8, 64), dtypes or ("fp32",), device, as_json)
        return
    if hot_rows or trim_rows:
        raise click.UsageError("--hot-rows and --trim-rows go with --shortlist")
    if checkpoint and any(x is not None for x in (vocab, hidden, rank)):
        raise click.UsageError("--vocab, --hidden and --rank describe a head without CHECKPOINT (it has its own)")
    if not with_kappa and (target is not None or rho_tau is not None):
        raise click.UsageError("--target and --rho-tau go with --kappa (the head timing alone reads neither)")
    if rank is not None and hidden is not None and rank >= hidden:
        raise click.BadParameter(f"{rank} is not below --hidden {hidden} (0 < r < d)", param_hint="--rank")
    if with_kappa and not checkpoint:
        raise click.UsageError("--kappa needs a CHECKPOINT")
    if checkpoint:
        head = checkpoint_head(checkpoint, source_vocab, rho_tau)
    elif vocab is None or hidden is None or rank is None:
        raise click.UsageError("give a CHECKPOINT or --vocab, --hidden and --rank")
    else:
        head = HeadShape(vocab, hidden, rank, source_vocab)
    dtypes = dtypes or ("fp32",)
    rows = bench_head(head, batches=batches or (1, 64), dtypes=dtypes, device=device)
    result: dict = {"head": rows}
    if with_kappa:  # the first --dtype: what the cycle is served in
        result.update(kappa_and_speedup(checkpoint, target, head, rows, dtype=dtypes[0], device=device))
    vocab, hidden, rank, source_vocab = head.vocab, head.hidden, head.rank, head.source_vocab
    where = resolve_device(device)
    if as_json:
        click.echo(json.dumps(result))
        return
    click.echo(f"head V={vocab} (full head: {source_vocab or vocab} rows), d={hidden}, r={rank}; greedy step = "
               f"logits + argmax, torch on {where}")
    click.echo(f"{'dtype':<10}{'batch':>6}{'full (ms)':>12}{'low-rank (ms)':>15}{'nu':>8}{'FLOP floor':>12}")
    for r in rows:
        click.echo(f"{r['dtype']:<10}{r['batch']:>6}{r['full_s'] * 1e3:>12.3f}{r['lowrank_s'] * 1e3:>15.3f}"
                   f"{r['nu']:>8.3f}{r['flop_floor']:>12.3f}")
    if "kappa" in result:
        k = result["kappa"]
        click.echo(f"kappa {k['kappa']:.3f} (the full {k['head_rows']}-row head {k['head_s'] * 1e3:.2f} ms "
                   f"x {k['draft_tokens']} vs drafter layer {k['drafter_layer_s'] * 1e3:.2f} ms x {k['draft_tokens']}"
                   " + target verify "
                   f"{k['target_verify_s'] * 1e3:.1f} ms)")
        click.echo(f"predicted rho_TPS = rho_tau (1 + kappa) / (1 + nu kappa) = {result['predicted_rho_tps']:.3f} "
                   f"(rho_tau {result['rho_tau']:.3f}{'' if head.rho_tau is not None else ', assumed'})")


def _bench_screen(head: HeadShape, screen: ScreenOptions, batches: tuple[int, ...], dtypes: tuple[str, ...],
                  device: str, as_json: bool) -> None:
    """`slimspec bench head --shortlist K`: the screen's table and where it stops paying."""
    rows = bench_screen(head, screen, batches=batches, dtypes=dtypes, device=device)
    stops = stops_paying(rows)
    if as_json:
        click.echo(json.dumps({"head": rows, "stops_paying_at_batch": stops}))
        return
    first = rows[0]
    click.echo(f"head V={head.vocab}, d={head.hidden}, r={head.rank}; screen K={screen.shortlist} N={screen.hot_rows}"
               f"; trimmed head {first['trim_rows']} rows; greedy step, {first['clock']} clock, "
               f"{first['threads']} torch thread(s) on {first['device']}; nu = time / the full head's (measured | "
               "multiply-add share)")
    click.echo(f"{'dtype':<10}{'batch':>6}{'full (ms)':>11}{'pair':>15}{'screen':>15}{'trimmed':>15}{'pays':>6}")
    for r in rows:
        click.echo(f"{r['dtype']:<10}{r['batch']:>6}{r['full_s'] * 1e3:>11.2f}"
                   f"{r['nu']:>8.3f} |{r['flop_floor']:>5.3f}{r['screen_nu']:>8.3f} |{r['screen_share']:>5.3f}"
                   f"{r['trim_nu']:>8.3f} |{r['trim_share']:>5.3f}{'yes' if r['screen_pays'] else 'no':>6}")
    for dtype, batch in stops.items():
        where = f"stops paying at batch {batch}" if batch else "pays at every batch size timed"
        click.echo(f"{dtype}: the screen {where} (pays: measured nu within {PAY_MARGIN} of its multiply-add share)")


@main.command(name="eval")
@click.argument("drafter")
@click.option("--target", "-t", help="Target model (default: the one the drafter names).")
@click.option("--dataset", default="mt_bench", show_default=True,
              help="mt_bench, humaneval, gsm8k (shipped), or a jsonl file with `turns`.")
@click.option("--num-prompts", type=click.IntRange(min=0), default=8, show_default=True,
              help="First N prompts (0: all).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True,
              help="Tokens generated per prompt.")
@click.option("--draft-tokens", "-k", type=click.IntRange(min=1), default=4, show_default=True,
              help="Draft chain length K.")
@click.option("--temperature", type=NON_NEGATIVE, default=0.0, show_default=True,
              help="0: greedy (output identical to the target's); > 0: speculative sampling.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of speculative sampling (T > 0).")
@click.option("--baseline", help="A second drafter measured in the same run (rho_tau = tau / tau_baseline).")
@click.option("--engine", type=click.Choice(["reference", "vllm"]), default="reference", show_default=True,
              help="vllm: measure in a real vLLM engine, beside the reference decoder. vLLM runs in its own "
                   "process: $SLIMSPEC_VLLM_PYTHON, a checkout's .venv-vllm, or this Python if vLLM is installed.")
@click.option("--device", default="auto", show_default=True,
              help="Where the reference decoder runs the target and the drafters: auto ($SLIMSPEC_DEVICE if set, "
                   "else a CUDA GPU when PyTorch sees one, else the CPU), cpu, cuda or cuda:N.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
def eval_command(drafter: str, target: str | None, dataset: str, num_prompts: int, max_new_tokens: int,
                 draft_tokens: int, temperature: float, seed: int, baseline: str | None, engine: str, device: str,
                 as_json: bool, quiet: bool) -> None:
    """Measure DRAFTER's acceptance length tau by reference speculative decoding against the target."""
    report = evaluate(drafter, target, dataset=dataset, num_prompts=num_prompts or None,
                      max_new_tokens=max_new_tokens, draft_tokens=draft_tokens, temperature=temperature, seed=seed,
                      baseline=baseline, engine=engine, progress=not quiet, device=device)
    if as_json:
        click.echo(json.dumps(report))
        return
    click.echo(f"{dataset}, {report['num_prompts']} prompts, K={draft_tokens}, T={temperature}, "
               f"{max_new_tokens} new tokens")
    header = f"{'':<26}{'drafter':>12}" + (f"{'baseline':>12}" if baseline else "")
    click.echo(header)
    runs = [report] + ([report["baseline"]] if baseline else [])
    click.echo(f"{'tau':<26}" + "".join(f"{r['tau']:>12.3f}" for r in runs))
    for j in range(draft_tokens):
        click.echo(f"{f'acceptance @ {j + 1}':<26}" + "".join(f"{r['acceptance_per_position'][j]:>12.3f}"
                                                            for r in runs))
    click.echo(f"{'tokens/s':<26}" + "".join(f"{r['tokens_per_second']:>12.1f}" for r in runs))
    if any(r["drafting"] == "parallel" for r in runs):  # P-EAGLE: all K drafts come from one pass
        click.echo(f"{'drafting':<26}" + "".join(f"{r['drafting']:>12}" for r in runs))
    if baseline:
        click.echo(f"{'rho_tau':<26}{report['rho_tau']:>12.3f}")
    if engine == "vllm":
        ref = report["reference"]
        click.echo(f"(vLLM engine above; reference decoder: tau {ref['tau']:.3f}, "
                   f"{ref['tokens_per_second']:.1f} tokens/s)")


@main.command()
@click.argument("drafter")
@click.option("--target", "-t", help="Target model, to measure the full-vocabulary head too.")
@click.option("--plot", type=click.Path(path_type=Path), help="Write a PNG of the energy curve here.")
@click.option("--json", "as_json", is_flag=True, help="Print everything as one JSON object.")
def inspect(drafter: str, target: str | None, plot: Path | None, as_json: bool) -> None:
    """Show DRAFTER's layout, shapes, draft vocabulary and head spectrum (energy at d/4, d/8, d/16)."""
    if plot is not None:
        from slimspec.plotting import pyplot

        plot = _png_path(plot, "--plot")
        pyplot()
    info = inspect_drafter(drafter, target, plot)
    if as_json:
        click.echo(json.dumps(info))
        return
    cfg = info["config"]
    click.echo(f"drafter        {info['drafter']}")
    click.echo(f"layout         {info['layout']}  (head: {info['head']})")
    layers = f", {cfg['num_layers']} decoder layers" if cfg["num_layers"] > 1 else ""
    click.echo(f"hidden         {cfg['hidden_size']}  (target hidden {cfg['target_hidden_size']}, "
               f"{cfg['num_attention_heads']} heads x {cfg['head_dim']}, {cfg['model_type']}{layers})")
    click.echo(f"draft vocab    {info['draft_vocab_size']} of {info['vocab_size']} "
               f"({100 * info['vocab_coverage']:.1f}% of the target vocabulary)")
    if cfg["parallel_token_id"] is not None:
        click.echo(f"drafting       parallel (P-EAGLE: mask_hidden, mask-slot token {cfg['parallel_token_id']}; "
                   "serve with parallel_drafting)")
    if info["dropped_tensors"]:
        click.echo(f"ignored        {', '.join(info['dropped_tensors'])}")
    if "screen" in info:
        screen, mib = info["screen"], 2**20
        reads = screen["bytes_read_per_step"]
        click.echo(f"screen         rank {info['rank']} pair scores every token, exact rows rescore its top "
                   f"{screen['shortlist']}" + (f" + {screen['hot_rows']} hot tokens" if screen["hot_rows"] else ""))
        click.echo(f"               multiply-adds {screen['multiply_add_share']:.3f} of the full head; head "
                   f"{screen['head_bytes'] / mib:.1f} MiB (pair + exact rows); read per step "
                   f"{reads['1'] / mib:.2f} MiB at B=1, at most {reads['64'] / mib:.2f} MiB at B=64 (full head "
                   f"{screen['full_head_bytes_read_per_step'] / mib:.2f} MiB)")
    click.echo("tensors")
    for name, meta in info["tensors"].items():
        click.echo(f"  {name:<44} {str(meta['shape']):<16} {meta['dtype']}")
    for name, energies in info["energy"].items():
        cells = ", ".join(f"{k}: {v:.4f}" for k, v in energies.items())
        click.echo(f"energy kept    {name}: {cells}")
        cells = ", ".join(f"{k}: {v:.4f}" for k, v in info["energy_centered"][name].items())
        click.echo(f"               rows centred (the part softmax sees): {cells}")
    if "plot" in info:
        click.echo(f"plot           {info['plot']}")


if __name__ == "__main__":
    main()
