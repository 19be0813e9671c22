"""Tiny EAGLE-3 drafters and targets written in every published layout, with real names and configs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

LAYOUTS = ("eagle", "specforge", "speculators", "modelopt", "angelslim")


@dataclass
class Spec:
    hidden: int = 32
    target_hidden: int = 32
    heads: int = 4
    kv_heads: int = 2
    head_dim: int | None = None
    inter: int = 48
    vocab: int = 301
    draft_vocab: int | None = 97
    target_layers: int = 8
    dtype: torch.dtype = torch.float32
    qwen3: bool = False
    fc_norm: bool = False
    norm_before_fc: bool = False
    no_head: bool = False
    layers: int = 1  # decoder layers; layers 1.. are written as layers.{i}.* (speculators' and vLLM's names)
    parallel_token: int | None = None  # a P-EAGLE drafter: mask_hidden and its mask-slot token
    attention_bias: bool = False  # q/k/v biases in every layer, o_proj's too in Llama-style ones (vLLM's set)
    # sliding-window attention: the layer config's layer_types (default: every layer sliding) and window
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    sharded: bool = False
    seed: int = 0
    extra_config: dict = field(default_factory=dict)

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads


def canonical_tensors(spec: Spec) -> dict[str, torch.Tensor]:
    """Random drafter tensors under canonical (EAGLE) names."""
    g = torch.Generator().manual_seed(spec.seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.2).to(spec.dtype)

    def norm(n: int) -> torch.Tensor:
        return (1 + 0.1 * torch.randn(n, generator=g)).to(spec.dtype)

    h, a, kv = spec.hidden, spec.heads * spec.hd, spec.kv_heads * spec.hd
    t = {
        "fc.weight": rnd(h, 3 * spec.target_hidden),
        "midlayer.input_layernorm.weight": norm(h),
        "midlayer.hidden_norm.weight": norm(h),
        "midlayer.post_attention_layernorm.weight": norm(h),
        "midlayer.self_attn.q_proj.weight": rnd(a, 2 * h),
        "midlayer.self_attn.k_proj.weight": rnd(kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": rnd(kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": rnd(h, a),
        "midlayer.mlp.gate_proj.weight": rnd(spec.inter, h),
        "midlayer.mlp.up_proj.weight": rnd(spec.inter, h),
        "midlayer.mlp.down_proj.weight": rnd(h, spec.inter),
        "norm.weight": norm(h),
    }
    if spec.qwen3:
        t["midlayer.self_attn.q_norm.weight"] = norm(spec.hd)
        t["midlayer.self_attn.k_norm.weight"] = norm(spec.hd)
    for i in range(1, spec.layers):  # plain decoder layers over the hidden state
        p = f"layers.{i}."
        t.update({p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
                  p + "self_attn.q_proj.weight": rnd(a, h), p + "self_attn.k_proj.weight": rnd(kv, h),
                  p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, a),
                  p + "mlp.gate_proj.weight": rnd(spec.inter, h), p + "mlp.up_proj.weight": rnd(spec.inter, h),
                  p + "mlp.down_proj.weight": rnd(h, spec.inter)})
        if spec.qwen3:
            t[p + "self_attn.q_norm.weight"] = norm(spec.hd)
            t[p + "self_attn.k_norm.weight"] = norm(spec.hd)
    if spec.attention_bias:
        for i in range(spec.layers):
            p = "midlayer." if i == 0 else f"layers.{i}."
            t.update({p + "self_attn.q_proj.bias": rnd(a), p + "self_attn.k_proj.bias": rnd(kv),
                      p + "self_attn.v_proj.bias": rnd(kv)})
            if not spec.qwen3:
                t[p + "self_attn.o_proj.bias"] = rnd(h)
    if spec.parallel_token is not None:
        t["mask_hidden"] = rnd(1, 3 * spec.target_hidden)
    if spec.fc_norm:
        for i in range(3):
            t[f"fc_norm.{i}.weight"] = norm(spec.target_hidden)
    if spec.norm_before_fc:
        t["input_norm.weight"] = norm(3 * spec.target_hidden)
    vd = spec.draft_vocab or spec.vocab
    if not spec.no_head:
        t["lm_head.weight"] = rnd(vd, h)
    if vd != spec.vocab:
        chosen = torch.randperm(spec.vocab, generator=g)[:vd]
        t["draft_ids"] = chosen  # frequency order (not monotonic); callers sort when needed
    return t


def _d2t_t2d(ids: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    d2t = ids - torch.arange(ids.numel())
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def _llama_config(spec: Spec) -> dict:
    cfg = {
        "hidden_size": spec.hidden,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "intermediate_size": spec.inter,
        "num_hidden_layers": spec.layers,
        "vocab_size": spec.vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 4096,
        "hidden_act": "silu",
        "model_type": "qwen3" if spec.qwen3 else "llama",
    }
    if spec.attention_bias:
        cfg["attention_bias"] = True
    if spec.sliding_window:  # as speculators' trainer writes it (use_sliding_window: Qwen3Config needs it)
        cfg.update(layer_types=spec.layer_types or ["sliding_attention"] * spec.layers,
                   sliding_window=spec.sliding_window, use_sliding_window=True)
    if spec.head_dim:
        cfg["head_dim"] = spec.head_dim
    return cfg


def write_drafter(folder: Path, layout: str, spec: Spec | None = None) -> dict[str, torch.Tensor]:
    """Write a drafter in ``layout``; return its canonical tensors (``d2t`` as offsets, ``t2d`` mask)."""
    spec = spec or Spec()
    folder.mkdir(parents=True, exist_ok=True)
    t = canonical_tensors(spec)
    ids = t.pop("draft_ids", None)
    if ids is not None:
        if layout != "modelopt":  # every other tool stores the draft vocab in increasing target id order
            order = torch.argsort(ids)
            ids = ids[order]
        d2t, t2d = _d2t_t2d(ids, spec.vocab)
        t["d2t"] = d2t
        if layout != "modelopt":
            t["t2d"] = t2d
    cfg = _llama_config(spec)
    vd = spec.draft_vocab or spec.vocab
    L = spec.target_layers
    if layout == "eagle":
        cfg.update(architectures=["LlamaForCausalLM"], draft_vocab_size=vd, torch_dtype="float16")
        if "mask_hidden" in t:  # vLLM views it as one row whatever its shape: write it flat here
            t["mask_hidden"] = t["mask_hidden"].flatten()
        stray = {"midlayer.self_attn.rotary_emb.inv_freq": torch.ones(spec.hd // 2)}
        torch.save({**t, **stray}, folder / "pytorch_model.bin")
    elif layout == "specforge":
        cfg.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=vd,
                   eagle_config={"eagle_aux_hidden_state_layer_ids": [1, L // 2 - 1, L - 4]},
                   fc_norm=spec.fc_norm, norm_output=False)
        save_file(t, str(folder / "model.safetensors"))
    elif layout == "speculators":
        inner = cfg
        cfg = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": inner,
            "draft_vocab_size": vd,
            "target_hidden_size": spec.target_hidden,
            "norm_before_fc": spec.norm_before_fc,
            "eagle_aux_hidden_state_layer_ids": [2, L // 2, L - 3],
            "speculators_config": {"verifier": {"name_or_path": "some-org/target-model"}},
        }
        renamed = {k.replace("midlayer.", "layers.0."): v for k, v in t.items()}
        save_file(renamed, str(folder / "model.safetensors"))
    elif layout == "modelopt":
        cfg.update(architectures=["LlamaForCausalLMEagle3"],
                   draft_vocab_size=None if spec.no_head else vd,
                   eagle_config={"eagle_aux_hidden_state_layer_ids": [1, L // 2 - 1, L - 4]})
        names = sorted(t)
        half = len(names) // 2
        shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
        weight_map = {}
        for file, part in shards.items():
            save_file({n: t[n] for n in part}, str(folder / file))
            weight_map.update({n: file for n in part})
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    elif layout == "angelslim":
        cfg.update(architectures=["Eagle3LlamaForCausalLM"], draft_vocab_size=vd, target_model_type="llama")
        torch.save(t, folder / "pytorch_model.bin")
    else:
        raise ValueError(layout)
    if spec.parallel_token is not None:  # speculators' "peagle" names it mask_token_id, AWS's P-EAGLE ptd_token_id
        if layout == "speculators":
            cfg.update(speculators_model_type="peagle", mask_token_id=spec.parallel_token)
        else:
            cfg["ptd_token_id"] = spec.parallel_token
    cfg.update(spec.extra_config)
    (folder / "config.json").write_text(json.dumps(cfg))
    return t


def write_target(folder: Path, *, vocab: int = 301, hidden: int = 32, layers: int = 8, tied: bool = True,
                 sharded: bool = False, seed: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A target folder holding only what conversion reads; returns its LM head."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    head = (torch.randn(vocab, hidden, generator=g) * 0.3).to(dtype)
    other = {"model.norm.weight": torch.ones(hidden, dtype=dtype),
             "model.layers.0.mlp.up_proj.weight": torch.randn(8, hidden, generator=g).to(dtype)}
    tensors = {"model.embed_tokens.weight": head, **other} if tied else {
        "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g).to(dtype), "lm_head.weight": head, **other}
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "num_hidden_layers": layers, "vocab_size": vocab, "tie_word_embeddings": tied,
           "num_attention_heads": 4, "intermediate_size": 8}
    (folder / "config.json").write_text(json.dumps(cfg))
    if sharded:
        head_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
        first = {k: v for k, v in tensors.items() if k != head_name}
        save_file(first, str(folder / "model-00001-of-00002.safetensors"))
        save_file({head_name: head}, str(folder / "model-00002-of-00002.safetensors"))
        weight_map = {k: "model-00001-of-00002.safetensors" for k in first}
        weight_map[head_name] = "model-00002-of-00002.safetensors"
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return head


def assert_same_ttt_forward(src, out, tokens: int, aux_width: int = 96, hidden: int = 32) -> None:
    """Two drafter checkpoints whose decoders must be untouched give bit-identical TTT unrolls (3 steps) on the same
    seeded inputs (the embedding is a 49,152-token stand-in)."""
    from slimspec.model import Eagle3Drafter

    embed = torch.randn(49152, hidden, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 49152, (1, tokens + 3), generator=torch.Generator().manual_seed(1))
    aux = torch.randn(1, tokens, aux_width, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a = Eagle3Drafter.from_checkpoint(src, embed_weight=embed).ttt_forward(ids, aux, 3)
        b = Eagle3Drafter.from_checkpoint(out, embed_weight=embed).ttt_forward(ids, aux, 3)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
