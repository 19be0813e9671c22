"""The table of published drafters: the target of a drafter whose config names none, and "did you mean" for a Hub
id that is not found (checked with a fake Hub on local folders, as in test_hub.py)."""


import pytest

import slimspec
from slimspec.checkpoint import load_drafter
from slimspec.checkpoint.known import KNOWN_TARGETS, close_matches, known_target
from slimspec.checkpoint.target_model import target_of
from slimspec.errors import CheckpointError, OptionError, SlimSpecError, SlimSpecWarning
from slimspec.hub import HUB_ID, resolve_model
from tests.conftest import hub_error
from tests.layouts import Spec, write_drafter, write_target

EAGLE_8B = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"


def test_lookup_is_exact_up_to_case():
    """Catches a lookup that misses the id as a user types it (other case) or answers for an id it does not hold."""
    assert known_target(EAGLE_8B) == LLAMA_8B
    assert known_target(EAGLE_8B.lower()) == LLAMA_8B
    assert known_target(f" {EAGLE_8B.upper()} ") == LLAMA_8B
    assert known_target("Tengyunw/qwen3_8b_eagle3") == "Qwen/Qwen3-8B"
    assert known_target("RedHatAI/gpt-oss-20b-speculator.eagle3") == "openai/gpt-oss-20b"
    assert known_target("yuhuili/EAGLE3-LLaMA3.1-8B") is None  # close is not equal
    assert known_target("org/unknown") is None


def test_table_holds_hub_ids_once():
    """Catches an entry that can never match (not an owner/name id) or two entries that differ only in case."""
    assert len({drafter.lower() for drafter in KNOWN_TARGETS}) == len(KNOWN_TARGETS)
    bad = [(d, t) for d, t in KNOWN_TARGETS.items() if not (HUB_ID.match(d) and HUB_ID.match(t))]
    assert not bad, bad


def test_close_matches_find_the_model_cards_misspelling():
    """Catches "did you mean" missing the repository a card misspells, or offering another size's drafter (a
    Llama-3.1-8B id is close to the 70B one as text, but its target is another model)."""
    assert close_matches("yuhuili/EAGLE3-LLaMA3.1-8B")[0] == EAGLE_8B
    assert close_matches("angelslim/qwen3-8b-eagle3")[0] == "AngelSlim/Qwen3-8B_eagle3"
    assert not any("70B" in m for m in close_matches("nvidia/Llama-3.1-8B-Instruct-Eagle3"))
    assert EAGLE_8B not in close_matches(EAGLE_8B.lower())  # never the id itself
    assert close_matches("org/missing") == []


def test_conversion_takes_the_tables_target_when_the_config_names_none(fake_hub, tmp_path, capsys):
    """Catches `slimspec convert yuhuili/EAGLE3-LLaMA3.1-Instruct-8B` without --target failing with "--vocab full
    needs --target" because the drafter's config names no target, and the output not naming the target it used."""
    hub, calls = fake_hub
    write_drafter(hub / EAGLE_8B, "eagle", Spec())
    assert load_drafter(hub / EAGLE_8B).named_target is None  # as published: the config names no target
    write_target(hub / LLAMA_8B)
    res = slimspec.convert_drafter(EAGLE_8B, None, "d/8", out=tmp_path / "o", distill_steps=0, progress=True)
    assert res.report["source"]["target"] == LLAMA_8B
    assert LLAMA_8B in [c[0] for c in calls]
    assert load_drafter(res.out).named_target == LLAMA_8B  # eval and distill of the output find it
    said = [line for line in capsys.readouterr().err.splitlines() if "table" in line]
    assert len(said) == 1 and LLAMA_8B in said[0] and "--target overrides" in said[0], said


def test_draft_vocab_conversion_records_the_tables_target(fake_hub, tmp_path):
    """Catches a conversion that reads no target (`--vocab draft`) writing an output that names none: the output is
    a local folder the table cannot match, so a later eval or distill of it would need --target."""
    hub, calls = fake_hub
    write_drafter(hub / EAGLE_8B, "eagle", Spec())
    res = slimspec.convert_drafter(EAGLE_8B, None, 8, vocab="draft", out=tmp_path / "o",
                                   distill_steps=0, progress=False)
    assert [c[0] for c in calls] == [EAGLE_8B] * len(calls)  # the target was not downloaded
    assert load_drafter(res.out).named_target == LLAMA_8B


def test_given_target_and_the_configs_own_target_win_over_the_table(fake_hub, tmp_path):
    """Catches the table overriding --target, or overriding the target a drafter's config names."""
    hub, calls = fake_hub
    write_drafter(hub / EAGLE_8B, "eagle", Spec())
    write_target(hub / "org" / "other")
    res = slimspec.convert_drafter(EAGLE_8B, "org/other", 8, out=tmp_path / "given", distill_steps=0, progress=False)
    assert res.report["source"]["target"] == "org/other" and LLAMA_8B not in [c[0] for c in calls]

    speculator = "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3"  # in the table; its config names its verifier
    write_drafter(hub / speculator, "speculators", Spec())
    write_target(hub / "some-org" / "target-model")
    res = slimspec.convert_drafter(speculator, None, 8, out=tmp_path / "named", distill_steps=0, progress=False)
    assert res.report["source"]["target"] == "some-org/target-model" and LLAMA_8B not in [c[0] for c in calls]


def test_unknown_drafter_without_target_is_one_line_asking_for_target(fake_hub, tmp_path):
    """Catches an unknown drafter whose config names no target failing in some other way than a one-line error
    that asks for --target."""
    hub, _ = fake_hub
    write_drafter(hub / "org" / "drafter", "eagle", Spec())
    with pytest.raises(OptionError) as err:
        slimspec.convert_drafter("org/drafter", None, 8, out=tmp_path / "o", distill_steps=0, progress=False)
    assert "--target" in err.value.render(lambda name: f"--{name}") and "\n" not in str(err.value)


def test_target_of_falls_back_to_the_table_with_a_warning(tmp_path):
    """Catches eval and distill (target_of) refusing a published drafter whose config names no target, or using the
    table's target silently; an unknown drafter still asks for --target in one line."""
    write_drafter(tmp_path / "d", "eagle", Spec())
    ckpt = load_drafter(tmp_path / "d")
    with pytest.warns(SlimSpecWarning, match="--target overrides"):
        assert target_of(EAGLE_8B.lower(), ckpt) == LLAMA_8B
    with pytest.raises(OptionError) as err:
        target_of(str(tmp_path / "d"), ckpt)
    assert "--target" in err.value.render(lambda name: f"--{name}") and "\n" not in str(err.value)


def test_missing_hub_id_says_did_you_mean(fake_hub):
    """Catches the card's misspelt id failing with the Hub's bare 404, without naming the repository that exists."""
    with pytest.raises(CheckpointError, match=r"did you mean yuhuili/EAGLE3-LLaMA3\.1-Instruct-8B\?") as err:
        resolve_model("yuhuili/EAGLE3-LLaMA3.1-8B", "drafter")
    assert "cannot download 'yuhuili/EAGLE3-LLaMA3.1-8B'" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(CheckpointError) as err:
        resolve_model("org/missing", "drafter")
    assert "did you mean" not in str(err.value)


@pytest.mark.parametrize("error", ["gated", "network"])
def test_no_did_you_mean_when_the_repo_may_exist(monkeypatch, error):
    """Catches a "did you mean" on a gated repo or a network failure: the id may be right, the hint would mislead."""
    import huggingface_hub

    def snapshot_download(repo_id, **kwargs):
        if error == "gated":
            raise hub_error("GatedRepoError", f"403 Client Error: access to {repo_id} is restricted")
        raise OSError("connection refused")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(SlimSpecError) as err:
        resolve_model("yuhuili/EAGLE3-LLaMA3.1-8B", "drafter")
    assert "cannot download" in str(err.value) and "did you mean" not in str(err.value)



def test_default_distillation_without_a_target_says_how_to_go_on(fake_hub, tmp_path):
    """Catches a drafter whose target cannot be resolved (its config names none, the table does not list it, no
    --target) failing the default distillation in some other way than one line that offers --target or
    --distill-steps 0 (the plain SVD head, which needs no target here), in the API, the CLI and its dry run."""
    from click.testing import CliRunner

    from slimspec.cli import main

    hub, _ = fake_hub
    write_drafter(hub / "org" / "drafter", "eagle", Spec())
    with pytest.raises(OptionError) as err:
        slimspec.convert_drafter("org/drafter", None, 8, out=tmp_path / "o", progress=False)
    assert "add target TARGET, or distill_steps 0 for the plain SVD head" in str(err.value)
    for extra in ([], ["--dry-run"]):
        result = CliRunner().invoke(main, ["convert", "org/drafter", "-r", "8", "-o", str(tmp_path / "o"), "-q",
                                           *extra])
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.exit_code == 2 and len(lines) == 1, result.output
        assert lines[0].startswith("error: org/drafter names no target") and lines[0].endswith(
            "add --target TARGET, or --distill-steps 0 for the plain SVD head"), lines[0]
    ok = CliRunner().invoke(main, ["convert", "org/drafter", "-r", "8", "--vocab", "draft", "--distill-steps", "0",
                                   "-o", str(tmp_path / "o"), "-q"])
    assert ok.exit_code == 0, ok.output
