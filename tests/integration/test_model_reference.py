"""Our drafter against an independent implementation: speculators' ``Eagle3DraftModel`` (vllm-project/speculators
0.9.0), same weights, same inputs, float32, eager attention; hidden states and logits of every TTT step.

speculators is installed without its dependencies (see the Makefile); only its model code runs here.
Its conventions, checked below: the batch is ``input_ids = x[1:]`` against ``hidden_states = f[:-1]`` (so
position t pairs f_t with x_{t+1}, as ours), TTT step i feeds token x_{t+1+i} and position + i, and the last i
positions of step i are padding (compared only where both sides are defined). Its training positions start at
1, ours at 0: RoPE is relative, so the outputs agree (``test_one_based_positions_agree``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from speculators.config import SpeculatorsConfig, VerifierConfig  # noqa: E402
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig  # noqa: E402
from speculators.proposals.greedy import GreedyTokenProposalConfig  # noqa: E402
from transformers import LlamaConfig, Qwen3Config  # noqa: E402

from slimspec.checkpoint import load_drafter  # noqa: E402
from slimspec.checkpoint.drafter import DrafterConfig  # noqa: E402
from slimspec.model import Eagle3Drafter, LowRankHead  # noqa: E402
from tests.layouts import Spec, write_drafter  # noqa: E402

pytestmark = pytest.mark.slow

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 512}

YARN_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
             "original_max_position_embeddings": 256}  # gpt-oss drafters' setting, at a small context

# name: (layout, spec, rope_scaling, first position, low-rank rank)
CASES = {
    "llama-eagle-full-vocab-head_dim": ("eagle", Spec(head_dim=12, draft_vocab=None), None, 0, None),
    "llama-speculators-trimmed-nbr-fc_norm-llama3": ("speculators", Spec(fc_norm=True), LLAMA3_ROPE, 1000, None),
    "qwen3-norm_before_fc-norm_output": (
        "speculators",
        Spec(qwen3=True, norm_before_fc=True, head_dim=16,
             extra_config={"norm_output": True, "norm_before_residual": False}),
        None, 0, None),
    "llama-specforge-lowrank": ("specforge", Spec(kv_heads=4), None, 0, 6),
    "llama-speculators-3-layers": ("speculators", Spec(layers=3), None, 0, None),
    "llama-eagle-2-layers-attention_bias": ("eagle", Spec(layers=2, attention_bias=True), None, 0, None),
    "llama-speculators-yarn": ("speculators", Spec(), YARN_ROPE, 300, None),
    "qwen3-speculators-2-layers-lowrank-norm_output": (
        "speculators", Spec(qwen3=True, layers=2, head_dim=16, extra_config={"norm_output": True}), None, 7, 5),
}


def _speculators_model(cfg: DrafterConfig, tensors: dict[str, torch.Tensor], embed: torch.Tensor,
                       head: torch.Tensor) -> Eagle3DraftModel:
    """speculators' model with our config and weights (canonical names mapped to its state dict)."""
    layer_cls = Qwen3Config if cfg.model_type == "qwen3" else LlamaConfig
    rope = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    layer = layer_cls(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size, rms_norm_eps=cfg.rms_norm_eps, hidden_act=cfg.hidden_act,
        num_hidden_layers=cfg.num_layers, max_position_embeddings=cfg.max_position_embeddings, rope_parameters=rope,
        attention_bias=cfg.attention_bias,
        **({"layer_types": cfg.layer_types, "sliding_window": cfg.sliding_window, "use_sliding_window": True}
           if cfg.layer_types else {}),
    )
    layer._attn_implementation = "eager"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=cfg.draft_vocab_size,
        norm_before_residual=cfg.norm_before_residual,
        norm_before_fc=cfg.norm_before_fc,
        fc_norm=cfg.fc_norm,
        norm_output=cfg.norm_output,
        target_hidden_size=cfg.target_hidden_size,
        eagle_aux_hidden_state_layer_ids=cfg.aux_layer_ids,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
        ),
    )
    model = Eagle3DraftModel(config)
    state = {k.replace("midlayer.", "layers.0."): v.float() for k, v in tensors.items()
             if not k.startswith("lm_head") and k not in ("d2t", "t2d")}
    state.update({"embed_tokens.weight": embed, "lm_head.weight": head})
    for name in ("d2t", "t2d"):
        if name in tensors:
            state[name] = tensors[name]
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    assert set(result.missing_keys) <= {"verifier_lm_head.weight", "verifier_norm.weight"}, result.missing_keys
    return model.eval()


def _run_speculators(model: Eagle3DraftModel, ids: torch.Tensor, aux: torch.Tensor, steps: int,
                     positions: torch.Tensor | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Pre-norm hidden states (the last decoder layer's outputs) and logits of each TTT step, caught with forward
    hooks."""
    t = aux.shape[1]
    hidden, logits = [], []
    hooks = [model.layers[-1].register_forward_hook(lambda m, a, out: hidden.append(out)),
             model.lm_head.register_forward_hook(lambda m, a, out: logits.append(out))]
    try:
        with torch.no_grad():
            model(hidden_states=aux, input_ids=ids[:, 1:t + 1], document_ids=torch.zeros(1, t, dtype=torch.long),
                  position_ids=positions, ttt_steps=steps)
    finally:
        for h in hooks:
            h.remove()
    return hidden, logits


def _pair(tmp_path, layout: str, spec: Spec, rope_scaling: dict | None, rank: int | None, seed: int = 0):
    write_drafter(tmp_path / "d", layout, spec)
    ckpt = load_drafter(tmp_path / "d")
    if rope_scaling:
        ckpt.config = dataclasses.replace(ckpt.config, rope_scaling=rope_scaling)
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(ckpt.config.vocab_size, ckpt.config.hidden_size, generator=g)
    head = None
    if rank:
        vd, h = ckpt.config.draft_vocab_size, ckpt.config.hidden_size
        head = LowRankHead(torch.randn(vd, rank, generator=g) * 0.3, torch.randn(rank, h, generator=g) * 0.3)
    ours = Eagle3Drafter.from_checkpoint(ckpt, embed_weight=embed, head=head)
    full_head = ours.lm_head.full_weight().detach().clone()
    theirs = _speculators_model(ckpt.config, ckpt.tensors, embed, full_head)
    return ours, theirs, ckpt.config


def _data(cfg: DrafterConfig, t: int, steps: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (1, t + steps), generator=g)
    aux = torch.randn(1, t, cfg.num_aux_hidden_states * cfg.target_hidden_size, generator=g)
    return ids, aux


@pytest.mark.parametrize("case", CASES)
def test_ttt_steps_match_speculators(tmp_path, case):
    """Catches any divergence from an independent EAGLE-3 implementation on the same weights: layer maths,
    embedding-first concat, norm_before_residual, fc_norm / input_norm, Qwen3 q/k norms, explicit head_dim,
    GQA, llama3 RoPE at large positions, norm_output feedback, the low-rank head, TTT masking/shift, and the
    later decoder layers of a multi-layer drafter (their residuals, norms, attention over the hidden state alone
    and their own KV caches across TTT steps)."""
    layout, spec, rope_scaling, start, rank = CASES[case]
    ours, theirs, cfg = _pair(tmp_path, layout, spec, rope_scaling, rank)
    T, steps = 9, 3
    ids, aux = _data(cfg, T, steps)
    positions = torch.arange(start, start + T)[None]
    their_h, their_logits = _run_speculators(theirs, ids, aux, steps, positions)
    with torch.no_grad():
        our_h = ours.ttt_forward(ids, aux, steps, positions=positions)
        our_logits = [ours.logits(h) for h in our_h]
    assert len(their_h) == len(their_logits) == steps
    for i in range(steps):
        n = T - i  # speculators pads the last i tokens of step i
        torch.testing.assert_close(our_h[i][:, :n], their_h[i][:, :n], rtol=1e-4, atol=2e-5, msg=f"hidden, step {i}")
        torch.testing.assert_close(our_logits[i][:, :n], their_logits[i][:, :n], rtol=1e-4, atol=2e-5,
                                   msg=f"logits, step {i}")
        assert torch.equal(our_logits[i][:, :n].argmax(-1), their_logits[i][:, :n].argmax(-1))


def test_one_based_positions_agree(tmp_path):
    """Catches a non-relative RoPE: speculators trains at positions 1..T (its shift_batch), vLLM and we use
    0..T-1; with RoPE the two must give the same outputs."""
    ours, theirs, cfg = _pair(tmp_path, "speculators", Spec(qwen3=True), None, None)
    ids, aux = _data(cfg, 8, 2, seed=5)
    their_h, _ = _run_speculators(theirs, ids, aux, 2, positions=None)  # its default: 1 + arange(T)
    with torch.no_grad():
        our_h = ours.ttt_forward(ids, aux, 2)
    for i in range(2):
        torch.testing.assert_close(our_h[i][:, :8 - i], their_h[i][:, :8 - i], rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("qwen3", [False, True])
def test_sliding_window_matches_speculators_where_its_mask_is_vllms(tmp_path, qwen3):
    """Catches a window on the wrong layer or off by one against speculators' own sliding-window model (layer_types
    and sliding_window in its layer config; a window of 4 on the first of two layers): step 0 agrees at every
    position. speculators' later TTT steps keep the step-0 window at t-3..t where vLLM's cache, and ours, count back
    from the query's position t+i, so they are compared where both windows reach position 0 (t < 4 - i), and they
    must differ past that (the window is vLLM's, not speculators' training mask)."""
    spec = Spec(qwen3=qwen3, layers=2, head_dim=16 if qwen3 else None, sliding_window=4,
                layer_types=["sliding_attention", "full_attention"])
    ours, theirs, cfg = _pair(tmp_path, "speculators", spec, None, None)
    assert cfg.layer_types == ["sliding_attention", "full_attention"] and cfg.sliding_window == 4
    T, steps = 12, 3
    ids, aux = _data(cfg, T, steps)
    their_h, their_logits = _run_speculators(theirs, ids, aux, steps, torch.arange(T)[None])
    with torch.no_grad():
        our_h = ours.ttt_forward(ids, aux, steps)
        our_logits = [ours.logits(h) for h in our_h]
        unwindowed = Eagle3Drafter.from_checkpoint(
            dataclasses.replace(load_drafter(tmp_path / "d"), config=dataclasses.replace(
                cfg, layer_types=None, sliding_window=None)), embed_weight=ours.embed_weight.float(),
            head=ours.lm_head).ttt_forward(ids, aux, 1)[0]
    torch.testing.assert_close(our_h[0], their_h[0], rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(our_logits[0], their_logits[0], rtol=1e-4, atol=2e-5)
    assert not torch.allclose(unwindowed[:, 4:], our_h[0][:, 4:], rtol=1e-3, atol=1e-3)  # the window cuts there
    for i in range(1, steps):
        agree = 4 - i
        torch.testing.assert_close(our_h[i][:, :agree], their_h[i][:, :agree], rtol=1e-4, atol=2e-5,
                                   msg=f"step {i}")
        assert not torch.allclose(our_h[i][:, agree:T - i], their_h[i][:, agree:T - i], rtol=1e-3, atol=1e-3)
