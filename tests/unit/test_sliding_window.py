"""Sliding-window drafters (``layer_types`` + ``sliding_window``): read as vLLM builds them, written back in the form
vLLM reads, and run with the window in every forward (evaluation and the TTT unroll of distillation)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from slimspec.checkpoint import load_drafter
from slimspec.checkpoint.drafter import DrafterConfig
from slimspec.checkpoint.writer import drafter_config_json, eagle_config_json
from slimspec.errors import CheckpointError
from slimspec.model import Eagle3Drafter
from tests.layouts import Spec, write_drafter
from tests.unit.test_model import (
    _attention_by_hand,
    _config,
    _inputs,
    _layer_by_hand,
    _mlp_by_hand,
    _random_drafter,
    _rms,
)

SLIDE, FULL = "sliding_attention", "full_attention"


def _write(tmp_path, layout: str, spec: Spec, **keys) -> DrafterConfig:
    """A drafter in ``layout`` with ``keys`` set where that layout keeps its layer config; its config as read."""
    folder = tmp_path / layout
    write_drafter(folder, layout, spec)
    config = json.loads((folder / "config.json").read_text())
    (config["transformer_layer_config"] if layout == "speculators" else config).update(keys)
    (folder / "config.json").write_text(json.dumps(config))
    return load_drafter(folder).config


# ------------------------------------------------------------------------------------------------ reading


@pytest.mark.parametrize("layout", ["eagle", "speculators", "specforge"])
def test_layer_types_and_window_are_read_per_layer(tmp_path, layout):
    """Catches a sliding-window drafter read as full attention (or its window put on the wrong layer): vLLM's Eagle3
    layers give layer i the window where layer_types[i] is sliding_attention. Entries past the drafter's layers are
    the target's (vLLM reads only the drafter's), and a list that slides nowhere carries nothing."""
    cfg = _write(tmp_path, layout, Spec(layers=2), layer_types=[FULL, SLIDE, SLIDE, FULL], sliding_window=8)
    assert (cfg.layer_types, cfg.sliding_window) == ([FULL, SLIDE], 8)
    assert [cfg.attention_window(i) for i in range(2)] == [None, 8]
    cfg = _write(tmp_path / "b", layout, Spec(layers=1), layer_types=[FULL, SLIDE], sliding_window=8)
    assert (cfg.layer_types, cfg.sliding_window) == (None, None)
    cfg = _write(tmp_path / "c", layout, Spec(layers=2), layer_types=[SLIDE], sliding_window=8)
    assert cfg.layer_types == [SLIDE, FULL]  # a short list: the rest full (vLLM's Qwen3 layer; its Llama one fails)
    for window in (0, None):  # vLLM's ModelConfig: a window of 0 is none
        cfg = _write(tmp_path / f"w{window}", layout, Spec(), layer_types=[SLIDE], sliding_window=window)
        assert (cfg.layer_types, cfg.sliding_window) == (None, None)
    with pytest.raises(CheckpointError, match="sliding_window -3"):
        _write(tmp_path / "bad", layout, Spec(), layer_types=[SLIDE], sliding_window=-3)


def test_qwen3_config_keeps_the_window_only_under_use_sliding_window(tmp_path):
    """Catches a flat Qwen3 config read unlike transformers' Qwen3Config, which vLLM builds it into: the window only
    with use_sliding_window, absent layer_types derived from max_window_layers. vLLM's SpeculatorsConfig keeps both
    keys as written, whatever use_sliding_window says."""
    spec = Spec(qwen3=True, layers=2)
    cfg = _write(tmp_path / "a", "eagle", spec, layer_types=[SLIDE, SLIDE], sliding_window=8)
    assert cfg.layer_types is None
    cfg = _write(tmp_path / "b", "eagle", spec, layer_types=[SLIDE, FULL], sliding_window=8, use_sliding_window=True)
    assert (cfg.layer_types, cfg.sliding_window) == ([SLIDE, FULL], 8)
    cfg = _write(tmp_path / "c", "eagle", spec, sliding_window=8, use_sliding_window=True, max_window_layers=1)
    assert cfg.layer_types == [FULL, SLIDE]
    cfg = _write(tmp_path / "d", "speculators", spec, layer_types=[SLIDE, SLIDE], sliding_window=8,
                 use_sliding_window=False)
    assert cfg.layer_types == [SLIDE, SLIDE]


@pytest.mark.parametrize("qwen3", [False, True])
def test_written_configs_keep_the_window_as_vllm_reads_it(tmp_path, qwen3):
    """Catches a conversion that drops the window (vLLM would serve full attention) or writes it where transformers
    drops it (Qwen3Config without use_sliding_window): transformers' config class for the written config, which vLLM
    builds, holds the same layers sliding and the window (tests/integration/test_convert.py reads converted outputs
    back)."""
    from transformers import LlamaConfig, Qwen3Config

    cfg = _write(tmp_path, "speculators", Spec(layers=3, qwen3=qwen3), layer_types=[SLIDE, FULL, SLIDE],
                 sliding_window=4)
    for name, written in (("slimspec", drafter_config_json(cfg, rank=4, head_vocab=cfg.draft_vocab_size,
                                                           dtype=torch.float32, slimspec_meta={})),
                          ("eagle", eagle_config_json(cfg, cfg.draft_vocab_size))):
        assert written["layer_types"] == [SLIDE, FULL, SLIDE] and written["sliding_window"] == 4
        built = (Qwen3Config if qwen3 else LlamaConfig)(**{k: v for k, v in written.items() if k != "slimspec"})
        assert (built.layer_types, built.sliding_window) == ([SLIDE, FULL, SLIDE], 4), name
    plain = dataclasses.replace(cfg, layer_types=None, sliding_window=None)
    assert "layer_types" not in drafter_config_json(plain, rank=4, head_vocab=1, dtype=torch.float32, slimspec_meta={})


# ------------------------------------------------------------------------------------------------ forward


def _window_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """[B, T, S]: key j visible to query i iff its position is at most the query's and, with a window, more than
    ``window`` positions back is out (``window`` keys, the query's own included), written out by loops."""
    b, t, s = query_positions.shape[0], query_positions.shape[1], key_positions.shape[1]
    allowed = torch.zeros(b, t, s, dtype=torch.bool)
    for row in range(b):
        for i in range(t):
            for j in range(s):
                p, k = int(query_positions[row, i]), int(key_positions[row, j])
                allowed[row, i, j] = k <= p and (window is None or k >= p - window + 1)
    return allowed


def _later_layer_by_hand(layer, x, pos, allowed, cfg):
    h = x + _attention_by_hand(layer.self_attn, _rms(x, layer.input_layernorm.weight, cfg.rms_norm_eps), pos,
                               allowed, cfg)
    return _mlp_by_hand(layer, h, cfg.rms_norm_eps)


@pytest.mark.parametrize("qwen3", [False, True])
def test_window_matches_float64_hand_reference(qwen3):
    """Catches a window applied to the wrong layers, off by one (window keys, the query's own included, as vLLM's and
    transformers' convention), counted over cache indices rather than positions, or not at all: three layers
    (sliding, full, sliding) with a window of 4 over 16 positions against plain attention with an explicit mask."""
    cfg = _config(model_type="qwen3" if qwen3 else "llama", num_layers=3, num_attention_heads=6,
                  num_key_value_heads=2, layer_types=[SLIDE, FULL, SLIDE], sliding_window=4)
    model = _random_drafter(cfg)
    ids, aux = _inputs(cfg, 2, 16, 0)
    g = model.combine(aux)
    pos = torch.stack([torch.arange(16), torch.arange(16) + 5])
    keys = torch.arange(16)[None].expand(2, 16)
    slide, full = _window_mask(keys, keys, 4), _window_mask(keys, keys, None)
    with torch.no_grad():
        h, _ = model(ids, g, pos)
        ref = _layer_by_hand(model, ids, g, pos, slide)
        ref = _later_layer_by_hand(model.layers["1"], ref, pos, full, cfg)
        ref = _later_layer_by_hand(model.layers["2"], ref, pos, slide, cfg)
        torch.testing.assert_close(h, ref, rtol=1e-10, atol=1e-10)
        wider, _ = _random_drafter(dataclasses.replace(cfg, sliding_window=5))(ids, g, pos)
        unwindowed, _ = _random_drafter(dataclasses.replace(cfg, layer_types=None, sliding_window=None))(ids, g, pos)
    for other in (wider, unwindowed):  # the window changes exactly the positions it cuts keys from
        assert torch.equal(other[:, :4], h[:, :4]) and not torch.allclose(other[:, 5:], h[:, 5:])


@pytest.mark.parametrize("variant", [{}, {"num_layers": 2, "layer_types": [FULL, SLIDE], "norm_output": True},
                                     {"parallel_token_id": 7}])
def test_windowed_ttt_equals_the_cached_draft_chain(variant):
    """Catches distillation training on other attention than vLLM serves: with a window of 3, TTT step i at t (query
    at position t+i) must equal the chain a speculative decoder runs through its KV cache, where a key sits at its
    own position (step j's at t+j) and the window counts back from the query's: the step-0 keys it keeps shrink as i
    grows (speculators' training mask keeps them at t-2..t instead). For a P-EAGLE drafter, one parallel pass."""
    variant = {"layer_types": [SLIDE], "sliding_window": 3, **variant}
    cfg = _config(**variant)
    model = _random_drafter(cfg)
    T, k = 8, 4
    ids, aux = _inputs(cfg, 1, T, k)
    with torch.no_grad():
        ttt = model.ttt_forward(ids, aux, k, positions=torch.arange(2, 2 + T)[None])
        g = model.combine(aux)
        for t in range(T):
            h, cache = model(ids[:, 1:t + 2], g[:, :t + 1], torch.arange(t + 1)[None])
            h = h[:, -1:]
            torch.testing.assert_close(h, ttt[0][:, t:t + 1], rtol=1e-10, atol=1e-10)
            if model.is_parallel:
                emb, hidden = model.masked_slots(1, k - 1)
                slots, _ = model(inputs_embeds=emb, hidden=hidden, past_key_values=cache,
                                 positions=torch.arange(t + 1, t + k)[None])
                for i in range(1, k):
                    torch.testing.assert_close(slots[:, i - 1:i], ttt[i][:, t:t + 1], rtol=1e-10, atol=1e-10)
                continue
            for i in range(1, k):
                token = ids[:, t + 1 + i:t + 2 + i]
                h, cache = model(token, model.next_hidden(h), torch.tensor([[t + i]]), past_key_values=cache)
                torch.testing.assert_close(h, ttt[i][:, t:t + 1], rtol=1e-10, atol=1e-10,
                                           msg=f"step {i} position {t}")
        full = _random_drafter(dataclasses.replace(cfg, layer_types=None, sliding_window=None))
        assert not torch.allclose(full.ttt_forward(ids, aux, k)[k - 1], ttt[k - 1])


def test_window_survives_the_drafter_round_trip(tmp_path):
    """Catches a model built from a checkpoint without its window (from_checkpoint reads the config it is given)."""
    cfg = _write(tmp_path, "speculators", Spec(layers=2), layer_types=[SLIDE, FULL], sliding_window=6)
    model = Eagle3Drafter.from_checkpoint(load_drafter(tmp_path / "speculators"), embed_weight=torch.randn(301, 32))
    assert model.attention_windows == [6, None] and cfg.attention_window(0) == 6
