"""The experiment losses of scripts/distill_variants.py (BENCHMARKS.md rows are rebuilt with them)."""

from types import SimpleNamespace

import pytest
import torch

from slimspec.distill.teacher import TeacherData
from tests.scripts import SCRIPTS, load_script


def test_reverse_kl_matches_float64_and_keeps_forward_kl_for_evaluation():
    """Catches a swapped KL direction (the reverse row would then be the forward one), a wrong token weighting, and
    the held-out KL (no gradients) switching to the reverse KL, which would make its rows incomparable."""
    variants = load_script("distill_variants")
    g = torch.Generator().manual_seed(0)
    h, down, up = torch.randn(7, 5, generator=g), torch.randn(3, 5, generator=g), torch.randn(11, 3, generator=g)
    th, head, w = torch.randn(7, 4, generator=g), torch.randn(11, 4, generator=g), torch.rand(7, generator=g)
    down.requires_grad_(True)
    loss = variants.reverse_kl_when_training(lambda *a, **k: "forward")(h, down, up, th, head, weights=w)
    loss.backward()

    d64 = down.detach().double().requires_grad_(True)
    log_p = torch.log_softmax(th.double() @ head.double().T, -1)
    log_q = torch.log_softmax(h.double() @ d64.T @ up.double().T, -1)
    ref = (w.double() * (log_q.exp() * (log_q - log_p)).sum(-1)).sum() / w.double().sum()
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(down.grad.double(), d64.grad, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        assert variants.reverse_kl_when_training(lambda *a, **k: "forward")(h, down, up, th, head) == "forward"


def test_target_ce_labels_the_next_token_within_the_sequence_and_draft_vocab():
    """Catches an off-by-one in the label (TTT row ``here`` predicts token ``here + 1``), a label taken across a
    sequence boundary or past the end, prompt tokens used as labels, and target tokens outside the draft
    vocabulary mapped onto some draft row."""
    variants = load_script("distill_variants")
    g = torch.Generator().manual_seed(1)
    d2t = torch.tensor([2, 4, 6, 8, 10, 12])  # draft row -> target id
    up, down = torch.randn(6, 3, generator=g), torch.randn(3, 5, generator=g)
    drafter = SimpleNamespace(lm_head=SimpleNamespace(weight_up=up, weight_down=down),
                              draft_to_target=lambda ids: d2t[ids])
    ids = torch.tensor([1, 4, 6, 7, 8, 2, 10, 12, 4])  # two sequences: tokens 0-4 and 5-8
    mask = torch.tensor([0, 1, 1, 1, 1, 0, 0, 1, 1], dtype=torch.bool)
    teacher = TeacherData(input_ids=ids, loss_mask=mask, aux=torch.zeros(9, 1), final=torch.zeros(9, 1),
                          starts=torch.tensor([0, 5, 9]))
    here = torch.tensor([[0], [1], [2], [4], [5], [6], [8]])  # one TTT step
    hidden = torch.randn(7, 1, 5, generator=g)
    terms = variants.with_target_ce(lambda *a, **k: (torch.zeros(()), [0.0]), alpha=0.7)
    total, _ = terms(drafter, hidden, here, torch.ones(7, 1), teacher, None, 0.8)
    # row 0 -> token 4 (draft 1); row 1 -> token 6 (draft 2); row 2 -> 7 (not drafted); row 3 -> next sequence;
    # row 4 -> token 10 but a prompt token; row 5 -> 12 (draft 5); row 6 -> past the end
    rows, labels = torch.tensor([0, 1, 5]), torch.tensor([1, 2, 5])
    logits = hidden[rows, 0].double() @ down.double().T @ up.double().T
    expected = 0.7 * torch.nn.functional.cross_entropy(logits, labels)
    torch.testing.assert_close(total.double(), expected, rtol=1e-5, atol=1e-6)


def test_variant_options_reach_the_calibration_data_and_other_keys_the_distillation(tmp_path, monkeypatch):
    """Catches a variant's ``options`` (DataOptions fields: which prompts, sampled answers) being dropped or sent
    to the distillation config, and the recipe's other data settings (64-token answers, static engine) being lost
    when one field is overridden: the sampled-answer and chat-calibration rows would then measure the demo's data."""
    import sys

    variants = load_script("distill_variants")
    sys.path.insert(0, str(SCRIPTS))
    import rank_sweep

    import slimspec.convert.pipeline as convert_pipeline
    import slimspec.hub as hub

    calls = []

    def fake_convert(source, target, rank, **kwargs):
        calls.append(kwargs)
        return SimpleNamespace(report={"distill": {"kl_after_per_step": [0.5]}, "teacher": {"tokens": 3}})

    monkeypatch.setattr(convert_pipeline, "convert", fake_convert)
    monkeypatch.setattr(hub, "resolve_model", lambda spec, kind: tmp_path)
    monkeypatch.setattr(rank_sweep, "VllmTau", lambda: (lambda folder: {"tau": 1.5}))
    out = tmp_path / "rows.jsonl"
    args = ['[{"name": "s", "steps": 7, "options": {"temperature": 1.0, "seed": 3, "data": ["a.jsonl"]}}]',
            "--out", str(out), "--work", str(tmp_path / "work")]
    assert variants.main(args) == 0
    (kw,) = calls
    data, cfg = kw["data_options"], kw["distill_config"]
    assert (data.temperature, data.seed, data.data) == (1.0, 3, ["a.jsonl"])
    assert (data.max_new_tokens, data.engine, data.num_prompts) == (64, "static", None)
    assert cfg.steps == kw["distill_steps"] == 7 and cfg.teacher == "drafter"
    assert cfg.seed == 0  # the data seed stays with the data


def test_feature_noise_perturbs_only_training_states_by_the_stated_amount():
    """Catches the augmentation leaking into the held-out KL (no gradients: states must arrive untouched), a scale
    applied to the wrong quantity (iso: per-row RMS; data: the difference of two random rows of the batch), and
    a perturbation that is not there at all (the augmentation rows would then measure the plain recipe)."""
    variants = load_script("distill_variants")
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(4000, 2, 6, generator=g) * torch.tensor([1.0, 3.0, 0.1, 2.0, 5.0, 0.5])
    seen = []
    inner = lambda drafter, h, *a, **k: (seen.append(h) or torch.zeros(()), [])  # noqa: E731
    with torch.no_grad():
        variants.with_feature_noise(inner, {"kind": "iso", "scale": 0.5})(None, hidden)
    assert seen[-1] is hidden
    variants.with_feature_noise(inner, {"kind": "iso", "scale": 0.5})(None, hidden)
    delta = seen[-1] - hidden
    rms = hidden.pow(2).mean(-1, keepdim=True).sqrt()
    ratio = (delta / rms).std()
    assert abs(float(ratio) - 0.5) < 0.01
    variants.with_feature_noise(inner, {"kind": "data", "scale": 0.25})(None, hidden)
    delta = seen[-1] - hidden
    # a difference of two independent rows has twice the per-dimension variance of the data
    expected = 0.25 * (2 * hidden.var(0)).sqrt()
    torch.testing.assert_close(delta.std(0), expected, rtol=0.08, atol=1e-3)


def test_interpolated_heads_lie_between_start_and_end_and_keep_the_rest(tmp_path):
    """Catches the interpolation running the wrong way (alpha = 0 must give the start, 1 the distilled head), a
    factor left out, the drafter's other tensors or config changing, and two unrelated conversions being mixed."""
    from safetensors.torch import load_file, save_file

    variants = load_script("distill_variants")
    g = torch.Generator().manual_seed(3)
    body = torch.randn(4, 6, generator=g)
    heads = {}
    for name in ("start", "final"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text('{"architectures": ["Eagle3SlimSpecLlamaForCausalLM"]}')
        heads[name] = {"lm_head.weight": torch.randn(9, 2, generator=g), "lm_head_down.weight": torch.randn(2, 6,
                                                                                                        generator=g)}
        save_file({**heads[name], "fc.weight": body}, str(folder / "model.safetensors"))
    for alpha in (0.0, 0.25, 1.0):
        out = variants.interpolate_heads(tmp_path / "final", tmp_path / "start", alpha, tmp_path / f"a{alpha}")
        got = load_file(str(out / "model.safetensors"))
        for k, start in heads["start"].items():
            torch.testing.assert_close(got[k], start + alpha * (heads["final"][k] - start))
        assert torch.equal(got["fc.weight"], body)
        assert (out / "config.json").read_text() == (tmp_path / "final" / "config.json").read_text()
    save_file({**heads["start"], "fc.weight": body + 1}, str(tmp_path / "start" / "model.safetensors"))
    with pytest.raises(SystemExit, match="differ outside the head"):
        variants.interpolate_heads(tmp_path / "final", tmp_path / "start", 0.5, tmp_path / "bad")


def test_tied_up_head_keeps_the_start_and_stays_in_the_source_heads_column_space():
    """Catches the tied parametrisation changing the start it is handed (the product W_up W_down must survive the
    rebalance and the change of basis), training V x r weights after all, and a W_up that leaves the source
    head's column space after a step (the variant would then measure the plain recipe)."""
    from slimspec.model import LowRankHead

    variants = load_script("distill_variants")
    g = torch.Generator().manual_seed(4)
    source = torch.randn(40, 6, generator=g, dtype=torch.float64).float()  # [V, d]
    up = source @ torch.randn(6, 3, generator=g) * 5.0  # a start inside the column space, lopsided in scale
    down = torch.randn(3, 6, generator=g) * 0.1
    drafter = SimpleNamespace(lm_head=LowRankHead(up, down))
    teacher_head = torch.cat([source, torch.zeros(40, 1)], dim=1)  # the drafter teacher's bias column is dropped
    seen = {}

    def fake_distill(d, teacher, head, cfg, **kwargs):
        params = list(d.lm_head.parameters())
        seen["shapes"] = sorted(tuple(p.shape) for p in params)
        torch.testing.assert_close(d.lm_head.weight_up @ d.lm_head.weight_down, up @ down, rtol=1e-4, atol=1e-4)
        loss = (d.lm_head(torch.randn(5, 6, generator=g)) ** 2).sum()
        loss.backward()
        with torch.no_grad():
            for p in params:
                p -= 0.1 * p.grad
        return "result"

    assert variants.tied_up(fake_distill)(drafter, None, teacher_head, None) == "result"
    assert seen["shapes"] == [(3, 6), (6, 3)]  # coef [d, r] and W_down [r, d]: no [V, r] weights
    w_up = drafter.lm_head.weight_up.detach()
    assert not torch.allclose(w_up @ drafter.lm_head.weight_down.detach(), up @ down, atol=1e-3)  # it moved
    inside = source @ torch.linalg.lstsq(source, w_up).solution
    torch.testing.assert_close(inside, w_up, rtol=1e-4, atol=1e-4)
