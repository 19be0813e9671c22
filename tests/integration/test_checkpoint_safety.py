"""What a conversion carries to later commands, and what no command may destroy or misread ."""

import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner

import slimspec
from slimspec.checkpoint import load_drafter
from slimspec.checkpoint.files import _load_bin
from slimspec.checkpoint.target_model import aux_layers_for
from slimspec.checkpoint.writer import remove_stale_temps
from slimspec.cli import main
from slimspec.errors import CheckpointError, SlimSpecError, SlimSpecWarning
from tests.layouts import Spec, write_drafter, write_target

LAYERS = 8  # write_target's default


def _features(folder) -> tuple:
    ckpt = load_drafter(folder)
    return aux_layers_for(ckpt.config.aux_layer_ids, ckpt.layout, LAYERS, ckpt.aux_convention)


@pytest.mark.parametrize("layout", ["specforge", "speculators"])
def test_conversion_reads_the_same_target_layers_as_its_source(tmp_path, layout):
    """Catches a conversion of a SpecForge drafter (ids count the layer that *produced* a state) that reloads as
    layout slimspec and is then read in the other convention: distill, eval and the trim baselines would feed it
    the states one layer lower than its source. Also the vLLM config must say how many aux states there are."""
    from slimspec.evaluate.trim import write_trimmed

    write_drafter(tmp_path / "d", layout, Spec())
    write_target(tmp_path / "t")
    source = _features(tmp_path / "d")
    expected = {"specforge": (2, 4, 5), "speculators": (2, 4, 5)}[layout]  # ids [1, 3, 4] + 1 / [2, 4, 5] as is
    assert source == expected
    out = slimspec.convert_drafter(str(tmp_path / "d"), str(tmp_path / "t"), 8, vocab="draft", out=tmp_path / "o",
                           distill_steps=0, progress=False).out
    assert _features(out) == source
    config = json.loads((out / "config.json").read_text())
    assert config["num_aux_hidden_states"] == 3
    ckpt = load_drafter(tmp_path / "d")
    trimmed = write_trimmed(ckpt, torch.arange(40), tmp_path / "trim")
    assert _features(trimmed) == source


def test_output_folder_is_never_the_source(tmp_path):
    """Catches `convert DRAFTER -o DRAFTER --overwrite` (or a batch job with out = drafter) replacing the source
    drafter by its conversion."""
    write_drafter(tmp_path / "d", "eagle", Spec())
    write_target(tmp_path / "t")
    before = sorted(p.name for p in (tmp_path / "d").iterdir())
    with pytest.raises(SlimSpecError, match="drafter's own folder"):
        slimspec.convert_drafter(str(tmp_path / "d"), str(tmp_path / "t"), 8, out=tmp_path / "d", overwrite=True,
                         distill_steps=0, progress=False)
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == before
    load_drafter(tmp_path / "d")  # still the source


def test_batch_replaces_only_its_own_outputs(tmp_path):
    """Catches a batch that replaces any existing folder named as a job's out (its `overwrite` key ignored)."""
    write_drafter(tmp_path / "d", "eagle", Spec())
    write_target(tmp_path / "t")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("mine")
    jobs = [{"drafter": str(tmp_path / "d"), "target": str(tmp_path / "t"), "rank": 8, "out": str(tmp_path / "mine"),
             "name": "foreign", "distill_steps": 0},
            {"drafter": str(tmp_path / "d"), "target": str(tmp_path / "t"), "rank": 8, "out": str(tmp_path / "d"),
             "name": "source", "overwrite": True, "distill_steps": 0}]
    manifest = tmp_path / "jobs.json"
    manifest.write_text(json.dumps({"jobs": jobs}))
    report = tmp_path / "report.jsonl"
    result = CliRunner().invoke(main, ["batch", str(manifest), "--continue-on-error", "--report", str(report)])
    rows = {r["job"]: r for r in map(json.loads, report.read_text().splitlines())}
    assert result.exit_code == 1
    assert rows["foreign"]["status"] == "failed" and "already exists" in rows["foreign"]["error"]
    assert (tmp_path / "mine" / "keep.txt").read_text() == "mine"
    assert rows["source"]["status"] == "failed" and "drafter's own folder" in rows["source"]["error"]
    load_drafter(tmp_path / "d")
    jobs[0]["overwrite"] = True  # asked for: replaced; a changed rank then replaces the batch's own output
    manifest.write_text(json.dumps({"jobs": jobs[:1]}))
    assert CliRunner().invoke(main, ["batch", str(manifest)]).exit_code == 0
    assert not (tmp_path / "mine" / "keep.txt").exists() and load_drafter(tmp_path / "mine").rank == 8
    manifest.write_text(json.dumps({"jobs": [{**jobs[0], "overwrite": False, "rank": 4}]}))
    assert CliRunner().invoke(main, ["batch", str(manifest)]).exit_code == 0
    assert load_drafter(tmp_path / "mine").rank == 4


def test_conversion_records_where_its_sources_are(tmp_path, monkeypatch):
    """Catches a relative source path recorded as typed (distill --teacher drafter and eval, run from another
    folder, would not find the source or the target), and revisions that are not recorded."""
    import slimspec.hub as hub

    write_drafter(tmp_path / "d", "eagle", Spec())
    write_target(tmp_path / "t")
    real = hub.resolve_model
    monkeypatch.setattr("slimspec.workflows.convert.resolve_model", lambda name, role, revision=None: real(name, role))
    monkeypatch.setattr("slimspec.workflows.job._is_local", lambda name: False)  # the folders stand in for Hub repos
    monkeypatch.chdir(tmp_path)
    out = slimspec.convert_drafter("d", "t", 8, out="o", revision="r1", target_revision="t1",
                                   distill_steps=0, progress=False).out
    meta = json.loads((tmp_path / "o" / "config.json").read_text())["slimspec"]
    assert meta["source_drafter"] == str(tmp_path / "d") and meta["target"] == str(tmp_path / "t")
    assert meta["source_revision"] == "r1" and meta["target_revision"] == "t1"
    assert load_drafter(out).recorded("target_revision") == "t1"
    # eval and distill reuse it for the recorded target, named or not, and never for another target
    ckpt = load_drafter(out)
    assert ckpt.target_revision_for(None) == ckpt.target_revision_for(str(tmp_path / "t")) == "t1"
    assert ckpt.target_revision_for("org/other-target") is None
    from slimspec.evaluate.acceptance import load_for_eval

    seen = []
    for module in ("slimspec.evaluate.acceptance", "slimspec.checkpoint.target_model"):
        monkeypatch.setattr(f"{module}.resolve_model", lambda name, role, revision=None: seen.append(revision) or
                            real(name, role))
    load_for_eval(str(out), str(tmp_path / "t"))
    assert "t1" in seen


def test_bin_rewritten_in_place_is_read_again(tmp_path):
    """Catches the memory-mapped .bin cache keyed on the path alone (a drafter rewritten at the same path came
    back with its old tensors), and pre-1.6 (non-zip) .bin files refused because they cannot be mapped."""
    path = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.zeros(3)}, path)
    assert torch.equal(_load_bin(path)["w"], torch.zeros(3))
    torch.save({"w": torch.ones(4)}, path)
    assert torch.equal(_load_bin(path)["w"], torch.ones(4))
    torch.save({"w": torch.arange(5.0)}, path, _use_new_zipfile_serialization=False)
    assert torch.equal(_load_bin(path)["w"], torch.arange(5.0))


def test_killed_runs_temporary_folders_are_swept(tmp_path):
    """Catches full-size temporary teacher folders of a killed build left forever (a rerun has another pid)."""
    dead, live = tmp_path / ".key.tmp-999999999", tmp_path / f".key.tmp-{os.getpid()}"
    dead.mkdir()
    live.mkdir()
    (tmp_path / ".other.tmp-999999999").mkdir()
    remove_stale_temps(tmp_path, "key")
    assert not dead.exists() and live.exists() and (tmp_path / ".other.tmp-999999999").exists()


def test_layer_style_comes_from_the_tensors(tmp_path):
    """Catches a config's model_type deciding the served class (mistral crashed at the end of a conversion, qwen3
    without q_norm would pick vLLM's Qwen3 layer) and a layer with biases whose biases were silently dropped."""
    for model_type in ("mistral", "qwen3"):
        write_drafter(tmp_path / model_type, "specforge", Spec(extra_config={"model_type": model_type}))
        assert load_drafter(tmp_path / model_type).config.model_type == "llama"
    write_drafter(tmp_path / "q3", "specforge", Spec(qwen3=True))
    assert load_drafter(tmp_path / "q3").config.model_type == "qwen3"
    write_drafter(tmp_path / "b", "eagle", Spec())
    tensors = torch.load(tmp_path / "b" / "pytorch_model.bin", weights_only=True)
    tensors["midlayer.self_attn.q_proj.bias"] = torch.zeros(32)
    torch.save(tensors, tmp_path / "b" / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="biases"):
        load_drafter(tmp_path / "b")


def test_trimmed_drafter_keeps_the_eagle_3_1_norm_output_recurrence(tmp_path):
    """Catches a trim (VocabTrim/FR-Spec baselines) of an EAGLE 3.1 drafter (`norm_output: true`: the next draft
    step takes the normed state) that writes a config without the flag: the trimmed drafter would run another
    recurrence than its source and the baselines would be measured on the wrong model."""
    from slimspec.evaluate.trim import write_trimmed

    write_drafter(tmp_path / "d", "eagle", Spec())
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    (tmp_path / "d" / "config.json").write_text(json.dumps({**config, "norm_output": True}))
    ckpt = load_drafter(tmp_path / "d")
    assert ckpt.config.norm_output
    trimmed = load_drafter(write_trimmed(ckpt, torch.arange(40), tmp_path / "trim"))
    assert trimmed.config.norm_output


def test_trimmed_p_eagle_drafter_still_drafts_in_parallel(tmp_path):
    """Catches a trim of a P-EAGLE drafter (the plane's baselines) that loses mask_hidden or its mask-slot token:
    the baseline would then be measured as a chain drafter (or refused by vLLM's parallel drafting)."""
    from slimspec.evaluate.trim import write_trimmed

    write_drafter(tmp_path / "d", "eagle", Spec(parallel_token=9))
    ckpt = load_drafter(tmp_path / "d")
    trimmed = load_drafter(write_trimmed(ckpt, torch.arange(40), tmp_path / "trim"))
    assert trimmed.config.parallel_token_id == 9
    assert torch.equal(trimmed.tensors["mask_hidden"], ckpt.tensors["mask_hidden"])


def _edit_bin(folder, **changes) -> None:
    """Add (or with None, remove) tensors of an EAGLE-layout drafter's pytorch_model.bin."""
    tensors = torch.load(folder / "pytorch_model.bin", weights_only=True)
    for name, value in changes.items():
        name = name.replace("__", ".")
        if value is None:
            tensors.pop(name, None)
        else:
            tensors[name] = value
    torch.save(tensors, folder / "pytorch_model.bin")


@pytest.mark.parametrize(("tensor", "needle"), [
    ("layers.1.self_attn.q_proj.weight", "decoder layer 1 of 2 lacks input_layernorm.weight"),
    ("model.layers.2.mlp.up_proj.weight", "decoder layer 1 of 3 lacks input_layernorm.weight"),
    ("lm_head.bias", "LM head with a bias"),
    ("midlayer.self_attn.q_norm.weight", "both self_attn.q_norm and self_attn.k_norm"),
])
def test_drafter_parts_that_would_be_dropped_are_refused(tmp_path, tensor, needle):
    """Catches a stray tensor of a second decoder layer (an incomplete layer), an LM-head bias or half of Qwen3's
    q/k norms loaded without them: the conversion (and vLLM) would run another model than the published one, with
    no error. (Complete later layers load: tests/unit/test_layouts.py.)"""
    write_drafter(tmp_path / "d", "eagle", Spec())
    _edit_bin(tmp_path / "d", **{tensor.replace(".", "__"): torch.ones(4)})
    with pytest.raises(CheckpointError, match=needle):
        load_drafter(tmp_path / "d")


def test_conversion_warns_about_tensors_it_does_not_know(tmp_path):
    """Catches a drafter variant this reader does not know losing tensors without a word (P-EAGLE's mask_hidden,
    dropped that way, changes what vLLM serves): an unknown tensor must be named in a warning (the CLI shows it) and in
    slimspec.json, while the ones dropped on purpose (RoPE's inv_freq, here in every EAGLE-layout test drafter)
    stay silent."""
    import warnings

    write_drafter(tmp_path / "d", "eagle", Spec())
    write_target(tmp_path / "t")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a known-unused tensor must not warn
        slimspec.convert_drafter(str(tmp_path / "d"), str(tmp_path / "t"), 8, out=tmp_path / "o1",
                                 distill_steps=0, progress=False)
    _edit_bin(tmp_path / "d", some_new_thing__weight=torch.ones(4))
    with pytest.warns(SlimSpecWarning, match=r"1 tensor\(s\) of an unknown kind are not carried into the output: "
                                         r"some_new_thing\.weight"):
        res = slimspec.convert_drafter(str(tmp_path / "d"), str(tmp_path / "t"), 8, out=tmp_path / "o2",
                                       distill_steps=0, progress=False)
    assert "some_new_thing.weight" in res.report["source"]["dropped_tensors"]
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "d"), "--target", str(tmp_path / "t"), "--rank", "8",
                                       "--distill-steps", "0", "-o", str(tmp_path / "o3"), "-q"])
    assert result.exit_code == 0, result.output
    assert f"warning: {tmp_path / 'd'}: 1 tensor(s) of an unknown kind are not carried into the output: " \
        "some_new_thing.weight\n" in result.stderr


def test_full_size_draft_vocab_in_another_order_keeps_target_order(tmp_path):
    """Catches `--vocab draft` on a drafter whose draft vocab is the whole vocabulary but permuted by d2t: the
    output has no d2t, so its rows must be in target order (they were left in draft order: wrong tokens)."""
    write_drafter(tmp_path / "d", "eagle", Spec(draft_vocab=None))
    write_target(tmp_path / "t")
    head = torch.load(tmp_path / "d" / "pytorch_model.bin", weights_only=True)["lm_head.weight"]
    shutil.copytree(tmp_path / "d", tmp_path / "p")
    perm = torch.randperm(head.shape[0], generator=torch.Generator().manual_seed(3))
    _edit_bin(tmp_path / "p", lm_head__weight=head[perm].clone(), d2t=perm - torch.arange(perm.numel()),
              t2d=torch.ones(perm.numel(), dtype=torch.bool))
    products = []
    for name in ("d", "p"):
        out = slimspec.convert_drafter(str(tmp_path / name), str(tmp_path / "t"), 8, vocab="draft",
                               out=tmp_path / f"{name}-o", distill_steps=0, progress=False).out
        ckpt = load_drafter(out)
        assert ckpt.d2t is None
        products.append(ckpt.tensors["lm_head.weight"].double() @ ckpt.tensors["lm_head_down.weight"].double())
    torch.testing.assert_close(products[1], products[0], rtol=1e-5, atol=1e-6)
    # the drafter teacher of such a student is in target order too (it taught row i with draft row i)
    from slimspec.checkpoint.target_model import load_target_parts
    from slimspec.distill.pipeline import self_teacher_head

    parts = load_target_parts(str(tmp_path / "t"))
    teachers = [self_teacher_head(load_drafter(tmp_path / name), parts, head.shape[0]) for name in ("d", "p")]
    torch.testing.assert_close(teachers[1], teachers[0])


def test_untied_target_never_uses_its_embedding_as_head(tmp_path):
    """Catches a target whose config says `tie_word_embeddings: false` but whose head sits under a name not
    looked for: its input embedding was taken as the LM head (another matrix), reported as tied. The multimodal
    `language_model.*` names are looked for."""
    from safetensors.torch import load_file, save_file

    from slimspec.checkpoint import load_target_head

    head = write_target(tmp_path / "t", tied=False)
    tensors = load_file(str(tmp_path / "t" / "model.safetensors"))
    tensors["language_model.lm_head.weight"] = tensors.pop("lm_head.weight")
    save_file(tensors, str(tmp_path / "t" / "model.safetensors"))
    found = load_target_head(tmp_path / "t")
    assert found.tensor_name == "language_model.lm_head.weight" and torch.equal(found.weight, head)
    tensors["vision_tower.lm_head.weight"] = tensors.pop("language_model.lm_head.weight")
    save_file(tensors, str(tmp_path / "t" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="tie_word_embeddings: false"):
        load_target_head(tmp_path / "t")


def test_output_folder_never_contains_an_input(tmp_path):
    """Catches `--out` set to the target's folder or to a folder holding the drafter: `--overwrite` replaced (and
    so deleted) that model. Also a mistyped --init is refused before any work."""
    write_drafter(tmp_path / "models" / "d", "eagle", Spec())
    write_target(tmp_path / "t")
    for out, needle in ((tmp_path / "models", "contains"), (tmp_path / "t", "is the folder of")):
        with pytest.raises(SlimSpecError, match=needle):
            slimspec.convert_drafter(str(tmp_path / "models" / "d"), str(tmp_path / "t"), 8, out=out, overwrite=True,
                             distill_steps=0, progress=False)
    assert (tmp_path / "models" / "d" / "config.json").exists() and (tmp_path / "t" / "model.safetensors").exists()
    with pytest.raises(SlimSpecError, match="init must be"):
        slimspec.convert_drafter(str(tmp_path / "models" / "d"), str(tmp_path / "t"), 8, out=tmp_path / "o",
                                 init="whitend",
                         distill_steps=0, progress=False)


def test_output_files_are_readable_as_the_umask_allows(tmp_path):
    """Catches weights written 0600 (safetensors' own mode) beside a 0644 config: a vLLM server running as another
    user then cannot read the model it is pointed at. Every file of a conversion gets the mode the umask gives."""
    write_drafter(tmp_path / "d", "eagle", Spec())
    write_target(tmp_path / "t")
    old = os.umask(0o022)
    try:
        slimspec.convert_drafter(str(tmp_path / "d"), str(tmp_path / "t"), 8, out=tmp_path / "c",
                                 distill_steps=0, progress=False)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "c").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes


def test_trimmed_qwen3_drafter_is_labelled_qwen3(tmp_path):
    """Catches a trimmed Qwen3 drafter written as LlamaForCausalLM (vLLM would build Llama layers, no q/k norms)."""
    from slimspec.evaluate.trim import write_trimmed

    for qwen3, arch in ((True, "Qwen3ForCausalLM"), (False, "LlamaForCausalLM")):
        write_drafter(tmp_path / f"d{qwen3}", "eagle", Spec(qwen3=qwen3))
        trimmed = write_trimmed(load_drafter(tmp_path / f"d{qwen3}"), torch.arange(40), tmp_path / f"trim{qwen3}")
        assert json.loads((trimmed / "config.json").read_text())["architectures"] == [arch]
        assert load_drafter(trimmed).config.model_type == ("qwen3" if qwen3 else "llama")


def test_conversion_records_the_target_its_source_names(tmp_path, monkeypatch):
    """Catches `convert --vocab draft` without --target recording target null though the source names its verifier
    (a later eval or distill of the output then fails with "--target is needed")."""
    write_drafter(tmp_path / "d", "speculators", Spec())
    write_target(tmp_path / "t")
    monkeypatch.chdir(tmp_path)
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = "t"  # a relative folder: recorded absolute
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    res = slimspec.convert_drafter("d", None, 8, vocab="draft", out="o", distill_steps=0, progress=False)
    assert res.report["source"]["target"] is None  # none was read
    assert load_drafter(res.out).named_target == str(tmp_path / "t")
    out2 = slimspec.convert_drafter(str(res.out), None, 4, vocab="draft", out="o2",
                                    distill_steps=0, progress=False).out  # and again
    assert load_drafter(out2).named_target == str(tmp_path / "t")
    write_drafter(tmp_path / "h", "speculators", Spec())  # a Hub id stays as named
    assert load_drafter(slimspec.convert_drafter("h", None, 8, vocab="draft", out="o3",
                                                 distill_steps=0, progress=False).out
                        ).named_target == "some-org/target-model"
