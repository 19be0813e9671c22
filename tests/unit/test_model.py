"""The plain-PyTorch EAGLE-3 drafter: loading, saving, heads, the layer's maths, and the TTT unroll."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from slimspec.checkpoint import load_drafter
from slimspec.checkpoint.drafter import DrafterCheckpoint, DrafterConfig
from slimspec.errors import CheckpointError
from slimspec.model import Eagle3Drafter, FullHead, LowRankHead, rope_inv_freq
from tests.layouts import LAYOUTS, Spec, write_drafter

VARIANTS = {
    "plain": Spec(),
    "qwen3-headdim": Spec(qwen3=True, head_dim=12),
    "fc_norm": Spec(fc_norm=True),
    "norm_before_fc": Spec(norm_before_fc=True, kv_heads=1, extra_config={"norm_before_fc": True}),
}


def _config(**kw) -> DrafterConfig:
    base = dict(hidden_size=22, num_attention_heads=3, num_key_value_heads=1, head_dim=10, intermediate_size=17,
                target_hidden_size=14, vocab_size=53, draft_vocab_size=53, rms_norm_eps=1e-5, rope_theta=10000.0)
    base.update(kw)
    return DrafterConfig(**base)


def _random_drafter(cfg: DrafterConfig, seed: int = 0, dtype: torch.dtype = torch.float64) -> Eagle3Drafter:
    """A drafter whose every weight (norms included) is random, so no term can hide behind a 1 or a 0."""
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    model = Eagle3Drafter(cfg, embed_weight=embed).to(dtype)
    with torch.no_grad():
        for p in model.parameters():  # norms around 1, matrices around 0
            p.copy_((p.dim() == 1) + 0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype))
    return model


def _inputs(cfg: DrafterConfig, b: int, t: int, extra: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (b, t + extra), generator=g)
    aux = torch.randn(b, t, cfg.num_aux_hidden_states * cfg.target_hidden_size, generator=g, dtype=torch.float64)
    return ids, aux


# -------------------------------------------------------------------------------------- loading, saving


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_loads_and_runs(tmp_path, layout, variant):
    """Catches a layout/variant whose canonical tensors do not fit the module (names, shapes, q/k norms,
    fc_norm, input_norm, explicit head_dim, GQA)."""
    spec = VARIANTS[variant]
    write_drafter(tmp_path / "d", layout, spec)
    ckpt = load_drafter(tmp_path / "d")
    embed = torch.randn(ckpt.config.vocab_size, ckpt.config.hidden_size)
    model = Eagle3Drafter.from_checkpoint(ckpt, embed_weight=embed)
    ids, aux = _inputs(ckpt.config, 2, 5, 2)
    hs = model.ttt_forward(ids, aux.float(), steps=2)
    assert [tuple(h.shape) for h in hs] == [(2, 5, spec.hidden)] * 2
    logits = model.logits(hs[-1])
    assert logits.shape == (2, 5, ckpt.config.draft_vocab_size) and torch.isfinite(logits).all()
    assert model.config.norm_before_residual == (layout == "speculators")


def test_tensor_without_its_config_flag_is_ignored_like_vllm(tmp_path):
    """Catches input_norm.weight being used when the config does not say norm_before_fc: vLLM follows the
    flag and ignores the tensor, so we drop it (and say so) to compute what vLLM computes."""
    write_drafter(tmp_path / "d", "eagle", Spec(norm_before_fc=True))
    ckpt = load_drafter(tmp_path / "d")
    assert not ckpt.config.norm_before_fc
    assert "input_norm.weight" in ckpt.dropped and "input_norm.weight" not in ckpt.tensors
    model = Eagle3Drafter.from_checkpoint(ckpt, embed_weight=torch.randn(301, 32))
    assert model.input_norm is None


def test_headless_drafter_takes_the_targets_head(tmp_path):
    """Catches a ModelOpt-style drafter without lm_head silently getting a random head."""
    write_drafter(tmp_path / "d", "modelopt", Spec(no_head=True, draft_vocab=None))
    ckpt = load_drafter(tmp_path / "d")
    with pytest.raises(ValueError, match="no lm_head"):
        Eagle3Drafter.from_checkpoint(ckpt)
    target_head = torch.randn(301, 32)
    model = Eagle3Drafter.from_checkpoint(ckpt, embed_weight=torch.randn(301, 32), head=FullHead(target_head))
    assert torch.equal(model.lm_head.weight, target_head)


@pytest.mark.parametrize("lowrank", [False, True])
def test_canonical_state_dict_round_trip(tmp_path, lowrank):
    """Catches a tensor lost, renamed or altered between a checkpoint and the module (incl. W_up/W_down, d2t, a
    second decoder layer)."""
    write_drafter(tmp_path / "d", "speculators", Spec(qwen3=True, fc_norm=True, layers=2))
    ckpt = load_drafter(tmp_path / "d")
    assert "layers.1.self_attn.q_norm.weight" in ckpt.tensors
    if lowrank:
        ckpt.tensors["lm_head.weight"] = torch.randn(97, 5)
        ckpt.tensors["lm_head_down.weight"] = torch.randn(5, 32)
    model = Eagle3Drafter.from_checkpoint(ckpt, embed_weight=torch.randn(301, 32))
    assert isinstance(model.lm_head, LowRankHead if lowrank else FullHead)
    state = model.canonical_state_dict()
    expected = {k: v for k, v in ckpt.tensors.items() if k != "t2d"}
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
    t2d = model.canonical_state_dict(with_t2d=True)["t2d"]
    assert torch.equal(t2d, ckpt.tensors["t2d"])

    again = Eagle3Drafter.from_checkpoint(dataclasses.replace(ckpt, tensors=state), embed_weight=model.embed_weight)
    ids, aux = _inputs(ckpt.config, 1, 4, 2)
    h1, h2 = model.ttt_forward(ids, aux.float(), 2), again.ttt_forward(ids, aux.float(), 2)
    assert torch.equal(model.logits(h1[1]), again.logits(h2[1]))


def test_checkpoint_embedding_wins_and_missing_embedding_is_loud(tmp_path):
    """Catches a drafter that ships its own embed_tokens being run with the target's (or with none)."""
    write_drafter(tmp_path / "d", "eagle", Spec())
    ckpt = load_drafter(tmp_path / "d")
    bare = Eagle3Drafter.from_checkpoint(ckpt)
    ids, aux = _inputs(ckpt.config, 1, 3, 1)
    with pytest.raises(ValueError, match="embedding"):
        bare.ttt_forward(ids, aux.float(), 1)
    own = torch.randn(301, 32)
    ckpt.tensors["embed_tokens.weight"] = own
    model = Eagle3Drafter.from_checkpoint(ckpt, embed_weight=torch.zeros(301, 32))
    assert torch.equal(model.embed_weight, own)
    assert torch.equal(model.canonical_state_dict()["embed_tokens.weight"], own)
    assert "embed_weight" not in model.state_dict()  # the target's 128K x d table is never saved by accident


def test_dtype_and_frozen_embedding(tmp_path):
    """Catches bf16 loading rounding the RoPE frequencies, d2t losing its integer type, or the frozen target
    embedding receiving gradients while fc and the head do."""
    write_drafter(tmp_path / "d", "eagle", Spec())
    ckpt = load_drafter(tmp_path / "d")
    embed = torch.randn(301, 32)
    model = Eagle3Drafter.from_checkpoint(ckpt, embed_weight=embed, dtype=torch.bfloat16)
    assert model.fc.weight.dtype == torch.bfloat16 and model.d2t.dtype == torch.long
    assert model._inv_freq.dtype == torch.float64
    ids, aux = _inputs(ckpt.config, 1, 4, 2)
    assert model.ttt_forward(ids, aux.bfloat16(), 2)[1].dtype == torch.bfloat16

    model = Eagle3Drafter.from_checkpoint(ckpt, embed_weight=embed)
    loss = sum(model.logits(h).logsumexp(-1).sum() for h in model.ttt_forward(ids, aux.float(), 2))
    loss.backward()
    assert model.fc.weight.grad is not None and model.lm_head.weight.grad is not None
    assert not model.embed_weight.requires_grad and model.embed_weight.grad is None


def test_draft_to_target(tmp_path):
    """Catches d2t read as absolute ids instead of offsets (target id = i + d2t[i])."""
    written = write_drafter(tmp_path / "d", "modelopt", Spec())
    model = Eagle3Drafter.from_checkpoint(load_drafter(tmp_path / "d"), embed_weight=torch.randn(301, 32))
    ids = torch.tensor([[0, 5, 96]])
    assert torch.equal(model.draft_to_target(ids), ids + written["d2t"][ids])
    full = Eagle3Drafter(_config())
    assert torch.equal(full.draft_to_target(ids), ids)


# ---------------------------------------------------------------------------------------------- heads


def test_lowrank_head_equals_product_head():
    """Catches W_up/W_down swapped or transposed: the low-rank head's logits are those of W = W_up @ W_down."""
    g = torch.Generator().manual_seed(0)
    up = torch.randn(41, 6, generator=g, dtype=torch.float64)
    down = torch.randn(6, 22, generator=g, dtype=torch.float64)
    h = torch.randn(2, 3, 22, generator=g, dtype=torch.float64)
    low, full = LowRankHead(up, down), FullHead(up @ down)
    torch.testing.assert_close(low(h), full(h), rtol=1e-12, atol=1e-12)
    assert low.rank == 6 and torch.equal(low.weight_up, up) and torch.equal(low.weight_down, down)
    assert set(low.canonical_tensors()) == {"lm_head.weight", "lm_head_down.weight"}

    cfg = _config(draft_vocab_size=41)
    model = _random_drafter(cfg)
    h = torch.randn(2, 3, 22, dtype=torch.float64)
    model.lm_head = low
    a = model.logits(h)
    model.lm_head = full
    torch.testing.assert_close(a, model.logits(h), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError):
        Eagle3Drafter(cfg, head=LowRankHead(torch.randn(40, 6), torch.randn(6, 22)))


# ---------------------------------------------------------------------------------- the layer by hand


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _rope_by_hand(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, hd]: pair (j, j + hd/2) rotated by angle pos * inv_freq[j] (Llama's convention)."""
    half = x.shape[-1] // 2
    ang = pos[:, :, None, None].double() * inv_freq
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], dim=-1)


def _attention_by_hand(attn, x: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor,
                       cfg: DrafterConfig) -> torch.Tensor:
    """A layer's attention in float64, written out: softmax(QK^T/sqrt(hd) + mask)V with explicit GQA, then o_proj."""
    eps, hd, nh, nkv = cfg.rms_norm_eps, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    b, t, _ = x.shape
    q = (x @ attn.q_proj.weight.T).view(b, t, nh, hd)
    k = (x @ attn.k_proj.weight.T).view(b, t, nkv, hd)
    v = (x @ attn.v_proj.weight.T).view(b, t, nkv, hd)
    if cfg.model_type == "qwen3":
        q, k = _rms(q, attn.q_norm.weight, eps), _rms(k, attn.k_norm.weight, eps)
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    q, k = _rope_by_hand(q, pos, inv_freq), _rope_by_hand(k, pos, inv_freq)
    out = torch.zeros(b, t, nh, hd, dtype=torch.float64)
    for head in range(nh):
        kv = head // (nh // nkv)  # query heads are grouped over kv heads in order
        scores = q[:, :, head] @ k[:, :, kv].transpose(1, 2) / math.sqrt(hd)
        scores = scores + torch.where(allowed, 0.0, float("-inf"))
        out[:, :, head] = torch.softmax(scores, dim=-1) @ v[:, :, kv]
    return out.reshape(b, t, nh * hd) @ attn.o_proj.weight.T


def _mlp_by_hand(layer, h: torch.Tensor, eps: float) -> torch.Tensor:
    """h + SwiGLU MLP of post_attention_layernorm(h)."""
    m, hn = layer.mlp, _rms(h, layer.post_attention_layernorm.weight, eps)
    return h + (torch.nn.functional.silu(hn @ m.gate_proj.weight.T) * (hn @ m.up_proj.weight.T)) @ m.down_proj.weight.T


def _layer_by_hand(model: Eagle3Drafter, ids: torch.Tensor, g: torch.Tensor, pos: torch.Tensor,
                   allowed: torch.Tensor) -> torch.Tensor:
    """The EAGLE-3 layer in float64: attention over [norm(embedding), hidden_norm(g)], residual g or its norm."""
    cfg, L = model.config, model.midlayer
    gn = _rms(g, L.hidden_norm.weight, cfg.rms_norm_eps)
    x = torch.cat([_rms(model.embed_weight[ids], L.input_layernorm.weight, cfg.rms_norm_eps), gn], dim=-1)
    h = (gn if cfg.norm_before_residual else g) + _attention_by_hand(L.self_attn, x, pos, allowed, cfg)
    return _mlp_by_hand(L, h, cfg.rms_norm_eps)


@pytest.mark.parametrize("heads", [(3, 1), (6, 2)])
@pytest.mark.parametrize("qwen3", [False, True])
@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_layer_matches_float64_hand_reference(qwen3, norm_before_residual, heads):
    """Catches errors in the layer's maths at odd shapes (3 heads on 1 kv head or 6 on 2, head_dim 10, T=7):
    embedding/hidden order, which residual, q/k-norm placement, RoPE convention, GQA grouping, scaling, mask."""
    cfg = _config(model_type="qwen3" if qwen3 else "llama", norm_before_residual=norm_before_residual,
                  num_attention_heads=heads[0], num_key_value_heads=heads[1])
    model = _random_drafter(cfg)
    ids, aux = _inputs(cfg, 2, 7, 0)
    g = model.combine(aux)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [3, 4, 5, 6, 7, 8, 9]])
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    with torch.no_grad():
        h, (k, v) = model(ids, g, pos)
        ref = _layer_by_hand(model, ids, g, pos, causal)
    torch.testing.assert_close(h, ref, rtol=1e-10, atol=1e-10)
    assert k.shape == (2, heads[1], 7, 10) and v.shape == (2, heads[1], 7, 10)

    # an arbitrary (non-causal) mask is honoured too
    allowed = torch.rand(2, 7, 7, generator=torch.Generator().manual_seed(3)) < 0.6
    allowed |= torch.eye(7, dtype=torch.bool)
    with torch.no_grad():
        h, _ = model(ids, g, pos, attention_mask=allowed)
    torch.testing.assert_close(h, _layer_by_hand(model, ids, g, pos, allowed), rtol=1e-10,
                               atol=1e-10)


def _later_layer_by_hand(layer, x: torch.Tensor, pos: torch.Tensor, cfg: DrafterConfig) -> torch.Tensor:
    """A later decoder layer in float64: x + attn(norm(x)), then + mlp(norm(.)), causal."""
    causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
    h = x + _attention_by_hand(layer.self_attn, _rms(x, layer.input_layernorm.weight, cfg.rms_norm_eps), pos,
                               causal, cfg)
    return _mlp_by_hand(layer, h, cfg.rms_norm_eps)


@pytest.mark.parametrize("qwen3", [False, True])
def test_multi_layer_drafter_matches_float64_hand_reference(qwen3):
    """Catches a later decoder layer (layers.{i}, over the hidden state alone) wired wrong: its input (the previous
    layer's full output), its residuals and norms, its attention width, and its own slice of the KV cache."""
    cfg = _config(model_type="qwen3" if qwen3 else "llama", num_layers=3, num_attention_heads=6,
                  num_key_value_heads=2)
    model = _random_drafter(cfg)
    ids, aux = _inputs(cfg, 2, 7, 0)
    g = model.combine(aux)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [3, 4, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        h, (k, v) = model(ids, g, pos)
        ref = _layer_by_hand(model, ids, g, pos, torch.ones(7, 7, dtype=torch.bool).tril())
        for name in ("1", "2"):
            ref = _later_layer_by_hand(model.layers[name], ref, pos, cfg)
    torch.testing.assert_close(h, ref, rtol=1e-10, atol=1e-10)
    assert k.shape == (2, 3 * 2, 7, 10) and v.shape == (2, 3 * 2, 7, 10)
    assert set(model.canonical_state_dict()) >= {"layers.1.mlp.down_proj.weight", "layers.2.input_layernorm.weight"}
    assert not any(name.startswith("layers.1.hidden_norm") for name in model.state_dict())


def test_combine_norms_by_hand():
    """Catches fc_norm applied to the wrong chunks, input_norm over the wrong width, or fc before the norms."""
    for kw in ({"fc_norm": True}, {"norm_before_fc": True}, {}):
        cfg = _config(**kw)
        model = _random_drafter(cfg)
        _, aux = _inputs(cfg, 2, 3, 0)
        x = aux
        if cfg.norm_before_fc:
            x = _rms(x, model.input_norm.weight, cfg.rms_norm_eps)
        if cfg.fc_norm:
            chunks = zip(x.split(14, -1), model.fc_norm, strict=True)
            x = torch.cat([_rms(c, n.weight, cfg.rms_norm_eps) for c, n in chunks], -1)
        torch.testing.assert_close(model.combine(aux), x @ model.fc.weight.T, rtol=1e-12, atol=1e-12)


def test_logits_and_norm_output():
    """Catches logits taken from the pre-norm hidden, or norm_output not changing what is fed back."""
    cfg = _config()
    model = _random_drafter(cfg)
    h = torch.randn(1, 2, 22, dtype=torch.float64)
    normed = _rms(h, model.norm.weight, cfg.rms_norm_eps)
    torch.testing.assert_close(model.normed(h), normed)
    torch.testing.assert_close(model.logits(h), normed @ model.lm_head.weight.T)
    assert torch.equal(model.next_hidden(h), h)
    model.config.norm_output = True
    torch.testing.assert_close(model.next_hidden(h), normed)


# ------------------------------------------------------------------------------------------------ RoPE


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 512},
    {"type": "llama3", "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
     "original_max_position_embeddings": 8192},
])
def test_rope_frequencies_match_transformers(scaling):
    """Catches a wrong RoPE scaling formula (llama3's blended band especially); transformers is the reference."""
    params = {"rope_type": "default", **(scaling or {}), "rope_theta": 500000.0}
    params["rope_type"] = params.pop("type", params["rope_type"])
    hf = LlamaConfig(hidden_size=256, num_attention_heads=2, head_dim=128, rope_parameters=params)
    ref, scale = ROPE_INIT_FUNCTIONS.get(params["rope_type"], lambda c, d: (
        1.0 / 500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128), 1.0))(hf, "cpu")
    assert scale == 1.0
    torch.testing.assert_close(rope_inv_freq(128, 500000.0, scaling).float(), ref.float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("scaling", [
    # gpt-oss EAGLE-3 drafters' setting
    {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
     "original_max_position_embeddings": 4096},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},  # defaults, truncated range
    {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 16,
     "original_max_position_embeddings": 4096},
    {"rope_type": "yarn", "factor": 8.0, "attention_factor": 1.3, "original_max_position_embeddings": 1024},
])
def test_yarn_matches_transformers(scaling):
    """Catches a wrong YaRN ramp (correction range, truncation, beta defaults) or attention factor (mscale
    variants): transformers' YaRN is the reference for both the frequencies and the factor cos/sin carry."""
    from slimspec.model import rope_parameters

    params = {**scaling, "rope_theta": 150000.0}
    hf = LlamaConfig(hidden_size=512, num_attention_heads=4, head_dim=64, max_position_embeddings=131072,
                     rope_parameters=params)
    ref, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    inv, ours = rope_parameters(64, 150000.0, scaling, 131072)
    torch.testing.assert_close(inv.float(), ref.float(), rtol=1e-6, atol=0)
    assert ours == pytest.approx(factor, rel=1e-12) and (ours != 1.0)


def test_unsupported_rope_scaling_raises():
    """Catches a dynamic-NTK (or other unsupported) drafter silently run with plain RoPE, or refused with a
    traceback, not a one-line CheckpointError."""
    with pytest.raises(CheckpointError, match="RoPE scaling type 'dynamic' is not supported"):
        Eagle3Drafter(_config(rope_scaling={"rope_type": "dynamic", "factor": 4.0}))
    with pytest.raises(CheckpointError, match="activation 'tanh' is not supported"):
        Eagle3Drafter(_config(hidden_act="tanh"))


# ---------------------------------------------------------------------------------- cache and TTT


@pytest.mark.parametrize("layers", [1, 3])
def test_cached_prefill_in_chunks_equals_one_pass(layers):
    """Catches a KV cache that loses keys, repeats RoPE, masks cached positions, or hands one layer's cached
    keys to another."""
    cfg = _config(model_type="qwen3", num_layers=layers)
    model = _random_drafter(cfg)
    ids, aux = _inputs(cfg, 2, 9, 0)
    g = model.combine(aux)
    with torch.no_grad():
        full, _ = model(ids, g)
        a, cache = model(ids[:, :4], g[:, :4])
        b, cache = model(ids[:, 4:8], g[:, 4:8], past_key_values=cache)
        c, cache = model(ids[:, 8:], g[:, 8:], past_key_values=cache)
    torch.testing.assert_close(torch.cat([a, b, c], 1), full, rtol=1e-12, atol=1e-12)
    assert cache[0].shape[1:3] == (layers * cfg.num_key_value_heads, 9)


@pytest.mark.parametrize("variant", [
    {},
    {"norm_output": True},
    {"norm_before_residual": True, "model_type": "qwen3", "fc_norm": True},
    {"num_layers": 2, "norm_output": True},
])
def test_ttt_step_equals_cached_draft_chain(variant):
    """Catches training and inference disagreeing: TTT step i at position t must equal the chain a speculative
    decoder runs -- prefill positions 0..t with step-0 inputs, then feed each output back one token at a time
    through the KV cache (token x_{t+1+i} at position t+i). A wrong TTT mask, token shift, RoPE offset or
    feedback (pre-norm vs norm_output) all break it."""
    cfg = _config(**variant)
    model = _random_drafter(cfg)
    T, k = 6, 3
    ids, aux = _inputs(cfg, 1, T, k)
    with torch.no_grad():
        ttt = model.ttt_forward(ids, aux, k)
        g = model.combine(aux)
        for t in range(T):
            h, cache = model(ids[:, 1:t + 2], g[:, :t + 1], torch.arange(t + 1)[None])
            h = h[:, -1:]
            torch.testing.assert_close(h, ttt[0][:, t:t + 1], rtol=1e-10, atol=1e-10)
            for i in range(1, k):
                token = ids[:, t + 1 + i:t + 2 + i]
                h, cache = model(token, model.next_hidden(h), torch.tensor([[t + i]]), past_key_values=cache)
                torch.testing.assert_close(h, ttt[i][:, t:t + 1], rtol=1e-10, atol=1e-10,
                                           msg=f"step {i} position {t}")


@pytest.mark.parametrize("variant", [{}, {"num_layers": 2, "norm_output": True, "model_type": "qwen3"}])
def test_parallel_drafter_ttt_equals_one_parallel_pass(variant):
    """Catches a P-EAGLE drafter trained (or distilled) on other states than vLLM's parallel drafting serves: TTT
    step i at t must equal the output at position t+i of ONE causal pass over the real positions 0..t followed by
    i masked slots (token ``parallel_token_id``, hidden ``combine(mask_hidden)``, positions counting on), as vLLM's
    copy_and_expand_eagle_inputs lays them out. A chain's fed-back state or token, a slot position that does not
    count on, or a slot that sees a later slot all break it."""
    cfg = _config(parallel_token_id=7, **variant)
    model = _random_drafter(cfg)
    assert model.is_parallel and model.mask_hidden.shape == (1, 3 * cfg.target_hidden_size)
    T, k = 6, 3
    ids, aux = _inputs(cfg, 1, T, k)
    with torch.no_grad():
        ttt = model.ttt_forward(ids, aux, k)
        g = model.combine(aux)
        slot = model.combine(model.mask_hidden.to(torch.float64))[None]
        for t in range(T):
            tokens = torch.cat([ids[:, 1:t + 2], torch.full((1, k - 1), 7)], dim=1)
            hidden = torch.cat([g[:, :t + 1], slot.expand(1, k - 1, -1)], dim=1)
            h, _ = model(tokens, hidden)  # positions 0..t+k-1, causal
            for i in range(k):
                torch.testing.assert_close(ttt[i][:, t], h[:, t + i], rtol=1e-10, atol=1e-10,
                                           msg=f"step {i} position {t}")
        other = ids.clone()
        other[:, T + 1:] = (other[:, T + 1:] + 1) % cfg.vocab_size  # tokens only chain steps would read
        torch.testing.assert_close(model.ttt_forward(other, aux, k)[k - 1], ttt[k - 1], rtol=0, atol=0)


def test_ttt_alignment_each_step_sees_the_next_token():
    """Catches an off-by-one in the token shift: step i at position t must read token x_{t+1+i} and nothing
    later; changing x_j changes step i exactly at positions t >= j-1-i (attention carries it forward)."""
    cfg = _config()
    model = _random_drafter(cfg)
    T, k = 6, 3
    ids, aux = _inputs(cfg, 1, T, k)
    with torch.no_grad():
        base = model.ttt_forward(ids, aux, k)
        j = 4
        other = ids.clone()
        other[0, j] = (other[0, j] + 1) % cfg.vocab_size
        moved = model.ttt_forward(other, aux, k)
    for i in range(k):
        changed = (moved[i] - base[i]).abs().amax(-1)[0] > 0
        first = j - 1 - i
        assert not changed[:first].any(), f"step {i} read a future token"
        assert changed[first:].all(), f"step {i} at position {first} did not read x_{j}"


def test_ttt_batch_rows_are_independent_and_positions_relative():
    """Catches batch rows leaking into each other and a non-relative RoPE (a constant position offset, as
    speculators' 1-based training positions, must not change the outputs)."""
    cfg = _config(model_type="qwen3")
    model = _random_drafter(cfg)
    ids, aux = _inputs(cfg, 3, 5, 2)
    with torch.no_grad():
        batch = model.ttt_forward(ids, aux, 2)
        single = model.ttt_forward(ids[1:2], aux[1:2], 2)
        shifted = model.ttt_forward(ids, aux, 2, positions=torch.arange(5).expand(3, 5) + 1000)
    for i in range(2):
        torch.testing.assert_close(batch[i][1:2], single[i], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(batch[i], shifted[i], rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="tokens"):
        model.ttt_forward(ids[:, :6], aux, 2)


def test_checkpoint_of_random_drafter_round_trips_through_dataclass():
    """Catches canonical names drifting from what the checkpoint reader produces (fc_norm.{i}, input_norm, q/k
    norms all present)."""
    cfg = _config(model_type="qwen3", fc_norm=True, norm_before_fc=True, draft_vocab_size=11)
    model = _random_drafter(cfg, dtype=torch.float32)
    model.d2t = torch.arange(11) * 3
    state = model.canonical_state_dict()
    assert {"fc_norm.0.weight", "fc_norm.2.weight", "input_norm.weight", "midlayer.self_attn.q_norm.weight",
            "midlayer.self_attn.k_norm.weight", "d2t", "lm_head.weight"} <= set(state)
    ckpt = DrafterCheckpoint(layout="slimspec", config=cfg, tensors=state, source=None, files=[], raw_config={})
    again = Eagle3Drafter.from_checkpoint(ckpt, embed_weight=model.embed_weight)
    for name, tensor in again.canonical_state_dict().items():
        assert torch.equal(tensor, state[name]), name


def test_from_scratch_drafter_takes_the_targets_rope(tmp_path):
    """Catches a from-scratch drafter that reads only `rope_theta`/`rope_scaling`: transformers 5 targets write
    `rope_parameters` instead, and the drafter would run RoPE at 1e4 without the target's llama3 scaling."""
    import json
    from types import SimpleNamespace

    from slimspec.distill.scratch import scratch_config

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    base = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}
    (tmp_path / "config.json").write_text(json.dumps({**base, "rope_parameters": rope}))
    cfg = scratch_config(SimpleNamespace(path=tmp_path, head=torch.zeros(100, 64)), 10)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == {k: v for k, v in rope.items() if k != "rope_theta"}
    (tmp_path / "config.json").write_text(json.dumps({**base, "rope_theta": 1e5}))  # transformers 4 style
    cfg = scratch_config(SimpleNamespace(path=tmp_path, head=torch.zeros(100, 64)), 10)
    assert cfg.rope_theta == 1e5 and cfg.rope_scaling is None


def test_rope_frequencies_are_copied_once_per_device_and_dtype():
    """Catches the float64 RoPE frequencies copied to the positions' device on every forward: on a GPU each copy
    is a host-to-device transfer that waits for the queued kernels (a slower decoder, a drafter layer timed too
    slow in kappa); and catches a copy that ignores a change of the model's dtype."""
    model = _random_drafter(_config(), dtype=torch.float32)
    pos = torch.arange(5)[None]
    cos, sin = model.rope(pos)
    model.rope(pos + 1)
    assert list(model._inv_freq_on) == [(torch.device("cpu"), torch.float32)]
    angles = pos[0, :, None].double() * model._inv_freq
    assert torch.allclose(cos[0, :, : angles.shape[1]].double(), angles.cos(), atol=1e-6)
    model.rope(pos.to("meta"))
    model.to(torch.float64)
    cos64, _ = model.rope(pos)
    assert set(model._inv_freq_on) == {(torch.device("cpu"), torch.float32), (torch.device("meta"), torch.float32),
                                       (torch.device("cpu"), torch.float64)}
    assert cos64.dtype == torch.float64 and torch.allclose(cos64[0, :, : angles.shape[1]], angles.cos(), atol=1e-12)
