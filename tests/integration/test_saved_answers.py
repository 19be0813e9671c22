"""Saved answers: a teacher cache rebuilt from its answers' token ids equals the one decoded (float32 references)."""

import pytest
import torch

from slimspec.checkpoint.target_model import load_target_model
from slimspec.distill.answers import answers_in_progress, answers_of_cache, load_answers, save_answers
from slimspec.distill.static_decode import static_decode, static_prefill
from slimspec.distill.teacher import TeacherSettings, build_teacher_data, teacher_location
from slimspec.errors import SlimSpecError
from slimspec.prompts import Prompt

pytestmark = pytest.mark.slow
PROMPTS = ["Say hi.", "Count to three, slowly please, and then stop.", "Why is the sky blue? Answer briefly.", "Go",
           "Name a colour.", "Write one short line about rain, please."]
COMMON = {"max_new_tokens": 12, "aux_layers": (1, 2, 4), "generation_batch": 3, "generation_dtype": "float32",
          "dtype": "float32", "engine": "static"}


def test_static_prefill_matches_a_transformers_forward(tiny_target):
    """Catches right padding leaking into attention (rows of a batch would differ from alone), positions that
    start anywhere but 0, features taken at the wrong layer or before the final norm, and padded rows kept."""
    model, _ = load_target_model(tiny_target)
    torch.manual_seed(3)
    seqs = [torch.randint(0, 1000, (n,)).tolist() for n in (5, 17, 1, 11)]
    layers = (1, 2, model.config.num_hidden_layers)
    for seq, (aux, final) in zip(seqs, static_prefill(model, seqs, layers), strict=True):
        out = model(input_ids=torch.tensor([seq]), output_hidden_states=True)
        assert aux.shape == (len(seq), 3 * model.config.hidden_size) and final.shape[0] == len(seq)
        torch.testing.assert_close(aux, torch.cat([out.hidden_states[i][0] for i in layers], -1), atol=1e-4,
                                   rtol=1e-4)
        torch.testing.assert_close(final, out.hidden_states[-1][0], atol=1e-4, rtol=1e-4)


def _refuse_decoding(monkeypatch, allowed: int = 0) -> list[int]:
    import slimspec.distill.static_decode as sd

    calls = []

    def counted(*args, **kwargs):
        calls.append(len(args[1]))
        if len(calls) > allowed:
            raise AssertionError("decoded a prompt whose answer was saved")
        return static_decode(*args, **kwargs)

    monkeypatch.setattr(sd, "static_decode", counted)
    return calls


def _same(a, b) -> None:
    assert torch.equal(a.starts, b.starts) and torch.equal(a.input_ids, b.input_ids)
    assert torch.equal(a.loss_mask, b.loss_mask)
    torch.testing.assert_close(a.aux, b.aux, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a.final, b.final, atol=1e-4, rtol=1e-4)


def test_cache_rebuilt_from_saved_answers_equals_the_decoded_one(tiny_target, tmp_path, monkeypatch):
    """Catches saved answers that lose or shift tokens (prompt/answer split off by one), a rebuild that decodes
    again instead of reading them, features of the rebuild unlike the decoded ones, and answers of one cache
    accepted for another (other settings: another key)."""
    prompts = [Prompt(str(i), p) for i, p in enumerate(PROMPTS)]
    settings = TeacherSettings(**COMMON)
    decoded = build_teacher_data(tiny_target, prompts, settings, cache_root=tmp_path / "a", progress=False)
    answers = answers_of_cache(decoded.folder)
    assert len(answers) == len(PROMPTS) and all(answers.values())
    key = decoded.manifest["key"]
    save_answers(tmp_path / "answers.jsonl.gz", key, len(prompts), answers)
    assert load_answers(tmp_path / "answers.jsonl.gz", key) == answers
    calls = _refuse_decoding(monkeypatch)
    rebuilt = build_teacher_data(tiny_target, prompts, TeacherSettings(**COMMON), cache_root=tmp_path / "b",
                                 progress=False, answers=tmp_path / "answers.jsonl.gz")
    assert calls == [] and rebuilt.manifest["key"] == key
    _same(rebuilt, decoded)
    with pytest.raises(SlimSpecError, match="answers of teacher cache"):
        build_teacher_data(tiny_target, prompts, TeacherSettings(**{**COMMON, "max_new_tokens": 5}),
                           cache_root=tmp_path / "c", progress=False, answers=tmp_path / "answers.jsonl.gz")


def test_shipped_answers_of_a_key_are_read_instead_of_decoding(tiny_target, tmp_path, monkeypatch):
    """Catches answers shipped in the package (``SHIPPED_ANSWERS``, named by cache key) being ignored (the build
    decodes again: ~5 min of the demo on a slow CPU) or read for a cache of another key (other settings)."""
    import slimspec.distill.teacher as teacher

    prompts = [Prompt(str(i), p) for i, p in enumerate(PROMPTS)]
    decoded = build_teacher_data(tiny_target, prompts, TeacherSettings(**COMMON), cache_root=tmp_path / "a",
                                 progress=False)
    key = decoded.manifest["key"]
    save_answers(tmp_path / "shipped" / f"{key}.jsonl.gz", key, len(prompts), answers_of_cache(decoded.folder))
    monkeypatch.setattr(teacher, "SHIPPED_ANSWERS", tmp_path / "shipped")
    calls = _refuse_decoding(monkeypatch)
    rebuilt = build_teacher_data(tiny_target, prompts, TeacherSettings(**COMMON), cache_root=tmp_path / "b",
                                 progress=False)
    assert calls == [] and rebuilt.manifest["key"] == key
    _same(rebuilt, decoded)
    with pytest.raises(AssertionError, match="decoded"):  # another key: no shipped answers, so it decodes
        build_teacher_data(tiny_target, prompts, TeacherSettings(**{**COMMON, "max_new_tokens": 5}),
                           cache_root=tmp_path / "c", progress=False)


def test_shipped_answers_match_the_embedded_brief_recipe():
    """Catches the shipped answers drifting from the key the demo's recipe computes for the embedded target and the
    reference drafter (a changed setting, prompt file or cache version: the demo would silently decode again)."""
    from slimspec import embedded
    from slimspec.checkpoint.drafter import load_drafter
    from slimspec.checkpoint.target_model import aux_layers_for
    from slimspec.distill.teacher import SHIPPED_ANSWERS
    from slimspec.prompts import load_prompts
    from slimspec.workflows.recipes import brief_distillation

    options, _ = brief_distillation()
    ckpt = load_drafter(embedded.reference_drafter_path())
    target = embedded.embedded_target_path(progress=False)
    layers = aux_layers_for(ckpt.config.aux_layer_ids, ckpt.layout, 30, None)
    settings = options.teacher_settings(layers)
    settings.generation_dtype = "float32"  # what convert_briefly pins for the embedded target
    prompts = load_prompts(options.data, limit=options.num_prompts)
    key = teacher_location(target, prompts, settings, None).key
    path = SHIPPED_ANSWERS / f"{key}.jsonl.gz"
    import transformers

    # The key hashes the target's config.json, which names the transformers that saved it: run with the version
    # pinned in constraints/dev.txt (make setup), or the demo decodes its answers again (correct, only slower).
    assert path.exists(), (f"no shipped answers for key {key} (embedded target saved by transformers "
                           f"{transformers.__version__}); shipped: {sorted(p.name for p in SHIPPED_ANSWERS.iterdir())}")
    answers = load_answers(path, key)
    assert sorted(answers) == list(range(len(prompts))) == list(range(300))
    assert all(0 < len(a) <= options.max_new_tokens for a in answers.values())


def test_answers_of_an_interrupted_build_resume_on_a_fresh_machine(tiny_target, tmp_path, monkeypatch):
    """Catches answers of an unfinished build read from the wrong rows of its batch files, and a build from
    partial answers that decodes the answered prompts again or skips the unanswered ones."""
    import slimspec.distill.static_decode as sd

    prompts = [Prompt(str(i), p) for i, p in enumerate(PROMPTS)]
    decoded = build_teacher_data(tiny_target, prompts, TeacherSettings(**COMMON), cache_root=tmp_path / "a",
                                 progress=False)
    def dies_on_second(*args, **kwargs):
        if dies_on_second.calls == 1:
            raise KeyboardInterrupt
        dies_on_second.calls += 1
        return static_decode(*args, **kwargs)

    dies_on_second.calls = 0
    monkeypatch.setattr(sd, "static_decode", dies_on_second)
    settings = TeacherSettings(**COMMON)
    with pytest.raises(KeyboardInterrupt):
        build_teacher_data(tiny_target, prompts, settings, cache_root=tmp_path / "b", progress=False)
    where = teacher_location(tiny_target, prompts, settings, tmp_path / "b")
    partial = answers_in_progress(where.work)
    full = answers_of_cache(decoded.folder)
    assert len(partial) == 3 and all(partial[i] == full[i] for i in partial)
    save_answers(tmp_path / "partial.jsonl.gz", where.key, len(prompts), partial)
    calls = _refuse_decoding(monkeypatch, allowed=1)
    rebuilt = build_teacher_data(tiny_target, prompts, TeacherSettings(**COMMON), cache_root=tmp_path / "fresh",
                                 progress=False, answers=tmp_path / "partial.jsonl.gz")
    assert calls == [3]  # only the unanswered half is decoded
    _same(rebuilt, decoded)
