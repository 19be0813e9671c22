"""Read every published EAGLE-3 drafter layout into one canonical in-memory form.

Canonical tensor names follow the EAGLE reference (``fc.weight``, ``midlayer.*``, ``norm.weight``,
``lm_head.weight``, ``d2t``), whatever the source called them; a drafter with more decoder layers (speculators
trains them; vLLM serves them) keeps layers 1, 2, ... under vLLM's names ``layers.{i}.*``. ``d2t[i]`` is an offset:
draft token ``i`` is target token ``i + d2t[i]`` (true for every format, frequency-ordered ones too).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from slimspec.checkpoint.files import read_json, read_tensors, sha256_file, weight_map
from slimspec.errors import CheckpointError, SlimSpecWarning

LAYOUTS = ("eagle", "specforge", "speculators", "modelopt", "angelslim", "slimspec")
LOWRANK_DOWN = "lm_head_down.weight"  # SlimSpec: lm_head.weight is W_up [V, r], this is W_down [r, d]
# SlimSpec screen and rescore: the exact rows [V, d] (draft order) rescoring the pair's shortlist, and the draft ids
# always rescored (int64 [N], sorted; absent when N = 0); the config's slimspec block holds head, shortlist, hot_rows
SCREEN_EXACT = "lm_head_exact.weight"
SCREEN_HOT_IDS = "lm_head_hot_ids"
SCREEN_HEAD = "screen_rescore"

# Tensors of the EAGLE-3 decoder layer (after the prefix), required unless marked optional.
LAYER_TENSORS = (
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
OPTIONAL_LAYER_TENSORS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
# attention biases of a config with attention_bias (vLLM: q/k/v in every Eagle3 layer, o_proj too in Llama-style ones;
# its comment: "Parallel drafting checkpoints may have attention bias enabled")
BIAS_TENSORS = tuple(f"self_attn.{p}_proj.bias" for p in "qkvo")
LAYER_PREFIXES = ("midlayer.", "layers.0.")
# Layers 1, 2, ... are plain decoder layers over the hidden state alone: no hidden_norm (vLLM builds one, unused).
LATER_LAYER_TENSORS = tuple(n for n in LAYER_TENSORS if n != "hidden_norm.weight")
LATER_LAYER = re.compile(r"^layers\.([1-9][0-9]*)\.(.+)$")
# Source tensors dropped on purpose, as vLLM ignores them too: RoPE's inverse frequencies (recomputed), a later
# layer's hidden_norm and an input_norm without norm_before_fc (built, never read). Anything else dropped is unknown.
KNOWN_UNUSED = re.compile(r"(^|\.)rotary_emb\.inv_freq$|^layers\.[1-9][0-9]*\.hidden_norm\.weight$"
                          r"|^input_norm\.weight$")
SLIDING = "sliding_attention"  # the layer_types entry of a sliding-window layer (any other one is full attention)
# P-EAGLE (parallel drafting): the stand-in for the target's aux features at the masked draft slots, [1, n*Ht]
MASK_HIDDEN = "mask_hidden"
# config keys naming the token of the masked slots, in the order vLLM's proposer reads them (speculators' "peagle"
# writes mask_token_id, which vLLM passes on as pard_token; AWS's P-EAGLE drafters write ptd_token_id)
PARALLEL_TOKEN_KEYS = ("mask_token_id", "pard_token", "ptd_token_id")


def layer_prefix(index: int) -> str:
    """The canonical prefix of decoder layer ``index``: ``midlayer.`` for the first, ``layers.{i}.`` after it."""
    return "midlayer." if index == 0 else f"layers.{index}."


@dataclass
class DrafterConfig:
    """Everything about a drafter's shape and variant, independent of the layout it came in."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    target_hidden_size: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int  # rows of the drafter's own head (== vocab_size when untrimmed)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    model_type: str = "llama"  # "llama" or "qwen3" (q/k norms)
    num_aux_hidden_states: int = 3
    # As the source wrote them (vLLM reads them as indices of the target hidden state *entering* a layer).
    aux_layer_ids: list[int] | None = None
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    num_layers: int = 1  # decoder layers: the EAGLE-3 layer, then plain ones over the hidden state (vLLM's layer_idx)
    attention_bias: bool = False  # q/k/v biases (and o_proj's in Llama-style layers), as vLLM builds them
    # Sliding-window attention as vLLM builds it: ``layer_types[i]`` is ``sliding_attention`` or ``full_attention``
    # for each decoder layer (None: every layer full); a sliding layer's query at position p attends the keys at
    # positions p - sliding_window + 1 .. p (``sliding_window`` keys, its own included)
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    # P-EAGLE: the token of the masked slots of a parallel drafter (one with mask_hidden); None drafts in a chain
    parallel_token_id: int | None = None
    target_model: str | None = None  # the verifier named in the config, if any
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def attention_window(self, layer: int) -> int | None:
        """The keys decoder layer ``layer`` attends at most (its own position's included), or None: full attention."""
        types = self.layer_types or []
        return self.sliding_window if layer < len(types) and types[layer] == SLIDING else None


@dataclass
class DrafterCheckpoint:
    """A drafter in canonical form: config, canonical tensors, and where it came from."""

    layout: str
    config: DrafterConfig
    tensors: dict[str, torch.Tensor]
    source: Path
    files: list[Path]
    raw_config: dict[str, Any]
    dropped: list[str] = field(default_factory=list)  # stray source tensors not carried over

    @property
    def has_head(self) -> bool:
        return "lm_head.weight" in self.tensors

    @property
    def named_target(self) -> str | None:
        """The target this drafter names: SlimSpec's own record, else its config's verifier/base model."""
        return self.recorded("target") or self.config.target_model

    def target_revision_for(self, target: str | None) -> str | None:
        """The target revision this drafter was converted against, for ``target`` (None: the one it names); None
        when another target is given (its revision is that model's own business)."""
        if target is None or str(target) in (self.recorded("target"), self.named_target):
            return self.recorded("target_revision")
        return None

    def recorded(self, key: str) -> Any:
        """A value SlimSpec recorded in this checkpoint's config (``"slimspec"`` section), or None."""
        return (self.raw_config.get("slimspec") or {}).get(key)

    @property
    def aux_convention(self) -> str:
        """How this drafter's aux layer ids count: ``output`` (SpecForge/ModelOpt configs: the layer that produced
        the state) or ``input`` (the layer it enters). A conversion keeps its source's ids and so its convention."""
        written = self.recorded("aux_convention") or self.raw_config.get("aux_convention")
        if written in ("input", "output"):
            return written
        layout = (self.recorded("source_layout") or self.layout) if self.layout == "slimspec" else self.layout
        return "output" if layout in ("specforge", "modelopt") else "input"

    @property
    def unknown_dropped(self) -> list[str]:
        """Source tensors the reader did not recognise and dropped (``KNOWN_UNUSED`` ones aside): a conversion does
        not carry them, so a drafter variant this reader does not know yet would lose them."""
        return [n for n in self.dropped if not KNOWN_UNUSED.search(n.removeprefix("model."))]

    def warn_unknown_dropped(self, name: str) -> None:
        """A ``SlimSpecWarning`` naming ``unknown_dropped`` (``name``: how the user called this drafter), if any: an
        output written from this checkpoint will not carry them."""
        names = self.unknown_dropped
        if names:
            warnings.warn(f"{name}: {len(names)} tensor(s) of an unknown kind are not carried into the output: "
                          f"{', '.join(names[:5])}{' ...' if len(names) > 5 else ''}",
                          SlimSpecWarning, stacklevel=3)

    @property
    def is_parallel(self) -> bool:
        """A P-EAGLE drafter: vLLM drafts all its tokens in one pass (``parallel_drafting``), masked slots fed
        ``mask_hidden`` and the token ``config.parallel_token_id``."""
        return self.config.parallel_token_id is not None

    @property
    def is_lowrank(self) -> bool:
        return LOWRANK_DOWN in self.tensors

    @property
    def rank(self) -> int | None:
        return int(self.tensors[LOWRANK_DOWN].shape[0]) if self.is_lowrank else None

    @property
    def is_screen(self) -> bool:
        """A screen-and-rescore head: the pair plus exact rows for its shortlist."""
        return self.is_lowrank and SCREEN_EXACT in self.tensors

    @property
    def shortlist(self) -> int | None:
        """K, the pair's top tokens a screen head rescores (None for other heads)."""
        return int(self.recorded("shortlist")) if self.is_screen else None

    @property
    def hot_rows(self) -> int:
        """N, the tokens a screen head always rescores (0 for other heads)."""
        hot = self.tensors.get(SCREEN_HOT_IDS)
        return int(hot.numel()) if hot is not None else 0

    def head_weight(self) -> torch.Tensor | None:
        """The drafter's head as one ``[Vd, d]`` matrix (``W_up @ W_down`` for a SlimSpec head)."""
        if not self.has_head:
            return None
        head = self.tensors["lm_head.weight"]
        if self.is_screen:  # the exact rows: the source head the screen shortlists for
            return self.tensors[SCREEN_EXACT]
        if self.is_lowrank:
            return head.float() @ self.tensors[LOWRANK_DOWN].float()
        return head

    @property
    def d2t(self) -> torch.Tensor | None:
        return self.tensors.get("d2t")

    def draft_to_target_ids(self) -> torch.Tensor:
        """Target token id of each draft token: ``arange(Vd) + d2t`` (identity without d2t)."""
        ids = torch.arange(self.config.draft_vocab_size, dtype=torch.long)
        d2t = self.d2t
        return ids if d2t is None else ids + d2t.long()

    def rows_in_target_order(self, rows: torch.Tensor) -> torch.Tensor:
        """A head's rows over the draft vocabulary, in target order where that vocabulary holds every target token
        in another order (a conversion writes no d2t then, so its rows go in target order); else as given."""
        ids = self.draft_to_target_ids()
        if rows.shape[0] != self.config.vocab_size or ids.numel() != rows.shape[0]:
            return rows
        if torch.equal(ids, torch.arange(ids.numel())):
            return rows
        ordered = torch.empty_like(rows)
        ordered[ids] = rows
        return ordered

    @property
    def dtype(self) -> torch.dtype:
        ref = self.tensors.get("lm_head.weight", self.tensors["fc.weight"])
        return ref.dtype

    def file_hashes(self) -> dict[str, str]:
        return {p.name: sha256_file(p) for p in self.files}


def detect_layout(raw: dict[str, Any], names: set[str]) -> str:
    """Name the tool that wrote this checkpoint (it decides only how the config is read)."""
    archs = raw.get("architectures") or []
    if isinstance(raw.get("slimspec"), dict):
        return "slimspec"
    if raw.get("speculators_model_type") or "Eagle3Speculator" in archs:
        return "speculators"
    if "target_model_type" in raw or "Eagle3LlamaForCausalLM" in archs and "eagle_config" not in raw:
        return "angelslim"
    if "LlamaForCausalLMEagle3" in archs:
        modelopt = "t2d" not in names or "lm_head.weight" not in names or raw.get("draft_vocab_size", 0) is None
        return "modelopt" if modelopt else "specforge"
    return "eagle"


def _canonical_name(name: str) -> str | None:
    """Map a source tensor name to its canonical name, or None for a stray tensor."""
    name = name.removeprefix("model.")
    for prefix in LAYER_PREFIXES:
        if name.startswith(prefix):
            rest = name[len(prefix):]
            if rest in LAYER_TENSORS or rest in OPTIONAL_LAYER_TENSORS or rest in BIAS_TENSORS:
                return "midlayer." + rest
            return None
    later = LATER_LAYER.match(name)
    if later:
        rest = later.group(2)
        known = rest in LATER_LAYER_TENSORS or rest in OPTIONAL_LAYER_TENSORS or rest in BIAS_TENSORS
        return name if known else None
    if name in ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight",
                "input_norm.weight", LOWRANK_DOWN, MASK_HIDDEN, SCREEN_EXACT, SCREEN_HOT_IDS):
        return name
    if name.startswith("fc_norm.") and name.endswith(".weight"):
        return name
    return None


@dataclass(frozen=True)
class _SourceConfig:
    """A drafter's config as its layout's adapter reads it: which part of it holds which kind of key."""

    raw: dict[str, Any]  # config.json as written: aux layer ids, sizes and the verifier named at its top level
    layer: dict[str, Any]  # the decoder layer: sizes, vocab, RoPE, eps, activation, num_hidden_layers
    served: dict[str, Any]  # what vLLM builds the drafter from: flags, biases, feature count, mask-slot token
    eagle: dict[str, Any]  # eagle_config ({} without one), where vLLM reads norm_before_fc first
    norm_before_residual_default: bool  # the layout's default for the flag when no config sets it
    # the config class vLLM builds ``served`` into: transformers' for the flat config's model_type, or vLLM's own
    # SpeculatorsConfig (``speculators``), which keeps every key as written
    config_class: str = "llama"


def _get_eagle_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The config's ``eagle_config`` section; {} where it has none."""
    value = raw.get("eagle_config")
    return value if isinstance(value, dict) else {}


def _read_flat(raw: dict[str, Any]) -> _SourceConfig:
    """EAGLE (yuhuili), SpecForge, ModelOpt, AngelSlim and SlimSpec configs: one flat Llama-style config holding the
    layer and the flags, which vLLM builds the drafter from as it is, beside an optional ``eagle_config``."""
    return _SourceConfig(raw=raw, layer=raw, served=raw, eagle=_get_eagle_config(raw),
                         norm_before_residual_default=False, config_class=str(raw.get("model_type") or "llama"))


def _speculators_served(raw: dict[str, Any], layer: dict[str, Any]) -> dict[str, Any]:
    """The config vLLM (0.32-0.34) builds a speculators drafter from: its ``transformer_layer_config`` (``layer``)
    with the top level's flags written over it (vLLM's speculators ``eagle3`` and ``peagle`` updaters): the inner
    copies of these flags never count, and ``peagle``'s top-level ``mask_token_id`` arrives as ``pard_token``. A flag
    the top level leaves out takes the reader's default."""
    view = dict(layer)
    peagle = raw.get("speculators_model_type") == "peagle"
    for key in ("norm_before_residual", "norm_before_fc") + (() if peagle else ("fc_norm", "norm_output")):
        view.pop(key, None)
        if raw.get(key) is not None:
            view[key] = raw[key]
    if peagle and raw.get("mask_token_id") is not None:
        view["pard_token"] = raw["mask_token_id"]
    return view


def _read_speculators(raw: dict[str, Any]) -> _SourceConfig:
    """A vllm-project/speculators config: the layer in ``transformer_layer_config``, the flags as vLLM serves them
    (``_speculators_served``). Its eagle3 checkpoints default to norm-before-residual (as vLLM reads them); its
    peagle ones do not."""
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise CheckpointError("speculators config has no transformer_layer_config")
    return _SourceConfig(raw=raw, layer=layer, served=_speculators_served(raw, layer), eagle=_get_eagle_config(raw),
                         norm_before_residual_default=raw.get("speculators_model_type") != "peagle",
                         config_class="speculators")


# The adapter reading each layout's config: speculators nests the layer and writes its flags over it; every other
# tool writes one flat config.
_CONFIG_READERS = {
    "eagle": _read_flat,
    "specforge": _read_flat,
    "speculators": _read_speculators,
    "modelopt": _read_flat,
    "angelslim": _read_flat,
    "slimspec": _read_flat,
}
# layer config keys DrafterConfig reads into its own fields; the other scalar ones go to its ``extra``
_READ_LAYER_KEYS = {"hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                    "vocab_size", "draft_vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling",
                    "max_position_embeddings", "hidden_act", "model_type", "architectures", "torch_dtype", "dtype",
                    "sliding_window", "use_sliding_window", "max_window_layers"}


def _build_config(raw: dict[str, Any], layout: str, tensors: dict[str, torch.Tensor]) -> DrafterConfig:
    """Read ``raw``, a config in ``layout``, into the canonical DrafterConfig: the layout's adapter says where each
    key lives, the rest is the same for every layout."""
    return _canonical_config(_CONFIG_READERS[layout](raw), tensors)


def _need(config: dict[str, Any], key: str) -> Any:
    """``config[key]``; a CheckpointError when it is missing or null."""
    if key not in config or config[key] is None:
        raise CheckpointError(f"drafter config lacks {key!r}")
    return config[key]


def _attention_shape(layer: dict[str, Any]) -> tuple[int, int, int, int]:
    """(hidden_size, attention heads, key/value heads, head_dim): kv heads default to the heads, head_dim to
    hidden/heads."""
    hidden = int(_need(layer, "hidden_size"))
    heads = int(_need(layer, "num_attention_heads"))
    kv_heads = int(layer.get("num_key_value_heads") or heads)
    head_dim = int(layer.get("head_dim") or hidden // heads)
    return hidden, heads, kv_heads, head_dim


def _aux_features(src: _SourceConfig, fc: torch.Tensor) -> tuple[Any, int]:
    """(the aux layer ids named, how many target hidden states fc reads): the ids from the top level, else from
    ``eagle_config``; the count from ``num_aux_hidden_states`` (vLLM sizes fc by it first), else the ids', else 3."""
    aux_ids = src.raw.get("eagle_aux_hidden_state_layer_ids") or src.eagle.get("eagle_aux_hidden_state_layer_ids")
    declared_aux = src.served.get("num_aux_hidden_states")
    if declared_aux is not None and aux_ids and int(declared_aux) != len(aux_ids):
        raise CheckpointError(f"the config declares num_aux_hidden_states={declared_aux} but names {len(aux_ids)} "
                              f"feature layers {list(aux_ids)}")
    num_aux = int(declared_aux) if declared_aux is not None else len(aux_ids) if aux_ids else 3
    if num_aux < 1 or fc.shape[1] % num_aux:
        raise CheckpointError(f"fc.weight {list(fc.shape)} is not {num_aux} target hidden states wide")
    return aux_ids, num_aux


def _vocab_sizes(src: _SourceConfig, tensors: dict[str, torch.Tensor]) -> tuple[int, Any]:
    """(the target's vocab_size, the draft vocabulary as written): ``draft_vocab_size`` from the top level, else the
    layer; where it is null, the head's rows, else the target's vocabulary (a drafter sharing the target's head)."""
    vocab = int(_need(src.layer, "vocab_size"))
    draft_vocab = src.raw.get("draft_vocab_size", src.layer.get("draft_vocab_size"))
    if draft_vocab is None:
        head = tensors.get("lm_head.weight")
        draft_vocab = head.shape[0] if head is not None else vocab
    return vocab, draft_vocab


def _layer_style(tensors: dict[str, torch.Tensor]) -> str:
    """``qwen3`` or ``llama``: the layer's tensors decide its style (vLLM serves a Llama- or a Qwen3-style layer); a
    config's model_type of qwen3 without q_norm, or mistral/qwen2, describes the target rather than this layer."""
    return "qwen3" if "midlayer.self_attn.q_norm.weight" in tensors else "llama"


def _flag(src: _SourceConfig, key: str, default: bool) -> bool:
    """A variant flag where vLLM reads it: ``norm_before_fc`` from ``eagle_config`` first, then the served config;
    the others from the served config alone; ``default`` where none sets it."""
    sources = (src.eagle, src.served) if key == "norm_before_fc" else (src.served,)
    for source in sources:
        if source.get(key) is not None:
            return bool(source[key])
    return default


def _parallel_token(served: dict[str, Any], tensors: dict[str, torch.Tensor]) -> int | None:
    """The mask-slot token of a P-EAGLE drafter (one whose weights hold ``mask_hidden``), from the first of
    ``PARALLEL_TOKEN_KEYS`` the served config sets (vLLM's order); None for a chain drafter."""
    if MASK_HIDDEN not in tensors:
        return None
    found = [served[k] for k in PARALLEL_TOKEN_KEYS if served.get(k) is not None]
    if not found:
        raise CheckpointError(f"the weights hold {MASK_HIDDEN} (a P-EAGLE parallel drafter) but the config names "
                              f"no mask-slot token ({', '.join(PARALLEL_TOKEN_KEYS)})")
    return int(found[0])


def _target_model(raw: dict[str, Any]) -> str | None:
    """The verifier a config names: ``speculators_config.verifier.name_or_path``, else ``base_model_name_or_path``,
    else ``target_model``."""
    target_model = None
    spec = raw.get("speculators_config")
    if isinstance(spec, dict) and isinstance(spec.get("verifier"), dict):
        target_model = spec["verifier"].get("name_or_path")
    return target_model or raw.get("base_model_name_or_path") or raw.get("target_model")


def _layer_count(layer: dict[str, Any], tensors: dict[str, torch.Tensor]) -> int:
    """The decoder layers the weights hold. One layer is read as the EAGLE reference reads it, whatever the config
    says (some copy the target's count: 40 is reported for yuhuili's EAGLE3-Vicuna1.3-13B); several must match the
    config's ``num_hidden_layers``, which is what vLLM builds."""
    num_layers = decoder_layer_count(tensors)
    declared = layer.get("num_hidden_layers")
    if num_layers > 1 and declared is not None and int(declared) != num_layers:
        raise CheckpointError(f"the config declares num_hidden_layers={declared} but the weights hold {num_layers} "
                              "decoder layers")
    return num_layers


def _canonical_config(src: _SourceConfig, tensors: dict[str, torch.Tensor]) -> DrafterConfig:
    """The DrafterConfig of a drafter whose config ``src`` reads and whose canonical ``tensors`` give what the config
    may leave out (feature width, head rows, layer style and count); refuses what vLLM would build unlike it."""
    layer, served = src.layer, src.served
    hidden, heads, kv_heads, head_dim = _attention_shape(layer)
    fc = tensors["fc.weight"]
    aux_ids, num_aux = _aux_features(src, fc)
    target_hidden = int(src.raw.get("target_hidden_size") or layer.get("target_hidden_size")
                        or fc.shape[1] // num_aux)
    vocab, draft_vocab = _vocab_sizes(src, tensors)
    model_type = _layer_style(tensors)
    _refuse_unbuilt_biases(served, model_type)
    parallel_token = _parallel_token(served, tensors)
    target_model = _target_model(src.raw)
    rope_theta, rope_scaling = rope_of(layer)
    num_layers = _layer_count(layer, tensors)
    layer_types, sliding_window = _sliding_windows(src, num_layers)
    return DrafterConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=int(_need(layer, "intermediate_size")),
        target_hidden_size=target_hidden,
        vocab_size=vocab,
        draft_vocab_size=int(draft_vocab),
        rms_norm_eps=float(layer.get("rms_norm_eps") or 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(layer.get("max_position_embeddings") or 2048),
        hidden_act=str(layer.get("hidden_act") or "silu"),
        model_type=model_type,
        num_aux_hidden_states=num_aux,
        aux_layer_ids=[int(i) for i in aux_ids] if aux_ids else None,
        norm_before_residual=_flag(src, "norm_before_residual", src.norm_before_residual_default),
        norm_before_fc=_flag(src, "norm_before_fc", False),
        fc_norm=_flag(src, "fc_norm", any(k.startswith("fc_norm.") for k in tensors)),
        norm_output=_flag(src, "norm_output", False),
        num_layers=num_layers,
        attention_bias=bool(served.get("attention_bias") or False),
        layer_types=layer_types,
        sliding_window=sliding_window,
        parallel_token_id=parallel_token,
        target_model=target_model,
        extra={k: v for k, v in layer.items() if k not in _READ_LAYER_KEYS and isinstance(v, (int, float, str, bool))},
    )


def decoder_layer_count(tensors: dict[str, Any]) -> int:
    """How many decoder layers canonical ``tensors`` hold (``midlayer.*`` and ``layers.{i}.*``)."""
    later = {int(m.group(1)) for name in tensors if (m := LATER_LAYER.match(name))}
    return 1 + max(later, default=0)


def rope_of(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) of a Llama-style config: transformers 5 writes ``rope_parameters``
    {rope_type, rope_theta, ...} instead of ``rope_theta``/``rope_scaling``."""
    rope = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    theta = float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    kind = rope.get("rope_type") or rope.get("type")
    scaling = None if not kind or kind == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}
    return theta, config.get("rope_scaling") or scaling


def _check_shapes(cfg: DrafterConfig, t: dict[str, torch.Tensor], where: Path) -> None:
    h, a = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    expected = {
        "fc.weight": (h, cfg.num_aux_hidden_states * cfg.target_hidden_size),
        "midlayer.self_attn.q_proj.weight": (a, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, a),
        "midlayer.mlp.gate_proj.weight": (cfg.intermediate_size, h),
        "midlayer.mlp.up_proj.weight": (cfg.intermediate_size, h),
        "midlayer.mlp.down_proj.weight": (h, cfg.intermediate_size),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        LOWRANK_DOWN: (t[LOWRANK_DOWN].shape[0] if LOWRANK_DOWN in t else 0, h),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
        MASK_HIDDEN: (1, cfg.num_aux_hidden_states * cfg.target_hidden_size),
    }
    if LOWRANK_DOWN in t:
        if "lm_head.weight" not in t or t[LOWRANK_DOWN].dim() != 2:
            raise CheckpointError(f"{where}: a low-rank head needs lm_head.weight and {LOWRANK_DOWN}")
        expected["lm_head.weight"] = (cfg.draft_vocab_size, t[LOWRANK_DOWN].shape[0])
    _check_screen(cfg, t, where)
    for i in range(1, cfg.num_layers):  # later layers read the hidden state alone
        p = layer_prefix(i)
        expected.update({p + name.removeprefix("midlayer."): shape for name, shape in expected.items()
                         if name.startswith("midlayer.") and "hidden_norm" not in name})
        for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"):
            expected[p + name] = (expected[p + name][0], h)
    for name, shape in expected.items():
        if name in t and tuple(t[name].shape) != shape:
            raise CheckpointError(
                f"{where}: {name} has shape {list(t[name].shape)}, config implies {list(shape)}"
            )
    if cfg.parallel_token_id is not None and not 0 <= cfg.parallel_token_id < cfg.vocab_size:
        raise CheckpointError(f"{where}: the mask-slot token {cfg.parallel_token_id} is outside the target vocab of "
                              f"{cfg.vocab_size}")
    d2t = t.get("d2t")
    if d2t is not None:
        ids = torch.arange(cfg.draft_vocab_size) + d2t.long()
        if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
            raise CheckpointError(f"{where}: d2t maps draft tokens outside the target vocab of {cfg.vocab_size}")
        if ids.unique().numel() != ids.numel():
            raise CheckpointError(f"{where}: d2t maps two draft tokens to the same target token")
    elif cfg.draft_vocab_size != cfg.vocab_size and "lm_head.weight" in t:
        raise CheckpointError(
            f"{where}: draft vocab {cfg.draft_vocab_size} differs from vocab {cfg.vocab_size} but there is no d2t"
        )


def _check_screen(cfg: DrafterConfig, t: dict[str, torch.Tensor], where: Path) -> None:
    """A screen head's exact rows and hot ids against the config and the pair."""
    if SCREEN_HOT_IDS in t and SCREEN_EXACT not in t:
        raise CheckpointError(f"{where}: {SCREEN_HOT_IDS} without {SCREEN_EXACT}")
    if SCREEN_EXACT not in t:
        return
    if LOWRANK_DOWN not in t:
        raise CheckpointError(f"{where}: {SCREEN_EXACT} needs the low-rank pair (lm_head.weight, {LOWRANK_DOWN})")
    if tuple(t[SCREEN_EXACT].shape) != (cfg.draft_vocab_size, cfg.hidden_size):
        raise CheckpointError(f"{where}: {SCREEN_EXACT} has shape {list(t[SCREEN_EXACT].shape)}, config implies "
                              f"{[cfg.draft_vocab_size, cfg.hidden_size]}")
    hot = t.get(SCREEN_HOT_IDS)
    if hot is not None and (hot.dim() != 1 or hot.is_floating_point() or hot.numel() and (
            int(hot.min()) < 0 or int(hot.max()) >= cfg.draft_vocab_size or hot.unique().numel() != hot.numel())):
        raise CheckpointError(f"{where}: {SCREEN_HOT_IDS} must be distinct draft ids in [0, {cfg.draft_vocab_size})")


def _check_screen_config(raw: dict[str, Any], t: dict[str, torch.Tensor], where: Path) -> None:
    """The ``slimspec`` block of a screen head names it and a shortlist that fits the vocabulary."""
    if SCREEN_EXACT not in t:
        return
    meta = raw.get("slimspec") if isinstance(raw.get("slimspec"), dict) else {}
    k, vocab = meta.get("shortlist"), t[SCREEN_EXACT].shape[0]
    if meta.get("head") != SCREEN_HEAD or not isinstance(k, int) or not 1 <= k <= vocab:
        raise CheckpointError(f"{where}: {SCREEN_EXACT} needs config.json's slimspec block to hold "
                              f"\"head\": \"{SCREEN_HEAD}\" and an integer \"shortlist\" in [1, {vocab}]")
    hot = t.get(SCREEN_HOT_IDS)
    if meta.get("hot_rows", 0) != (0 if hot is None else hot.numel()):
        raise CheckpointError(f"{where}: slimspec.hot_rows {meta.get('hot_rows')} but {SCREEN_HOT_IDS} holds "
                              f"{0 if hot is None else hot.numel()} ids")


def _refuse_unbuilt_biases(served: dict[str, Any], model_type: str) -> None:
    """Llama-style flags that make vLLM build biases this tool does not carry: ``bias`` (Llama's decoder layer gives
    o_proj a bias under it, while the Eagle3 layer's q/k/v follow ``attention_bias`` alone) and ``mlp_bias``.
    vLLM would serve such a drafter with bias parameters the weights do not fill, so it is refused, not misread
    (``qkv_bias`` is ignored, as vLLM's Eagle3 layer rebuilds q/k/v by ``attention_bias``)."""
    if model_type != "llama":  # vLLM's Qwen3 layer reads neither key
        return
    if served.get("bias") and not served.get("attention_bias"):
        raise CheckpointError("the config sets bias without attention_bias: vLLM would build an o_proj bias "
                              "without q/k/v ones, a layer slimspec does not convert")
    if served.get("mlp_bias"):
        raise CheckpointError("the config sets mlp_bias: vLLM would build MLP biases, which slimspec does not "
                              "convert")


def _sliding_windows(src: _SourceConfig, num_layers: int) -> tuple[list[str] | None, int | None]:
    """(layer_types, sliding_window) of the drafter's ``num_layers`` decoder layers as vLLM builds them (its Llama and
    Qwen3 Eagle3 layers give layer ``i`` the window where ``layer_types[i]`` is ``sliding_attention``); (None, None)
    when no layer slides. The config class decides what vLLM sees: transformers' Qwen3Config keeps the window only
    under ``use_sliding_window`` and derives absent layer_types from ``max_window_layers``; LlamaConfig and vLLM's
    SpeculatorsConfig keep both as written; a window of 0 is none (vLLM's ModelConfig). Layers the list does not
    reach are full attention (vLLM's Qwen3 layer; its Llama layer fails on a short list)."""
    served = src.served
    window, types = served.get("sliding_window"), served.get("layer_types")
    if src.config_class == "qwen3":
        window = window if served.get("use_sliding_window") else None
        if types is None and window is not None:
            first = int(served.get("max_window_layers", 28))
            types = [SLIDING if i >= first else "full_attention" for i in range(num_layers)]
    if not window or not isinstance(types, list):
        return None, None
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise CheckpointError(f"the config's sliding_window {window!r} is not a positive number of positions")
    types = [SLIDING if i < len(types) and types[i] == SLIDING else "full_attention" for i in range(num_layers)]
    return (types, window) if SLIDING in types else (None, None)


QUANTISED_CONFIG_KEYS = ("quantization_config", "compression_config")
QUANTISED_SCALES = re.compile(r"_scale(_inv)?$")  # FP8/INT8 checkpoints' weight_scale, input_scale, k_scale, ...


def _refuse_quantised(raw: dict[str, Any], names: list[str], folder: Path) -> None:
    """A quantised drafter (a quantization config, or scale tensors beside its weights): its stored values are not
    the weights, and a conversion would read them as such and drop the scales."""
    configs = (raw, raw.get("transformer_layer_config"))  # a speculators config's layer config too
    key = next((k for c in configs if isinstance(c, dict) for k in QUANTISED_CONFIG_KEYS if c.get(k)), None)
    scales = [n for n in names if QUANTISED_SCALES.search(n)]
    if key or scales:
        cause = f"config.json has {key}" if key else f"the weights hold scale tensors ({scales[0]}, ...)"
        raise CheckpointError(f"{folder}: a quantised drafter ({cause}) is not supported: give the unquantised one")


def _refuse_quantised_weights(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """Weights stored in a quantised dtype (float8, int8, ...) rather than a 16/32-bit float."""
    for name, tensor in tensors.items():
        if name not in ("d2t", "t2d", SCREEN_HOT_IDS) and (not tensor.is_floating_point() or tensor.element_size() < 2):
            raise CheckpointError(f"{folder}: {name} is stored as {str(tensor.dtype).removeprefix('torch.')}: "
                                  "quantised drafters are not supported: give the unquantised one")


def attention_bias_names(cfg: DrafterConfig) -> list[str]:
    """The bias tensors vLLM builds for ``cfg`` (canonical names): none without attention_bias; else q/k/v of every
    layer, and o_proj's too in Llama-style layers (vLLM's Qwen3 attention has no o_proj bias)."""
    if not cfg.attention_bias:
        return []
    projections = "qkvo" if cfg.model_type == "llama" else "qkv"
    return [layer_prefix(i) + f"self_attn.{p}_proj.bias" for i in range(cfg.num_layers) for p in projections]


def _check_biases(cfg: DrafterConfig, names: set[str], folder: Path) -> None:
    """The weights hold exactly the attention biases the config makes vLLM build (it fails on any other set)."""
    held = {n for n in names if n.endswith("_proj.bias")}
    expected = set(attention_bias_names(cfg))
    if held and not cfg.attention_bias:
        raise CheckpointError(f"{folder}: the weights hold attention biases ({sorted(held)[0]}, ...) but the config "
                              "does not set attention_bias (vLLM would not build them)")
    if held != expected:
        missing, extra = sorted(expected - held), sorted(held - expected)
        raise CheckpointError(f"{folder}: attention_bias is set but the biases do not match what vLLM builds for a "
                              f"{cfg.model_type}-style layer: missing {missing[:3]}, unexpected {extra[:3]}")


def load_drafter(folder: str | Path) -> DrafterCheckpoint:
    """Read an EAGLE-3 drafter folder of any published layout into canonical form."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a folder")
    raw = read_json(folder / "config.json")
    files = weight_map(folder)
    _refuse_quantised(raw, list(files), folder)
    mapping: dict[str, str] = {}
    dropped: list[str] = []
    for name in files:
        canon = _canonical_name(name)
        if name.endswith("lm_head.bias"):
            raise CheckpointError(f"{folder}: {name!r}: an LM head with a bias is not supported")
        if canon is None and name.endswith(".bias") and ("midlayer." in name or "layers." in name):
            raise CheckpointError(f"{folder}: layer tensor {name!r}: a decoder layer with biases outside attention's "
                                  "q/k/v/o projections is not supported (vLLM's EAGLE-3 layers have none)")
        if canon is None:
            dropped.append(name)
        elif canon in mapping:
            raise CheckpointError(f"{folder}: tensors {mapping[canon]!r} and {name!r} both map to {canon!r}")
        else:
            mapping[canon] = name
    layers = decoder_layer_count(mapping)
    qk = [tuple(layer_prefix(i) + f"self_attn.{n}_norm.weight" in mapping for n in "qk") for i in range(layers)]
    if any(q != k for q, k in qk):
        raise CheckpointError(f"{folder}: a Qwen3-style layer needs both self_attn.q_norm and self_attn.k_norm")
    if len(set(qk)) > 1:
        raise CheckpointError(f"{folder}: some decoder layers have Qwen3 q/k norms and others do not")
    missing = [n for n in ("fc.weight", "norm.weight") if n not in mapping]
    missing += ["midlayer." + n for n in LAYER_TENSORS if "midlayer." + n not in mapping]
    if not missing:
        for i in range(1, layers):
            lacking = [n for n in LATER_LAYER_TENSORS if layer_prefix(i) + n not in mapping]
            if lacking:
                raise CheckpointError(f"{folder}: decoder layer {i} of {layers} lacks {', '.join(lacking[:3])}"
                                      f"{' and more' if len(lacking) > 3 else ''} (the weights name layers up to "
                                      f"layers.{layers - 1}.*)")
    if missing:
        raise CheckpointError(
            f"{folder}: not an EAGLE-3 drafter (missing {', '.join(missing[:3])}"
            f"{' and more' if len(missing) > 3 else ''})"
        )
    loaded = read_tensors(files, mapping.values())
    tensors = {canon: loaded[src] for canon, src in mapping.items()}
    _refuse_quantised_weights(tensors, folder)
    if MASK_HIDDEN in tensors:  # written [n*Ht] or [1, n*Ht]; vLLM views it as one row
        tensors[MASK_HIDDEN] = tensors[MASK_HIDDEN].reshape(1, -1)
    layout = detect_layout(raw, set(mapping))
    try:
        cfg = _build_config(raw, layout, tensors)
    except (ValueError, TypeError) as exc:  # e.g. "hidden_size": "abc"
        raise CheckpointError(f"{folder}: config.json holds a value of the wrong type ({exc})") from None
    if "input_norm.weight" in tensors and not cfg.norm_before_fc:  # vLLM follows the flag and ignores the tensor
        del tensors["input_norm.weight"]
        dropped.append(mapping["input_norm.weight"])
    _check_biases(cfg, set(tensors), folder)
    _check_shapes(cfg, tensors, folder)
    _check_screen_config(raw, tensors, folder)
    return DrafterCheckpoint(
        layout=layout,
        config=cfg,
        tensors=tensors,
        source=folder,
        files=sorted(set(files.values())),
        raw_config=raw,
        dropped=sorted(dropped),
    )
