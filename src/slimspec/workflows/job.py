"""One conversion's options as a job: built the same way from the CLI's options, a batch manifest's keys and the
Python API's arguments, and checked by one ``validate()`` before any download or teacher data.

Options have one name everywhere: the Python keyword, the manifest key, and (with ``--`` and dashes) the CLI flag.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from slimspec import embedded
from slimspec.choices import DISTILL_ONLY_OPTIONS, INITS, STITCHES, VOCABS
from slimspec.convert.pipeline import VocabMode
from slimspec.convert.rank import parse_rank
from slimspec.distill.pipeline import DataOptions
from slimspec.distill.train import DistillConfig
from slimspec.dtypes import torch_dtype
from slimspec.errors import OptionError, RankError
from slimspec.hardware import check_max_memory, resolve_device
from slimspec.hub import HUB_ID
from slimspec.workflows.budget import budget_share
from slimspec.workflows.recipes import DEFAULT_RECIPE, brief_keys

DATA_OPTIONS = {"data": None, "num_prompts": None, "responses": "regenerate", "max_new_tokens": 128,
                "generation_engine": "transformers", "generation_dtype": "auto", "device": None,
                "temperature": 0.0, "seed": 0, "aux_layers": None, "aux_convention": None,
                "max_memory": None, "offload_folder": None, "feature_dtype": "auto"}
"""Options that shape the teacher data (and where the target computes it), and their defaults."""
DISTILL_OPTIONS = {"teacher": "target", "lr": 2e-3, "warmup_steps": 10, "batch_tokens": 2048, "ttt_steps": 3,
                   "bf16": False, "teacher_temperature": 1.0, "screen_train_share": 0.5}
"""Options of the distillation loop (``DistillConfig`` fields; ``seed`` also seeds it), and their defaults."""
UNREAD_WITHOUT_DATA = ("data", "num_prompts", "responses", "max_new_tokens", "temperature", "generation_engine",
                       "generation_dtype", "feature_dtype", "max_memory", "offload_folder", "aux_layers",
                       "aux_convention", "teacher", "teacher_temperature", "screen_train_share", "ttt_steps", "lr",
                       "warmup_steps", "batch_tokens", "seed", "bf16")
"""Options a conversion reads only when it computes teacher data (a whitened start or distillation steps), in the
order ``--help`` lists them."""


@dataclass(frozen=True)
class ConvertJob:
    """One conversion's options. ``given`` names the options the user set (a default serves silently; a given
    option the conversion would not read is refused). Nothing here is mutated."""

    drafter: str
    target: str | None = None
    rank: str | int = "d/8"
    vocab: VocabMode = "full"
    out: Path | None = None
    dtype: str | torch.dtype | None = None  # bf16/fp16/fp32 or a torch dtype; None: the source's
    overwrite: bool = False
    revision: str | None = None
    target_revision: str | None = None
    stitch: str = "target"
    init: str = "auto"
    distill_steps: int = 0
    data_options: DataOptions = field(default_factory=DataOptions)
    distill_config: DistillConfig = field(default_factory=DistillConfig)
    push_to: str | None = None
    shortlist: int = 0  # screen and rescore: the pair's top K tokens rescored by the exact rows (0: the plain pair)
    hot_rows: int = 0  # screen and rescore: the N most frequent draft tokens, always rescored
    head_budget: str | None = None  # the screen (r, K, N) of best measured agreement under this cost (``d/8``, 0.06)
    serve_batch: int = 1  # the batch size a head budget is planned for (rows read grow with it; see budget.py)
    recipe: str | None = None  # the recipe that set the options not given (``brief``), if any
    given: frozenset[str] = frozenset()
    progress: bool = True
    verify_samples: int = 16
    extra_report: dict[str, Any] = field(default_factory=dict)

    @property
    def resolved_init(self) -> str:
        """``auto``: whitened when distilling (it starts at about half the KL), else svd."""
        if self.init != "auto":
            return self.init
        return "whitened" if self.distill_steps > 0 else "svd"

    @property
    def reads_data(self) -> bool:
        """Whether the conversion computes teacher data (a whitened start or distillation steps)."""
        return self.resolved_init != "svd" or self.distill_steps > 0

    @property
    def distils_by_default(self) -> bool:
        """Whether the distillation is the default recipe's: no recipe and no ``distill_steps`` were given."""
        return self.recipe is not None and not {"recipe", "distill_steps"} & self.given

    def no_target_error(self) -> OptionError:
        """The refusal of a conversion that reads teacher data but has no target to compute it with."""
        if self.distils_by_default:
            return OptionError(f"{self.drafter} names no target and SlimSpec's table of published drafters does "
                               "not list it, so the default distillation has no target to compute its teacher data "
                               "with: add {target} TARGET, or {distill_steps} 0 for the plain SVD head",
                               "target", "distill_steps")
        return OptionError("a whitened start and distillation steps need a target: add {target}", "target")

    def validate(self) -> None:
        """Refuse, in one line each, options no conversion can run with or that this one would ignore."""
        _check_choices(self)
        _check_screen(self)
        _check_sources(self)
        _check_unread(self)
        rank = str(self.rank).strip()
        if rank == "auto":
            raise OptionError("{rank} auto measures several conversions: run it with `slimspec convert --rank auto`",
                              "rank")
        try:
            parse_rank(rank, 1 << 30)  # the syntax; the drafter's d decides the range when the job runs
        except RankError as exc:
            if "singular values" not in str(exc):
                raise
        resolve_device(self.data_options.device)  # an unusable device fails now, not after the first stages
        placement = self.data_options.placement()  # so do malformed --max-memory budgets
        if placement.max_memory is not None:
            check_max_memory(placement.max_memory)


def _check_screen(job: ConvertJob) -> None:
    """Screen-and-rescore options: sizes >= 0, hot rows only beside a shortlist, the draft vocabulary, and hot rows
    only where teacher data names the frequent tokens."""
    for name in ("shortlist", "hot_rows"):
        if getattr(job, name) < 0:
            raise OptionError(f"{{{name}}} must be >= 0, got {getattr(job, name)}", name)
    if job.hot_rows and not job.shortlist:
        raise OptionError("{hot_rows} adds always-rescored tokens to a shortlist: give {shortlist} K too",
                          "hot_rows", "shortlist")
    if job.shortlist and job.vocab != "draft":
        raise OptionError("{shortlist} rescores with the drafter's own head rows: use {vocab} draft (with {vocab} "
                          "full the exact rows would be the target's whole head)", "shortlist", "vocab")
    if job.head_budget is not None:
        _check_head_budget(job)
    if job.serve_batch < 1:
        raise OptionError(f"{{serve_batch}} must be >= 1, got {job.serve_batch}", "serve_batch")
    if job.serve_batch != 1 and job.head_budget is None:
        raise OptionError("{serve_batch} is the batch size a {head_budget} is planned for: give {head_budget} too",
                          "serve_batch", "head_budget")
    if job.hot_rows and not job.reads_data:
        raise OptionError("{hot_rows} are the tokens most frequent in the target's answers to the calibration "
                          "prompts: give {distill_steps} N (or {init} whitened)", "hot_rows", "distill_steps")


def _check_head_budget(job: ConvertJob) -> None:
    """A head budget picks the rank, shortlist and hot rows itself, from calibration data, over the draft vocab."""
    budget_share(job.head_budget, 1 << 16, 1 << 12)  # the syntax; the head's shape decides the value
    taken = [name for name in ("rank", "shortlist", "hot_rows") if name in job.given]
    if taken:
        raise OptionError(f"{{head_budget}} picks the rank, the shortlist and the hot rows: drop "
                          f"{', '.join(f'{{{name}}}' for name in taken)}", "head_budget", *taken)
    if job.vocab != "draft":
        raise OptionError("{head_budget} picks a screen over the drafter's own head rows: use {vocab} draft",
                          "head_budget", "vocab")
    if not job.reads_data:
        raise OptionError("{head_budget} measures its candidates on calibration data: give {distill_steps} N (or "
                          "{init} whitened)", "head_budget", "distill_steps")


def _check_choices(job: ConvertJob) -> None:
    for name, value, allowed in (("vocab", job.vocab, VOCABS), ("init", job.init, INITS),
                                 ("stitch", job.stitch, STITCHES)):
        if value not in allowed:
            raise OptionError(f"{{{name}}} must be one of {', '.join(allowed)}, got {value!r}", name)
    if isinstance(job.dtype, str):
        torch_dtype(job.dtype)
    if job.distill_steps < 0:
        raise OptionError(f"{{distill_steps}} must be >= 0, got {job.distill_steps}", "distill_steps")
    if "stitch" in job.given and job.vocab != "full":
        raise OptionError("{stitch} fills the rows a {vocab} full head adds; {vocab} draft adds none", "stitch",
                          "vocab")


def _is_local(name: str) -> bool:
    return embedded.is_embedded(name) or Path(name).expanduser().exists()


def _check_sources(job: ConvertJob) -> None:
    """Revisions pin Hub models only; a push needs a Hub repo id."""
    if job.revision and _is_local(job.drafter):
        raise OptionError(f"{{revision}} pins a Hub drafter; {job.drafter} is local", "revision")
    if job.target_revision and job.target and _is_local(job.target):
        raise OptionError(f"{{target_revision}} pins a Hub target; {job.target} is local", "target_revision")
    if job.push_to and not HUB_ID.match(job.push_to):
        raise OptionError(f"{{push_to}} {job.push_to!r} is not a Hub repo id (owner/name)", "push_to")


def _check_unread(job: ConvertJob) -> None:
    """Given data and distillation options that this conversion would not read."""
    if job.distill_steps > 0:
        return
    given = [name for name in UNREAD_WITHOUT_DATA if name in job.given]
    if job.init != "whitened" and given:
        fields = ", ".join(f"{{{name}}}" for name in given)
        raise OptionError(f"this conversion reads no data (SVD start, {{distill_steps}} 0), so {fields} would be "
                          "ignored: give {distill_steps} N (or {init} whitened), or drop them",
                          "distill_steps", "init", *given)
    unread = [name for name in given if name in DISTILL_ONLY_OPTIONS]
    if unread:
        raise OptionError(f"{', '.join(f'{{{name}}}' for name in unread)} only shape distillation steps: give "
                          "{distill_steps} N or drop them", "distill_steps", *unread)


def distills_by_default(options: dict[str, Any]) -> bool:
    """Whether a conversion's options leave its distillation to the default recipe (no recipe, no steps)."""
    return options.get("recipe") is None and options.get("distill_steps") is None


def with_recipe(options: dict[str, Any], given: Iterable[str]) -> dict[str, Any]:
    """``recipe: brief``, and the default when neither a recipe nor ``distill_steps`` is given: the demo's brief
    distillation for every option not given (given ones override it)."""
    if distills_by_default(options):
        options = {**options, "recipe": DEFAULT_RECIPE}
    if options.get("recipe") is None:
        return dict(options)
    keys = brief_keys(str(options["drafter"]), options.get("target"))
    return {**options, **{key: value for key, value in keys.items() if key not in set(given)}}


def data_options_from(options: dict[str, Any]) -> DataOptions:
    """The teacher-data options of a job's options (absent ones at their defaults)."""
    value = {**DATA_OPTIONS, **{k: v for k, v in options.items() if k in DATA_OPTIONS and v is not None}}
    data = value["data"]
    return DataOptions(data=(list(data) or None) if isinstance(data, list | tuple) else data,
                       num_prompts=value["num_prompts"], responses=value["responses"],
                       max_new_tokens=int(value["max_new_tokens"]), temperature=float(value["temperature"]),
                       seed=int(value["seed"]) if value["temperature"] > 0 else 0,
                       aux_layers=value["aux_layers"], aux_convention=value["aux_convention"],
                       engine=value["generation_engine"],
                       generation_dtype=None if value["generation_dtype"] == "auto" else value["generation_dtype"],
                       device=value["device"], max_memory=value["max_memory"],
                       offload_folder=None if value["offload_folder"] is None else str(value["offload_folder"]),
                       feature_dtype=None if value["feature_dtype"] == "auto" else value["feature_dtype"])


def distill_config_from(options: dict[str, Any], steps: int) -> DistillConfig:
    """The distillation loop's settings of a job's options (absent ones at their defaults)."""
    value = {**DISTILL_OPTIONS, **{k: v for k, v in options.items() if k in DISTILL_OPTIONS and v is not None}}
    return DistillConfig(steps=steps, seed=int(options.get("seed") or 0), **value)


def conversion_job(options: dict[str, Any], given: Iterable[str] = (), **settings: Any) -> ConvertJob:
    """The job of a conversion's options (option names as keys; ``recipe`` applied), not yet validated.
    ``settings``: the job's other fields (``progress``, ``extra_report``, ``overwrite``, ...). Without a recipe
    and without ``distill_steps``, the default recipe (:data:`DEFAULT_RECIPE`) sets the options not given."""
    given = frozenset(given)
    options = with_recipe(options, given)
    steps = int(options.get("distill_steps") or 0)
    fields = {name: options[name] for name in ("target", "rank", "vocab", "dtype", "overwrite", "revision",
                                              "target_revision", "stitch", "init", "push_to", "recipe",
                                              "shortlist", "hot_rows", "head_budget", "serve_batch")
              if options.get(name) is not None}
    if options.get("out") is not None:
        fields["out"] = Path(options["out"])
    if (fields.get("shortlist") or fields.get("head_budget")) and "vocab" not in given:  # the drafter's own rows
        fields["vocab"] = "draft"
    job = ConvertJob(drafter=str(options["drafter"]), distill_steps=steps, data_options=data_options_from(options),
                     distill_config=distill_config_from(options, steps), given=given, **fields)
    return replace(job, **settings)
