"""Push a converted drafter to the Hugging Face Hub (validated first; the token is never printed)."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from slimspec.checkpoint import load_drafter
from slimspec.checkpoint.files import read_json
from slimspec.errors import SlimSpecError, first_line
from slimspec.hub import HUB_ID

HUB_TAGS = ("speculative-decoding", "eagle3", "slimspec")
PUSHED_FILES = ("config.json", "slimspec.json", "training.json", "generation_config.json", "README.md",
                "*.safetensors", "*.safetensors.index.json")
"""What a push uploads from a folder: a checkpoint's own files (never a stray .env, notes or old weights)."""
REPLACED_REMOTE = ("*.safetensors", "*.bin", "*.index.json", "*.pt", "slimspec.json", "training.json")
"""Remote files a push removes unless it uploads them again: a repo's earlier weights (a stale shard index would
make vLLM load old shards) and reports."""


@dataclass
class PushPlan:
    """What a push sends: the folder's files and the model card's metadata."""

    folder: Path
    repo_id: str
    files: dict[str, int]  # name -> bytes
    metadata: dict[str, Any]
    revision: str | None = None
    private: bool = False
    commit_message: str = ""
    url: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def validate_folder(folder: Path) -> dict[str, Any]:
    """Reload a SlimSpec folder and check its factors and config; returns its slimspec.json (or {})."""
    if not folder.is_dir():
        raise SlimSpecError(f"{folder}: not a folder")
    ckpt = load_drafter(folder)
    if not ckpt.is_lowrank:
        raise SlimSpecError(f"{folder}: not a SlimSpec checkpoint (no lm_head_down.weight)")
    meta = ckpt.raw_config.get("slimspec") or {}
    up, down = ckpt.tensors["lm_head.weight"], ckpt.tensors["lm_head_down.weight"]
    if int(meta.get("rank", -1)) != down.shape[0] or up.shape[1] != down.shape[0]:
        raise SlimSpecError(f"{folder}: factor shapes {list(up.shape)} x {list(down.shape)} disagree with rank "
                            f"{meta.get('rank')} in config.json")
    if not str((ckpt.raw_config.get("architectures") or [""])[0]).startswith("Eagle3SlimSpec"):
        raise SlimSpecError(f"{folder}: config.json does not name a SlimSpec architecture")
    report = folder / "slimspec.json"
    return read_json(report) if report.exists() else {}


def card_with_metadata(folder: Path, report: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The model card text with Hub metadata (base_model, tags) and the measured numbers ensured."""
    config = json.loads((folder / "config.json").read_text())
    meta = config.get("slimspec", {})
    source = meta.get("source_drafter") or report.get("source", {}).get("drafter")
    metadata: dict[str, Any] = {"tags": list(HUB_TAGS), "library_name": "vllm"}
    # a Hub id only: a local path (recorded absolute since 0.x, or a relative one) never goes into a public card
    if source and HUB_ID.match(source) and not Path(source).exists():
        metadata["base_model"] = source
    card_path = folder / "README.md"
    body = card_path.read_text() if card_path.exists() else f"# {folder.name}\n"
    if body.startswith("---\n"):
        body = body.split("---\n", 2)[2] if body.count("---\n") >= 2 else body
    lines = ["---"]
    if "base_model" in metadata:
        lines.append(f"base_model: {metadata['base_model']}")
    lines += ["tags:", *[f"- {t}" for t in HUB_TAGS], "library_name: vllm", "---", ""]
    numbers = {k: report[k] for k in ("rank", "energy_kept", "relative_frobenius_error", "head_flop_ratio", "tau",
                                      "rho_tau") if k in report}
    if "distill" in report:
        numbers["kl_before_distill"] = report["distill"].get("kl_before")
        numbers["kl_after_distill"] = report["distill"].get("kl_after")
        for key in ("top1_before", "top1_after"):
            if report["distill"].get(key) is not None:
                numbers[f"{key}_distill"] = report["distill"][key]
    if numbers and "## Measured" not in body:
        body += "\n## Measured (slimspec.json)\n\n" + "\n".join(f"- {k}: {v}" for k, v in numbers.items()) + "\n"
    return "\n".join(lines) + body.lstrip("\n"), metadata


def push(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    dry_run: bool = False,
) -> PushPlan:
    """Validate ``folder`` and upload it to ``repo_id`` in one commit (creating the repo if needed)."""
    folder = Path(folder)
    if not HUB_ID.match(repo_id):
        raise SlimSpecError(f"{repo_id!r} is not a Hub repo id (owner/name)")
    report = validate_folder(folder)
    card, metadata = card_with_metadata(folder, report)
    found = [p for p in sorted(folder.iterdir()) if p.is_file()]
    files = {p.name: p.stat().st_size for p in found if any(fnmatch(p.name, pattern) for pattern in PUSHED_FILES)}
    plan = PushPlan(folder=folder, repo_id=repo_id, files=files, metadata=metadata, revision=revision,
                    private=private, commit_message=commit_message or f"Upload SlimSpec drafter (rank "
                    f"{report.get('rank', '?')})")
    plan.extra["not_pushed"] = [p.name for p in found if p.name not in files]
    if dry_run:
        return plan
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        # None keeps an organisation's default visibility; False would make a new repo public
        url = api.create_repo(repo_id, private=True if private else None, exist_ok=True)
        if private and not api.repo_info(repo_id).private:
            raise SlimSpecError(f"{repo_id} exists and is public: --private cannot apply to it (make it private on "
                                "the Hub first, or push without --private); nothing uploaded")
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            staged = Path(tmp) / folder.name
            staged.mkdir()
            for name in files:
                (staged / name).symlink_to((folder / name).resolve())
            (staged / "README.md").unlink(missing_ok=True)
            (staged / "README.md").write_text(card)
            api.upload_folder(repo_id=repo_id, folder_path=staged, revision=revision,
                              commit_message=plan.commit_message, delete_patterns=list(REPLACED_REMOTE))
    except SlimSpecError:
        raise
    except Exception as exc:  # auth, network, permissions: one line, never the token
        first = first_line(exc)
        raise SlimSpecError(f"push to {repo_id} failed: {first}") from None
    plan.url = str(url)
    plan.files["README.md"] = len(card.encode())
    return plan
