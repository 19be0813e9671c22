"""Every published EAGLE-3 layout loads into the same canonical form, tensor for tensor."""

import json
import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file

from slimspec.checkpoint import load_drafter
from slimspec.errors import CheckpointError
from tests.layouts import LAYOUTS, Spec, write_drafter


def _assert_same(ckpt, written):
    expected = {k: v for k, v in written.items()}
    assert set(ckpt.tensors) == set(expected), set(ckpt.tensors) ^ set(expected)
    for name, tensor in expected.items():
        assert torch.equal(ckpt.tensors[name], tensor), name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_loads(tmp_path, layout):
    """Catches a layout whose names or config the reader misses."""
    spec = Spec(dtype=torch.float16 if layout == "eagle" else torch.bfloat16)
    written = write_drafter(tmp_path / layout, layout, spec)
    ckpt = load_drafter(tmp_path / layout)
    assert ckpt.layout == layout
    _assert_same(ckpt, written)
    cfg = ckpt.config
    assert (cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size) == (32, 301, 97)
    assert cfg.target_hidden_size == 32 and cfg.head_dim == 8
    ids = ckpt.draft_to_target_ids()
    assert ids.unique().numel() == 97 and int(ids.max()) < 301


def test_eagle_drops_stray_keys_and_keeps_fp16(tmp_path):
    write_drafter(tmp_path / "d", "eagle", Spec(dtype=torch.float16))
    ckpt = load_drafter(tmp_path / "d")
    assert ckpt.dropped == ["midlayer.self_attn.rotary_emb.inv_freq"]
    assert ckpt.dtype == torch.float16
    assert ckpt.config.rope_theta == 500000.0 and not ckpt.config.norm_before_residual


def test_speculators_defaults_and_variants(tmp_path):
    """Catches reading speculators' nested config wrong: norm_before_residual defaults to True there,
    Qwen3 q/k norms and input_norm (norm_before_fc) are carried."""
    written = write_drafter(tmp_path / "s", "speculators", Spec(qwen3=True, norm_before_fc=True, head_dim=16))
    ckpt = load_drafter(tmp_path / "s")
    _assert_same(ckpt, written)
    cfg = ckpt.config
    assert cfg.norm_before_residual and cfg.norm_before_fc and cfg.model_type == "qwen3" and cfg.head_dim == 16
    assert cfg.target_model == "some-org/target-model"
    assert cfg.aux_layer_ids == [2, 4, 5]


def test_specforge_fc_norm(tmp_path):
    written = write_drafter(tmp_path / "s", "specforge", Spec(fc_norm=True))
    ckpt = load_drafter(tmp_path / "s")
    _assert_same(ckpt, written)
    assert ckpt.config.fc_norm and ckpt.config.aux_layer_ids == [1, 3, 4]


def test_modelopt_frequency_ordered_d2t(tmp_path):
    """Catches mapping through t2d (wrong for ModelOpt): d2t offsets in frequency order must be honoured."""
    written = write_drafter(tmp_path / "m", "modelopt", Spec())
    ckpt = load_drafter(tmp_path / "m")
    ids = ckpt.draft_to_target_ids()
    assert not torch.all(ids[1:] > ids[:-1]), "fixture should be non-monotonic"
    assert torch.equal(ids, torch.arange(97) + written["d2t"])
    assert "t2d" not in ckpt.tensors and len(ckpt.files) == 2


def test_modelopt_without_head(tmp_path):
    write_drafter(tmp_path / "m", "modelopt", Spec(no_head=True, draft_vocab=None))
    ckpt = load_drafter(tmp_path / "m")
    assert not ckpt.has_head and ckpt.config.draft_vocab_size == 301 and ckpt.d2t is None


def test_angelslim_explicit_head_dim(tmp_path):
    written = write_drafter(tmp_path / "a", "angelslim", Spec(head_dim=12))
    ckpt = load_drafter(tmp_path / "a")
    _assert_same(ckpt, written)
    assert ckpt.config.head_dim == 12 and ckpt.layout == "angelslim"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_multi_layer_drafter_loads_in_every_layout(tmp_path, layout):
    """Catches the later decoder layers of a multi-layer drafter (``layers.{i}.*``: speculators trains them,
    vLLM serves them) dropped, renamed or refused: every tensor must come through and the config count them."""
    written = write_drafter(tmp_path / layout, layout, Spec(layers=3, qwen3=layout == "speculators"))
    ckpt = load_drafter(tmp_path / layout)
    _assert_same(ckpt, written)
    assert ckpt.config.num_layers == 3 and "layers.2.mlp.down_proj.weight" in ckpt.tensors
    assert ckpt.config.model_type == ("qwen3" if layout == "speculators" else "llama")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_attention_bias_drafter_loads_in_every_layout(tmp_path, layout):
    """Catches the attention biases vLLM builds under ``attention_bias`` (q/k/v in every Eagle3 layer, o_proj's too
    in Llama-style ones; "parallel drafting checkpoints may have attention bias enabled") refused or dropped: they
    come through with the flag, and a conversion's config must say it again."""
    qwen3 = layout == "speculators"
    written = write_drafter(tmp_path / layout, layout, Spec(layers=2, attention_bias=True, qwen3=qwen3))
    ckpt = load_drafter(tmp_path / layout)
    _assert_same(ckpt, written)
    assert ckpt.config.attention_bias and "layers.1.self_attn.v_proj.bias" in ckpt.tensors
    assert ("midlayer.self_attn.o_proj.bias" in ckpt.tensors) is not qwen3  # vLLM's Qwen3 o_proj has no bias


def test_attention_biases_must_be_the_set_vllm_builds(tmp_path):
    """Catches biases read without attention_bias (vLLM would not build them and fails on the weights), the flag
    without its biases (vLLM would leave them unset), a Qwen3-style o_proj bias vLLM has no place for, and an MLP
    bias (no Eagle3 layer has one)."""
    folder = tmp_path / "b"
    write_drafter(folder, "eagle", Spec(attention_bias=True))
    _edit_config(folder, attention_bias=False)
    with pytest.raises(CheckpointError, match="hold attention biases .* does not set attention_bias"):
        load_drafter(folder)
    write_drafter(tmp_path / "nb", "eagle", Spec())
    _edit_config(tmp_path / "nb", attention_bias=True)
    with pytest.raises(CheckpointError, match=r"missing \['midlayer.self_attn.k_proj.bias'"):
        load_drafter(tmp_path / "nb")
    write_drafter(tmp_path / "q", "specforge", Spec(attention_bias=True, qwen3=True))
    tensors = load_file(str(tmp_path / "q" / "model.safetensors"))
    save_file({**tensors, "midlayer.self_attn.o_proj.bias": torch.zeros(32)}, str(tmp_path / "q" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"qwen3-style layer: missing \[\], unexpected \['midlayer.self_attn.o_"):
        load_drafter(tmp_path / "q")
    save_file({**tensors, "midlayer.mlp.up_proj.bias": torch.zeros(48)}, str(tmp_path / "q" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="biases outside attention's q/k/v/o projections"):
        load_drafter(tmp_path / "q")


def test_bias_flags_vllm_reads_beside_attention_bias(tmp_path):
    """Catches a Llama-style config whose ``bias`` or ``mlp_bias`` makes vLLM build an o_proj or MLP bias that the
    weights cannot fill (it would serve unset parameters): refused. ``bias`` beside attention_bias adds nothing,
    ``qkv_bias`` is not read by vLLM's Eagle3 layer, and a Qwen3-style layer reads neither key."""
    write_drafter(tmp_path / "b", "eagle", Spec())
    for changes, message in (({"bias": True}, "sets bias without attention_bias"), ({"mlp_bias": True}, "mlp_bias")):
        _edit_config(tmp_path / "b", **{"bias": False, "mlp_bias": False, **changes})
        with pytest.raises(CheckpointError, match=message):
            load_drafter(tmp_path / "b")
    _edit_config(tmp_path / "b", bias=False, mlp_bias=False, qkv_bias=True)
    assert not load_drafter(tmp_path / "b").config.attention_bias
    write_drafter(tmp_path / "ab", "eagle", Spec(attention_bias=True))
    _edit_config(tmp_path / "ab", bias=True)
    assert "midlayer.self_attn.o_proj.bias" in load_drafter(tmp_path / "ab").tensors
    write_drafter(tmp_path / "q", "specforge", Spec(qwen3=True))
    _edit_config(tmp_path / "q", bias=True, mlp_bias=True)
    assert load_drafter(tmp_path / "q").config.model_type == "qwen3"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_parallel_drafter_loads_in_every_layout(tmp_path, layout):
    """Catches a P-EAGLE drafter (AWS's write ``ptd_token_id``, speculators' ``peagle`` ``mask_token_id``) read as
    a plain chain drafter: ``mask_hidden`` was once dropped as a stray tensor, which vLLM then misses when it
    serves the conversion with parallel_drafting. The tensor comes through as one row (vLLM's view) with the token;
    speculators' peagle reads norm_before_residual False by default (its eagle3 reads True)."""
    written = write_drafter(tmp_path / layout, layout, Spec(parallel_token=5, layers=2))
    ckpt = load_drafter(tmp_path / layout)
    written["mask_hidden"] = written["mask_hidden"].reshape(1, -1)
    _assert_same(ckpt, written)
    assert ckpt.is_parallel and ckpt.config.parallel_token_id == 5 and ckpt.dropped in ([], [
        "midlayer.self_attn.rotary_emb.inv_freq"])
    assert ckpt.config.norm_before_residual is False
    assert not load_drafter(_plain(tmp_path, layout)).is_parallel


def _plain(tmp_path, layout):
    write_drafter(tmp_path / f"{layout}-plain", layout, Spec())
    return tmp_path / f"{layout}-plain"


def test_parallel_drafter_needs_its_token_and_a_row_of_target_features(tmp_path):
    """Catches a P-EAGLE drafter accepted without the mask-slot token vLLM needs (it raises at serving time), with a
    token outside the target's vocabulary, or with a mask_hidden that is not n x target_hidden wide."""
    folder = tmp_path / "p"
    write_drafter(folder, "specforge", Spec(parallel_token=5))
    config = json.loads((folder / "config.json").read_text())
    del config["ptd_token_id"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="weights hold mask_hidden .* names no mask-slot token"):
        load_drafter(folder)
    _edit_config(folder, pard_token=301)
    with pytest.raises(CheckpointError, match="mask-slot token 301 is outside the target vocab of 301"):
        load_drafter(folder)
    _edit_config(folder, pard_token=300)
    assert load_drafter(folder).config.parallel_token_id == 300
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({**tensors, "mask_hidden": torch.zeros(1, 64)}, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"mask_hidden has shape \[1, 64\], config implies \[1, 96\]"):
        load_drafter(folder)


def test_flags_and_mask_token_are_read_where_vllm_reads_them(tmp_path):
    """Catches flags read from places vLLM ignores, which silently changes what a conversion serves (the output
    writes every flag at the top level, where vLLM does read it): a speculators config's inner copies of
    norm_before_residual / norm_before_fc (vLLM overwrites them with the top level's or its default), a flat
    config's eagle_config.norm_before_residual (vLLM reads only the config itself) and a top-level norm_before_fc
    put before eagle_config's (vLLM reads eagle_config's first); and a speculators peagle's top-level
    mask_token_id put before the inner one (vLLM's hf_config is the inner config, the top one becomes pard_token).
    tests/e2e/test_vllm.py checks the speculators cases against vLLM's own config builder."""
    spec = tmp_path / "spec"
    write_drafter(spec, "speculators", Spec())
    config = json.loads((spec / "config.json").read_text())
    config["transformer_layer_config"].update(norm_before_residual=False, norm_before_fc=True)
    (spec / "config.json").write_text(json.dumps(config))
    assert (load_drafter(spec).config.norm_before_residual, load_drafter(spec).config.norm_before_fc) == (True, False)
    flat = tmp_path / "flat"
    write_drafter(flat, "specforge", Spec())
    config = json.loads((flat / "config.json").read_text())
    config["eagle_config"].update(norm_before_residual=True, norm_before_fc=True)
    config["norm_before_fc"] = False
    (flat / "config.json").write_text(json.dumps(config))
    assert (load_drafter(flat).config.norm_before_residual, load_drafter(flat).config.norm_before_fc) == (False, True)
    peagle = tmp_path / "peagle"
    write_drafter(peagle, "speculators", Spec(parallel_token=7, layers=2))
    config = json.loads((peagle / "config.json").read_text())
    config["transformer_layer_config"]["mask_token_id"] = 9
    (peagle / "config.json").write_text(json.dumps(config))
    assert load_drafter(peagle).config.parallel_token_id == 9
    del config["transformer_layer_config"]["mask_token_id"]
    config["transformer_layer_config"]["ptd_token_id"] = 11  # below pard_token (the top mask_token_id) in the order
    (peagle / "config.json").write_text(json.dumps(config))
    assert load_drafter(peagle).config.parallel_token_id == 7


def test_num_aux_hidden_states_sizes_fc_as_vllm_does(tmp_path):
    """Catches `num_aux_hidden_states` ignored (vLLM sizes fc by it before the layer ids): a 4-feature drafter
    without ids was refused as "not 3 target hidden states wide", and one whose count and ids disagree (vLLM
    would build fc for one and feed it the other) was read."""
    folder = tmp_path / "aux4"
    write_drafter(folder, "eagle", Spec())
    tensors = torch.load(folder / "pytorch_model.bin", weights_only=True)
    tensors["fc.weight"] = torch.zeros(32, 4 * 32, dtype=tensors["fc.weight"].dtype)
    torch.save(tensors, folder / "pytorch_model.bin")
    _edit_config(folder, num_aux_hidden_states=4)
    cfg = load_drafter(folder).config
    assert (cfg.num_aux_hidden_states, cfg.target_hidden_size) == (4, 32)
    _edit_config(folder, eagle_aux_hidden_state_layer_ids=[1, 3, 5])
    with pytest.raises(CheckpointError, match="num_aux_hidden_states=4 but names 3 feature layers"):
        load_drafter(folder)


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_layer_count_follows_the_weights_and_must_match_a_multi_layer_config(tmp_path):
    """Catches trusting the config's num_hidden_layers over the weights: one layer of weights is one layer (as the
    EAGLE reference reads it; 40 is reported for yuhuili's EAGLE3-Vicuna1.3-13B), but several layers of weights
    with another declared count are refused (vLLM would build the config's count)."""
    write_drafter(tmp_path / "one", "eagle", Spec())
    _edit_config(tmp_path / "one", num_hidden_layers=40)
    assert load_drafter(tmp_path / "one").config.num_layers == 1
    write_drafter(tmp_path / "two", "eagle", Spec(layers=2))
    assert load_drafter(tmp_path / "two").config.num_layers == 2
    _edit_config(tmp_path / "two", num_hidden_layers=3)
    with pytest.raises(CheckpointError, match="declares num_hidden_layers=3 but the weights hold 2"):
        load_drafter(tmp_path / "two")


def test_later_layer_hidden_norm_is_dropped_and_mixed_qk_norms_refused(tmp_path):
    """Catches a later layer's ``hidden_norm`` (vLLM builds one per layer but only layer 0 reads it) taken for a
    weight the model must hold, and a drafter whose layers disagree on Qwen3 q/k norms loaded as one style."""
    folder = tmp_path / "s"
    write_drafter(folder, "speculators", Spec(qwen3=True, layers=2))
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({**tensors, "layers.1.hidden_norm.weight": torch.ones(32)}, str(folder / "model.safetensors"))
    ckpt = load_drafter(folder)
    assert ckpt.dropped == ["layers.1.hidden_norm.weight"] and ckpt.config.num_layers == 2
    del tensors["layers.1.self_attn.q_norm.weight"], tensors["layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="some decoder layers have Qwen3 q/k norms and others do not"):
        load_drafter(folder)


class _Evil:
    def __reduce__(self):
        return (exec, ("open('/tmp/slimspec_pwned','w').write('x')",))


def test_bin_never_runs_pickle_code(tmp_path):
    """Catches torch.load without weights_only: a malicious pickle must be refused, not executed."""
    import os

    folder = tmp_path / "evil"
    write_drafter(folder, "eagle", Spec())
    with open(folder / "pytorch_model.bin", "wb") as f:
        pickle.dump({"fc.weight": _Evil()}, f)
    if os.path.exists("/tmp/slimspec_pwned"):
        os.remove("/tmp/slimspec_pwned")
    with pytest.raises(CheckpointError):
        load_drafter(folder)
    assert not os.path.exists("/tmp/slimspec_pwned")


def test_quantised_drafter_is_refused(tmp_path):
    """Catches an FP8/quantised drafter converted from its raw stored values with the scales dropped."""
    written = write_drafter(tmp_path / "d", "specforge", Spec())
    _edit_config(tmp_path / "d", quantization_config={"quant_method": "modelopt", "quant_algo": "FP8"})
    with pytest.raises(CheckpointError, match="quantization_config.*quantised drafter|quantised drafter.*"
                       "quantization_config"):
        load_drafter(tmp_path / "d")
    _edit_config(tmp_path / "d", quantization_config=None)
    q = "midlayer.self_attn.q_proj.weight"
    scale = written[q].abs().max() / 448
    fp8 = {**written, q: (written[q] / scale).to(torch.float8_e4m3fn)}
    save_file(fp8, str(tmp_path / "d" / "model.safetensors"))  # fp8 weights, no scale tensor, no config key
    with pytest.raises(CheckpointError, match="float8_e4m3fn: quantised drafters are not supported"):
        load_drafter(tmp_path / "d")
    save_file({**fp8, q.replace(".weight", ".weight_scale"): scale.reshape(())}, str(tmp_path / "d" /
                                                                                   "model.safetensors"))
    with pytest.raises(CheckpointError, match="scale tensors .*weight_scale.*give the unquantised one"):
        load_drafter(tmp_path / "d")
