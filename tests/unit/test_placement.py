"""Where the target goes (``--device``, ``--max-memory``, ``--offload-folder``) and the dtype its features are read
in (``--feature-dtype``): the parsing, the choices made from its size, and what reaches the cache key."""

import pytest
import torch
from click.testing import CliRunner

from slimspec.checkpoint import placement
from slimspec.checkpoint.placement import Placement, feature_dtype_for, weight_bytes
from slimspec.distill.pipeline import DataOptions
from slimspec.distill.teacher import TeacherSettings, cache_key
from slimspec.errors import OptionError
from slimspec.hardware import check_max_memory, parse_max_memory
from slimspec.prompts import Prompt

GIB = 2**30


@pytest.mark.parametrize(("text", "expected"), [
    ("cuda:0=70GiB,cpu=100GiB", {0: 70 * GIB, "cpu": 100 * GIB}),
    ("0=70GiB, 1=1.5GB ,cpu=512MiB", {0: 70 * GIB, 1: 1_500_000_000, "cpu": 512 * 2**20}),
    ("CPU=2TB", {"cpu": 2 * 10**12}),
])
def test_max_memory_budgets_parse_to_bytes(text, expected):
    """Catches a unit read as another (GiB as GB: 7 % less memory than asked) or a GPU named cuda:N kept as a
    string, which accelerate does not take as a device index."""
    assert parse_max_memory(text) == expected


@pytest.mark.parametrize("text", ["cuda:0", "0=70", "gpu=1GiB", "cpu=1GiB,cpu=2GiB", "", "0=-1GiB", "cuda:x=1GiB",
                                  "cpu=70 gigs", "0=70GiB,"])
def test_bad_max_memory_is_one_line_naming_the_option(text):
    """Catches a malformed budget passed on to accelerate (a traceback deep in from_pretrained, or a budget
    silently dropped) instead of one line that names --max-memory."""
    with pytest.raises(OptionError) as caught:
        parse_max_memory(text)
    assert "\n" not in str(caught.value) and caught.value.options == ("max_memory",)


def test_budgets_for_unseen_gpus_are_refused(pretend_gpus):
    """Catches cuda:1 budgets on a one-GPU machine reaching accelerate, which would place layers on no device."""
    pretend_gpus(1)
    check_max_memory({0: GIB, "cpu": GIB})
    with pytest.raises(OptionError, match="cuda:1"):
        check_max_memory({1: GIB})


def test_cli_refuses_bad_budgets_before_any_work(tmp_path):
    """Catches --max-memory parsed only when the target loads, after the drafter and target were read."""
    from slimspec.cli import main

    result = CliRunner().invoke(main, ["distill", str(tmp_path / "absent"), "--max-memory", "cuda:0=lots"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --max-memory"), result.output


def test_weight_bytes_counts_the_parameters_in_the_load_dtype(tiny_target):
    """Catches the size of a target judged by its files in their own dtype (a float32 checkpoint loaded in bf16
    taken for twice its size) or tied weights counted twice: against the loaded model's own parameters."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())  # tied embedding counted once, as stored
    assert weight_bytes(tiny_target, torch.float32) == 4 * params
    assert weight_bytes(tiny_target, torch.bfloat16) == 2 * params


def test_auto_shards_only_a_target_too_large_for_one_device(tiny_target, monkeypatch):
    """Catches auto sharding a target that fits (slower, for nothing), keeping whole one that does not (an OOM), or
    an explicit --device overridden by the size check."""
    monkeypatch.delenv("SLIMSPEC_DEVICE", raising=False)
    size = weight_bytes(tiny_target, torch.float32)
    monkeypatch.setattr(placement, "available_memory", lambda device: 100 * size)
    assert Placement().budgets(tiny_target, torch.float32) is None
    monkeypatch.setattr(placement, "available_memory", lambda device: size // 2)
    assert Placement().budgets(tiny_target, torch.float32) == {"cpu": int(placement.CPU_SHARE * (size // 2))}
    assert Placement("cpu").budgets(tiny_target, torch.float32) is None
    given = Placement.of("cpu", "cpu=1MiB")
    assert given.budgets(tiny_target, torch.float32) == {"cpu": 2**20}


def test_offload_folder_needs_a_sharded_target(tmp_path):
    """Catches --offload-folder silently unused with an explicit --device that keeps the target whole."""
    with pytest.raises(OptionError, match="offload_folder"):
        Placement.of("cpu", None, tmp_path)
    assert Placement.of("cpu", "cpu=1GiB", tmp_path).offload_folder == tmp_path
    assert Placement.of(None, None, tmp_path).offload_folder == tmp_path


def test_auto_feature_dtype_is_float32_only_where_a_float32_copy_fits(tiny_target, monkeypatch):
    """Catches float32 features asked of a target whose float32 copy does not fit (the 280 GB copy of a 70B target),
    or bf16 features where float32 ones fit; an asked dtype is kept either way."""
    size = weight_bytes(tiny_target, torch.float32)
    assert feature_dtype_for(tiny_target, Placement.of("cpu", f"cpu={size}B")) == "float32"
    assert feature_dtype_for(tiny_target, Placement.of("cpu", f"cpu={size - 1}B")) == "bfloat16"
    assert feature_dtype_for(tiny_target, Placement.of("cpu", f"cpu={size - 1}B"), "float32") == "float32"
    with pytest.raises(OptionError, match="feature_dtype"):
        feature_dtype_for(tiny_target, Placement(), "float64")


def test_float32_features_must_fit_the_gpus_not_the_host_beside_them(tiny_target, monkeypatch, pretend_gpus):
    """Catches float32 features chosen because host memory could take the layers the GPU cannot (a float32 copy
    spilling to the CPU runs many times slower than a bf16 copy whole on the GPU)."""
    pretend_gpus(1)
    size = weight_bytes(tiny_target, torch.float32)
    monkeypatch.setattr(placement, "available_memory", lambda device: size if device.type == "cuda" else 100 * size)
    assert feature_dtype_for(tiny_target, Placement()) == "bfloat16"
    assert Placement().budgets(tiny_target, torch.bfloat16) is None  # the bf16 copy whole on the GPU
    assert feature_dtype_for(tiny_target, Placement.of(None, f"0={size}B,cpu=1GiB")) == "float32"


def test_data_options_resolve_the_dtypes_against_the_target(tiny_target):
    """Catches the feature dtype lost on the way to the teacher settings, or a float32 answering copy kept (auto)
    where a float32 copy does not fit."""
    size = weight_bytes(tiny_target, torch.float32)
    small = DataOptions(device="cpu", max_memory=f"cpu={size // 2}B", generation_dtype=None)
    settings = small.teacher_settings((1, 2, 3), tiny_target)
    assert settings.feature_dtype == "bfloat16" and settings.generation_dtype in ("bfloat16", "float16")
    assert DataOptions(device="cpu").teacher_settings((1, 2, 3), tiny_target).feature_dtype == "float32"
    assert DataOptions(feature_dtype="float16").teacher_settings((1, 2, 3)).feature_dtype == "float16"


def test_feature_dtype_keys_the_cache_and_float32_keeps_the_old_key(tmp_path):
    """Catches bf16 features reused as float32 ones (or the reverse), and every existing cache (and the answers
    shipped under their keys) orphaned by the new setting: float32 features keep the key computed without it."""
    (tmp_path / "config.json").write_text("{}")
    prompts = [Prompt(id="a", text="hello")]
    keys = {d: cache_key(tmp_path, prompts, TeacherSettings(feature_dtype=d)) for d in ("float32", "bfloat16")}
    assert keys["float32"] != keys["bfloat16"]
    import hashlib
    import json
    from dataclasses import asdict

    from slimspec.distill.teacher import CACHE_VERSION, prompts_fingerprint, target_fingerprint

    fields = asdict(TeacherSettings())
    for name in ("feature_dtype", "engine", "seed"):
        fields.pop(name)
    payload = {"v": CACHE_VERSION, "target": target_fingerprint(tmp_path), "prompts": prompts_fingerprint(prompts),
               "settings": {**fields, "seed": 0, "temperature": 0.0}}
    assert keys["float32"] == hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]


def test_cli_flags_and_manifest_keys_reach_the_placement(tmp_path, monkeypatch):
    """Catches --max-memory, --offload-folder or --feature-dtype (and their manifest keys) dropped on the way to
    the teacher data: the target would load whole, or in float32, as if they were never given."""
    import slimspec.cli as cli
    from slimspec.workflows.job import data_options_from

    seen = {}

    def distil(checkpoint, target, **kwargs):
        seen["options"] = kwargs["data_options"]
        raise OptionError("stop here")

    monkeypatch.setattr(cli, "run_distill", distil)
    result = CliRunner().invoke(cli.main, ["distill", "ckpt", "--device", "cpu", "--max-memory", "cpu=1GiB",
                                           "--offload-folder", str(tmp_path), "--feature-dtype", "bfloat16"])
    assert "stop here" in result.output
    manifest = data_options_from({"device": "cpu", "max_memory": "cpu=1GiB", "offload_folder": tmp_path,
                                  "feature_dtype": "bfloat16"})
    for options in (seen["options"], manifest):
        assert options.placement() == Placement("cpu", {"cpu": GIB}, tmp_path)
        assert options.teacher_settings((1, 2, 3)).feature_dtype == "bfloat16"
