"""A policy file that parses but means something broken is refused: at startup (`kvgate serve` exits with code 2 and
names the field) and on reload (the old config stays, the rejection is counted, `/admin/reload` answers 400)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from kvgate.router.core.errors import ConfigError
from kvgate.router.settings.holder import ConfigHolder
from tests.abuse.support import assert_openai_error, gateway_config
from tests.support import KVGATE, REPO, Gateway, Sim, start_kvgate, start_sim

GOOD = "replicas: [{name: a, url: 'http://127.0.0.1:9'}]\n"
BROKEN = {
    "unknown policy": (GOOD + "policy: {name: bogus}\n", "policy.name"),
    "empty file": ("", "replicas"),
    "no replicas": ("replicas: []\n", "replicas"),
    "tokenizer that does not load": (GOOD + "models: [{name: m, tokenizer: /nonexistent/tokenizer}]\n",
                                     "models.0.tokenizer"),
    "event endpoint that is not one": ("replicas: [{name: a, url: 'http://127.0.0.1:9', kv_events: not-a-url}]\n",
                                       "replicas.0.kv_events"),
    "replay endpoint without a port": ("replicas: [{name: a, url: 'http://127.0.0.1:9', kv_replay: 'tcp://host'}]\n",
                                       "replicas.0.kv_replay"),
    "peer hints with no token to key them": (GOOD + "peers: {hints: {bind: 'tcp://127.0.0.1:5590'}}\n", "peers.hints"),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_a_broken_meaning_is_rejected_on_reload_and_at_startup(tmp_path: Path, name: str) -> None:
    text, field = BROKEN[name]
    path = tmp_path / "kvgate.yaml"
    path.write_text(GOOD)
    holder = ConfigHolder(path)
    old = holder.current
    path.write_text(text)
    assert holder.reload() is False
    assert holder.current is old and holder.reloads_rejected == 1
    assert holder.last_error is not None and field in holder.last_error
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        ConfigHolder(path)


def test_an_unchanged_tokenizer_is_not_reloaded_to_be_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = REPO / "loadgen" / "assets" / "tokenizer"
    path = tmp_path / "kvgate.yaml"
    path.write_text(GOOD + f"models: [{{name: m, tokenizer: '{tokenizer}'}}]\n")
    holder = ConfigHolder(path)
    loads: list[str] = []
    monkeypatch.setattr("kvgate.router.settings.validate.ModelTokenizer.from_path", lambda p: loads.append(p))
    path.write_text(GOOD + f"models: [{{name: m, tokenizer: '{tokenizer}'}}]\nhealth: {{interval_s: 3}}\n")
    assert holder.reload() is True
    assert loads == []


@pytest.mark.integration
def test_kvgate_serve_refuses_to_start_on_a_broken_meaning(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text(BROKEN["event endpoint that is not one"][0])
    done = subprocess.run([*KVGATE, "serve", "--config", str(path), "--port", "0"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "replicas.0.kv_events" in done.stderr and "Traceback" not in done.stderr


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    s = start_sim(tmp_path_factory.mktemp("abuse-config-sim"), 1, "--time-scale", "0")
    yield s
    s.stop()


@pytest.mark.integration
def test_admin_reload_answers_400_and_keeps_serving(sim: Sim, tmp_path: Path) -> None:
    path = gateway_config(sim, tmp_path, "kvgate.yaml", server={"admin_token": "secret"},
                          tenants={"api_keys": {"key-a": "a"}, "salt_secret": "s" * 32})
    good = path.read_text()
    gw: Gateway = start_kvgate(tmp_path, path)
    try:
        admin = {"Authorization": "Bearer secret"}
        for text, field in (BROKEN["empty file"], BROKEN["unknown policy"]):
            path.write_text(text if text else "")
            response = httpx.post(gw.url + "/admin/reload", headers=admin, timeout=30)
            error = assert_openai_error(response, 400, "config_rejected")
            assert field in error["message"]
        broken = yaml.safe_load(good)
        broken["replicas"][0]["kv_events"] = "not-a-url"
        path.write_text(yaml.safe_dump(broken))
        assert_openai_error(httpx.post(gw.url + "/admin/reload", headers=admin, timeout=30), 400, "config_rejected")
        # The old config is still in force: tenant auth on, admin still there, the replica still routed to.
        assert httpx.get(gw.url + "/admin/replicas", headers=admin, timeout=10).status_code == 200
        body = {"model": "kvgate-sim", "prompt": "hi", "max_tokens": 1}
        assert httpx.post(gw.url + "/v1/completions", json=body, timeout=30).status_code == 401
        ok = httpx.post(gw.url + "/v1/completions", json=body, headers={"Authorization": "Bearer key-a"}, timeout=30)
        assert ok.status_code == 200, ok.text
        metrics = httpx.get(gw.url + "/metrics", timeout=10).text
        assert "kvgate_config_reloads_rejected_total 3.0" in metrics.splitlines()
    finally:
        gw.stop()


TOKEN = "adm-3f9c"  # short enough for PyYAML to quote it whole
SALT = "salt-secret-never-shown-7d2e1a"
LEAKY = {
    "a YAML syntax error on a token's line": f"server: {{admin_token: {TOKEN}\nreplicas: [\n",
    "a YAML error right after the salt secret": f"tenants:\n  salt_secret: '{SALT}\n  api_keys: {{}}\n",
    "an API key whose tenant is not a name": "replicas: [{name: a, url: 'http://127.0.0.1:9'}]\n"
                                             f"tenants: {{api_keys: {{{TOKEN}: [1]}}, salt_secret: {SALT}}}\n",
}


@pytest.mark.parametrize("name", list(LEAKY))
def test_config_errors_name_the_place_never_a_secret(tmp_path: Path, name: str) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text(LEAKY[name])
    with pytest.raises(ConfigError) as caught:
        ConfigHolder(path)
    message = str(caught.value)
    assert TOKEN not in message and SALT not in message, message
    assert "line" in message or "api_keys.<key>" in message, message


@pytest.mark.integration
def test_a_rejected_reload_shows_no_secret_in_its_answer_or_the_log(sim: Sim, tmp_path: Path) -> None:
    path = gateway_config(sim, tmp_path, "kvgate.yaml", server={"admin_token": "secret"},
                          tenants={"api_keys": {"key-a": "a"}, "salt_secret": SALT})
    gw = start_kvgate(tmp_path, path)
    try:
        good = path.read_text()
        path.write_text(good.replace(f"salt_secret: {SALT}", f"salt_secret: '{SALT}"))  # an unclosed quote
        response = httpx.post(gw.url + "/admin/reload", headers={"Authorization": "Bearer secret"}, timeout=30)
        error = assert_openai_error(response, 400, "config_rejected")
        assert SALT not in error["message"] and "line" in error["message"]
        assert SALT not in gw.process.output()
    finally:
        gw.stop()


@pytest.mark.integration
def test_kvgate_serve_shows_no_secret_when_the_file_does_not_parse(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text(LEAKY["a YAML syntax error on a token's line"])
    done = subprocess.run([*KVGATE, "serve", "--config", str(path), "--port", "0"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and TOKEN not in done.stderr + done.stdout, done.stderr
