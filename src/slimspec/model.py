"""A plain-PyTorch EAGLE-3 drafter with a pluggable LM head (full or SlimSpec low-rank).

One decoder layer, as in the EAGLE-3 reference and vLLM's ``Eagle3LlamaForCausalLM``::

    g   = fc(aux)                                  # aux = cat(f_low, f_mid, f_high), 3*Ht wide; only step 0
    x   = cat(input_layernorm(emb(token)), hidden_norm(g))     # embedding FIRST, 2H wide
    h   = residual + o_proj(attn(q_proj(x), k_proj(x), v_proj(x)))   # residual = g (or hidden_norm(g))
    h   = h + mlp(post_attention_layernorm(h))     # the pre-norm output, fed back to the next draft step
    logits = head(norm(h))                         # draft-vocab logits; target id = i + d2t[i]

Alignment (DESIGN.md §4): at position ``t`` the drafter sees target features ``f_t`` and the embedding
of token ``x_{t+1}`` with RoPE position ``t``, and predicts ``x_{t+2}``. Draft step ``i`` (0-based) at
position ``t`` sees token ``x_{t+1+i}`` at RoPE position ``t+i`` and predicts ``x_{t+2+i}``.

A P-EAGLE drafter (``config.parallel_token_id`` set, a ``mask_hidden`` parameter) drafts its K tokens in one pass
(vLLM's ``parallel_drafting``): after the last real position come K-1 masked slots at the next RoPE positions, each
fed the token ``parallel_token_id`` and ``combine(mask_hidden)`` in place of target features; slot j predicts the
token a chain's step j would.

Module names follow the canonical tensor names (``fc``, ``fc_norm.{i}``, ``input_norm``, ``midlayer.*``,
``layers.{i}.*`` for the later layers of a multi-layer drafter, ``norm``), so
:meth:`Eagle3Drafter.canonical_state_dict` is the module's own state plus the head's canonical names
(``lm_head.weight`` = ``W_up`` and ``lm_head_down.weight`` = ``W_down`` for a low-rank head) and ``d2t``. The token
embedding is the target's and stays frozen: a non-persistent buffer.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from slimspec.checkpoint.drafter import LOWRANK_DOWN, SCREEN_EXACT, SCREEN_HOT_IDS, DrafterCheckpoint, DrafterConfig
from slimspec.checkpoint.target_model import TargetParts
from slimspec.errors import CheckpointError
from slimspec.kernels.shortlist import shortlist_argmax, topk_lower_ids

# (keys, values), each [B, kv_heads, S, head_dim], RoPE already applied; a multi-layer drafter's cache stacks its
# layers' kv heads on dim 1, [B, layers * kv_heads, S, head_dim], so cropping and lengths read dim 2 alike
KVCache = tuple[Tensor, Tensor]

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, computed in at least float32 (as HF Llama/Qwen3)."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        xf = x.to(torch.promote_types(dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


# ----------------------------------------------------------------------------------------------- heads


class FullHead(nn.Module):
    """A plain LM head: ``logits = h @ weight.T`` with ``weight`` [V, d]."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())

    @classmethod
    def empty(cls, vocab: int, hidden: int) -> FullHead:
        """A randomly initialised head (nn.Linear's initialisation)."""
        return cls(nn.Linear(hidden, vocab, bias=False).weight.data)

    def forward(self, h: Tensor) -> Tensor:
        return F.linear(h, self.weight)

    def greedy(self, h: Tensor) -> Tensor:
        """The drafted token ids [...]: the argmax of the logits."""
        return self.forward(h).argmax(-1)

    @property
    def weight_up(self) -> Tensor:
        return self.weight

    @property
    def weight_down(self) -> None:
        return None

    @property
    def rank(self) -> None:
        return None

    def full_weight(self) -> Tensor:
        return self.weight

    def canonical_tensors(self) -> dict[str, Tensor]:
        return {"lm_head.weight": self.weight}


class LowRankHead(nn.Module):
    """SlimSpec head ``W_up [V, r] @ W_down [r, d]``: ``logits = (h @ down.T) @ up.T``, never forming ``W``."""

    def __init__(self, up: Tensor, down: Tensor) -> None:
        super().__init__()
        if up.dim() != 2 or down.dim() != 2 or up.shape[1] != down.shape[0]:
            raise ValueError(f"low-rank head needs up [V, r] and down [r, d], got {list(up.shape)}, {list(down.shape)}")
        self.up = nn.Parameter(up.detach().clone())
        self.down = nn.Parameter(down.detach().clone())

    def forward(self, h: Tensor) -> Tensor:
        return F.linear(F.linear(h, self.down), self.up)

    def greedy(self, h: Tensor) -> Tensor:
        """The drafted token ids [...]: the argmax of the logits."""
        return self.forward(h).argmax(-1)

    @property
    def weight_up(self) -> Tensor:
        return self.up

    @property
    def weight_down(self) -> Tensor:
        return self.down

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    def full_weight(self) -> Tensor:
        """``W_up @ W_down`` [V, d] (for checks; the forward never builds it)."""
        return self.up @ self.down

    def canonical_tensors(self) -> dict[str, Tensor]:
        return {"lm_head.weight": self.up, LOWRANK_DOWN: self.down}


GATHER_ELEMENTS = 2**24
"""Rows of exact weights gathered at once by :class:`ScreenRescoreHead` (bounds its memory on large batches)."""


class ScreenRescoreHead(LowRankHead):
    """Screen and rescore: the pair ``W_up [V, r] @ W_down [r, d]`` scores every token, the exact rows
    ``W_exact [V, d]`` (the source head's, frozen) rescore its top ``shortlist`` tokens and the ``hot_ids``.

    ``forward`` gives the two-level logits (exact on the shortlist, the pair's elsewhere); ``greedy`` the exact
    argmax over the shortlist. The top-K and the argmax break ties toward the lower token id. Only the pair trains.
    """

    def __init__(self, up: Tensor, down: Tensor, exact: Tensor, shortlist: int, hot_ids: Tensor | None = None
                 ) -> None:
        super().__init__(up, down)
        vocab = up.shape[0]
        if exact.dim() != 2 or tuple(exact.shape) != (vocab, down.shape[1]):
            raise ValueError(f"exact rows must be [{vocab}, {down.shape[1]}], got {list(exact.shape)}")
        if not 1 <= shortlist <= vocab:
            raise ValueError(f"shortlist must lie in [1, {vocab}], got {shortlist}")
        hot = torch.zeros(0, dtype=torch.long) if hot_ids is None else hot_ids.detach().long().reshape(-1)
        hot = torch.unique(hot.cpu())  # sorted, unique
        if hot.numel() and (int(hot[0]) < 0 or int(hot[-1]) >= vocab):
            raise ValueError(f"hot ids must lie in [0, {vocab})")
        self.shortlist = int(shortlist)
        self.register_buffer("exact", exact.detach().clone())
        self.register_buffer("hot_ids", hot.to(up.device))

    @property
    def hot_rows(self) -> int:
        return int(self.hot_ids.numel())

    def screen(self, h: Tensor) -> Tensor:
        """The pair's logits [..., V]."""
        return super().forward(h)

    def shortlist_ids(self, screen: Tensor) -> Tensor:
        """Token ids rescored per row [..., K + N]: the screen's top K (ties to the lower id), then the hot ids."""
        return screen_shortlist(screen, self.shortlist, self.hot_ids)

    def exact_scores(self, h: Tensor, ids: Tensor) -> Tensor:
        """``h . W_exact[ids]`` [..., M], gathered a bounded number of rows at a time."""
        flat_h, flat_ids = h.reshape(-1, h.shape[-1]), ids.reshape(-1, ids.shape[-1])
        step = max(1, GATHER_ELEMENTS // max(1, flat_ids.shape[1] * h.shape[-1]))
        parts = [torch.bmm(self.exact[flat_ids[a:a + step]].to(h.dtype), flat_h[a:a + step, :, None])[..., 0]
                 for a in range(0, flat_h.shape[0], step)]
        return torch.cat(parts).reshape(ids.shape) if parts else h.new_zeros(ids.shape)

    def forward(self, h: Tensor) -> Tensor:
        screen = self.screen(h)
        ids = self.shortlist_ids(screen)
        return screen.scatter(-1, ids, self.exact_scores(h, ids).to(screen.dtype))

    def greedy(self, h: Tensor) -> Tensor:
        """The exact argmax over the shortlist [...], ties toward the lower token id."""
        ids = self.shortlist_ids(self.screen(h))
        scores = self.exact_scores(h, ids)
        flat = shortlist_argmax(scores.reshape(-1, scores.shape[-1]), ids.reshape(-1, ids.shape[-1]))
        return flat.reshape(ids.shape[:-1])

    def multiply_add_share(self) -> float:
        """Multiply-adds per token as a share of the full ``V x d`` head's: ``(r (V + d) + (K + N) d) / (V d)``."""
        return screen_cost(self.up.shape[0], self.down.shape[1], self.rank, self.shortlist, self.hot_rows)

    def canonical_tensors(self) -> dict[str, Tensor]:
        out = {**super().canonical_tensors(), SCREEN_EXACT: self.exact}
        if self.hot_rows:
            out[SCREEN_HOT_IDS] = self.hot_ids
        return out


def screen_shortlist(screen: Tensor, shortlist: int, hot_ids: Tensor | None = None, exact_ties: bool = True
                     ) -> Tensor:
    """Ids [..., K + N] a screen rescores: the top ``shortlist`` of ``screen`` [..., V] (equal scores: the lower id
    first), then ``hot_ids`` [N] (a token in both appears twice; its exact score is the same). ``exact_ties=False``:
    ``torch.topk``'s order among equal scores at the K-th place (several times faster on a CPU; what training uses)."""
    if not exact_ties:
        top = torch.topk(screen.detach(), shortlist, dim=-1, sorted=False).indices
    else:
        flat = screen.detach().reshape(-1, screen.shape[-1])
        top = topk_lower_ids(flat, shortlist).reshape(*screen.shape[:-1], shortlist)
    if hot_ids is None or not hot_ids.numel():
        return top
    return torch.cat([top, hot_ids.to(top.device).expand(*top.shape[:-1], hot_ids.numel())], dim=-1)


def screen_cost(vocab: int, hidden: int, rank: int, shortlist: int, hot_rows: int = 0) -> float:
    """A screen-and-rescore head's multiply-adds per token as a share of the full ``vocab x hidden`` head's."""
    return (rank * (vocab + hidden) + (shortlist + hot_rows) * hidden) / (vocab * hidden)


def screen_footprint(vocab: int, hidden: int, rank: int, shortlist: int, hot_rows: int, width: int) -> dict:
    """A screen-and-rescore head's shortlist, multiply-add share of the full head, size in bytes (the pair and the
    exact rows it keeps), and head bytes read per draft step at batch 1 and 64 (the pair, then at most the distinct
    exact rows the batch rescores: the hot rows once, one shortlist per sequence), for weights of ``width`` bytes."""
    pair = rank * (vocab + hidden)
    return {"shortlist": shortlist, "hot_rows": hot_rows,
            "multiply_add_share": screen_cost(vocab, hidden, rank, shortlist, hot_rows),
            "head_bytes": (pair + vocab * hidden) * width,
            "bytes_read_per_step": {str(b): (pair + min(vocab, hot_rows + b * shortlist) * hidden) * width
                                    for b in (1, 64)},
            "full_head_bytes_read_per_step": vocab * hidden * width}


Head = FullHead | LowRankHead | ScreenRescoreHead


def head_from_tensors(tensors: dict[str, Tensor], shortlist: int | None = None) -> Head | None:
    """The head a canonical tensor dict describes: low-rank when ``lm_head_down.weight`` is present, screen and
    rescore when ``lm_head_exact.weight`` is too (``shortlist``: K, from the config's ``slimspec`` block)."""
    if "lm_head.weight" not in tensors:
        return None
    if LOWRANK_DOWN in tensors and SCREEN_EXACT in tensors:
        if shortlist is None:
            raise ValueError(f"{SCREEN_EXACT} needs the shortlist size (the config's slimspec.shortlist)")
        return ScreenRescoreHead(tensors["lm_head.weight"], tensors[LOWRANK_DOWN], tensors[SCREEN_EXACT], shortlist,
                                 tensors.get(SCREEN_HOT_IDS))
    if LOWRANK_DOWN in tensors:
        return LowRankHead(tensors["lm_head.weight"], tensors[LOWRANK_DOWN])
    return FullHead(tensors["lm_head.weight"])


# ------------------------------------------------------------------------------------------------ RoPE


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None, max_position_embeddings: int = 2048) -> Tensor:
    """Inverse frequencies [head_dim/2] (float64) of plain, ``linear``, ``llama3`` or ``yarn`` RoPE scaling."""
    return rope_parameters(head_dim, theta, scaling, max_position_embeddings)[0]


def rope_parameters(head_dim: int, theta: float, scaling: dict | None,
                    max_position_embeddings: int = 2048) -> tuple[Tensor, float]:
    """(inverse frequencies [head_dim/2] float64, the factor cos and sin are multiplied by): 1 but for YaRN, whose
    attention factor (0.1 ln(factor) + 1, or mscale / mscale_all_dim, or attention_factor) scales them as
    transformers' and vLLM's YaRN rotary embeddings do (gpt-oss EAGLE-3 drafters use it)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    kind = None if not scaling else (scaling.get("rope_type") or scaling.get("type"))
    if kind in (None, "default"):
        return inv, 1.0
    if kind == "linear":
        return inv / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        # long wavelengths (low frequencies) are slowed by `factor`, short ones kept, the band between blended
        smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        return (1 - smooth) * inv / factor + smooth * inv, 1.0
    if kind == "yarn":
        return _yarn(inv, head_dim, theta, scaling, max_position_embeddings)
    raise CheckpointError(f"the drafter's RoPE scaling type {kind!r} is not supported for distillation or evaluation "
                          "(only default, linear, llama3, yarn)")


def _yarn(inv: Tensor, head_dim: int, theta: float, scaling: dict, max_position_embeddings: int
          ) -> tuple[Tensor, float]:
    """YaRN (Peng et al. 2023): frequencies above the beta_fast band kept, below beta_slow divided by ``factor``,
    a linear ramp between, over the original context length."""
    factor = float(scaling["factor"])
    original = float(scaling.get("original_max_position_embeddings") or max_position_embeddings)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def dim_of(rotations: float) -> float:  # the frequency index that turns `rotations` times over `original`
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(float(scaling.get("beta_fast") or 32)), dim_of(float(scaling.get("beta_slow") or 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0.0, 1.0)
    kept = 1 - ramp  # share of the original (extrapolated) frequency
    return inv / factor * (1 - kept) + inv * kept, float(attention)


def check_buildable(cfg: DrafterConfig) -> None:
    """Raise the one-line ``CheckpointError`` that building an :class:`Eagle3Drafter` for ``cfg`` would (RoPE
    scaling, activation), before any costly work (a target's download) is done for it."""
    rope_parameters(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
    activation(cfg)


def activation(cfg: DrafterConfig):
    """The MLP's activation function, or the one-line ``CheckpointError`` for one it does not know."""
    if cfg.hidden_act not in ACTIVATIONS:
        raise CheckpointError(f"the drafter's activation {cfg.hidden_act!r} is not supported "
                              f"(only {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[cfg.hidden_act]


def rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` [B, heads, T, hd] by angles given as cos/sin [B, T, hd] (HF half-split convention)."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def windowed(mask: Tensor, query_positions: Tensor, key_positions: Tensor, window: int | None) -> Tensor:
    """``mask`` [B or 1, T, S] narrowed to a sliding window over ``query_positions`` [B, T] and ``key_positions``
    [B or 1, S]: a query at position p keeps the keys at positions p - window + 1 .. p (``window`` keys, its own
    included: vLLM's window, as transformers' and speculators'); ``mask`` itself for ``window`` None."""
    if window is None:
        return mask
    distance = query_positions.unsqueeze(-1) - key_positions.unsqueeze(-2)
    return mask & (distance < window)


# ----------------------------------------------------------------------------------------------- layer


class Eagle3Attention(nn.Module):
    """Attention over the 2H-wide input of the EAGLE-3 layer (``width`` H in later layers); GQA, explicit
    head_dim, optional Qwen3 q/k norms, a (k, v) cache."""

    def __init__(self, cfg: DrafterConfig, width: int | None = None) -> None:
        super().__init__()
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ValueError(f"{cfg.num_attention_heads} heads do not share {cfg.num_key_value_heads} kv heads")
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h2 = 2 * cfg.hidden_size if width is None else width
        self.qk_norm = cfg.model_type == "qwen3"
        bias = cfg.attention_bias  # vLLM: q/k/v biases in every style, o_proj's in Llama-style layers only
        self.q_proj = nn.Linear(h2, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h2, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h2, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias and not self.qk_norm)
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, past: KVCache | None,
                mask: Tensor) -> tuple[Tensor, KVCache]:
        """``mask`` is boolean [B or 1, T, S] (True = may attend), S = cached + new keys."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim)
        if self.qk_norm:  # Qwen3: per-head RMSNorm over head_dim, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        rep = self.heads // self.kv_heads
        out = F.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), attn_mask=mask.unsqueeze(1)
        )
        out = out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        return self.o_proj(out), (k, v)


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.act = activation(cfg)  # the RoPE check is the drafter's own (once, not per layer)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """The EAGLE-3 decoder layer over [embedding, hidden] (canonical prefix ``midlayer.``)."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.self_attn = Eagle3Attention(cfg)
        self.mlp = Eagle3MLP(cfg)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, emb: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor, past: KVCache | None,
                mask: Tensor) -> tuple[Tensor, KVCache]:
        normed = self.hidden_norm(hidden)
        # vLLM llama_eagle3.py: norm_before_residual -> the residual is the normed hidden, else the raw one
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(emb), normed], dim=-1)
        attn, kv = self.self_attn(x, cos, sin, past, mask)
        h = residual + attn
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, kv


class Eagle3DecoderLayer(nn.Module):
    """A later decoder layer (``layers.{i}.``, i >= 1): a plain pre-norm Llama/Qwen3 layer over the hidden state
    alone, as speculators trains and vLLM serves multi-layer EAGLE-3 drafters."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg, width=cfg.hidden_size)
        self.mlp = Eagle3MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, past: KVCache | None,
                mask: Tensor) -> tuple[Tensor, KVCache]:
        attn, kv = self.self_attn(self.input_layernorm(x), cos, sin, past, mask)
        h = x + attn
        return h + self.mlp(self.post_attention_layernorm(h)), kv


# ----------------------------------------------------------------------------------------------- model


class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter: ``combine`` (fc), the decoder layer(s) (``forward``), ``logits``, and the TTT unroll."""

    def __init__(self, config: DrafterConfig, head: Head | None = None, embed_weight: Tensor | None = None,
                 d2t: Tensor | None = None) -> None:
        super().__init__()
        cfg = config
        self.config = cfg
        n, ht = cfg.num_aux_hidden_states, cfg.target_hidden_size
        self.input_norm = RMSNorm(n * ht, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(ht, cfg.rms_norm_eps) for _ in range(n)) if cfg.fc_norm else None
        self.fc = nn.Linear(n * ht, cfg.hidden_size, bias=False)
        if cfg.parallel_token_id is not None:  # P-EAGLE: the masked slots' stand-in for the target features
            self.mask_hidden = nn.Parameter(torch.zeros(1, n * ht))
        self.midlayer = Eagle3Layer(cfg)
        # layers 1, 2, ... of a multi-layer drafter (state-dict names layers.{i}.*, as vLLM's); empty for one layer
        self.layers = nn.ModuleDict({str(i): Eagle3DecoderLayer(cfg) for i in range(1, cfg.num_layers)})
        self.attention_windows = [cfg.attention_window(i) for i in range(cfg.num_layers)]  # None: full attention
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head: Head | None = head if head is not None else FullHead.empty(cfg.draft_vocab_size, cfg.hidden_size)
        if self.lm_head is not None:
            up, down = self.lm_head.weight_up, self.lm_head.weight_down
            width = up.shape[1] if down is None else down.shape[1]
            if up.shape[0] != cfg.draft_vocab_size or width != cfg.hidden_size:
                raise ValueError(f"head maps {width} -> {up.shape[0]}, config needs {cfg.hidden_size} -> "
                                 f"{cfg.draft_vocab_size}")
        # float64, not a buffer: model.to(bfloat16) must not round the frequencies
        self._inv_freq, self._rope_scale = rope_parameters(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                                           cfg.max_position_embeddings)
        self._inv_freq_on: dict[tuple[torch.device, torch.dtype], Tensor] = {}  # its copies per (device, dtype)
        self._embed_in_checkpoint = False
        self.register_buffer("embed_weight", None, persistent=False)
        if embed_weight is not None:
            self.set_embedding(embed_weight)
        self.register_buffer("d2t", None if d2t is None else d2t.long().clone())

    # -------------------------------------------------------------------------------- building, saving

    @classmethod
    def from_checkpoint(cls, ckpt: DrafterCheckpoint, embed_weight: Tensor | None = None,
                        dtype: torch.dtype = torch.float32, head: Head | None = None) -> Eagle3Drafter:
        """Build from a canonical checkpoint. The embedding is ``embed_weight`` (the target's) unless the
        checkpoint carries ``embed_tokens.weight``; ``head`` overrides the checkpoint's head (needed for
        drafters that share the target's head and carry none)."""
        t = ckpt.tensors
        if head is None:
            head = head_from_tensors(t, ckpt.shortlist)
            if head is None:
                raise ValueError("the checkpoint has no lm_head.weight: pass head= (e.g. the target's, as FullHead)")
        embed = t.get("embed_tokens.weight", embed_weight)
        model = cls(ckpt.config, head=head, embed_weight=embed, d2t=t.get("d2t"))
        own = {k: v for k, v in t.items() if not k.startswith("lm_head") and k not in
               ("d2t", "t2d", "embed_tokens.weight")}
        state = {k: v for k, v in model.state_dict().items() if not k.startswith("lm_head.") and k != "d2t"}
        if set(own) != set(state):
            raise ValueError(f"checkpoint tensors do not match its config (fc_norm, norm_before_fc, model_type): "
                             f"{sorted(set(own) - set(state))} unexpected, {sorted(set(state) - set(own))} missing")
        with torch.no_grad():
            for name, tensor in own.items():
                if tuple(state[name].shape) != tuple(tensor.shape):
                    raise ValueError(f"{name}: checkpoint {list(tensor.shape)} vs model {list(state[name].shape)}")
                state[name].copy_(tensor)
        model._embed_in_checkpoint = "embed_tokens.weight" in t
        return model.to(dtype)

    def set_embedding(self, weight: Tensor) -> None:
        """Use ``weight`` [V, H] (the target's token embedding) as the frozen embedding; shared, not copied,
        when its dtype and device already fit (it is never written to)."""
        if tuple(weight.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(f"embedding {list(weight.shape)} is not [vocab {self.config.vocab_size}, "
                             f"hidden {self.config.hidden_size}]")
        ref = self.fc.weight
        self.embed_weight = weight.detach().to(device=ref.device, dtype=ref.dtype)

    def canonical_state_dict(self, with_embedding: bool | None = None, with_t2d: bool = False) -> dict[str, Tensor]:
        """Tensors under canonical names (see ``checkpoint/drafter.py``); round-trips with ``from_checkpoint``.

        ``embed_tokens.weight`` is included when the checkpoint carried it (or ``with_embedding``); the boolean
        ``t2d`` mask (derived from ``d2t``) only on request."""
        out = {k: v for k, v in self.state_dict().items() if not k.startswith("lm_head.") and k != "d2t"}
        if self.lm_head is not None:
            out.update(self.lm_head.canonical_tensors())
        if self.d2t is not None:
            out["d2t"] = self.d2t
            if with_t2d:
                t2d = torch.zeros(self.config.vocab_size, dtype=torch.bool, device=self.d2t.device)
                t2d[self.draft_to_target(torch.arange(self.d2t.numel(), device=self.d2t.device))] = True
                out["t2d"] = t2d
        if with_embedding is None:
            with_embedding = getattr(self, "_embed_in_checkpoint", False)
        if with_embedding and self.embed_weight is not None:
            out["embed_tokens.weight"] = self.embed_weight
        return {k: v.detach() for k, v in out.items()}

    def draft_to_target(self, ids: Tensor) -> Tensor:
        """Target token ids of draft token ids: ``ids + d2t[ids]`` (identity without d2t)."""
        return ids if self.d2t is None else ids + self.d2t[ids]

    # ------------------------------------------------------------------------------------------ forward

    def embed(self, input_ids: Tensor) -> Tensor:
        if self.embed_weight is None:
            raise ValueError("no token embedding: pass embed_weight (the target's) or inputs_embeds")
        return F.embedding(input_ids, self.embed_weight)

    def combine(self, aux: Tensor) -> Tensor:
        """Target features ``aux`` [B, T, n*Ht] -> ``g`` [B, T, H]: input_norm / per-chunk fc_norm, then fc."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(aux)

    @property
    def is_parallel(self) -> bool:
        """A P-EAGLE drafter (see the module docstring)."""
        return self.config.parallel_token_id is not None

    def masked_slots(self, b: int, t: int) -> tuple[Tensor, Tensor]:
        """(embeddings, hidden) [B, T, H] of P-EAGLE masked slots: the mask token's embedding, combine(mask_hidden)."""
        if not self.is_parallel:
            raise ValueError("this drafter has no masked slots (not a P-EAGLE drafter)")
        token = torch.full((b, t), self.config.parallel_token_id, dtype=torch.long, device=self.fc.weight.device)
        return self.embed(token), self.combine(self.mask_hidden).expand(b, t, -1)

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [B, T, head_dim] for integer ``positions`` [B, T]; angles in float32 (as HF and vLLM) or
        float64 for a float64 model."""
        dtype = self.fc.weight.dtype
        exact = torch.promote_types(dtype, torch.float32)
        key = (positions.device, exact)
        if key not in self._inv_freq_on:  # once per device: a host-to-GPU copy each step would stall the GPU queue
            self._inv_freq_on[key] = self._inv_freq.to(device=positions.device, dtype=exact)
        inv_freq = self._inv_freq_on[key]
        angles = positions.to(exact).unsqueeze(-1) * inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        if self._rope_scale != 1.0:  # YaRN's attention factor
            return (angles.cos() * self._rope_scale).to(dtype), (angles.sin() * self._rope_scale).to(dtype)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, input_ids: Tensor | None = None, hidden: Tensor | None = None, positions: Tensor | None = None,
                past_key_values: KVCache | None = None, attention_mask: Tensor | None = None,
                inputs_embeds: Tensor | None = None, key_positions: Tensor | None = None) -> tuple[Tensor, KVCache]:
        """One pass of the decoder layer(s) over T new positions; returns (pre-norm h [B, T, H], new cache).

        ``hidden`` [B, T, H] is ``combine(aux)`` on step 0, or a previous step's output (see ``next_hidden``).
        ``positions`` [B, T] default to ``cached + arange(T)``. ``attention_mask``: boolean [B or 1, T, S]
        over S = cached + T keys (True = may attend); default causal with every cached key visible.
        ``key_positions`` [B or 1, S]: the positions of those keys, which a sliding-window layer's window counts
        over (default: the new keys at ``positions``, the cached ones at the positions just before the first).
        The returned cache holds the cached and the new keys/values (RoPE applied).
        """
        if hidden is None:
            raise ValueError("hidden is required")
        emb = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        b, t, _ = hidden.shape
        past_len = 0 if past_key_values is None else past_key_values[0].shape[2]
        if positions is None:
            positions = torch.arange(past_len, past_len + t, device=hidden.device).expand(b, t)
        if attention_mask is None:
            q = torch.arange(t, device=hidden.device).unsqueeze(1) + past_len
            attention_mask = (torch.arange(past_len + t, device=hidden.device).unsqueeze(0) <= q).unsqueeze(0)
        masks = [attention_mask] * len(self.attention_windows)
        if any(w is not None for w in self.attention_windows):
            if key_positions is None:  # the new keys at their positions, the cached ones just before the first
                cached = positions[:, :1] - past_len + torch.arange(past_len, device=hidden.device)
                key_positions = torch.cat([cached, positions], dim=1)
            masks = [windowed(attention_mask, positions, key_positions, w) for w in self.attention_windows]
        cos, sin = self.rope(positions)
        kv = self.config.num_key_value_heads
        past = [None if past_key_values is None else
                (past_key_values[0][:, i * kv:(i + 1) * kv], past_key_values[1][:, i * kv:(i + 1) * kv])
                for i in range(1 + len(self.layers))]
        h, cache = self.midlayer(emb, hidden, cos, sin, past[0], masks[0])
        if not self.layers:
            return h, cache
        caches = [cache]
        for i, layer in enumerate(self.layers.values(), start=1):
            h, cache = layer(h, cos, sin, past[i], masks[i])
            caches.append(cache)
        return h, (torch.cat([c[0] for c in caches], dim=1), torch.cat([c[1] for c in caches], dim=1))

    def normed(self, h: Tensor) -> Tensor:
        """The final norm of a pre-norm output."""
        return self.norm(h)

    def logits(self, h: Tensor) -> Tensor:
        """Draft-vocab logits ``head(norm(h))`` of pre-norm outputs ``h``."""
        if self.lm_head is None:
            raise ValueError("this drafter has no head")
        return self.lm_head(self.norm(h))

    def draft_ids(self, h: Tensor) -> Tensor:
        """Greedy draft-vocab ids of pre-norm outputs ``h``: the head's ``greedy`` (a screen's exact argmax over its
        shortlist, which the argmax of its two-level logits may miss)."""
        if self.lm_head is None:
            raise ValueError("this drafter has no head")
        return self.lm_head.greedy(self.norm(h))

    def next_hidden(self, h: Tensor) -> Tensor:
        """What the next draft step takes as ``hidden``: the pre-norm ``h``, or ``norm(h)`` if ``norm_output``
        (the EAGLE 3.1 variant, as speculators and vLLM read that flag)."""
        return self.norm(h) if self.config.norm_output else h

    def ttt_forward(self, input_ids: Tensor, aux: Tensor, steps: int, positions: Tensor | None = None,
                    inputs_embeds: Tensor | None = None) -> list[Tensor]:
        """Training-time-test unroll: ``steps`` pre-norm outputs, each [B, T, H].

        ``input_ids`` [B, T+steps] are the tokens x_0..x_{T+steps-1}; ``aux`` [B, T, n*Ht] the target
        features f_0..f_{T-1} (``inputs_embeds`` [B, T+steps, H] may replace the ids).

        Step 0 at position t: hidden ``combine(f_t)``, token x_{t+1}, RoPE position t (``positions``, default
        0..T-1). Step i >= 1: hidden ``next_hidden`` of step i-1 at t, token x_{t+1+i}, RoPE position t+i.
        Step i at position t predicts **x_{t+2+i}** (its teacher is the target's distribution at t+1+i).
        Step i's query at t attends causally to step-0 keys at positions <= t plus the keys of steps 1..i at
        position t only -- exactly what a cached draft chain at inference sees; a sliding-window layer keeps those
        within its window of the query's RoPE position t+i, counting each key at its own (step j's at t+j), as vLLM's
        cache holds them. A P-EAGLE drafter's steps i >= 1 are its masked slots instead (token and hidden from
        ``masked_slots``, same positions and mask): what one parallel draft pass at inference sees.
        """
        emb = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        b, t, _ = aux.shape
        if emb.shape[1] < t + steps:
            raise ValueError(f"need T+steps = {t + steps} tokens for {steps} steps over T={t}, got {emb.shape[1]}")
        if positions is None:
            positions = torch.arange(t, device=aux.device).expand(b, t)
        idx = torch.arange(t, device=aux.device)
        causal = idx.unsqueeze(0) <= idx.unsqueeze(1)  # [T query, T key]
        diag = idx.unsqueeze(0) == idx.unsqueeze(1)
        hidden = self.combine(aux)
        cache: KVCache | None = None
        outputs: list[Tensor] = []
        slots = self.masked_slots(b, t) if self.is_parallel and steps > 1 else None
        for i in range(steps):
            mask = torch.cat([causal] + [diag] * i, dim=1).unsqueeze(0)  # [1, T, (i+1)T]
            step_emb = emb[:, 1 + i:1 + i + t] if i == 0 or slots is None else slots[0]
            keys = torch.cat([positions + j for j in range(i + 1)], dim=1)  # each key at its RoPE position
            h, cache = self.forward(inputs_embeds=step_emb, hidden=hidden, positions=positions + i,
                                    past_key_values=cache, attention_mask=mask, key_positions=keys)
            outputs.append(h)
            hidden = self.next_hidden(h) if slots is None else slots[1]
        return outputs


def drafter_model(ckpt: DrafterCheckpoint, target: TargetParts) -> Eagle3Drafter:
    """Our torch drafter for a checkpoint, with the target's embedding (and head, if it has none)."""
    head = None if ckpt.has_head else FullHead(target.head.clone())
    return Eagle3Drafter.from_checkpoint(ckpt, embed_weight=target.embedding, head=head)
