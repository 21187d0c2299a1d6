from __future__ import annotations

import pytest

from understudy.engine_shim.config import ConfigError, from_env

BASE = {
    "ENGINE_ROLE": "shadow",
    "UNDERSTUDY_ENGINE_NAME": "engine-shadow-1",
    "UNDERSTUDY_RUN_DIR": "/run/understudy",
    "UNDERSTUDY_DEVICES": "0,1",
}


def test_defaults_follow_the_pod_contract():
    cfg = from_env(BASE)
    assert cfg.lock_socket.as_posix() == "/run/understudy/lock.sock"
    assert cfg.gms_socket(1).as_posix() == "/run/understudy/gms/gms_1_weights.sock"
    assert cfg.devices == (0, 1)
    # Served only through the front, on a Unix socket named after this process.
    assert cfg.serve_socket.parent.as_posix() == "/run/understudy/serve"
    assert cfg.serve_socket.name == cfg.engine_id.replace("/", ".") + ".sock"
    assert cfg.engine_id.startswith("engine-shadow-1/")
    assert from_env(BASE).engine_id != cfg.engine_id  # a new process is a new holder


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("ENGINE_ROLE", "leader", "ENGINE_ROLE"),
        ("UNDERSTUDY_DEVICES", "0,0", "distinct"),
        ("UNDERSTUDY_DEVICES", "a", "UNDERSTUDY_DEVICES"),
        ("UNDERSTUDY_WAKE_TIMEOUT_S", "0", "positive"),
        ("UNDERSTUDY_REMAP_TIMEOUT_S", "soon", "not a number"),
        ("UNDERSTUDY_ENGINE_ARGS", '{"a": 1}', "JSON list"),
        ("UNDERSTUDY_ENGINE_ADAPTER", "tensorrt", "ADAPTER"),
        ("UNDERSTUDY_GMS_BACKEND", "rdma", "host or cuda"),
    ],
)
def test_bad_values_are_named(key, value, match):
    with pytest.raises(ConfigError, match=match):
        from_env({**BASE, key: value})


def test_role_is_required():
    with pytest.raises(ConfigError, match="ENGINE_ROLE"):
        from_env({})


def test_each_adapter_has_its_default_model():
    assert from_env(BASE).model == "builtin:all-MiniLM-L6-v2"
    llama = from_env({**BASE, "UNDERSTUDY_ENGINE_ADAPTER": "llama"})
    assert (llama.adapter, llama.model) == ("llama", "builtin:tiny-llama")
    vllm = from_env({**BASE, "UNDERSTUDY_ENGINE_ADAPTER": "vllm"})
    assert (vllm.adapter, vllm.model) == ("vllm", "builtin:tiny-llama")
    chosen = {**BASE, "UNDERSTUDY_ENGINE_ADAPTER": "llama", "UNDERSTUDY_MODEL": "/models/x"}
    assert from_env(chosen).model == "/models/x"
