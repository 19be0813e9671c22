"""convert end to end on tiny folders of every layout: output format, numbers, round trip, CLI."""

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

import slimspec
from slimspec.checkpoint import load_drafter
from slimspec.cli import main
from tests.layouts import LAYOUTS, Spec, write_drafter, write_target


def _svd_error(weight: torch.Tensor, rank: int) -> float:
    s = torch.linalg.svdvals(weight.double())
    return float((s[rank:] ** 2).sum().sqrt() / (s ** 2).sum().sqrt())


def _stitched(written, target_head):
    full = target_head.float().clone()
    ids = torch.arange(written["lm_head.weight"].shape[0]) + written["d2t"]
    full[ids] = written["lm_head.weight"].float()
    return full


@pytest.mark.parametrize("layout", LAYOUTS)
def test_convert_full_vocab_every_layout(tmp_path, layout):
    """Catches wrong stitching (d2t mapping, rows from the target), wrong names for vLLM, lost tensors."""
    written = write_drafter(tmp_path / "d", layout, Spec())
    head = write_target(tmp_path / "t", tied=layout != "speculators", sharded=layout == "modelopt")
    res = slimspec.convert_drafter(str(tmp_path / "d"), str(tmp_path / "t"), "d/4", out=tmp_path / "o",
                                   distill_steps=0, progress=False)
    assert res.rank == 8
    with safe_open(str(tmp_path / "o" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        up, down = f.get_tensor("lm_head.weight"), f.get_tensor("lm_head_down.weight")
    assert up.shape == (301, 8) and down.shape == (8, 32)
    assert "d2t" not in names and "t2d" not in names
    head_names = {n for n in names if "head" in n}
    assert head_names == {"lm_head.weight", "lm_head_down.weight"}  # vLLM: head tensors must say lm_head
    carried = {k for k in written if k not in ("lm_head.weight", "d2t", "t2d")}
    assert names - head_names == carried
    full = _stitched(written, head)
    err = float(torch.linalg.norm(full - up @ down) / torch.linalg.norm(full))
    assert abs(err - _svd_error(full, 8)) < 1e-5
    assert abs(res.report["relative_frobenius_error"] - err) < 1e-5
    assert res.report["rows_from_drafter"] == 97 and res.report["rows_from_target"] == 204
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    assert cfg["architectures"][0].startswith("Eagle3") and cfg["architectures"][0] != "Eagle3LlamaForCausalLM"
    assert cfg["draft_vocab_size"] == cfg["vocab_size"] == 301 and cfg["slimspec"]["rank"] == 8
    assert cfg["norm_before_residual"] == (layout == "speculators")
    meta = json.loads((tmp_path / "o" / "slimspec.json").read_text())
    assert meta["rank"] == 8 and meta["source"]["drafter_layout"] == layout
    assert all(len(h) == 64 for h in meta["source"]["drafter_files"].values())
    assert abs(meta["head_flop_ratio"] - (8 * 32 + 301 * 8) / (97 * 32)) < 1e-12
    assert (tmp_path / "o" / "README.md").read_text().startswith("---\nbase_model:")
    assert not list(tmp_path.glob(".o.tmp-*"))
    reloaded = load_drafter(tmp_path / "o")
    assert reloaded.layout == "slimspec" and reloaded.rank == 8 and reloaded.config.vocab_size == 301


def test_draft_vocab_keeps_d2t(tmp_path):
    """Catches --vocab draft dropping or corrupting d2t (frequency-ordered ModelOpt source)."""
    written = write_drafter(tmp_path / "d", "modelopt", Spec())
    write_target(tmp_path / "t")
    slimspec.convert_drafter(str(tmp_path / "d"), str(tmp_path / "t"), 5, vocab="draft", out=tmp_path / "o",
                             distill_steps=0, progress=False)
    with safe_open(str(tmp_path / "o" / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("d2t"), written["d2t"])
        up, down = f.get_tensor("lm_head.weight"), f.get_tensor("lm_head_down.weight")
    w = written["lm_head.weight"].float()
    assert abs(float(torch.linalg.norm(w - up @ down) / torch.linalg.norm(w)) - _svd_error(w, 5)) < 1e-5
    assert json.loads((tmp_path / "o" / "config.json").read_text())["draft_vocab_size"] == 97


def test_a_conversion_converted_again_only_shrinks(tmp_path):
    """Catches re-converting a SlimSpec output at a rank at or above its own (a pair padded with zero directions,
    reported as "energy kept 1.0000") and its source head counted as the full V x d matrix it no longer is; and a
    rank whose pair outweighs the full head passing without a word."""
    import warnings

    from slimspec.errors import SlimSpecError, SlimSpecWarning

    write_drafter(tmp_path / "d", "eagle", Spec(draft_vocab=97))
    write_target(tmp_path / "t")
    slimspec.convert_drafter(str(tmp_path / "d"), str(tmp_path / "t"), 8, vocab="draft", out=tmp_path / "r8",
                             distill_steps=0, progress=False)
    with pytest.raises(SlimSpecError, match="already a rank-8 pair: a rank-8 pair adds only zero directions"):
        slimspec.convert_drafter(str(tmp_path / "r8"), None, 8, vocab="draft", out=tmp_path / "again",
                                 distill_steps=0, progress=False)
    smaller = slimspec.convert_drafter(str(tmp_path / "r8"), None, 4, vocab="draft", out=tmp_path / "r4",
                                       distill_steps=0, progress=False)
    assert smaller.report["head_params_source"] == 8 * (97 + 32) and smaller.report["head_params"] == 4 * (97 + 32)
    assert smaller.report["head_rows_source"] == 97  # what `slimspec bench` times the full head at
    # a stitched full-vocabulary head has target rows beside the pair's: any rank below d is worth converting to
    slimspec.convert_drafter(str(tmp_path / "r8"), str(tmp_path / "t"), 16, out=tmp_path / "full",
                             distill_steps=0, progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        slimspec.convert_drafter(str(tmp_path / "d"), str(tmp_path / "t"), 24, vocab="draft", out=tmp_path / "r24",
                                 distill_steps=0, progress=False)  # 24 x (97 + 32) = 3096 < 97 x 32 = 3104
        slimspec.convert_drafter(str(tmp_path / "d"), str(tmp_path / "t"), 25, vocab="draft", out=tmp_path / "r25",
                                 distill_steps=0, progress=False)  # 3225 > 3104
    assert [str(w.message).split(":")[0] for w in caught if w.category is SlimSpecWarning] == ["rank 25"]


def test_headless_modelopt_factorises_target_head(tmp_path):
    write_drafter(tmp_path / "d", "modelopt", Spec(no_head=True, draft_vocab=None))
    head = write_target(tmp_path / "t", tied=False)
    res = slimspec.convert_drafter(str(tmp_path / "d"), str(tmp_path / "t"), 4, out=tmp_path / "o",
                                   distill_steps=0, progress=False)
    assert res.report["rows_from_drafter"] == 0
    assert abs(res.report["relative_frobenius_error"] - _svd_error(head, 4)) < 1e-5


def test_dtype_energy_rank_and_default_out(tmp_path, monkeypatch):
    write_drafter(tmp_path / "my-drafter", "eagle", Spec(dtype=torch.float16))
    write_target(tmp_path / "t")
    monkeypatch.chdir(tmp_path)
    res = slimspec.convert_drafter("my-drafter", "t", "energy:0.5", distill_steps=0, progress=False)
    assert res.out.name == f"my-drafter-slimspec-r{res.rank}"
    assert res.report["energy_kept"] >= 0.5 and res.report["dtype"] == "float16"
    with safe_open(str(res.out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.float16
    res2 = slimspec.convert_drafter("my-drafter", "t", "d/8", dtype="fp32", out="x", distill_steps=0, progress=False)
    assert res2.report["dtype"] == "float32"


def test_overwrite_replaces(tmp_path):
    write_drafter(tmp_path / "d", "eagle", Spec())
    write_target(tmp_path / "t")
    slimspec.convert_drafter(str(tmp_path / "d"), str(tmp_path / "t"), 4, out=tmp_path / "o",
                             distill_steps=0, progress=False)
    res = slimspec.convert_drafter(str(tmp_path / "d"), str(tmp_path / "t"), 6, out=tmp_path / "o", overwrite=True,
                           distill_steps=0, progress=False)
    assert load_drafter(tmp_path / "o").rank == 6 == res.rank
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "o", "t"]


def test_cli_json(tmp_path):
    write_drafter(tmp_path / "d", "specforge", Spec())
    write_target(tmp_path / "t")
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "d"), "--target", str(tmp_path / "t"),
                                       "--distill-steps", "0", "--rank", "d/8", "--out", str(tmp_path / "o"), "--json",
                                       "-q"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["rank"] == 4 and report["out"] == str(tmp_path / "o")
    assert report["verification"]["max_abs_reload_diff"] < 1e-5


def test_cli_human_report_and_inspect(tmp_path):
    write_drafter(tmp_path / "d", "eagle", Spec())
    write_target(tmp_path / "t")
    runner = CliRunner()
    result = runner.invoke(main, ["convert", str(tmp_path / "d"), "-t", str(tmp_path / "t"), "--distill-steps", "0",
                                  "-o", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert "energy kept" in result.stdout and "head FLOP ratio" in result.stdout
    png = tmp_path / "energy.png"
    result = runner.invoke(main, ["inspect", str(tmp_path / "d"), "--target", str(tmp_path / "t"), "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert "layout         eagle" in result.stdout and "32.2% of the target vocabulary" in result.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    info = json.loads(runner.invoke(main, ["inspect", str(tmp_path / "d"), "-t", str(tmp_path / "t"),
                                           "--json"]).stdout)
    w = torch.linalg.svdvals(_head(tmp_path))
    expected = float((w[:8] ** 2).sum() / (w ** 2).sum())
    assert abs(info["energy"]["draft vocab head"]["d/4"] - expected) < 1e-6
    head = _head(tmp_path).double()
    w = torch.linalg.svdvals(head - head.mean(0))
    assert abs(info["energy_centered"]["draft vocab head"]["d/4"] - float((w[:8] ** 2).sum() / (w ** 2).sum())) < 1e-6
    assert "rows centred (the part softmax sees): d/4: " in result.stdout


def test_inspect_shows_a_multi_layer_drafter(tmp_path):
    """Catches `inspect` hiding that a drafter has more than one decoder layer (its layer cost is then several
    times a single layer's)."""
    write_drafter(tmp_path / "d", "speculators", Spec(layers=3))
    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "d")])
    assert result.exit_code == 0, result.output
    assert "llama, 3 decoder layers)" in result.stdout and "layers.2.mlp.down_proj.weight" in result.stdout
    one = CliRunner().invoke(main, ["inspect", str(tmp_path / "d"), "--json"])
    assert json.loads(one.stdout)["config"]["num_layers"] == 3
    assert "drafting" not in result.stdout
    write_drafter(tmp_path / "p", "eagle", Spec(parallel_token=5))  # says a P-EAGLE drafter needs parallel drafting
    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "p")])
    assert "drafting       parallel (P-EAGLE: mask_hidden, mask-slot token 5; serve with parallel_drafting)" in (
        result.stdout), result.output


def _head(tmp_path):
    return load_drafter(tmp_path / "d").tensors["lm_head.weight"].double()


def test_output_config_is_unknown_outside_the_plugin(tmp_path):
    """Catches a converted config that another engine could load with the wrong head: SGLang falls back to
    transformers for unknown architectures and loads remote code through ``auto_map``; both must fail there."""
    import transformers

    write_drafter(tmp_path / "d", "eagle", Spec())
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    raw["auto_map"] = {"AutoConfig": "modeling_eagle3.Eagle3Config", "AutoModel": "modeling_eagle3.Eagle3Model"}
    (tmp_path / "d" / "config.json").write_text(json.dumps(raw))
    write_target(tmp_path / "t")
    for vocab in ("full", "draft"):
        out = tmp_path / f"o-{vocab}"
        slimspec.convert_drafter(str(tmp_path / "d"), str(tmp_path / "t"), 5, vocab=vocab, out=out,
                                 distill_steps=0, progress=False)
        cfg = json.loads((out / "config.json").read_text())
        assert "auto_map" not in cfg
        (arch,) = cfg["architectures"]
        assert arch.startswith("Eagle3SlimSpec") and getattr(transformers, arch, None) is None


def test_unsupported_rope_drafter_is_refused_before_the_target_only_when_built(tmp_path):
    """Catches a drafter with an unsupported RoPE scaling (dynamic NTK) failing with a NotImplementedError traceback
    after the target is loaded (whitened start, distillation) instead of a one-line error first; a plain SVD
    conversion must still work."""
    write_drafter(tmp_path / "d", "eagle", Spec(extra_config={"rope_scaling": {
        "rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 1024}}))
    write_target(tmp_path / "t")
    out = slimspec.convert_drafter(str(tmp_path / "d"), str(tmp_path / "t"), 8, out=tmp_path / "o",
                                   distill_steps=0, progress=False).out
    assert load_drafter(out).config.rope_scaling["rope_type"] == "dynamic"
    for options in (["--init", "whitened", "--distill-steps", "0"], ["--distill-steps", "2"]):  # no target is read
        result = CliRunner().invoke(main, ["convert", str(tmp_path / "d"), "--target", str(tmp_path / "nowhere"),
                                           "--rank", "8", "-o", str(tmp_path / "o2"), *options])
        assert result.exit_code == 2, result.output
        assert "RoPE scaling type 'dynamic' is not supported" in result.output and "Traceback" not in result.output
        assert "nowhere" not in result.output
