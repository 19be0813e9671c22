"""Distillation on a tiny target: teacher data, alignment, the loop, resume, NaN, whitened init, CLI."""

import json
import re
import shutil

import pytest
import torch
from click.testing import CliRunner

import slimspec
from slimspec.checkpoint.target_model import load_target_model
from slimspec.cli import main
from slimspec.distill.pipeline import DataOptions, distill
from slimspec.distill.teacher import TeacherSettings, build_teacher_data
from slimspec.distill.train import DistillConfig, _sequence_inputs
from slimspec.errors import SlimSpecError
from slimspec.prompts import Prompt, load_prompts
from tests.layouts import Spec, assert_same_ttt_forward, write_drafter

pytestmark = pytest.mark.slow
FEW = DataOptions(num_prompts=6, responses="regenerate", max_new_tokens=12)


def test_teacher_features_and_cache(tiny_target, tmp_path, monkeypatch):
    """Catches wrong feature layers (must be HF hidden_states[i], i = layer entered), an un-normed final state,
    a loss mask that covers the prompt, and a cache that reruns the target."""
    prompts = [Prompt("a", "Say hi."), Prompt("b", "Count to three.")]
    settings = TeacherSettings(max_new_tokens=8, aux_layers=(1, 2, 3))
    data = build_teacher_data(tiny_target, prompts, settings, cache_root=tmp_path, progress=False)
    model, _ = load_target_model(tiny_target)
    seq = data.sequence(0)
    out = model(input_ids=seq["input_ids"][None], output_hidden_states=True)
    def aux_of(layers):
        return torch.cat([out.hidden_states[i][0] for i in layers], -1)

    close = {"atol": 1e-3, "rtol": 8e-3}  # stored as bf16: about two roundings
    assert torch.allclose(seq["aux"].float(), aux_of((1, 2, 3)), **close)
    for wrong in ((0, 1, 2), (2, 3, 4)):  # one layer off either way (the off-by-one the docstring names)
        assert not torch.allclose(seq["aux"].float(), aux_of(wrong), **close)
    logits = seq["final"].float() @ model.lm_head.weight.T
    assert torch.allclose(logits, out.logits[0], atol=0.05)
    assert not seq["loss_mask"][0] and seq["loss_mask"][-1]
    monkeypatch.setattr("slimspec.distill.teacher.load_target_model", lambda *a, **k: 1 / 0)
    again = build_teacher_data(tiny_target, prompts, settings, cache_root=tmp_path, progress=False)
    assert torch.equal(again.aux, data.aux) and again.folder == data.folder
    other = TeacherSettings(max_new_tokens=9, aux_layers=(1, 2, 3))
    with pytest.raises(ZeroDivisionError):  # other settings -> other key -> the target must run
        build_teacher_data(tiny_target, prompts, other, cache_root=tmp_path, progress=False)


def test_alignment_indices(tiny_target, tmp_path):
    """Catches the off-by-one that trains and never accepts: step i at position t must be taught by the
    target's distribution at t+1+i, weighted by the loss mask there."""
    prompts = [Prompt("a", "Say hi.")]
    data = build_teacher_data(tiny_target, prompts, TeacherSettings(max_new_tokens=6, aux_layers=(1, 2, 3)),
                              cache_root=tmp_path, progress=False)
    seq, positions, teacher_index, weight = _sequence_inputs(data, 0, 3)
    assert positions == seq["input_ids"].numel() - 3
    for t in (0, positions - 1):
        for i in range(3):
            assert int(teacher_index[t, i]) == t + 1 + i
            assert float(weight[t, i]) == float(seq["loss_mask"][t + 1 + i])


def test_features_hold_answer_positions_only(tiny_converted, tiny_target, tmp_path):
    """Catches batches drawn from prompt positions (zero loss weight at every TTT step): they shrank the real
    batch by more than half on the calibration prompts."""
    from slimspec.checkpoint.drafter import load_drafter
    from slimspec.checkpoint.target_model import load_target_parts
    from slimspec.distill.train import student_features, student_outputs
    from slimspec.model import drafter_model

    prompts = [Prompt("a", "Say hi."), Prompt("b", "Count to three, slowly please.")]
    data = build_teacher_data(tiny_target, prompts, TeacherSettings(max_new_tokens=6, aux_layers=(1, 2, 3)),
                              cache_root=tmp_path, progress=False)
    drafter = drafter_model(load_drafter(tiny_converted), load_target_parts(str(tiny_target)))
    features = student_features(drafter, data, [0, 1], 3)
    expected = []
    for i in (0, 1):
        hidden, teacher_index, weight = student_outputs(drafter, data, i, 3)
        keep = weight.sum(1) > 0
        assert 0 < int(keep.sum()) < keep.numel()  # the prompt rows exist and are dropped
        expected.append((hidden[keep], teacher_index[keep]))
    assert bool((features.weight.sum(1) > 0).all())
    assert torch.equal(features.teacher_index, torch.cat([e[1] for e in expected]))
    torch.testing.assert_close(features.hidden, torch.cat([e[0] for e in expected]).float())


def test_distill_balances_a_lopsided_low_rank_head_first(tiny_converted, tiny_target, tmp_path):
    """Catches ``slimspec distill`` training a low-rank head whose factors have different scales as they are
    (conversions made before the whitened start was balanced: Adam then moved ``w_down`` in huge relative steps
    and ``w_up`` hardly at all). Before the first step each component's two norms must match, the logits kept."""
    from slimspec.checkpoint.drafter import load_drafter
    from slimspec.checkpoint.target_model import load_target_parts
    from slimspec.distill.pipeline import teacher_head_for
    from slimspec.distill.train import train_drafter
    from slimspec.model import LowRankHead, drafter_model

    parts = load_target_parts(str(tiny_target))
    drafter = drafter_model(load_drafter(tiny_converted), parts)
    up, down = drafter.lm_head.up.detach(), drafter.lm_head.down.detach()
    drafter.lm_head = LowRankHead(up * 300.0, down / 300.0)
    h = torch.randn(5, down.shape[1], generator=torch.Generator().manual_seed(0))
    before = drafter.lm_head(h)
    prompts = [Prompt(str(i), p) for i, p in enumerate(["Say hi.", "Count to three.", "Name a colour.", "Why?"])]
    data = build_teacher_data(tiny_target, prompts, TeacherSettings(max_new_tokens=8, aux_layers=(1, 2, 3)),
                              cache_root=tmp_path, progress=False)
    train_drafter(drafter, data, teacher_head_for(drafter, parts), DistillConfig(steps=0, eval_every_nth=2),
                    progress=False)
    head = drafter.lm_head
    torch.testing.assert_close(head.up.norm(dim=0), head.down.norm(dim=1), rtol=1e-4, atol=0.0)
    torch.testing.assert_close(head(h), before, rtol=1e-4, atol=1e-5)


def test_convert_with_whitened_init_and_distill(tiny_converted, tiny_target, tmp_path, capsys):
    """Catches a loop that does not reduce the held-out KL, a missing side-by-side init report (KL and top-1
    agreement), and a report table that shows the random-state agreement of a distilled head (meaningless)."""
    res = slimspec.convert_drafter(str(tmp_path / "drafter"), str(tiny_target), 8, out=tmp_path / "o", init="whitened",
                           distill_steps=15, data_options=FEW, progress=False,
                           distill_config=DistillConfig(lr=1e-2, warmup_steps=2, batch_tokens=256))
    rep = res.report
    assert set(rep["init_kl"]) == {"svd", "whitened"} and rep["init"] == "whitened"
    assert rep["distill"]["kl_after"] < rep["distill"]["kl_before"]
    assert abs(rep["distill"]["kl_before"] - rep["init_kl"]["whitened"]["step0_kl"]) < 1e-4
    assert rep["distill"]["top1_before"] == rep["init_kl"]["whitened"]["step0_top1"]
    assert all(0.0 <= rep["distill"][k] <= 1.0 for k in ("top1_before", "top1_after"))
    saved = json.loads((tmp_path / "o" / "slimspec.json").read_text())
    assert saved["distill"]["steps"] == 15 and saved["distill"]["top1_after"] == rep["distill"]["top1_after"]
    from slimspec.cli import _print_convert_report

    _print_convert_report({"out": str(res.out), **rep})  # as `slimspec convert` prints it
    table = capsys.readouterr().out
    d = rep["distill"]
    assert re.search(rf"top-1 agreement +{d['top1_before']:.3f} -> {d['top1_after']:.3f} \(held-out", table)
    assert f"(top-1 agreement {rep['init_kl']['svd']['step0_top1']:.3f})" in table
    assert "random h" not in table
    card = (tmp_path / "o" / "README.md").read_text()
    assert "not distilled" not in card
    assert f"| held-out KL to the target | {d['kl_before']:.4f} -> {d['kl_after']:.4f} |" in card
    assert f"| held-out top-1 agreement with the target | {d['top1_before']:.4f} -> {d['top1_after']:.4f} |" in card


@pytest.mark.parametrize("parallel", [False, True], ids=["chain", "p-eagle"])
def test_multi_layer_drafter_converts_distils_and_keeps_its_layers(tiny_target, tmp_path, parallel):
    """Catches a multi-layer drafter (speculators layout, 2 decoder layers) losing a layer in conversion: the
    output must declare and carry both (vLLM builds num_hidden_layers of them), its backbone must compute exactly
    the source's states, and the whitened start and the distillation must run through both layers. As a P-EAGLE
    drafter (speculators' peagle), the output must keep mask_hidden and name its mask-slot token (vLLM's parallel
    drafting needs both), and its card must serve it with parallel_drafting; it also has attention biases (vLLM:
    "parallel drafting checkpoints may have attention bias enabled"), which must come through bit-exact with the
    attention_bias flag."""
    from slimspec.checkpoint import load_drafter

    source = tmp_path / "drafter"
    write_drafter(source, "speculators", Spec(vocab=49152, draft_vocab=512, hidden=32, target_hidden=32, layers=2,
                                              parallel_token=7 if parallel else None, attention_bias=parallel,
                                              extra_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}))
    res = slimspec.convert_drafter(str(source), str(tiny_target), 8, vocab="draft", out=tmp_path / "o", init="whitened",
                           distill_steps=10, data_options=FEW, progress=False,
                           distill_config=DistillConfig(lr=1e-2, warmup_steps=2, batch_tokens=256))
    assert res.report["distill"]["kl_after"] < res.report["distill"]["kl_before"]
    assert json.loads((res.out / "config.json").read_text())["num_hidden_layers"] == 2
    src, out = load_drafter(source), load_drafter(res.out)
    assert out.config.num_layers == 2
    later = {k for k in src.tensors if k.startswith("layers.1.")}
    assert len(later) == (13 if parallel else 9) and all(torch.equal(out.tensors[k], src.tensors[k]) for k in later)
    assert out.config.attention_bias == parallel == json.loads((res.out / "config.json").read_text()).get(
        "attention_bias", False)
    assert torch.equal(out.tensors.get("midlayer.self_attn.o_proj.bias", torch.zeros(0)),
                       src.tensors.get("midlayer.self_attn.o_proj.bias", torch.zeros(0)))
    assert out.config.parallel_token_id == (7 if parallel else None)
    assert ("mask_hidden" in out.tensors) == parallel and ('"parallel_drafting":true' in
                                                         (res.out / "README.md").read_text()) == parallel
    if parallel:
        assert torch.equal(out.tensors["mask_hidden"], src.tensors["mask_hidden"])
        assert json.loads((res.out / "config.json").read_text())["ptd_token_id"] == 7
    assert_same_ttt_forward(src, out, tokens=6)


def test_resume_is_bit_for_bit(tiny_converted, tiny_target, tmp_path):
    """Catches a resume that changes the data order, optimizer state or RNG: the resumed run must end
    with exactly the same head as an uninterrupted one; and a resume that loads another run's checkpoint (other
    settings, other teacher data)."""
    cfg = dict(steps=6, save_every=3, batch_tokens=128, warmup_steps=2)
    full_out, full = distill(tiny_converted, str(tiny_target), out=tmp_path / "full", config=DistillConfig(**cfg),
                             data_options=FEW, progress=False)
    # interrupted: run 3 steps (keeping the checkpoint), then resume to 6
    part_cfg = DistillConfig(**cfg)
    import slimspec.distill.train as train

    original = train._lr_at
    calls = {"n": 0}

    def crash_after_three(step, c):
        calls["n"] += 1
        if step == 3:
            raise KeyboardInterrupt
        return original(step, c)

    train._lr_at = crash_after_three
    try:
        with pytest.raises(KeyboardInterrupt):
            distill(tiny_converted, str(tiny_target), out=tmp_path / "part", config=part_cfg, data_options=FEW,
                    progress=False)
    finally:
        train._lr_at = original
    saved = tmp_path / "part.checkpoints" / "step-000003.pt"
    assert not (tmp_path / "part").exists() and saved.exists()
    # a fresh run into the same folder neither ranks below the old checkpoints nor silently deletes them
    with pytest.raises(SlimSpecError, match="holds checkpoints of an earlier run"):
        distill(tiny_converted, str(tiny_target), out=tmp_path / "part", config=DistillConfig(**cfg),
                data_options=FEW, progress=False)
    assert saved.exists()
    # a checkpoint written before a DistillConfig field existed (here: bf16) resumes as that field's default
    state = torch.load(saved, weights_only=True)
    del state["config"]["bf16"]
    torch.save(state, saved)
    with pytest.raises(SlimSpecError, match="other settings \\(bf16 False, now True\\)"):
        distill(tiny_converted, str(tiny_target), out=tmp_path / "part", config=DistillConfig(**cfg, bf16=True),
                data_options=FEW, resume=True, progress=False)
    # --resume where no run saved anything starts nothing (it must not start over and replace the output)
    with pytest.raises(SlimSpecError, match="no checkpoint in .* to resume from"):
        distill(tiny_converted, str(tiny_target), out=tmp_path / "never", config=DistillConfig(**cfg),
                data_options=FEW, resume=True, progress=False)
    assert not (tmp_path / "never").exists()
    # nor a checkpoint of another student: a drafter of the same shapes but other weights resumed silently
    write_drafter(tmp_path / "other", "eagle", Spec(vocab=49152, draft_vocab=512, hidden=32, target_hidden=32,
                                                    seed=9))
    other = slimspec.convert_drafter(str(tmp_path / "other"), str(tiny_target), 8, out=tmp_path / "other-r8",
                             distill_steps=0, progress=False).out
    with pytest.raises(SlimSpecError, match="another source drafter"):
        distill(other, str(tiny_target), out=tmp_path / "part", config=DistillConfig(**cfg), data_options=FEW,
                resume=True, progress=False)
    # nor does one on other teacher data (the saved parameters and optimizer state belong to another run)
    from dataclasses import replace

    with pytest.raises(SlimSpecError, match="other teacher data"):
        distill(tiny_converted, str(tiny_target), out=tmp_path / "part", config=DistillConfig(**cfg),
                data_options=replace(FEW, num_prompts=5), resume=True, progress=False)
    # when checkpoints are written is not part of the run: a resume may change --save-every
    _, resumed = distill(tiny_converted, str(tiny_target), out=tmp_path / "part",
                         config=DistillConfig(**{**cfg, "save_every": 2}), data_options=FEW, resume=True,
                         progress=False)
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in full.history]
    # the training time counts both segments (the model card's minutes), not only the resumed one
    assert resumed.seconds >= resumed.history[-1]["seconds"] >= resumed.history[2]["seconds"] > 0
    assert [h["seconds"] for h in resumed.history] == sorted(h["seconds"] for h in resumed.history)
    from safetensors.torch import load_file

    a, b = load_file(str(full_out / "model.safetensors")), load_file(str(tmp_path / "part" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # --overwrite starts over: an old run's later checkpoint (step 9) must not be taken as this run's latest
    (tmp_path / "again.checkpoints").mkdir()
    torch.save({"step": 9}, tmp_path / "again.checkpoints" / "step-000009.pt")
    _, again = distill(tiny_converted, str(tiny_target), out=tmp_path / "again", config=DistillConfig(**cfg),
                       data_options=FEW, overwrite=True, progress=False)
    assert [h["loss"] for h in again.history] == [h["loss"] for h in full.history]
    assert not list((tmp_path / "again.checkpoints").glob("step-000009.pt"))


def test_one_prompt_has_no_held_out_kl(tiny_converted, tiny_target, tmp_path):
    """Catches a run on one sequence (nothing to hold out) that failed with "no teacher sequence has answer
    tokens" although the training data is fine; its held-out KL is reported as missing, not NaN in JSON."""
    result = CliRunner().invoke(main, ["distill", str(tiny_converted), "-t", str(tiny_target), "--num-prompts", "1",
                                       "--max-new-tokens", "12", "--steps", "2", "--batch-tokens", "64", "-o",
                                       str(tmp_path / "one"), "--json", "-q"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["kl_before"] is None and summary["kl_after"] is None and len(summary["losses"]) == 2
    assert all(v is None for v in summary["kl_after_per_step"])
    def strict(text):  # NaN is not JSON: other tools' parsers refuse it
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} written"))

    for name in ("config.json", "slimspec.json"):
        strict((tmp_path / "one" / name).read_text())


def test_nan_stops_with_clear_message(tiny_converted, tiny_target, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tiny_converted / "model.safetensors"
    tensors = load_file(str(path))
    tensors["lm_head_down.weight"][0, 0] = float("nan")
    save_file(tensors, str(path))
    result = CliRunner().invoke(main, ["distill", str(tiny_converted), "-t", str(tiny_target), "--steps", "3",
                                       "--num-prompts", "4", "--max-new-tokens", "8", "-o", str(tmp_path / "o"),
                                       "-q"])
    assert result.exit_code == 2
    assert "loss became nan at step 1" in result.stderr and not (tmp_path / "o").exists()


def test_cli_distill_json(tiny_converted, tiny_target, tmp_path):
    """Catches a distilled folder whose card still says the pair is not distilled (the conversion's note stays
    until distillation removes it) or loses the card's other text."""
    from slimspec.checkpoint.writer import NOT_DISTILLED_NOTE

    source_card = (tiny_converted / "README.md").read_text()
    assert NOT_DISTILLED_NOTE in source_card
    result = CliRunner().invoke(main, ["distill", str(tiny_converted), "-t", str(tiny_target), "--steps", "4",
                                       "--num-prompts", "4", "--max-new-tokens", "8", "--batch-tokens", "64",
                                       "-o", str(tmp_path / "o"), "--json", "-q"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["steps"] == 4 and summary["kl_after"] > 0
    assert json.loads((tmp_path / "o" / "config.json").read_text())["slimspec"]["distilled_steps"] == 4
    card = (tmp_path / "o" / "README.md").read_text()
    assert "not distilled" not in card and "\n## Distillation\n\n4 steps of full-vocabulary KL" in card
    assert card.startswith(source_card.replace(NOT_DISTILLED_NOTE, "")) and "\n\n\n" not in card


def test_prompts_sources(tmp_path):
    rows = [{"turns": ["hello"]}, {"messages": [{"role": "user", "content": "hi there"}]}, {"prompt": "p"}]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert [p.text for p in load_prompts(str(tmp_path / "*.jsonl"))] == ["hello", "hi there", "p"]
    assert len(load_prompts(None)) == 300
    # a U+2028 inside a JSON string is not a line break (str.splitlines would split it)
    (tmp_path / "b.jsonl").write_text(json.dumps({"turns": ["one\u2028two"]}, ensure_ascii=False) + "\n")
    assert load_prompts(str(tmp_path / "b.jsonl"))[0].text == "one\u2028two"
    assert len(load_prompts(str(tmp_path / "*.jsonl"), limit=2)) == 2


def test_from_scratch_trains_an_eagle_layout_drafter(tiny_target, tmp_path):
    """Catches a from-scratch drafter that does not learn or is not a valid EAGLE-layout checkpoint:
    the held-out KL must fall, and the folder must load and convert like any published drafter."""
    from slimspec.checkpoint import load_drafter

    result = CliRunner().invoke(main, ["distill", "--from-scratch", "-t", str(tiny_target), "--draft-vocab", "300",
                                       "--steps", "25", "--lr", "5e-3", "--num-prompts", "8", "--max-new-tokens",
                                       "16", "--batch-tokens", "128", "-o", str(tmp_path / "scratch"), "--json", "-q"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["kl_after"] < summary["kl_before"]
    ckpt = load_drafter(tmp_path / "scratch")
    assert ckpt.layout == "eagle" and ckpt.config.draft_vocab_size == 300 and ckpt.dtype == torch.float16
    assert ckpt.tensors["t2d"].sum() == 300
    res = slimspec.convert_drafter(str(tmp_path / "scratch"), str(tiny_target), 4, out=tmp_path / "conv",
                                   distill_steps=0, progress=False)
    assert res.report["rows_from_drafter"] == 300


def test_from_scratch_records_its_feature_layers_and_low_rank_head(tiny_target, tmp_path):
    """Catches `--from-scratch --aux-layers` training on layers its config does not name (later reads use the
    default layers), ids read in the wrong convention, an fc sized for 3 states when 2 are given, and a
    `--head-rank` drafter written as a plain Llama EAGLE config that stock vLLM would load with a [V, r] head."""
    from slimspec.checkpoint import load_drafter
    from slimspec.checkpoint.target_model import aux_layers_for
    from slimspec.evaluate.acceptance import evaluate

    result = CliRunner().invoke(main, ["distill", "--from-scratch", "-t", str(tiny_target), "--draft-vocab", "300",
                                       "--head-rank", "4", "--aux-layers", "0,2", "--aux-convention", "output",
                                       "--steps", "2", "--num-prompts", "4", "--max-new-tokens", "8",
                                       "--batch-tokens", "128", "-o", str(tmp_path / "scratch"), "--json", "-q"])
    assert result.exit_code == 0, result.output
    ckpt = load_drafter(tmp_path / "scratch")
    assert aux_layers_for(ckpt.config.aux_layer_ids, ckpt.layout, 4, ckpt.aux_convention) == (1, 3)
    assert ckpt.tensors["fc.weight"].shape[1] == 2 * 32 and ckpt.config.num_aux_hidden_states == 2
    assert ckpt.layout == "slimspec" and ckpt.is_lowrank and ckpt.tensors["lm_head_down.weight"].shape == (4, 32)
    config = json.loads((tmp_path / "scratch" / "config.json").read_text())
    assert config["architectures"] == ["Eagle3SlimSpecLlamaForCausalLM"] and config["slimspec"]["rank"] == 4
    training = json.loads((tmp_path / "scratch" / "training.json").read_text())
    assert training["teacher"]["aux_layers"] == [1, 3]  # the layers it was trained on
    assert evaluate(str(tmp_path / "scratch"), str(tiny_target), num_prompts=1, max_new_tokens=4,
                    progress=False)["tau"] >= 1.0


def test_from_scratch_layers_trains_every_layer_and_writes_them(tiny_target, tmp_path):
    """Catches `--from-scratch --layers N` writing a 1-layer drafter (or a config that does not declare the layers
    its weights hold) and a later layer left at its random start (not in the optimizer, or not on the forward path);
    and `--layers`/`--head-rank`/`--draft-vocab` silently ignored without --from-scratch."""
    from slimspec.checkpoint import load_drafter
    from slimspec.checkpoint.target_model import load_target_parts
    from slimspec.distill.scratch import init_drafter

    result = CliRunner().invoke(main, ["distill", "--from-scratch", "-t", str(tiny_target), "--draft-vocab", "300",
                                       "--layers", "2", "--steps", "3", "--lr", "5e-3", "--backbone-lr", "5e-3",
                                       "--num-prompts", "4",
                                       "--max-new-tokens", "8", "--batch-tokens", "128", "-o",
                                       str(tmp_path / "scratch"), "--json", "-q"])
    assert result.exit_code == 0, result.output
    ckpt = load_drafter(tmp_path / "scratch")
    config = json.loads((tmp_path / "scratch" / "config.json").read_text())
    assert ckpt.layout == "eagle" and ckpt.config.num_layers == 2 and config["num_hidden_layers"] == 2
    start = init_drafter(ckpt.config, load_target_parts(str(tiny_target)), ckpt.tensors["t2d"].nonzero()[:, 0],
                         None, seed=0).canonical_state_dict(with_embedding=False)
    for name in ("midlayer.self_attn.q_proj.weight", "layers.1.self_attn.q_proj.weight",
                 "layers.1.mlp.down_proj.weight"):
        moved = (ckpt.tensors[name].float() - start[name].float()).abs()
        assert moved.mean() > 1e-3, name  # 3 Adam steps at ~5e-3 each; fp16 rounding of ~0.02 weights is ~1e-5
    for flag in (["--layers", "2"], ["--head-rank", "4"], ["--draft-vocab", "300"]):
        refused = CliRunner().invoke(main, ["distill", str(tmp_path / "scratch"), "-t", str(tiny_target), *flag])
        assert refused.exit_code == 2 and "--from-scratch" in refused.output, refused.output


def test_bf16_from_scratch_tracks_fp32(tiny_target, tmp_path):
    """``--bf16`` (autocast backbone, bf16 KL matmuls). Catches a flag that is not wired through (losses identical
    to fp32's, or not recorded in the config) and a mixed-precision path that does not learn or drifts from fp32:
    same seed and data, the held-out KL (always measured in fp32) must fall and land within 10 % of fp32's."""
    runs = {}
    for name, flag in (("fp32", []), ("bf16", ["--bf16"])):
        result = CliRunner().invoke(main, ["distill", "--from-scratch", "-t", str(tiny_target), "--draft-vocab", "300",
                                           "--steps", "25", "--lr", "5e-3", "--num-prompts", "8", "--max-new-tokens",
                                           "16", "--batch-tokens", "128", "-o", str(tmp_path / name), "--json", "-q",
                                           *flag])
        assert result.exit_code == 0, result.output
        runs[name] = json.loads(result.stdout)
    fp32, bf16 = runs["fp32"], runs["bf16"]
    assert bf16["config"]["bf16"] is True and fp32["config"]["bf16"] is False
    assert bf16["losses"] != fp32["losses"]
    assert bf16["kl_before"] == pytest.approx(fp32["kl_before"], rel=1e-6)  # same init, fp32 evaluation
    assert bf16["kl_after"] < bf16["kl_before"]
    assert bf16["kl_after"] == pytest.approx(fp32["kl_after"], rel=0.1)


def test_interrupted_generation_resumes(tiny_target, tmp_path, monkeypatch):
    """Catches a teacher build that starts over after a kill: finished answers come from the journal."""
    import slimspec.distill.teacher as teacher

    prompts = [Prompt(str(i), f"Question number {i}?") for i in range(6)]
    settings = TeacherSettings(max_new_tokens=6, aux_layers=(1, 2, 3), generation_batch=2)
    original = teacher._features

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(teacher, "_features", killed)  # dies after generation, before features
    with pytest.raises(KeyboardInterrupt):
        build_teacher_data(tiny_target, prompts, settings, cache_root=tmp_path, progress=False)
    journals = list(tmp_path.glob(".*.responses.jsonl"))
    assert len(journals) == 1 and len(journals[0].read_text().splitlines()) == 6
    monkeypatch.setattr(teacher, "_features", original)
    calls = []
    from transformers import LlamaForCausalLM

    monkeypatch.setattr(LlamaForCausalLM, "generate", lambda *a, **k: calls.append(1) or 1 / 0)
    data = build_teacher_data(tiny_target, prompts, settings, cache_root=tmp_path, progress=False)
    assert len(data) == 6 and not calls and not list(tmp_path.glob(".*.responses.jsonl"))


def test_self_teacher_head_is_the_source_distribution(tiny_converted, tiny_target, tmp_path):
    """Catches a drafter teacher that puts mass outside the source's draft vocabulary, or maps its rows to the
    wrong target tokens: softmax([h, 1] @ teacher.T) must equal the source head's softmax scattered through d2t
    (float64 reference)."""
    from slimspec.checkpoint.drafter import load_drafter
    from slimspec.checkpoint.target_model import load_target_parts
    from slimspec.distill.pipeline import self_teacher_head

    source = load_drafter(tmp_path / "drafter")
    parts = load_target_parts(str(tiny_target))
    head = source.head_weight().double()
    ids = source.draft_to_target_ids()
    h = torch.randn(5, head.shape[1], dtype=torch.float64)
    expected = torch.zeros(5, parts.head.shape[0], dtype=torch.float64)
    expected[:, ids] = torch.softmax(h @ head.T, -1)
    for rows, want in ((parts.head.shape[0], expected), (head.shape[0], expected[:, ids])):
        teacher = self_teacher_head(source, parts, rows).double()
        got = torch.softmax(torch.cat([h, torch.ones(5, 1, dtype=torch.float64)], 1) @ teacher.T, -1)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_drafter_teacher_recovers_the_source_head(tiny_target, tmp_path):
    """Catches a drafter teacher that does not teach the source's choices: after distilling a rank-4 draft-vocab
    head against the source drafter, its argmax must agree with the source head's on held-out drafter states
    more often than the SVD start does, and the held-out KL to the source must fall."""
    from slimspec.checkpoint.drafter import load_drafter
    from slimspec.checkpoint.target_model import load_target_parts
    from slimspec.distill.pipeline import teacher_for
    from slimspec.distill.train import split_sequences, student_features
    from slimspec.model import drafter_model

    write_drafter(tmp_path / "drafter", "eagle", Spec(vocab=49152, draft_vocab=512, hidden=32, target_hidden=32))
    options = DataOptions(num_prompts=8, responses="regenerate", max_new_tokens=16)
    cfg = DistillConfig(lr=2e-2, warmup_steps=2, batch_tokens=256, teacher="drafter")
    runs = {}
    for steps in (0, 40):
        res = slimspec.convert_drafter(str(tmp_path / "drafter"), str(tiny_target), 4, vocab="draft", init="svd",
                               out=tmp_path / f"o{steps}", distill_steps=steps, data_options=options,
                               distill_config=cfg, progress=False)
        runs[steps] = res
    parts = load_target_parts(str(tiny_target))
    source = load_drafter(tmp_path / "drafter")
    teacher = teacher_for(source, parts, options, False)
    _, held = split_sequences(teacher, cfg.eval_every_nth)
    states = student_features(drafter_model(source, parts), teacher, held, 3, all_positions=True).hidden
    states = states.reshape(-1, states.shape[-1]).double()
    wanted = (states @ source.head_weight().double().T).argmax(-1)
    agreement = {}
    for steps, res in runs.items():
        out = load_drafter(res.out)
        agreement[steps] = float(((states @ out.head_weight().double().T).argmax(-1) == wanted).double().mean())
    distilled = runs[40].report["distill"]
    assert distilled["config"]["teacher"] == "drafter"
    assert distilled["kl_after"] < 0.8 * distilled["kl_before"], distilled["kl_after"]
    assert agreement[40] > agreement[0] + 0.05, agreement


def test_distill_cli_drafter_teacher_finds_the_source(tiny_converted, tiny_target, tmp_path, monkeypatch):
    """Catches `distill --teacher drafter` on a conversion that ignores the recorded source drafter (its own head
    as teacher would be a no-op with KL 0), and a plain drafter that is accepted with nothing to learn from, or
    refused only after its teacher data was built (hours on a large target)."""
    args = ["--steps", "3", "--num-prompts", "4", "--max-new-tokens", "8", "--teacher", "drafter", "-q"]
    result = CliRunner().invoke(main, ["distill", str(tiny_converted), "-t", str(tiny_target), "-o",
                                       str(tmp_path / "o"), *args])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "o" / "slimspec.json").read_text())["distill"]
    assert report["config"]["teacher"] == "drafter" and report["kl_before"] > 1e-3
    import slimspec.distill.pipeline as pipeline

    def no_teacher(*args, **kwargs):
        raise AssertionError("teacher data built before the drafter teacher was checked")

    monkeypatch.setattr(pipeline, "teacher_for", no_teacher)
    plain = CliRunner().invoke(main, ["distill", str(tmp_path / "drafter"), "-t", str(tiny_target), "-o",
                                      str(tmp_path / "p"), *args])
    assert plain.exit_code == 2 and "names no source drafter" in plain.stderr


def test_drafter_teacher_with_backbone_scores_the_frozen_source(tiny_target, tmp_path):
    """Catches a drafter teacher that scores the *moving* student's states once the backbone trains (the student
    could then shift its states to agree with itself): the reported held-out KL after training must equal a
    float64 KL between the source head on the source drafter's states and the trained student on its own."""
    from slimspec.checkpoint.drafter import load_drafter
    from slimspec.checkpoint.target_model import load_target_parts
    from slimspec.distill.pipeline import distill_teacher_head, teacher_for
    from slimspec.distill.train import source_states, split_sequences, student_features, train_drafter
    from slimspec.model import drafter_model

    write_drafter(tmp_path / "drafter", "eagle", Spec(vocab=49152, draft_vocab=512, hidden=32, target_hidden=32))
    options = DataOptions(num_prompts=8, responses="regenerate", max_new_tokens=16)
    res = slimspec.convert_drafter(str(tmp_path / "drafter"), str(tiny_target), 4, vocab="draft", init="svd",
                           out=tmp_path / "o", distill_steps=0, data_options=options, progress=False)
    parts = load_target_parts(str(tiny_target))
    source = load_drafter(tmp_path / "drafter")
    converted = load_drafter(res.out)
    student = drafter_model(converted, parts)
    teacher = teacher_for(source, parts, options, False)
    head = distill_teacher_head(source, student, parts, "drafter")
    cfg = DistillConfig(steps=15, lr=2e-2, backbone_lr=5e-3, warmup_steps=2, batch_tokens=256, teacher="drafter",
                        train_backbone=True)
    train_idx, held = split_sequences(teacher, cfg.eval_every_nth)
    frozen = source_states(drafter_model(source, parts), teacher, train_idx + held, 3)
    before = student_features(student, teacher, held, 3, source_rows=True)
    torch.testing.assert_close(before.hidden.reshape(-1, 32), frozen[before.teacher_index.reshape(-1)])
    fc_before = student.fc.weight.detach().clone()
    result = train_drafter(student, teacher, head, cfg, progress=False)
    assert not torch.equal(student.fc.weight, fc_before), "the backbone did not train"
    after = student_features(student, teacher, held, 3, source_rows=True)
    h, rows = after.hidden[:, 0].double(), after.teacher_index[:, 0]
    src = torch.cat([frozen[rows].double(), torch.ones(rows.numel(), 1, dtype=torch.float64)], 1) @ head.double().T
    down, up = student.lm_head.weight_down.double(), student.lm_head.weight_up.double()
    student_logp = torch.log_softmax(h @ down.T @ up.T, -1)
    teacher_logp = torch.log_softmax(src, -1)
    w = after.weight[:, 0].double()
    kl = ((teacher_logp.exp() * (teacher_logp - student_logp)).sum(1) * w).sum() / w.sum()
    assert abs(float(kl) - result.kl_after) < 1e-3 * max(1.0, float(kl)), (float(kl), result.kl_after)
    assert result.kl_after < result.kl_before
    # the held-out top-1 agreement is scored the same way: the frozen source's argmax against the student's
    same = (student_logp.argmax(1) == teacher_logp.argmax(1)).double()
    assert result.top1_after_per_step[0] == pytest.approx(float((same * w).sum() / w.sum()), abs=1e-6)


def test_same_shaped_target_rebuilds_the_teacher_cache(tiny_target, tmp_path):
    """Catches a teacher cache reused for another target of the same shapes (checkpoints of one fine-tune: the key
    names only the config and file sizes): its features must be the new target's own, and the first target's
    come back when it is used again."""
    import shutil

    from transformers import LlamaForCausalLM

    from slimspec.distill.teacher import cache_key

    other = tmp_path / "other-target"
    shutil.copytree(tiny_target, other)
    model = LlamaForCausalLM.from_pretrained(other)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.01 * torch.randn_like(param))
    model.save_pretrained(other)
    prompts = [Prompt("a", "Say hi."), Prompt("b", "Count to three.")]
    settings = TeacherSettings(max_new_tokens=6, aux_layers=(1, 2, 3))
    assert cache_key(tiny_target, prompts, settings) == cache_key(other, prompts, settings)

    def own_features(target, data):
        model, _ = load_target_model(target)
        seq = data.sequence(0)
        out = model(input_ids=seq["input_ids"][None], output_hidden_states=True)
        return seq["aux"].float(), torch.cat([out.hidden_states[i][0] for i in (1, 2, 3)], -1)

    first = build_teacher_data(tiny_target, prompts, settings, cache_root=tmp_path / "c", progress=False)
    second = build_teacher_data(other, prompts, settings, cache_root=tmp_path / "c", progress=False)
    stored, expected = own_features(other, second)
    assert torch.allclose(stored, expected, atol=1e-3, rtol=8e-3)
    assert not torch.equal(second.aux, first.aux)
    again = build_teacher_data(tiny_target, prompts, settings, cache_root=tmp_path / "c", progress=False)
    stored, expected = own_features(tiny_target, again)
    assert torch.allclose(stored, expected, atol=1e-3, rtol=8e-3)
    # a cache that cannot be removed (read-only shared cache) must never come back as the other target's data
    import slimspec.distill.teacher as teacher_module

    real_rmtree = shutil.rmtree
    try:
        teacher_module.shutil.rmtree = lambda *a, **k: None
        with pytest.raises(SlimSpecError, match="another target with the same shapes"):
            build_teacher_data(other, prompts, settings, cache_root=tmp_path / "c", progress=False)
    finally:
        teacher_module.shutil.rmtree = real_rmtree


def test_journal_line_cut_by_a_kill_does_not_swallow_the_next(tmp_path):
    """Catches answers appended right after a line a kill cut off: the next (whole) line merged into the broken
    one and was lost on resume (the static engine then crashed on a missing batch)."""
    import json

    from slimspec.distill.teacher import _append_lines

    journal = tmp_path / "j.jsonl"
    journal.write_text('{"i": 0, "tokens": [1, 2]}\n{"i": 1, "tok')
    _append_lines(journal, json.dumps({"i": 2, "tokens": [3]}) + "\n")
    rows = []
    for line in journal.read_text().split("\n"):
        try:
            rows.append(json.loads(line)["i"])
        except (json.JSONDecodeError, KeyError):
            continue
    assert rows == [0, 2]


def test_a_teacher_build_waits_for_another_of_the_same_key(tiny_target, tmp_path):
    """Catches two runs building one cache key at once (they numbered, read and deleted each other's batches and
    journal): a build must wait while another holds the key's lock, then use or finish the cache."""
    import fcntl
    import threading
    import time

    from slimspec.distill.teacher import teacher_location

    prompts = [Prompt("a", "Say hi.")]
    settings = TeacherSettings(max_new_tokens=4, aux_layers=(1, 2, 3), engine="static", generation_dtype="float32")
    where = teacher_location(tiny_target, prompts, settings, tmp_path)
    tmp_path.mkdir(exist_ok=True)
    done = []
    with open(tmp_path / f".{where.key}.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        worker = threading.Thread(target=lambda: done.append(
            build_teacher_data(tiny_target, prompts, settings, cache_root=tmp_path, progress=False)))
        worker.start()
        time.sleep(2.0)
        assert worker.is_alive() and not done and not where.work.exists()  # waiting, nothing written
        fcntl.flock(held, fcntl.LOCK_UN)
    worker.join(timeout=120)
    assert done and (where.folder / "manifest.json").exists()


def test_distill_trains_on_the_chosen_device(tiny_converted, tiny_target, tmp_path, monkeypatch, pretend_gpus):
    """Catches `distill --device` (or auto with a GPU) reaching the teacher data only: the head's steps then ran on
    CPU cores beside an idle GPU. The cache is built on the CPU first (same key: float32 answers), then a pretended
    GPU run must hand its device to the loop; $SLIMSPEC_DEVICE=cpu keeps it on the CPU."""
    import slimspec.distill.pipeline as pipeline

    options = DataOptions(num_prompts=6, responses="regenerate", max_new_tokens=12, generation_dtype="float32")
    distill(tiny_converted, str(tiny_target), out=tmp_path / "cpu", config=DistillConfig(steps=1, batch_tokens=64),
            data_options=options, progress=False)
    asked = []

    def recording(*args, device=None, **kwargs):
        asked.append(str(device))
        raise SlimSpecError("stop here")

    monkeypatch.setattr(pipeline, "train_drafter", recording)
    for setting, want in ((None, "cuda"), ("cpu", "cpu")):
        pretend_gpus(1)
        if setting is not None:
            monkeypatch.setenv("SLIMSPEC_DEVICE", setting)
        with pytest.raises(SlimSpecError, match="stop here"):
            distill(tiny_converted, str(tiny_target), out=tmp_path / "gpu", config=DistillConfig(steps=1),
                    data_options=options, progress=False, overwrite=True)
        assert asked[-1] == want


def test_distilling_a_drafter_with_unknown_tensors_warns(tiny_converted, tiny_target, tmp_path):
    """Catches `distill` writing a drafter without the source tensors it does not know, without a word (the output is
    written from the canonical tensors only)."""
    from safetensors.torch import load_file, save_file

    from slimspec.errors import SlimSpecWarning

    source = tmp_path / "source"
    shutil.copytree(tiny_converted, source)
    tensors = load_file(str(source / "model.safetensors"))
    save_file({**tensors, "adapter.scale": torch.ones(2)}, str(source / "model.safetensors"))
    with pytest.warns(SlimSpecWarning, match=r"1 tensor\(s\) of an unknown kind are not carried into the output: "
                                             r"adapter\.scale"):
        out, _ = distill(source, str(tiny_target), out=tmp_path / "o", data_options=FEW, progress=False,
                         config=DistillConfig(steps=1, batch_tokens=128, warmup_steps=1))
    assert "adapter.scale" not in load_file(str(out / "model.safetensors"))


def _synthetic_teacher(answers: list[bool], length: int = 12, vocab: int = 50, hidden: int = 16):
    """TeacherData of random sequences; answers[i] False: sequence i is all prompt (no position teaches)."""
    from slimspec.distill.teacher import TeacherData

    g = torch.Generator().manual_seed(0)
    masks = []
    for answered in answers:
        mask = torch.zeros(length, dtype=torch.bool)
        mask[4:] = answered
        masks.append(mask)
    n = length * len(answers)
    return TeacherData(input_ids=torch.randint(0, vocab, (n,), generator=g), loss_mask=torch.cat(masks),
                       aux=torch.randn(n, 3 * hidden, generator=g), final=torch.randn(n, hidden, generator=g),
                       starts=torch.arange(0, n + 1, length), manifest={"key": "synthetic"})


def test_backbone_training_without_weighted_rows(tmp_path):
    """Catches --train-backbone (and --from-scratch) crashing with "element 0 of tensors does not require grad"
    when a step draws only sequences without answer positions, and training nothing, silently, when no sequence
    has any (a head-only run refuses that in one line; now both do)."""
    from slimspec.checkpoint.drafter import DrafterConfig
    from slimspec.distill.train import train_drafter
    from slimspec.model import Eagle3Drafter, LowRankHead

    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                        intermediate_size=32, target_hidden_size=16, vocab_size=50, draft_vocab_size=50)
    drafter = Eagle3Drafter(cfg, head=LowRankHead(torch.randn(50, 4) * 0.1, torch.randn(4, 16) * 0.1),
                            embed_weight=torch.randn(50, 16))
    head = torch.randn(50, 16)
    with pytest.raises(SlimSpecError, match="no teacher sequence has answer tokens"):
        train_drafter(drafter, _synthetic_teacher([False] * 6), head,
                        DistillConfig(steps=2, train_backbone=True), progress=False)
    # one sequence per step (batch_tokens 1), most of them without answers: steps without rows just pass
    result = train_drafter(drafter, _synthetic_teacher([True, False, False, False, False, False, True, False]),
                             head, DistillConfig(steps=8, train_backbone=True, batch_tokens=1, warmup_steps=0),
                             progress=False)
    assert len(result.history) == 8 and any(h["loss"] == 0 for h in result.history)
    assert any(h["loss"] > 0 for h in result.history)
