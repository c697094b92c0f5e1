"""Fuzzing one real running node (HTTP API and gRPC, in process on 127.0.0.1).

* thousands of hypothesis-generated HTTP requests: random methods, paths, content types and
  bodies, and near-valid chat/completion bodies with fields of wrong types, huge numbers, NaN,
  unicode and missing fields. Every answer must be a 4xx with an OpenAI-style JSON error or a
  correct 200; never a 5xx, never a hang (each request has a deadline);
* random bytes as the serialized request of every gRPC method, and protobuf messages with random
  field values, sent WITH a valid cluster-key MAC so they reach the handlers: every call ends
  with an error status or a reply that parses, in time;
* raw garbage bytes on the HTTP and gRPC ports over plain TCP;
* afterwards the node still answers a greedy chat exactly like mlx_lm.generate did before.

No unhandled exception may be logged by the node meanwhile. The API serves no OpenAPI document,
so schemathesis has nothing to read; hypothesis generates the requests.

Messages from key holders that are *valid* (a heartbeat with the right cluster id, a plan for the
served model) are trusted by design (see meshnode/trust/auth.py) and are not fuzzed here: the
fuzzer only makes invalid or foreign ones.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import threading
import urllib.parse
import urllib.request
from collections import Counter

import grpc
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from meshnode.model.build import build_model
from meshnode.model.wire import RAW_REQUEST, is_raw
from meshnode.proto import mesh_pb2
from meshnode.transport.dataport import hello as data_hello
from meshnode.transport.dataport import recv_frame, send_frame
from meshnode.transport.refusals import StageRefused
from meshnode.transport.service import MAX_GRPC_MESSAGE
from meshnode.trust.auth import ClusterAuth
from meshnode.trust.signed import SignedChannel
from meshnode.version import OLDEST_PROTOCOL, PROTOCOL, describe
from tests.helpers import running_node

pytestmark = pytest.mark.timeout(240)

KEY = "fuzzing cluster key"
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
MAX_TOKENS_LIMIT = 8
TIMEOUT = 15.0  # seconds any single request may take before it counts as a hang


def fuzz(examples: int) -> settings:
    """No example database (nothing written into the working tree), no per-example deadline:
    the per-request TIMEOUT is the hang check."""
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.function_scoped_fixture,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
        ],
    )


class _Unhandled(logging.Handler):
    """Collects records that carry an exception (unhandled errors, 'Task exception was never retrieved')."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        text = record.getMessage()
        if "[NotImplementedError] raised by servicer method" in text and ("/Manifest]" in text or "/Fetch]" in text):
            return  # not served by this node yet (models from peers): grpc answers UNIMPLEMENTED
        if record.exc_info or "exception" in text.lower():
            self.records.append(record)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("fuzz") / "llama", "llama", num_layers=2, dtype="float32")


@pytest.fixture(scope="module")
def node(model, tmp_path_factory):
    handler = _Unhandled()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with running_node(
            model,
            tmp_path_factory.mktemp("node"),
            cluster_key=KEY,
            max_context=256,
            max_tokens_limit=MAX_TOKENS_LIMIT,
            default_max_tokens=4,
            max_body_bytes=64 * 1024,
            max_concurrent_requests=4,
        ) as (n, base):
            yield n, base, handler
    finally:
        root.removeHandler(handler)


def _no_unhandled(handler: _Unhandled) -> None:
    assert not handler.records, [(r.name, r.getMessage(), r.exc_text) for r in handler.records[:5]]


# ---------------------------------------------------------------------------- HTTP helpers
class Http:
    """One keep-alive connection, reopened whenever the server closes it."""

    def __init__(self, port: int):
        self.port = port
        self.conn: http.client.HTTPConnection | None = None

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        for attempt in range(2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT)
            try:
                self.conn.request(method, path, body=body, headers=headers or {})
                resp = self.conn.getresponse()
                data = resp.read()
            except (ConnectionError, http.client.RemoteDisconnected, http.client.BadStatusLine):
                self.close()
                if attempt:
                    raise
                continue
            if resp.will_close:
                self.close()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
        raise AssertionError("unreachable")

    def close(self):
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def _chat(http: Http, model_id: str, messages=MESSAGES, max_tokens: int = 8) -> str:
    body = json.dumps({"model": model_id, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    status, _, data = http.request("POST", "/v1/chat/completions", body.encode(), {"Content-Type": "application/json"})
    assert status == 200, data
    return json.loads(data)["choices"][0]["message"]["content"]


STANDARD_METHODS = {"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"}


def _check_error(status: int, headers: dict, data: bytes, method: str) -> None:
    assert 400 <= status < 500, (status, data[:300])
    if method == "HEAD":
        return
    if method not in STANDARD_METHODS and status == 400 and headers.get("content-type", "").startswith("text/plain"):
        return  # not HTTP that any route could see: aiohttp's parser answers before the app
    assert headers.get("content-type", "").startswith("application/json"), (status, headers, data[:200])
    err = json.loads(data)["error"]
    assert isinstance(err["message"], str) and err["message"]


def _check_generation(path: str, request: dict, headers: dict, data: bytes) -> None:
    """A 200 to a generation request must be a well-formed answer within the asked bounds."""
    kind = "chat" if path.startswith("/v1/chat") else "completion"
    limit = request.get("max_tokens")
    if not isinstance(limit, int) or isinstance(limit, bool):
        limit = MAX_TOKENS_LIMIT
    if request.get("stream") is True:
        assert headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", data[-200:]
        for raw in events[:-1]:
            event = json.loads(raw)
            assert "error" not in event, event
            assert event["object"] in ("chat.completion.chunk", "text_completion")
        return
    body = json.loads(data)
    choice = body["choices"][0]
    text = choice["message"]["content"] if kind == "chat" else choice["text"]
    assert isinstance(text, str)
    assert choice["finish_reason"] in ("stop", "length")
    assert 0 <= body["usage"]["completion_tokens"] <= min(limit, MAX_TOKENS_LIMIT)


# ---------------------------------------------------------------------------- strategies
json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(["", "user", "assistant", "system", "tool", "\u0000", "\ud7ff\ue000", "🦀" * 10]),
)
json_values = st.recursive(
    json_leaf,
    lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=12), c, max_size=4)),
    max_leaves=12,
)
small_int = st.one_of(st.integers(min_value=-3, max_value=12), st.sampled_from([2**31, 2**63, -(2**63), 10**30]))
valid_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool"]), "content": st.text(max_size=60)}
)
message = st.one_of(
    valid_message,
    st.fixed_dictionaries({}, optional={"role": json_values, "content": json_values, "name": json_values}),
    json_values,
)


@st.composite
def generation_bodies(draw, model_id: str):
    """Near-valid chat/completion bodies: each field right, wrong-typed, out of range or absent."""
    fields = {
        "model": st.one_of(st.just(model_id), json_values),
        "messages": st.one_of(st.lists(message, min_size=1, max_size=3), json_values),
        "prompt": st.one_of(st.text(max_size=60), st.lists(small_int, max_size=6), json_values),
        "max_tokens": st.one_of(small_int, json_values),
        "temperature": st.one_of(st.floats(min_value=-1, max_value=3), st.just(0), json_values),
        "top_p": st.one_of(st.floats(min_value=-0.5, max_value=1.5), json_values),
        "seed": st.one_of(small_int, json_values),
        "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=6), json_values),
        "stream": st.one_of(st.booleans(), json_values),
        "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
        "n": st.one_of(small_int, json_values),
        "logprobs": json_values,
        "tools": json_values,
        "response_format": json_values,
    }
    if draw(st.booleans()):  # a valid request with one field wrong, absent or extreme
        body = {
            "model": model_id,
            "max_tokens": draw(st.integers(1, MAX_TOKENS_LIMIT)),
            "temperature": draw(st.sampled_from([0, 0.7, 2])),
            "stream": draw(st.booleans()),
            "messages": draw(st.lists(valid_message, min_size=1, max_size=2)),
            "prompt": draw(st.one_of(st.text(max_size=40), st.lists(st.integers(0, 100), min_size=1, max_size=5))),
        }
        name = draw(st.sampled_from(sorted(fields)))
        if draw(st.booleans()):
            body[name] = draw(fields[name])
        else:
            body.pop(name, None)
        return body
    body = {}
    for name, strategy in fields.items():
        if draw(st.booleans()):
            body[name] = draw(strategy)
    if draw(st.integers(0, 9)) == 0:
        body[draw(st.text(min_size=1, max_size=10))] = draw(json_values)
    return body


def _encode_json(value) -> bytes:
    return json.dumps(value, allow_nan=True, ensure_ascii=bool(hash(str(value)) & 1)).encode("utf-8", "surrogatepass")


PATHS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/v1/mesh",
    "/health",
    "/metrics",
    "/",
    "/static/index.html",
    "/static/../../etc/passwd",
    "/v1",
    "/v1/",
    "/v1/chat/completions/",
    "//health",
    "/v1/chat/completions?stream=true",
    "/%00",
    "/static/%2e%2e/%2e%2e/x",
]
CONTENT_TYPES = [
    "application/json",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data",
    "application/json; charset=latin-1",
    "",
    "application/octet-stream",
    "\u00e9/\u00e9",
]


# ---------------------------------------------------------------------------- (d) before
def test_a_chat_before_fuzzing_equals_mlx_lm(node, model):
    from mlx_lm import generate, load

    n, base, handler = node
    m, tok = load(str(model))
    reference = generate(m, tok, prompt=tok.apply_chat_template(MESSAGES, add_generation_prompt=True), max_tokens=8)
    http = Http(n.http_port)
    answer = _chat(http, n.model_id)
    assert answer == reference
    node_reference.append(answer)


node_reference: list[str] = []
OUTCOMES: Counter = Counter()  # what the fuzzing got back, printed at the end (pytest -s)


# ---------------------------------------------------------------------------- (a) HTTP
@pytest.mark.slow
def test_http_random_methods_paths_content_types_and_bodies(node):
    n, base, handler = node
    http = Http(n.http_port)
    methods = st.one_of(
        st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
        st.from_regex(r"[A-Z]{1,12}", fullmatch=True),
    )
    paths = st.one_of(
        st.sampled_from(PATHS), st.text(max_size=40).map(lambda t: "/" + urllib.parse.quote(t, safe="/?=&%."))
    )
    bodies = st.one_of(
        st.none(), st.binary(max_size=300), json_values.map(_encode_json), st.just(b"{" * 5000), st.just(b"[" * 100_000)
    )

    @fuzz(500)
    @given(method=methods, path=paths, ctype=st.sampled_from(CONTENT_TYPES), body=bodies)
    def run(method, path, ctype, body):
        headers = {"Content-Type": ctype.encode("utf-8").decode("latin-1")} if ctype else {}
        status, got, data = http.request(method, path, body, headers)
        OUTCOMES[f"HTTP {status}"] += 1
        if status == 200:
            route = urllib.parse.urlsplit(path).path
            assert method in ("GET", "HEAD", "POST"), (method, path)
            if method == "POST":
                request = json.loads(body) if body else {}
                _check_generation(route, request, got, data)
            elif method == "GET" and route in ("/v1/models", "/v1/mesh", "/health"):
                json.loads(data)
        else:
            _check_error(status, got, data, method)

    try:
        run()
    finally:
        http.close()
    _no_unhandled(handler)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_http_generation_bodies(node, path):
    n, base, handler = node
    http = Http(n.http_port)

    @fuzz(350)
    @given(body=generation_bodies(n.model_id), json_body=st.integers(0, 19))
    def run(body, json_body):
        raw = _encode_json(body) if json_body else _encode_json(body)[:-1]  # 1 in 20: truncated JSON
        status, got, data = http.request("POST", path, raw, {"Content-Type": "application/json"})
        OUTCOMES[f"HTTP {status}"] += 1
        if status == 200:
            _check_generation(path, body, got, data)
        else:
            _check_error(status, got, data, "POST")
            if status == 429:
                assert got.get("retry-after")

    try:
        run()
    finally:
        http.close()
    _no_unhandled(handler)


@pytest.mark.parametrize("stream", [False, True])
def test_http_extreme_seeds_sample(node, stream):
    """A negative or very large seed (mx.random.key takes uint64) does not fail the generation: no
    500, nor a 500 written into an already started stream."""
    n, base, handler = node
    http = Http(n.http_port)
    for seed in (-1, -(2**63), 2**63 - 1, 2**32):
        body = {
            "model": n.model_id,
            "messages": MESSAGES,
            "max_tokens": 3,
            "temperature": 0.9,
            "seed": seed,
            "stream": stream,
        }
        status, got, data = http.request(
            "POST", "/v1/chat/completions", _encode_json(body), {"Content-Type": "application/json"}
        )
        assert status == 200, data
        _check_generation("/v1/chat/completions", body, got, data)
    http.close()
    _no_unhandled(handler)


# ---------------------------------------------------------------------------- (b) gRPC
METHODS = {  # method -> (request type, reply type, request streaming, reply streaming)
    "Heartbeat": (mesh_pb2.HeartbeatRequest, mesh_pb2.HeartbeatReply, False, False),
    "Install": (mesh_pb2.Plan, mesh_pb2.InstallReply, False, False),
    "Leave": (mesh_pb2.Goodbye, mesh_pb2.Ack, False, False),
    "Probe": (mesh_pb2.ProbeRequest, mesh_pb2.ProbeReply, False, False),
    "Manifest": (mesh_pb2.ManifestRequest, mesh_pb2.ModelManifest, False, False),
    "Generate": (mesh_pb2.GenerateRequest, mesh_pb2.GenerateReply, False, True),
    "Fetch": (mesh_pb2.FetchRequest, mesh_pb2.Chunk, False, True),
    "Forward": (mesh_pb2.ForwardRequest, mesh_pb2.ForwardReply, True, True),
}


class GrpcClient:
    """Raw-bytes calls on a signed channel, run on a loop in a thread of their own."""

    def __init__(self, port: int, auth: ClusterAuth | None):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def make():
            # the limits real peers use (a 4 MiB probe reply is over grpc's default)
            channel = grpc.aio.insecure_channel(
                f"127.0.0.1:{port}",
                options=[
                    ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE),
                    ("grpc.max_send_message_length", MAX_GRPC_MESSAGE),
                ],
            )
            return SignedChannel(channel, auth, "fuzzer") if auth is not None else channel

        self.channel = self.run(make())

    def run(self, coro, timeout: float = TIMEOUT):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _call(self, method: str, payloads: list[bytes]):
        _, _, req_stream, reply_stream = METHODS[method]
        name = f"/meshnode.v1.Mesh/{method}"
        replies: list[bytes] = []
        try:
            if not req_stream and not reply_stream:
                replies.append(await self.channel.unary_unary(name)(payloads[0], timeout=TIMEOUT - 5))
            elif not req_stream:
                async for reply in self.channel.unary_stream(name)(payloads[0], timeout=TIMEOUT - 5):
                    replies.append(reply)
            else:
                call = self.channel.stream_stream(name)(timeout=TIMEOUT - 5)
                try:
                    for p in payloads:
                        await call.write(p)
                    await call.done_writing()
                except asyncio.InvalidStateError:
                    pass  # the node already ended the call (refused an earlier message)
                async for reply in call:
                    replies.append(reply)
                code = await call.code()
                if code != grpc.StatusCode.OK:
                    return code, replies, await call.details() or ""
        except grpc.aio.AioRpcError as exc:
            return exc.code(), replies, exc.details() or ""
        return grpc.StatusCode.OK, replies, ""

    def call(self, method: str, payloads: list[bytes]):
        return self.run(self._call(method, payloads))

    def close(self):
        self.run(self.channel.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def _check_grpc(method: str, code, replies: list[bytes], details: str) -> None:
    """An error status, or replies that parse as the method's reply type. UNKNOWN would mean an
    exception escaped a handler."""
    assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED), (method, code, details)
    if code == grpc.StatusCode.INTERNAL:
        # grpc.aio's client reports this when the server ends a stream while the client is still
        # writing (grpc/grpc#36066): the node refused the stream, the client saw it late.
        assert METHODS[method][2] and details == "Internal error from Core", (method, code, details)
    for raw in replies:
        METHODS[method][1].FromString(raw)
    if code == grpc.StatusCode.OK and not METHODS[method][3]:
        assert len(replies) == 1


@pytest.fixture
def grpc_client(node):
    client = GrpcClient(node[0].grpc_port, ClusterAuth(KEY))
    yield client
    client.close()


@pytest.mark.slow
def test_grpc_random_bytes_to_every_method(node, grpc_client):
    n, base, handler = node

    @fuzz(400)
    @given(method=st.sampled_from(sorted(METHODS)), payloads=st.lists(st.binary(max_size=200), min_size=1, max_size=4))
    def run(method, payloads):
        _check_grpc(method, *grpc_client.call(method, payloads))

    run()
    _no_unhandled(handler)


def _tensors():
    return st.builds(
        mesh_pb2.Tensor,
        dtype=st.sampled_from(["float32", "int32", "bfloat16", "float16", "int64", "", "\u00e9"]),
        shape=st.lists(st.one_of(st.integers(0, 5), st.sampled_from([64, 2**31, 2**32 - 1])), max_size=5),
        data=st.one_of(st.binary(max_size=64), st.integers(0, 2048).map(lambda k: b"\x01" * k)),
    )


def _messages(served_epoch: int):
    text = st.text(max_size=30)
    u32 = st.one_of(st.integers(0, 8), st.just(2**32 - 1))
    u64 = st.one_of(st.integers(0, served_epoch + 2), st.just(2**64 - 1))
    floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
    node_info = st.builds(
        mesh_pb2.NodeInfo,
        node_id=text,
        addresses=st.lists(text, max_size=3),
        http_port=u32,
        grpc_port=u32,
        memory_budget=u64,
        cluster_id=text,
        models=st.lists(text, max_size=2),
        compute=st.floats(allow_nan=True),
        started_at=st.floats(allow_nan=True),
    )
    stage = st.builds(
        mesh_pb2.Stage,
        start_layer=u32,
        end_layer=u32,
        nodes=st.lists(text, max_size=3),
        bytes=u64,
        endpoints=st.lists(text, max_size=2),
    )
    plan = st.builds(
        mesh_pb2.Plan,
        epoch=u64,
        model=text,
        strategy=st.sampled_from(["single", "pipeline", "tensor", "hybrid", "x"]),
        stages=st.lists(stage, max_size=3),
        coordinator=text,
        max_context=u32,
        estimate_s=floats,
    )
    return {
        "Heartbeat": st.builds(
            mesh_pb2.HeartbeatRequest,
            node=node_info,
            coordinator=text,
            epoch=u64,
            alive=st.lists(text, max_size=3),
            ready_epoch=u64,
            plan_error=text,
            **{"plan": plan},
        ),
        "Install": plan,
        "Leave": st.builds(mesh_pb2.Goodbye, node_id=text),
        "Probe": st.builds(
            mesh_pb2.ProbeRequest, payload=st.binary(max_size=64), reply_bytes=st.one_of(u32, st.just(2**31 - 1))
        ),
        "Manifest": st.builds(mesh_pb2.ManifestRequest, model_id=text),
        "Fetch": st.builds(mesh_pb2.FetchRequest, model_id=text, path=text, offset=u64, length=u64),
        "Generate": st.builds(
            mesh_pb2.GenerateRequest,
            request_id=text,
            epoch=u64,
            prompt=st.lists(st.one_of(st.integers(0, 40), st.integers(0, 2**20), st.just(2**32 - 1)), max_size=6),
            max_tokens=st.integers(-5, 20),
            temperature=floats,
            top_p=floats,
            has_seed=st.booleans(),
            seed=st.integers(-(2**63), 2**63 - 1),
        ),
        "Forward": st.builds(
            mesh_pb2.ForwardRequest, request_id=text, epoch=u64, start_layer=u32, end_layer=u32, input=_tensors()
        ),
    }


@pytest.mark.slow
def test_grpc_random_field_values_to_every_method(node, grpc_client):
    n, base, handler = node
    served = n.served.serving_plan()
    assert served is not None
    strategies = _messages(served.epoch)
    layers = [(s.start_layer, s.end_layer) for s in served.stages]

    @fuzz(500)
    @given(data=st.data(), method=st.sampled_from(sorted(METHODS)))
    def run(data, method):
        count = data.draw(st.integers(1, 4)) if METHODS[method][2] else 1
        msgs = [data.draw(strategies[method]) for _ in range(count)]
        if method == "Generate" and data.draw(st.booleans()):  # the served epoch: reaches the sampler
            msgs[0].epoch = served.epoch
            if data.draw(st.booleans()):
                msgs[0].max_tokens, msgs[0].temperature, msgs[0].top_p = data.draw(st.integers(1, 8)), 0.0, 1.0
                msgs[0].prompt[:] = data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=6))
        if method == "Forward" and data.draw(st.booleans()):  # aim at the stage actually served
            msgs[0].epoch = served.epoch
            msgs[0].start_layer, msgs[0].end_layer = data.draw(st.sampled_from(layers))
        # A foreign cluster's heartbeat never joins; an Install names a model not served here.
        # Hypothesis also draws the test's own string constants ("llama"), so these are assumed.
        if method == "Heartbeat":
            assume(msgs[0].node.cluster_id != n.cluster_id)
        if method == "Install":
            assume(msgs[0].model != n.model_id)
        code, replies, details = grpc_client.call(method, [m.SerializeToString() for m in msgs])
        OUTCOMES[f"{method} {code.name}"] += 1
        if code == grpc.StatusCode.INTERNAL:
            OUTCOMES[f"{method} INTERNAL {details[:120]}"] += 1
        _check_grpc(method, code, replies, details)

    run()
    _no_unhandled(handler)


def test_a_peer_of_an_incompatible_protocol_is_refused_naming_both_and_never_joins(node, grpc_client, caplog):
    """A heartbeat from a build speaking another wire protocol is refused with a reason naming both
    builds, logged once, and the peer is not taken into the mesh; the node keeps serving."""
    n, base, handler = node
    peer = mesh_pb2.NodeInfo(
        node_id="node-future",
        addresses=["127.0.0.9"],
        grpc_port=9,
        cluster_id=n.cluster_id,
        version="9.0.0",
        protocol=PROTOCOL + 7,
    )
    msg = mesh_pb2.HeartbeatRequest(node=peer).SerializeToString()
    with caplog.at_level(logging.WARNING, logger="meshnode.control.heartbeats"):
        for _ in range(3):
            code, replies, details = grpc_client.call("Heartbeat", [msg])
            assert code == grpc.StatusCode.FAILED_PRECONDITION and not replies, (code, details)
    assert f"speaks wire protocol {PROTOCOL + 7}" in details and "meshnode 9.0.0" in details, details
    assert describe() in details and f"speaks {OLDEST_PROTOCOL} to {PROTOCOL}" in details, details
    assert [r.getMessage() for r in caplog.records].count(f"refusing node-future: {details}") == 1
    assert "node-future" not in n.peers.alive_infos()
    # the node's own build and protocol, as /v1/mesh shows them
    with urllib.request.urlopen(f"{base}/v1/mesh", timeout=TIMEOUT) as r:
        mesh = json.loads(r.read())
    assert mesh["version"] == describe() and mesh["protocol"] == PROTOCOL, mesh
    assert mesh["nodes"][0]["protocol"] == PROTOCOL and mesh["nodes"][0]["version"] == describe()
    _no_unhandled(handler)


def test_grpc_without_the_key_is_refused(node):
    client = GrpcClient(node[0].grpc_port, ClusterAuth("not the key"))
    try:

        @fuzz(60)
        @given(method=st.sampled_from(sorted(METHODS)), payload=st.binary(max_size=100))
        def run(method, payload):
            code, replies, _ = client.call(method, [payload])
            assert code == grpc.StatusCode.UNAUTHENTICATED and not replies

        run()
    finally:
        client.close()


# ---------------------------------------------------------------------------- (c) raw TCP garbage
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


@pytest.mark.slow
@pytest.mark.parametrize("port_kind", ["http", "grpc", "data"])
def test_raw_garbage_on_the_ports(node, port_kind):
    n, base, handler = node
    port = {"http": n.http_port, "grpc": n.grpc_port, "data": n._data.port}[port_kind]
    prefixes = st.sampled_from(
        [
            b"",
            b"GET / HTTP/1.1\r\n",
            b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n",
            HTTP2_PREFACE,
            HTTP2_PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00",
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
        ]
    )

    @fuzz(150)
    @given(prefix=prefixes, junk=st.binary(max_size=512), half_close=st.booleans())
    def run(prefix, junk, half_close):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            try:
                s.sendall(prefix + junk)
                if half_close:
                    s.shutdown(socket.SHUT_WR)
                s.settimeout(0.5 if not half_close else 5)
                while s.recv(65536):
                    pass
            except OSError:  # timed out, reset, or already closed by the server
                pass  # the server may wait for more, or close: either is fine, as long as it lives on

    run()
    # Still serving on both ports.
    assert Http(n.http_port).request("GET", "/health")[0] == 200
    client = GrpcClient(n.grpc_port, ClusterAuth(KEY))
    try:
        code, replies, _ = client.call("Probe", [mesh_pb2.ProbeRequest(reply_bytes=8).SerializeToString()])
        assert code == grpc.StatusCode.OK and len(mesh_pb2.ProbeReply.FromString(replies[0]).payload) == 8
    finally:
        client.close()
    _no_unhandled(handler)


# ---------------------------------------------------------------------------- (c') the data port
def _data_stream(n, auth: ClusterAuth, hello: bytes | None = None, raw: bool = False) -> socket.socket:
    """``raw``: the opening asks for raw replies (as every head does), so raw decode steps are read."""
    plan = n.served.serving_plan()
    stage = plan.stages[0]
    opening = mesh_pb2.DataOpen(
        forward=mesh_pb2.ForwardRequest(
            request_id="fuzz",
            epoch=plan.epoch,
            start_layer=stage.start_layer,
            end_layer=stage.end_layer,
            raw_replies=raw,
        )
    )
    s = socket.create_connection(("127.0.0.1", n._data.port), timeout=TIMEOUT)
    send_frame(s, hello if hello is not None else data_hello(auth, "fuzzer", opening))
    return s


def _closed_without_reply(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionError:
        return True


def test_data_port_refuses_the_wrong_key_and_replays_and_logs_it(node, caplog):
    n, base, handler = node
    caplog.set_level(logging.WARNING)
    n.auth._logged.clear()  # refusals are logged once per peer per 10 s: start this test's count afresh
    with _data_stream(n, ClusterAuth("not the cluster key")) as s:
        send_frame(
            s,
            mesh_pb2.ForwardRequest(
                input=mesh_pb2.Tensor(dtype="int32", shape=[1, 1], data=b"\x01\x00\x00\x00")
            ).SerializeToString(),
        )
        assert _closed_without_reply(s)
    assert any("refused data stream" in r.getMessage() and "bad mac" in r.getMessage() for r in caplog.records)
    assert KEY not in caplog.text
    # A hello captured off the wire and sent again is refused (the nonce was used).
    plan, auth = n.served.serving_plan(), ClusterAuth(KEY)
    hello = data_hello(
        auth,
        "fuzzer",
        mesh_pb2.DataOpen(
            forward=mesh_pb2.ForwardRequest(
                request_id="fuzz",
                epoch=plan.epoch,
                start_layer=plan.stages[0].start_layer,
                end_layer=plan.stages[0].end_layer,
            )
        ),
    )
    tokens = mesh_pb2.ForwardRequest(input=mesh_pb2.Tensor(dtype="int32", shape=[1, 1], data=b"\x01\x00\x00\x00"))
    with _data_stream(n, auth, hello) as s:
        send_frame(s, tokens.SerializeToString())
        reply = mesh_pb2.ForwardReply.FromString(bytes(recv_frame(s)))
        assert not reply.error and list(reply.output.shape)[:2] == [1, 1]
    n.auth._logged.clear()
    with _data_stream(n, auth, hello) as s:
        send_frame(s, tokens.SerializeToString())
        assert _closed_without_reply(s)
    assert any("replayed" in r.getMessage() for r in caplog.records)
    _no_unhandled(handler)


def test_data_port_random_frames_after_a_valid_hello(node):
    """Each frame is refused with a reply that names the error, or answered; the stream then
    closes or goes on; the node lives on."""
    n, base, handler = node
    auth = ClusterAuth(KEY)
    tensor = st.builds(
        mesh_pb2.Tensor,
        dtype=st.sampled_from(["int32", "float32", "bfloat16", "int64", ""]),
        shape=st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 3), max_size=5),
        data=st.binary(max_size=64),
    )
    frame = st.one_of(
        st.binary(max_size=256),
        st.builds(
            lambda x, ns: mesh_pb2.ForwardRequest(input=x, next_single=ns).SerializeToString(), tensor, st.booleans()
        ),
    )

    @fuzz(120)
    @given(frames=st.lists(frame, min_size=1, max_size=3))
    def run(frames):
        with _data_stream(n, auth) as s:
            for payload in frames:
                send_frame(s, payload)
                got = recv_frame(s)
                if got is None:
                    return
                reply = mesh_pb2.ForwardReply.FromString(bytes(got))
                OUTCOMES[
                    "data:"
                    + (
                        grpc.StatusCode.INVALID_ARGUMENT.name
                        if reply.code == 3
                        else "ok"
                        if not reply.error
                        else str(reply.code)
                    )
                ] += 1
                if reply.error:
                    assert _closed_without_reply(s)
                    return

    run()
    _no_unhandled(handler)


def test_data_port_random_raw_decode_steps_after_a_valid_hello(node):
    """On a stream that takes raw decode steps (RAW_REQUEST): random bytes after the raw marker,
    and well-formed headers with random fields and payloads, are refused with a reply that names
    the error, or answered with a raw reply; the node lives on."""
    n, base, handler = node
    auth = ClusterAuth(KEY)
    header = st.builds(
        lambda code, flags, rewind, positions, width, body: (
            RAW_REQUEST.pack(0, code, flags, rewind, positions, width) + body
        ),
        st.integers(0, 255),
        st.integers(0, 255),
        st.integers(0, 3) | st.integers(0, 2**32 - 1),
        st.integers(0, 3) | st.integers(0, 2**32 - 1),
        st.integers(0, 2) | st.integers(0, 2**32 - 1),
        st.binary(max_size=16),
    )
    frame = st.one_of(st.binary(max_size=64).map(lambda b: b"\x00" + b), header)

    @fuzz(120)
    @given(frames=st.lists(frame, min_size=1, max_size=3))
    def run(frames):
        with _data_stream(n, auth, raw=True) as s:
            for payload in frames:
                send_frame(s, payload)
                got = recv_frame(s)
                if got is None:
                    return
                if is_raw(got):
                    OUTCOMES["data raw: ok"] += 1
                    continue
                reply = mesh_pb2.ForwardReply.FromString(bytes(got))
                assert reply.error, "a ForwardReply on a raw stream is a refusal"
                OUTCOMES[f"data raw: {reply.code}"] += 1
                assert _closed_without_reply(s)
                return

    run()
    _no_unhandled(handler)


# ---------------------------------------------------------------------------- (d) after
def test_z_node_still_answers_like_mlx_lm_after_the_fuzzing(node):
    n, base, handler = node
    assert node_reference, "the reference answer was not recorded (run the whole module)"
    http = Http(n.http_port)
    assert http.request("GET", "/health")[0] == 200
    assert _chat(http, n.model_id) == node_reference[0]
    _no_unhandled(handler)
    print("fuzzing outcomes:", dict(sorted(OUTCOMES.items())))


def test_an_epoch_not_switched_to_yet_is_pending_and_an_older_one_is_gone(node, grpc_client):
    """The refusal tells a generation which wait it is in (issue 10's log): an epoch this node has
    not switched to yet is ABORTED (the caller retries the same placement shortly), an epoch
    older than this node's plan FAILED_PRECONDITION (the caller waits for the newer plan); the same
    on the data path's stage server. Neither is a lost node."""
    n, base, handler = node
    plan = n.served.serving_plan()
    stage = plan.stages[0]

    def generate(epoch):
        req = mesh_pb2.GenerateRequest(request_id="epochs", epoch=epoch, prompt=[1, 2], max_tokens=1, top_p=1.0)
        code, _, details = grpc_client.call("Generate", [req.SerializeToString()])
        return code, details

    def forward(epoch):
        msg = mesh_pb2.ForwardRequest(
            request_id="epochs", epoch=epoch, start_layer=stage.start_layer, end_layer=stage.end_layer
        )
        with pytest.raises(StageRefused) as info:
            n.stage_server.open(msg)
        return info.value.code

    assert generate(plan.epoch + 1)[0] == grpc.StatusCode.ABORTED
    assert forward(plan.epoch + 1) == grpc.StatusCode.ABORTED
    assert generate(0)[0] == grpc.StatusCode.FAILED_PRECONDITION  # before any plan: superseded
    assert generate(plan.epoch)[0] == grpc.StatusCode.OK
    _no_unhandled(handler)
