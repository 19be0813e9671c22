"""The ``slimspec`` command line: thin wrappers that parse, call the library, and print."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from slimspec import __version__
from slimspec.errors import SlimSpecError


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


class SlimSpecGroup(click.Group):
    """Turns SlimSpec errors into one line on stderr and exit code 2 (no traceback)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except SlimSpecError as exc:
            _fail(str(exc))
        except KeyboardInterrupt:
            _fail("interrupted (nothing was written)")


@click.group(cls=SlimSpecGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="slimspec")
def main() -> None:
    """SlimSpec: give a published EAGLE-3 drafter a low-rank LM head (W_up @ W_down).

    Models are Hub ids (owner/name), local folders, or embedded:smollm2-135m (target) and
    embedded:smollm2-135m-eagle3 (drafter), which work with no network.
    """


@main.command()
@click.argument("drafter")
@click.option("--target", "-t", help="Target model the drafter serves (Hub id, folder or embedded: name).")
@click.option("--rank", "-r", default="d/8", show_default=True,
              help="d/N, an integer, or energy:F (smallest r keeping share F of the head's squared singular values).")
@click.option("--vocab", type=click.Choice(["full", "draft"]), default="full", show_default=True,
              help="full: head over the whole target vocabulary (draft rows from the drafter, the rest from the "
                   "target's head); draft: keep the drafter's draft vocabulary and its d2t.")
@click.option("--out", "-o", type=click.Path(path_type=Path),
              help="Output folder [default: ./<drafter-name>-slimspec-r<r>].")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), help="Output dtype [default: the source's].")
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
@click.option("--revision", help="Hub revision (branch, tag or commit) for downloads.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object on stdout.")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines on stderr.")
def convert(drafter: str, target: str | None, rank: str, vocab: str, out: Path | None, dtype: str | None,
            overwrite: bool, revision: str | None, as_json: bool, quiet: bool) -> None:
    """Replace DRAFTER's LM head by an SVD-initialised low-rank pair and write a vLLM-ready folder.

    \b
    Example:
      slimspec convert yuhuili/EAGLE3-LLaMA3.1-Instruct-8B \\
          --target meta-llama/Llama-3.1-8B-Instruct --rank d/8
    """
    from slimspec.convert.pipeline import convert as run_convert

    result = run_convert(drafter, target, rank, vocab=vocab, out=out, dtype=dtype, overwrite=overwrite,
                         revision=revision, progress=not quiet)
    report = {"out": str(result.out), **result.report}
    if as_json:
        click.echo(json.dumps(report))
        return
    _print_convert_report(report)


def _print_convert_report(report: dict) -> None:
    rows = [
        ("output", report["out"]),
        ("source layout", report["source"]["drafter_layout"]),
        ("rank", f"{report['rank']} (d={report['hidden_size']}, spec {report['rank_spec']})"),
        ("head vocabulary", f"{report['head_vocab']} ({report['vocab_mode']}; {report['rows_from_drafter']} rows "
                            f"from the drafter, {report['rows_from_target']} from the target)"),
        ("head params", f"{report['head_params_source']:,} -> {report['head_params']:,}"),
        ("head FLOP ratio", f"{report['head_flop_ratio']:.4f}"),
        ("energy kept", f"{report['energy_kept']:.4f}"),
        ("relative Frobenius error", f"{report['relative_frobenius_error']:.4f}"),
        ("argmax agreement (random h)", f"{report['verification']['argmax_agreement_vs_full']:.3f}"),
        ("time", f"{report['timings']['total']:.1f}s"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key:<{width}}  {value}")


@main.command()
@click.argument("drafter")
@click.option("--target", "-t", help="Target model, to measure the full-vocabulary head too.")
@click.option("--plot", type=click.Path(path_type=Path), help="Write a PNG of the energy curve here.")
@click.option("--json", "as_json", is_flag=True, help="Print everything as one JSON object.")
def inspect(drafter: str, target: str | None, plot: Path | None, as_json: bool) -> None:
    """Show DRAFTER's layout, shapes, draft vocabulary and head spectrum (energy at d/4, d/8, d/16)."""
    from slimspec.inspection import inspect_drafter

    info = inspect_drafter(drafter, target, plot)
    if as_json:
        click.echo(json.dumps(info))
        return
    cfg = info["config"]
    click.echo(f"drafter        {info['drafter']}")
    click.echo(f"layout         {info['layout']}  (head: {info['head']})")
    click.echo(f"hidden         {cfg['hidden_size']}  (target hidden {cfg['target_hidden_size']}, "
               f"{cfg['num_attention_heads']} heads x {cfg['head_dim']}, {cfg['model_type']})")
    click.echo(f"draft vocab    {info['draft_vocab_size']} of {info['vocab_size']} "
               f"({100 * info['vocab_coverage']:.1f}% of the target vocabulary)")
    if info["dropped_tensors"]:
        click.echo(f"ignored        {', '.join(info['dropped_tensors'])}")
    click.echo("tensors")
    for name, meta in info["tensors"].items():
        click.echo(f"  {name:<44} {str(meta['shape']):<16} {meta['dtype']}")
    for name, energies in info["energy"].items():
        cells = ", ".join(f"{k}: {v:.4f}" for k, v in energies.items())
        click.echo(f"energy kept    {name}: {cells}")
    if "plot" in info:
        click.echo(f"plot           {info['plot']}")


if __name__ == "__main__":
    main()
