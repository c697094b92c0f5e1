"""encrypt = true: mutual TLS between nodes with a certificate derived from the cluster key
(meshnode.trust.tls), over real in-process nodes and real grpc.aio clients on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack

import grpc
import pytest
from cryptography import x509

from meshnode.config import ConfigError, Settings, load_settings
from meshnode.model.build import build_model
from meshnode.proto import mesh_pb2, mesh_pb2_grpc
from meshnode.trust import tls
from meshnode.trust.auth import ClusterAuth
from meshnode.trust.signed import SignedChannel
from meshnode.weights.profile import profile_model
from tests.helpers import running_node

pytestmark = pytest.mark.timeout(180)

KEY = "tls test cluster key"
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


# ---------------------------------------------------------------------------- derivation
def test_same_key_same_certificate_bytes_other_key_other_certificate():
    a = tls.derive_identity(KEY)
    tls.derive_identity.cache_clear()
    b = tls.derive_identity(KEY)
    assert a is not b and a.cert_pem == b.cert_pem and a.key_pem == b.key_pem
    # another process derives the very same bytes (no randomness anywhere, signature included)
    code = (
        f"import sys; from meshnode.trust.tls import derive_identity as d; sys.stdout.buffer.write(d({KEY!r}).cert_pem)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, check=True).stdout == a.cert_pem
    other = tls.derive_identity(KEY + "!")
    assert other.cert_pem != a.cert_pem and other.key_pem != a.key_pem
    cert = x509.load_pem_x509_certificate(a.cert_pem)
    assert cert.subject.get_attributes_for_oid(x509.oid.NameOID.COMMON_NAME)[0].value == tls.SERVER_NAME
    assert KEY not in repr(a) and b"PRIVATE" not in repr(a).encode()
    with pytest.raises(ValueError):
        tls.derive_identity("")


def test_encrypt_needs_a_cluster_key():
    with pytest.raises(ConfigError, match="cluster_key"):
        load_settings(None, env={"MESHNODE_ENCRYPT": "true"}, flags={})
    s = load_settings(None, env={"MESHNODE_ENCRYPT": "1", "MESHNODE_CLUSTER_KEY": KEY}, flags={})
    assert s.encrypt is True and s.authenticate is True


# ---------------------------------------------------------------------------- two real nodes
def node_thread(model, tmp_path, **overrides):
    """A real Node (HTTP + gRPC) on 127.0.0.1 in its own thread and loop; does not wait for a plan."""
    flags = dict(max_context=256, cluster_key=KEY, encrypt=True, strategy="pipeline")
    flags.update(overrides)
    return running_node(model, tmp_path, ready=False, **flags)


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


def _chat(base: str, model_id: str) -> str:
    body = json.dumps({"model": model_id, "messages": MESSAGES, "max_tokens": 16, "temperature": 0}).encode()
    req = urllib.request.Request(f"{base}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("tls") / "llama", "llama", num_layers=4, dtype="float32")


@pytest.fixture(scope="module")
def reference(model):
    from mlx_lm import generate, load

    m, tok = load(str(model))
    return generate(m, tok, prompt=tok.apply_chat_template(MESSAGES, add_generation_prompt=True), max_tokens=16)


async def _probe(target: str, credentials, auth: ClusterAuth | None):
    options = tls.channel_options() if credentials is not None else []
    channel = (
        grpc.aio.secure_channel(target, credentials, options=options)
        if credentials is not None
        else grpc.aio.insecure_channel(target)
    )
    if auth is not None:
        channel = SignedChannel(channel, auth, "intruder")
    async with channel:
        stub = mesh_pb2_grpc.MeshStub(channel)
        return await stub.Probe(mesh_pb2.ProbeRequest(reply_bytes=16), timeout=5)


def _refusal(target: str, credentials, auth) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(_probe(target, credentials, auth))
    return err.value.code()


@pytest.mark.slow
def test_two_encrypted_nodes_form_a_pipeline_answer_like_mlx_lm_and_refuse_outsiders(model, reference, tmp_path):
    # both nodes needed: a 2-stage pipeline (a node reserves KV for kv_requests requests by default)
    budget = int(profile_model(model).total_bytes(256, requests=Settings().kv_requests) * 0.6)
    with ExitStack() as stack:
        a, base_a = stack.enter_context(node_thread(model, tmp_path / "a", node_id="node-a", memory_budget=budget))
        b, base_b = stack.enter_context(
            node_thread(
                model, tmp_path / "b", node_id="node-b", memory_budget=budget, peers=[f"127.0.0.1:{a.grpc_port}"]
            )
        )
        deadline = time.monotonic() + 60
        while not (a.serving_ready() and b.serving_ready()):
            assert time.monotonic() < deadline, f"no encrypted mesh: {_get(base_a + '/v1/mesh')}"
            time.sleep(0.1)
        view = _get(base_a + "/v1/mesh")
        assert len(view["plan"]["stages"]) == 2, view["plan"]
        assert _chat(base_a, a.model_id) == reference
        assert _chat(base_b, b.model_id) == reference
        target = f"127.0.0.1:{a.grpc_port}"
        right = tls.channel_credentials(tls.derive_identity(KEY))
        wrong = tls.channel_credentials(tls.derive_identity("another cluster's key"))
        # The right certificate and MAC get a reply.
        reply = asyncio.run(_probe(target, right, ClusterAuth(KEY)))
        assert len(reply.payload) == 16
        # A plaintext client, even one with the right MAC key, never gets past the TLS handshake.
        assert _refusal(target, None, ClusterAuth(KEY)) == grpc.StatusCode.UNAVAILABLE
        # A client with a certificate derived from another key: handshake refused.
        assert _refusal(target, wrong, ClusterAuth(KEY)) == grpc.StatusCode.UNAVAILABLE
        # A client trusting the right certificate but presenting none: refused (client auth required).
        no_cert = grpc.ssl_channel_credentials(root_certificates=tls.derive_identity(KEY).cert_pem)
        assert _refusal(target, no_cert, ClusterAuth(KEY)) == grpc.StatusCode.UNAVAILABLE
        # The right certificate without the MAC: the HMAC layer still refuses (defence in depth).
        assert _refusal(target, right, None) == grpc.StatusCode.UNAUTHENTICATED
        # Both still answer after the intruders.
        assert _chat(base_b, b.model_id) == reference


async def test_a_client_refuses_a_server_without_the_key():
    """A man in the middle that does not hold the key cannot present the cluster certificate."""
    other = tls.derive_identity("not the cluster key")
    server = grpc.aio.server()
    mesh_pb2_grpc.add_MeshServicer_to_server(mesh_pb2_grpc.MeshServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials(other))
    await server.start()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _probe(f"127.0.0.1:{port}", tls.channel_credentials(tls.derive_identity(KEY)), ClusterAuth(KEY))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)
