"""Model cards in final/ and adapter/, and uploads to the Hub (`posttrain push`, hub.push_at_end) against a local
HTTP server on 127.0.0.1 that answers the four calls huggingface_hub makes for create_repo and upload_folder
(create, validate-yaml, preupload, commit) and records them: the files committed, the repository id, the token
sent. Also: no token, and no network (connection refused), each a message naming what to do."""

from __future__ import annotations

import base64
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from huggingface_hub import ModelCard, constants

from posttrain import __version__
from posttrain import cli
from posttrain.algorithms.sft import train_sft
from posttrain.config import ConfigError, SFTConfig, load_config
from posttrain.errors import RunError
from posttrain.rundir import foreign_files, read_manifest

TOKEN = "hf_posttrainTestToken0123456789abcdef"
RUN = [
    "model.name_or_path=posttrain/tiny", "data.train_files=['posttrain/arithmetic[:32]']",
    "data.eval_files=['posttrain/arithmetic:heldout[:16]']", "data.max_length=32", "trainer.max_steps=2",
    "trainer.micro_batch_size=8", "trainer.eval_every=1", "lora.enabled=true", "lora.r=4", "logging.progress=none",
    "logging.plot=false", "logging.report=false",
]


class FakeHub:
    """The endpoints create_repo and upload_folder call, answering as the Hub does (every file a regular,
    non-LFS upload), each request kept in `requests` as (method, path, authorization header, JSON or ndjson body)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, str | None, object]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None: ...

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                path = self.path.split("?")[0]
                if "/commit/" in path:
                    parsed: object = [json.loads(line) for line in body.splitlines() if line.strip()]
                else:
                    parsed = json.loads(body or b"{}")
                hub.requests.append(("POST", path, self.headers.get("Authorization"), parsed))
                if path == "/api/repos/create":
                    name = "/".join(filter(None, [parsed.get("organization"), parsed["name"]]))
                    self._answer({"url": f"{hub.endpoint}/{name}", "name": name})
                elif path == "/api/validate-yaml":
                    self._answer({"errors": [], "warnings": []})
                elif "/preupload/" in path:
                    self._answer({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                            for f in parsed["files"]]})
                elif "/commit/" in path:
                    repo = path.removeprefix("/api/models/").split("/commit/")[0]
                    self._answer({"commitUrl": f"{hub.endpoint}/{repo}/commit/{'a' * 40}", "commitOid": "a" * 40})
                else:
                    self._answer({"error": f"not faked: {path}"}, status=404)

            def _answer(self, payload: dict, status: int = 200) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def commits(self) -> list[tuple[str, dict[str, bytes]]]:
        """(repository id, {path: content}) of each commit received."""
        out = []
        for _, path, _, body in self.requests:
            if "/commit/" in path:
                files = {item["value"]["path"]: base64.b64decode(item["value"]["content"])
                         for item in body if item["key"] == "file"}
                out.append((path.removeprefix("/api/models/").split("/commit/")[0], files))
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def no_token_file(tmp_path, monkeypatch):
    """No token but what the test sets: no HF_TOKEN, and a token file that does not exist."""
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-here"))


@pytest.fixture(scope="module")
def pushed_run(tmp_path_factory, tiny_model_dir):
    """A LoRA SFT run with hub.push_at_end=true against the fake Hub: (run directory, the fake Hub)."""
    hub = FakeHub()
    out = tmp_path_factory.mktemp("hub") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_TOKEN", TOKEN)
        patch.setenv("HF_ENDPOINT", hub.endpoint)
        train_sft(load_config(SFTConfig, None, [*RUN, f"output_dir={out}", "hub.push_at_end=true",
                                                "hub.repo_id=someone/tiny-sft"]))
    yield out, hub
    hub.close()


def test_push_at_end_uploads_final_with_its_card_to_the_endpoint(pushed_run):
    out, hub = pushed_run
    create = next(body for _, path, _, body in hub.requests if path == "/api/repos/create")
    assert (create["organization"], create["name"]) == ("someone", "tiny-sft")
    assert "visibility" not in create  # not private: the Hub's default visibility
    [(repo, files)] = hub.commits()
    assert repo == "someone/tiny-sft"
    local = {p.relative_to(out / "final").as_posix() for p in (out / "final").rglob("*") if p.is_file()}
    assert set(files) == local - {"manifest.json"}
    assert {"README.md", "config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    assert files["model.safetensors"] == (out / "final" / "model.safetensors").read_bytes()
    assert files["README.md"] == (out / "final" / "README.md").read_bytes()
    # The token goes to the endpoint with every call, and into no file of the run.
    assert {auth for _, _, auth, _ in hub.requests} == {f"Bearer {TOKEN}"}
    holding = [p for p in out.rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]
    assert holding == []


def test_cards_carry_the_hub_header_the_run_and_how_to_load_it(pushed_run):
    out, _ = pushed_run
    card = ModelCard((out / "final" / "README.md").read_text())
    assert card.data.library_name == "transformers"
    assert card.data.pipeline_tag == "text-generation"
    assert {"posttrain", "sft", "lora"} <= set(card.data.tags)
    assert card.data.base_model is None  # an embedded model is no Hub repository; the text names it
    text = card.text
    assert "from `posttrain/tiny`" in text and f"posttrain {__version__}" in text and "recipe `sft`" in text
    assert "posttrain/arithmetic[:32]" in text
    assert "| `trainer.max_steps` | `2` |" in text and "| `lora.r` | `4` |" in text
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert f"At the last logged step ({records[-1]['step']})" in text
    assert f"| `loss` | {records[-1]['loss']:.4g} |" in text
    assert f"| `eval_loss` | {records[0]['eval_loss']:.4g} (step 1) | {records[-1]['eval_loss']:.4g} (step 2) |" in text
    assert "AutoModelForCausalLM.from_pretrained('someone/tiny-sft')" in text  # written again for the push
    adapter = ModelCard((out / "adapter" / "README.md").read_text())
    assert adapter.data.library_name == "peft" and "AutoPeftModelForCausalLM" in adapter.text
    # Each card is in its export's manifest, so a later run replaces final/ and adapter/ without calling the
    # card a file of the user's.
    for folder in ("final", "adapter"):
        assert "README.md" in read_manifest(out / folder)
        assert foreign_files(out / folder) == []


def test_cli_push_uploads_the_adapter_to_a_private_repository(pushed_run, monkeypatch, capsys):
    out, hub = pushed_run
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    assert cli.main(["push", str(out), "--repo-id", "someone/tiny-adapter", "--private", "--adapter"]) == 0
    assert f"to {hub.endpoint}/someone/tiny-adapter" in capsys.readouterr().out
    creates = [body for _, path, _, body in hub.requests if path == "/api/repos/create"]
    assert creates[-1]["visibility"] == "private" and creates[-1]["name"] == "tiny-adapter"
    repo, files = hub.commits()[-1]
    assert repo == "someone/tiny-adapter"
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= set(files)
    assert "model.safetensors" not in files
    assert b"AutoPeftModelForCausalLM.from_pretrained('someone/tiny-adapter')" in files["README.md"]


def test_push_without_a_token_says_how_to_give_one(pushed_run, no_token_file, monkeypatch, capsys):
    out, hub = pushed_run
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    sent = len(hub.requests)
    assert cli.main(["push", str(out), "--repo-id", "someone/x"]) == 1
    err = capsys.readouterr().err
    assert "no Hugging Face token" in err and "HF_TOKEN" in err and "hf auth login" in err
    assert len(hub.requests) == sent  # nothing was sent


def test_push_at_end_without_a_token_stops_before_training(tmp_path, no_token_file, tiny_model_dir):
    cfg = load_config(SFTConfig, None, [*RUN, f"output_dir={tmp_path}", "hub.push_at_end=true",
                                        "hub.repo_id=someone/x"])
    with pytest.raises(RunError, match="hub.push_at_end=true and no Hugging Face token.*HF_TOKEN"):
        train_sft(cfg)
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "final").exists()


def test_push_with_no_network_names_the_endpoint_and_the_command_to_retry(pushed_run, monkeypatch, capsys):
    out, _ = pushed_run
    with socket.socket() as probe:  # a port nothing listens on once closed: connection refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    assert cli.main(["push", str(out), "--repo-id", "someone/x"]) == 1
    err = capsys.readouterr().err
    assert f"could not reach http://127.0.0.1:{port}" in err
    assert f"posttrain push {out} --repo-id someone/x" in err
    assert TOKEN not in err


def test_hub_settings_are_validated_at_load():
    base = ["data.train_files=['posttrain/arithmetic[:8]']"]
    with pytest.raises(ConfigError, match="hub.push_at_end=true needs hub.repo_id"):
        load_config(SFTConfig, None, [*base, "hub.push_at_end=true"])
    with pytest.raises(ConfigError, match="hub.folder=adapter .* lora.enabled=true"):
        load_config(SFTConfig, None, [*base, "hub.folder=adapter"])
    with pytest.raises(ConfigError, match="hub.repo_id"):
        load_config(SFTConfig, None, [*base, "hub.repo_id='a/b/c'"])
