"""slimspec push against a local HTTP endpoint (HF_ENDPOINT) that records the Hub API calls it receives."""

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from click.testing import CliRunner

from slimspec.cli import main
from tests.layouts import Spec, write_drafter, write_target

TOKEN = "hf_NOTREAL_secret_token_42"


class FakeHub(BaseHTTPRequestHandler):
    calls: list = []
    public: set = set()  # repos that exist and are public (others are private once created with private=True)
    remote_files: list = []  # what a repo's tree lists before the push

    def log_message(self, *args):
        pass

    def _body(self):
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, code, payload):
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        self.calls.append(("GET", self.path, self.headers.get("Authorization"), b""))
        if self.path.startswith("/api/whoami"):
            return self._send(200, {"name": "tester", "type": "user"})
        if self.path.startswith("/api/models/") and "/tree/" in self.path:
            return self._send(200, [{"type": "file", "path": f, "size": 1, "oid": "b" * 40}
                                    for f in self.remote_files])
        if self.path.startswith("/api/models/"):
            repo = "/".join(self.path.split("?")[0].split("/")[3:5])
            return self._send(200, {"id": repo, "private": repo not in self.public, "sha": "a" * 40})
        self._send(404, {"error": "not found"})

    def do_POST(self):  # noqa: N802
        body = self._body()
        self.calls.append(("POST", self.path, self.headers.get("Authorization"), body))
        host = f"http://{self.headers['Host']}"
        if self.path == "/api/repos/create":
            repo = json.loads(body)
            return self._send(200, {"url": f"{host}/{repo.get('organization') or 'x'}/{repo['name']}"})
        if "/preupload/" in self.path:
            files = json.loads(body)["files"]
            return self._send(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                              for f in files]})
        if "/commit/" in self.path:
            repo = "/".join(self.path.split("/")[3:5])
            return self._send(200, {"commitUrl": f"{host}/{repo}/commit/{'a' * 40}", "commitOid": "a" * 40,
                                    "pullRequestUrl": None})
        if "/branch/" in self.path:
            return self._send(200, {})
        if self.path == "/api/validate-yaml":  # the Hub checks a README's metadata before committing it
            return self._send(200, {"errors": [], "warnings": []})
        self._send(404, {"error": "unexpected"})


@pytest.fixture
def hub(monkeypatch):
    FakeHub.calls, FakeHub.public, FakeHub.remote_files = [], set(), []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "ENDPOINT", endpoint)
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)  # read once at import: another test may have set it
    monkeypatch.setattr(c, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    yield FakeHub.calls
    server.shutdown()


@pytest.fixture
def converted(tmp_path):
    write_drafter(tmp_path / "d", "eagle", Spec())
    write_target(tmp_path / "t")
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "d"), "-t", str(tmp_path / "t"), "--rank", "8",
                                       "--distill-steps", "0", "-o", str(tmp_path / "out"), "-q"])
    assert result.exit_code == 0, result.output
    return tmp_path / "out"


def _committed_files(calls):
    commit = [c for c in calls if c[0] == "POST" and "/commit/" in c[1]]
    assert len(commit) == 1, [c[:2] for c in calls]
    files = {}
    for line in commit[0][3].decode().splitlines():
        item = json.loads(line)
        if item["key"] == "file":
            files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
    return commit[0], files


def test_push_uploads_folder_in_one_commit(hub, converted):
    """Catches a push that skips files, loses metadata, or leaks the token into output or files."""
    result = CliRunner().invoke(main, ["push", str(converted), "someone/tiny-slimspec", "--private",
                                       "--commit-message", "first upload"])
    assert result.exit_code == 0, result.output
    create = [c for c in hub if c[1] == "/api/repos/create"]
    payload = json.loads(create[0][3])
    assert len(create) == 1 and (payload.get("private") is True or payload.get("visibility") == "private")
    commit, files = _committed_files(hub)
    assert commit[1].startswith("/api/models/someone/tiny-slimspec/commit/main")
    assert commit[2] == f"Bearer {TOKEN}"
    assert set(files) == {"README.md", "config.json", "model.safetensors", "slimspec.json"}
    assert files["model.safetensors"] == (converted / "model.safetensors").read_bytes()
    card = files["README.md"].decode()
    assert card.startswith("---\n") and "- speculative-decoding\n- eagle3\n- slimspec" in card
    assert "rank: 8" in card and "vllm serve" in card
    assert json.loads(commit[3].decode().splitlines()[0])["value"]["summary"] == "first upload"
    assert TOKEN not in result.output and TOKEN not in result.stderr
    assert all(TOKEN.encode() not in p.read_bytes() for p in converted.iterdir())


def test_base_model_is_the_hub_source(hub, tmp_path, monkeypatch):
    """Catches a card without base_model when the source drafter is a Hub id (checked via a fake Hub download)."""
    import fnmatch
    import shutil

    import huggingface_hub

    src = tmp_path / "hubrepo"
    write_drafter(src, "eagle", Spec())
    write_target(tmp_path / "t")

    def snapshot_download(repo_id, allow_patterns=None, revision=None, **kw):
        dst = tmp_path / "dl"
        dst.mkdir(exist_ok=True)
        for f in src.iterdir():
            if any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):
                shutil.copy(f, dst / f.name)
        return str(dst)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    result = CliRunner().invoke(main, ["convert", "yuhuili/EAGLE3-Tiny", "-t", str(tmp_path / "t"), "-r", "4",
                                       "--distill-steps", "0", "-o", str(tmp_path / "o"), "-q", "--push-to",
                                       "me/eagle3-tiny-slim"])
    assert result.exit_code == 0, result.output
    _, files = _committed_files(hub)
    assert "base_model: yuhuili/EAGLE3-Tiny" in files["README.md"].decode()


def test_dry_run_sends_nothing(hub, converted):
    result = CliRunner().invoke(main, ["push", str(converted), "someone/x", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "model.safetensors" in result.stdout and "dry run" in result.stdout
    assert not [c for c in hub if c[0] == "POST"]


def test_invalid_folder_is_refused(hub, tmp_path):
    write_drafter(tmp_path / "orig", "eagle", Spec())
    result = CliRunner().invoke(main, ["push", str(tmp_path / "orig"), "someone/x"])
    assert result.exit_code == 2 and "not a SlimSpec checkpoint" in result.stderr
    assert not hub


def test_revision_creates_branch(hub, converted):
    result = CliRunner().invoke(main, ["push", str(converted), "someone/x", "--revision", "r8"])
    assert result.exit_code == 0, result.output
    assert any("/branch/r8" in c[1] for c in hub)
    commit, _ = _committed_files(hub)
    assert "/commit/r8" in commit[1]


def test_card_shows_the_measured_acceptance(tmp_path):
    """Catches a card that drops the tau and rho_tau a run recorded in slimspec.json (the demo writes them)."""
    from slimspec.workflows.publish import card_with_metadata

    (tmp_path / "config.json").write_text(json.dumps({"slimspec": {"rank": 72}}))
    card, _ = card_with_metadata(tmp_path, {"rank": 72, "tau": 1.425, "rho_tau": 0.881})
    assert "- rank: 72\n- tau: 1.425\n- rho_tau: 0.881\n" in card
    card, _ = card_with_metadata(tmp_path, {"rank": 72})
    assert "rho_tau" not in card


def test_visibility_is_never_made_public_by_us(hub, converted):
    """Catches `private=False` sent on create (it overrides an organisation's default-private setting: a new repo
    would be public) and `--private` on an existing public repo uploading publicly while saying "(private)"."""
    result = CliRunner().invoke(main, ["push", str(converted), "someone/plain"])
    assert result.exit_code == 0, result.output
    payload = json.loads([c for c in hub if c[1] == "/api/repos/create"][0][3])
    assert payload.get("private") is not False and payload.get("visibility") != "public"
    hub.clear()
    FakeHub.public = {"someone/open"}
    result = CliRunner().invoke(main, ["push", str(converted), "someone/open", "--private"])
    assert result.exit_code == 2 and "exists and is public" in result.stderr
    assert not [c for c in hub if "/commit/" in c[1]]


def test_only_checkpoint_files_are_pushed_and_stale_weights_removed(hub, converted):
    """Catches a push that uploads whatever lies in the folder (a .env, notes) and one that leaves a repo's earlier
    shards and index behind (vLLM would follow the stale index and load the old weights)."""
    (converted / ".env").write_text("HF_TOKEN=secret\n")
    (converted / "notes.txt").write_text("private notes\n")
    FakeHub.remote_files = ["README.md", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
                            "model-00002-of-00002.safetensors", "LICENSE"]
    result = CliRunner().invoke(main, ["push", str(converted), "someone/x"])
    assert result.exit_code == 0, result.output
    assert "not pushed (not checkpoint files): .env, notes.txt" in result.stdout
    commit, files = _committed_files(hub)
    assert set(files) == {"README.md", "config.json", "model.safetensors", "slimspec.json"}
    deleted = {json.loads(line)["value"]["path"] for line in commit[3].decode().splitlines()
               if json.loads(line)["key"] == "deletedFile"}
    assert deleted == {"model.safetensors.index.json", "model-00001-of-00002.safetensors",
                       "model-00002-of-00002.safetensors"}  # the LICENSE someone added on the Hub stays


def test_card_never_names_a_local_path_as_base_model(tmp_path):
    """Catches a recorded local source (absolute since local sources are recorded so) that no longer exists being
    published as the card's base_model (a home path in a public card, invalid Hub metadata)."""
    from slimspec.workflows.publish import card_with_metadata

    for source in ("/home/alice/drafters/eagle3-x", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"):
        (tmp_path / "config.json").write_text(json.dumps({"slimspec": {"rank": 8, "source_drafter": source}}))
        card, metadata = card_with_metadata(tmp_path, {})
        assert ("/home/alice" in card) is False and metadata.get("base_model") == (None if source[0] == "/" else
                                                                                    source)
