"""Every bad input: one clear line on stderr, exit code 2, no traceback, no output folder left behind."""

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from slimspec.cli import main
from tests.layouts import Spec, write_drafter, write_target


def _run(args, tmp_path):
    return CliRunner().invoke(main, ["convert", *args, "--distill-steps", "0", "--out", str(tmp_path / "out"),
                                     "--quiet"])


def _assert_clean_failure(result, tmp_path, needle):
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert needle.lower() in result.stderr.lower(), result.stderr
    assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


@pytest.fixture
def pair(tmp_path):
    write_drafter(tmp_path / "d", "eagle", Spec())
    write_target(tmp_path / "t")
    return str(tmp_path / "d"), str(tmp_path / "t")


def test_missing_folder(tmp_path, pair):
    _assert_clean_failure(_run([str(tmp_path / "nope"), "-t", pair[1]], tmp_path), tmp_path, "no such folder")


def test_unreachable_hub_id(tmp_path, pair, monkeypatch):
    import huggingface_hub.constants as c

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)  # the library reads the variable once, at import
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    result = _run(["someone/not-here-eagle3", "-t", pair[1]], tmp_path)
    _assert_clean_failure(result, tmp_path, "cannot download 'someone/not-here-eagle3'")


def test_missing_config(tmp_path, pair):
    os.remove(tmp_path / "d" / "config.json")
    _assert_clean_failure(_run([pair[0], "-t", pair[1]], tmp_path), tmp_path, "missing config.json")


def test_corrupt_config(tmp_path, pair):
    (tmp_path / "d" / "config.json").write_text("{not json")
    _assert_clean_failure(_run([pair[0], "-t", pair[1]], tmp_path), tmp_path, "not valid JSON")


def test_config_value_of_the_wrong_type(tmp_path, pair):
    """Catches a ValueError traceback (int("abc")) for a config field of the wrong type."""
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    config["hidden_size"] = "abc"
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    _assert_clean_failure(_run([pair[0], "-t", pair[1]], tmp_path), tmp_path, "value of the wrong type")


def test_missing_weights(tmp_path, pair):
    os.remove(tmp_path / "d" / "pytorch_model.bin")
    _assert_clean_failure(_run([pair[0], "-t", pair[1]], tmp_path), tmp_path, "no weights found")


def test_corrupt_bin(tmp_path, pair):
    (tmp_path / "d" / "pytorch_model.bin").write_bytes(b"garbage" * 100)
    _assert_clean_failure(_run([pair[0], "-t", pair[1]], tmp_path), tmp_path, "cannot be loaded safely")


def test_truncated_safetensors(tmp_path, pair):
    write_drafter(tmp_path / "s", "specforge", Spec())
    path = tmp_path / "s" / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    _assert_clean_failure(_run([str(tmp_path / "s"), "-t", pair[1]], tmp_path), tmp_path, "truncated")


def test_truncated_target(tmp_path, pair):
    path = tmp_path / "t" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    _assert_clean_failure(_run([pair[0], "-t", pair[1]], tmp_path), tmp_path, "truncated")


def test_not_a_drafter(tmp_path, pair):
    _assert_clean_failure(_run([pair[1], "-t", pair[1]], tmp_path), tmp_path, "not an EAGLE-3 drafter")


def test_shape_mismatch_with_target(tmp_path, pair):
    write_target(tmp_path / "t48", hidden=48)
    _assert_clean_failure(_run([pair[0], "-t", str(tmp_path / "t48")], tmp_path), tmp_path, "shape mismatch")


def test_vocab_mismatch(tmp_path, pair):
    write_target(tmp_path / "t300", vocab=300)
    _assert_clean_failure(_run([pair[0], "-t", str(tmp_path / "t300")], tmp_path), tmp_path, "vocab size mismatch")


def test_t2d_mismatch(tmp_path):
    """t2d longer than the target vocabulary although config says otherwise."""
    write_drafter(tmp_path / "d", "specforge", Spec(extra_config={"vocab_size": 300}))
    write_target(tmp_path / "t", vocab=300)
    _assert_clean_failure(_run([str(tmp_path / "d"), "-t", str(tmp_path / "t")], tmp_path), tmp_path, "t2d")


def test_full_vocab_needs_same_hidden(tmp_path):
    write_drafter(tmp_path / "d", "eagle", Spec(hidden=16, target_hidden=32, heads=2, kv_heads=1))
    write_target(tmp_path / "t")
    result = _run([str(tmp_path / "d"), "-t", str(tmp_path / "t")], tmp_path)
    _assert_clean_failure(result, tmp_path, "--vocab draft")


@pytest.mark.parametrize(("rank", "needle"), [("d/x", "cannot parse rank"), ("32", "0 < r < d"), ("0", "0 < r < d"),
                                              ("d/1", "0 < r < d"), ("energy:1.5", "energy share")])
def test_bad_rank(tmp_path, pair, rank, needle):
    _assert_clean_failure(_run([pair[0], "-t", pair[1], "--rank", rank], tmp_path), tmp_path, needle)


def test_learning_rates_must_be_positive(tmp_path, pair):
    """Catches a zero or negative --lr / --backbone-lr reaching AdamW (a ValueError traceback after the teacher
    data was built)."""
    _assert_clean_failure(_run([pair[0], "--target", pair[1], "--distill-steps", "2", "--lr", "0"], tmp_path), tmp_path,
                          "--lr must be > 0")
    result = CliRunner().invoke(main, ["distill", pair[0], "--target", pair[1], "--train-backbone", "--backbone-lr",
                                       "-1", "--out", str(tmp_path / "out"), "--quiet"])
    _assert_clean_failure(result, tmp_path, "--backbone-lr must be > 0")


@pytest.mark.parametrize("temperature", ["0", "-0.5", "nan"])
def test_teacher_temperature_must_be_positive(tmp_path, pair, temperature):
    """Catches a zero, negative or NaN --teacher-temperature reaching the loss (inf/NaN teacher logits after the
    teacher data was built)."""
    _assert_clean_failure(_run([pair[0], "--target", pair[1], "--distill-steps", "2", "--teacher-temperature",
                                temperature], tmp_path), tmp_path, "--teacher-temperature must be > 0")


def test_existing_out(tmp_path, pair):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    result = CliRunner().invoke(main, ["convert", pair[0], "--distill-steps", "0", "-t", pair[1], "--out",
                                       str(tmp_path / "out")])
    assert result.exit_code == 2 and "already exists" in result.stderr
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_real_process_has_no_traceback(tmp_path, pair):
    """The installed entry point (not only click's runner) exits 2 with one line."""
    proc = subprocess.run([sys.executable, "-m", "slimspec", "convert", pair[0], "-t", pair[1], "--rank", "99",
                           "--distill-steps", "0", "--out", str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert [ln for ln in lines if not ln.startswith("[slimspec]")] == [lines[-1]]
    assert lines[-1].startswith("error: rank '99'") and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_success_output_is_complete_or_absent(tmp_path, pair, monkeypatch):
    """A failure mid-write (here: in verification) leaves no folder that looks finished."""
    import slimspec.workflows.convert as conversion

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(conversion, "verify_folder", boom)
    result = _run([pair[0], "-t", pair[1]], tmp_path)
    assert result.exit_code != 0
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
    json.dumps({})


def test_non_finite_or_quantised_heads_are_one_line(tmp_path):
    """Catches an inf/NaN in a head ending deep in LAPACK ("LinAlgError: Internal Error", a traceback), and a
    target whose LM head is stored in FP8 read as if its values were the weights."""
    from safetensors.torch import load_file, save_file

    write_drafter(tmp_path / "d", "specforge", Spec())
    weights = load_file(str(tmp_path / "d" / "model.safetensors"))
    weights["lm_head.weight"][3, 5] = float("inf")
    save_file(weights, str(tmp_path / "d" / "model.safetensors"))
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "d"), "--rank", "8", "--vocab", "draft", "-o",
                                       str(tmp_path / "o"), "--distill-steps", "0"])
    assert result.exit_code == 2 and "holds inf or NaN (1 row(s), the first at token" in result.stderr, result.output
    assert "Traceback" not in result.output and not (tmp_path / "o").exists()
    write_drafter(tmp_path / "ok", "eagle", Spec())
    write_target(tmp_path / "t")
    target = load_file(str(tmp_path / "t" / "model.safetensors"))
    target["model.embed_tokens.weight"] = target["model.embed_tokens.weight"].to(torch.float8_e4m3fn)
    save_file(target, str(tmp_path / "t" / "model.safetensors"))
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "ok"), "-t", str(tmp_path / "t"), "--rank", "8",
                                       "--distill-steps", "0", "-o", str(tmp_path / "o2")])
    assert result.exit_code == 2 and "quantised head is not supported" in result.stderr, result.output
