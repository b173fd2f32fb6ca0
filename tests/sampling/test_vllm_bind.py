"""check_bind_host: a dev-mode vLLM server listens on loopback unless the user accepts the risk."""

import pytest

from jaxrlvr.sampling import vllm_server


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_is_accepted(host):
    vllm_server.check_bind_host(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.1.2.3", "192.168.0.7"])
def test_other_addresses_need_consent(host):
    with pytest.raises(vllm_server.UnsafeBindError, match=f"^--host {host}: refusing"):
        vllm_server.check_bind_host(host)
    vllm_server.check_bind_host(host, allow_remote=True)


def test_config_side_names_its_own_keys():
    with pytest.raises(vllm_server.UnsafeBindError) as err:
        vllm_server.check_bind_host(
            "0.0.0.0",
            key="sampler.vllm_host",
            allow_flag="sampler.vllm_allow_remote_dev_endpoints=true",
        )
    msg = str(err.value)
    assert msg.startswith("sampler.vllm_host='0.0.0.0': refusing to expose a dev-mode vLLM server")
    assert msg.endswith("or pass sampler.vllm_allow_remote_dev_endpoints=true on a trusted network")


def test_server_object_refuses_before_starting_anything(tmp_path):
    with pytest.raises(vllm_server.UnsafeBindError, match="^VLLMServer: host='0.0.0.0': refusing"):
        vllm_server.VLLMServer(tmp_path, host="0.0.0.0", start=False)
    s = vllm_server.VLLMServer(
        tmp_path, host="0.0.0.0", start=False, allow_remote_dev_endpoints=True, port=1234
    )
    assert s.url == "http://127.0.0.1:1234"
