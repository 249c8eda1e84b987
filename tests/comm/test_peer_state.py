"""AuthenticatedStateTransport: a behind group's state crosses real sockets intact, only between holders of the run's
secret, only as tensors and plain values; the server listens on the one address it is given; run_secret's errors."""

import hashlib
import http.client
import io
import logging
import pathlib
import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from lightning_dist.comm.peer_state import (MAC_HEADER, NONCE_HEADER, SECRET_ENV, SECRET_FILE_ENV, STEP_HEADER,
                                            AuthenticatedStateTransport, request_mac, response_mac, run_secret)

SECRET = b"this run's secret, 32 bytes long"
TIMEOUT = timedelta(seconds=5)
MARKER = "model-bytes-no-stranger-may-read"


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


HOSTS = ["127.0.0.1", pytest.param("::1", marks=pytest.mark.skipif(not _has_ipv6_loopback(), reason="no ::1"))]


@pytest.fixture
def transports():
    """Makes transports and shuts them all down after the test."""
    made = []

    def make(host="127.0.0.1", secret=SECRET, **kwargs):
        made.append(AuthenticatedStateTransport(host, secret, TIMEOUT, **kwargs))
        return made[-1]

    yield make
    for transport in made:  # all at once: each stops within the server's poll interval
        transport.shutdown(wait=False)
    for transport in made:
        transport._thread.join()


def nested_state() -> dict:
    """What a peer sends: torchft's {"user": ..., "torchft": ...} around a Lightning-like state."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    scheduler.step()
    tensors = [torch.arange(4), torch.ones(2, dtype=torch.bfloat16), torch.tensor([True, False]),
               torch.full((2, 2), 0.25, dtype=torch.float16), torch.randn(3, dtype=torch.float64)]
    loop = {"epoch": 2, "lr": 0.5, "stage": "fit", "best": None, "pair": (1, "a"), "flags": [True, False],
            "nested": {"batches": [1, 2, (3, 4.5)]}}
    user = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "rng": torch.Generator().manual_seed(3).get_state(), "tensors": tensors, "loop": loop, "name": MARKER}
    return {"user": user, "torchft": {"step": 7, "batches_committed": 21}}


def assert_same(received, sent, where="state"):
    assert type(received) is type(sent), where
    if isinstance(sent, torch.Tensor):
        assert received.dtype == sent.dtype and torch.equal(received, sent), where
    elif isinstance(sent, dict):
        assert list(received) == list(sent), where
        for key in sent:
            assert_same(received[key], sent[key], f"{where}[{key!r}]")
    elif isinstance(sent, (list, tuple)):
        assert len(received) == len(sent), where
        for index, (got, expected) in enumerate(zip(received, sent)):
            assert_same(got, expected, f"{where}[{index}]")
    else:
        assert received == sent, where


def raw_get(url: str, headers: dict) -> tuple[int, bytes]:
    """One GET of ``url`` with exactly ``headers``: the status and the body."""
    connection = http.client.HTTPConnection("127.0.0.1", int(url.split(":")[2].split("/")[0]), timeout=5)
    try:
        connection.request("GET", "/" + url.split("/", 3)[3], headers=headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def signed(url: str, authority: str | None = None) -> dict:
    """The headers of an authentic request for ``url`` (MAC'd for ``authority``, by default its own)."""
    nonce, (_, _, own, path) = secrets.token_hex(16), url.split("/", 3)
    return {NONCE_HEADER: nonce, MAC_HEADER: request_mac(SECRET, "GET", authority or own, "/" + path, nonce)}


@pytest.mark.parametrize("host", HOSTS)
def test_a_nested_state_round_trips_intact(transports, host):
    calls = []
    sender, receiver = transports(host), transports(host, on_receive=lambda: calls.append(1))
    state = nested_state()
    sender.send_checkpoint([1], 7, state, TIMEOUT)
    assert_same(receiver.recv_checkpoint(0, sender.metadata(), 7, TIMEOUT), state)
    assert calls == [1]


@pytest.mark.parametrize("host", HOSTS)
def test_the_server_listens_on_the_named_address_only(transports, host):
    transport = transports(host)
    bound, port = transport._server.socket.getsockname()[:2]
    assert bound == host
    shown = f"[{host}]" if ":" in host else host
    assert transport.metadata() == f"http://{shown}:{port}/state/"
    for everywhere in ("0.0.0.0", "::"):
        with pytest.raises(ValueError, match="every interface"):
            AuthenticatedStateTransport(everywhere, SECRET, TIMEOUT)


def test_shutdown_closes_the_port():
    transport = AuthenticatedStateTransport("127.0.0.1", SECRET, TIMEOUT)
    address = transport._server.server_address
    transport.shutdown()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(address, timeout=5).close()


def test_a_request_before_the_state_is_served_waits_for_it(transports):
    sender, receiver = transports(), transports()
    with ThreadPoolExecutor(1) as pool:
        received = pool.submit(receiver.recv_checkpoint, 0, sender.metadata(), 3, TIMEOUT)
        time.sleep(0.3)
        assert not received.done()
        sender.send_checkpoint([1], 3, {"weight": torch.ones(2)}, TIMEOUT)
        assert torch.equal(received.result(timeout=5)["weight"], torch.ones(2))


def test_a_receiver_with_another_secret_is_refused(transports, caplog):
    sender, stranger = transports(), transports(secret=b"another run's secret, 32 bytes!!")
    sender.send_checkpoint([1], 7, nested_state(), TIMEOUT)
    with caplog.at_level(logging.WARNING), pytest.raises(PermissionError) as refused:
        stranger.recv_checkpoint(0, sender.metadata(), 7, TIMEOUT)
    assert str(refused.value) == (
        f"the peer at {sender.metadata()}7 refused this group's request: its secret differs (another run shares "
        f"this Lighthouse, or this group's {SECRET_ENV} or {SECRET_FILE_ENV} differs)")
    assert "127.0.0.1" in caplog.text and "MAC is wrong" in caplog.text


@pytest.mark.parametrize("headers", [lambda url: {}, lambda url: {NONCE_HEADER: "0" * 32, MAC_HEADER: "0" * 64},
                                     lambda url: signed(url, authority="10.1.2.3:4567")],
                         ids=["no MAC", "wrong MAC", "relayed: MAC'd for another server"])
def test_an_unauthenticated_request_gets_403_and_nothing_of_the_state(transports, headers):
    sender = transports()
    sender.send_checkpoint([1], 7, nested_state(), TIMEOUT)
    url = sender.metadata() + "7"
    status, body = raw_get(url, headers(url))
    assert status == 403
    assert MARKER.encode() not in body and sender._slots["state"].payload[:64] not in body


def test_a_replayed_request_is_refused(transports, caplog):
    sender = transports()
    sender.send_checkpoint([1], 7, nested_state(), TIMEOUT)
    url = sender.metadata() + "7"
    headers = signed(url)
    status, body = raw_get(url, headers)
    assert status == 200 and MARKER.encode() in body
    with caplog.at_level(logging.WARNING):
        status, body = raw_get(url, headers)
    assert status == 403 and MARKER.encode() not in body
    assert "replays an earlier request" in caplog.text


def test_a_request_for_another_step_names_both_steps(transports):
    sender, receiver = transports(), transports()
    sender.send_checkpoint([1], 5, nested_state(), TIMEOUT)
    with pytest.raises(ValueError, match="serves the state of step 5, this group asked for step 6"):
        receiver.recv_checkpoint(0, sender.metadata(), 6, TIMEOUT)
    url = sender.metadata() + "6"
    assert raw_get(url, signed(url)) == (409, b"")  # the server sends nothing of step 5 either


class Evil:
    """Unpickled with pickle's rules, creates ``marker``: code that runs on load."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


def saved(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


@pytest.fixture
def fake_peer():
    """A peer that answers every request with ``payload``, MAC'd by ``sign(nonce, payload)``; returns its URL."""
    servers = []

    def serve(payload: bytes, sign) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Length", str(len(payload)))
                self.send_header(STEP_HEADER, "7")
                self.send_header(MAC_HEADER, sign(self.headers[NONCE_HEADER], payload))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/state/"

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def mac_with(secret: bytes, signed_payload=None):
    return lambda nonce, payload: response_mac(secret, nonce, "7",
                                               hashlib.sha256(signed_payload or payload).digest())


@pytest.mark.parametrize("case", ["another secret", "altered payload"])
def test_a_tampered_response_is_refused_before_decoding(transports, fake_peer, tmp_path, case):
    marker = tmp_path / "ran"
    payload = saved({"code": Evil(marker)})
    sign = mac_with(b"another run's secret, 32 bytes!!") if case == "another secret" else mac_with(
        SECRET, signed_payload=saved({"weight": torch.ones(2)}))
    with pytest.raises(PermissionError, match="failed authentication"):
        transports().recv_checkpoint(0, fake_peer(payload, sign), 7, TIMEOUT)
    assert not marker.exists()


def test_an_authentic_pickle_that_would_run_code_is_not_loaded(transports, fake_peer, tmp_path):
    control = tmp_path / "control"
    torch.load(io.BytesIO(saved(Evil(control))), weights_only=False)
    assert control.exists(), "the payload runs code when unpickled"
    marker = tmp_path / "ran"
    url = fake_peer(saved({"weight": torch.ones(2), "code": Evil(marker)}), mac_with(SECRET))
    with pytest.raises(ValueError, match="not a tensor or a plain value.*Unsupported global"):
        transports().recv_checkpoint(0, url, 7, TIMEOUT)
    assert not marker.exists()


def test_disallow_waits_for_a_response_in_flight(transports):
    sender = transports()
    sender.send_checkpoint([1], 7, {"weight": torch.zeros(8 << 20)}, TIMEOUT)  # 32 MiB: more than socket buffers
    url = sender.metadata() + "7"
    with socket.socket() as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(sender._server.server_address)
        path = "/" + url.split("/", 3)[3]
        head = "".join(f"{name}: {value}\r\n" for name, value in signed(url).items())
        client.sendall(f"GET {path} HTTP/1.0\r\n{head}\r\n".encode())
        received = [client.recv(1)]  # the response has started
        disallowing = threading.Thread(target=sender.disallow_checkpoint)
        disallowing.start()
        time.sleep(0.3)
        assert disallowing.is_alive(), "disallow_checkpoint returned while the state was being sent"
        while chunk := client.recv(1 << 20):
            received.append(chunk)
    disallowing.join(5)
    assert not disallowing.is_alive()
    assert len(b"".join(received)) > 32 << 20


@pytest.mark.parametrize(
    ("environment", "file_text", "error"),
    [({}, None, "missing or shorter than 16 bytes"), ({SECRET_ENV: ""}, None, "missing or shorter than 16 bytes"),
     ({SECRET_ENV: "short"}, None, "missing or shorter than 16 bytes"), ({}, "  short \n", "shorter than 16 bytes"),
     ({SECRET_ENV: "x" * 16}, "y" * 16, "both")],
    ids=["absent", "empty", "short", "short file", "both"])
def test_run_secret_errors_name_both_variables(monkeypatch, tmp_path, environment, file_text, error):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    if file_text is not None:
        (tmp_path / "secret").write_text(file_text)
        monkeypatch.setenv(SECRET_FILE_ENV, str(tmp_path / "secret"))
    with pytest.raises(ValueError, match=error) as raised:
        run_secret()
    assert SECRET_ENV in str(raised.value) and SECRET_FILE_ENV in str(raised.value)


def test_run_secret_reads_the_variable_or_the_file_stripped(monkeypatch, tmp_path):
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.setenv(SECRET_ENV, "s" * 16)
    assert run_secret() == b"s" * 16
    monkeypatch.delenv(SECRET_ENV)
    (tmp_path / "secret").write_text("\n  " + "f" * 20 + " \n")
    monkeypatch.setenv(SECRET_FILE_ENV, str(tmp_path / "secret"))
    assert run_secret() == b"f" * 20


def healed_pair(transports, **kwargs):
    """A source and a receiver that has taken the source's state of step 3 in a quorum (it knows its source)."""
    source, receiver = transports(**kwargs), transports(**kwargs)
    source.send_checkpoint([1], 3, {"counters": torch.tensor([3])}, TIMEOUT)
    receiver.recv_checkpoint(0, source.metadata(), 3, TIMEOUT)
    return source, receiver


def test_the_committed_state_is_fetched_from_the_source_of_the_last_heal_even_when_asked_before_it_is_published(
        transports):
    source, receiver = healed_pair(transports)
    source.publish(3, {"weight": torch.zeros(2)})  # an older commit, still served
    future = receiver.fetch_committed(4, TIMEOUT)
    time.sleep(0.3)
    assert not future.done(), "answered before the state of step 4 was published"
    state = nested_state()
    source.publish(4, state)
    assert_same(future.result(timeout=5), state)
    with pytest.raises(ValueError, match="serves the state of step 4, this group asked for step 3"):
        receiver.fetch_committed(3, TIMEOUT).result(timeout=5)  # a commit the source has left: named, not served


def test_a_withdrawn_committed_state_is_no_longer_served_and_the_fetch_says_so(transports):
    source, receiver = healed_pair(transports)
    source.publish(4, {"weight": torch.ones(2)})
    source.withdraw()
    short = timedelta(seconds=0.5)
    with pytest.raises(ConnectionError, match="committed/4 failed"):  # the server waits for a state to serve
        receiver.fetch_committed(4, short).result(timeout=5)


def test_the_committed_state_goes_to_holders_of_the_secret_only(transports):
    source = transports()
    stranger = transports(secret=b"another run's secret, 32 bytes!")
    source.send_checkpoint([1], 3, {"counters": torch.tensor([3])}, TIMEOUT)
    with pytest.raises(PermissionError):
        stranger.recv_checkpoint(0, source.metadata(), 3, TIMEOUT)
    source.publish(4, {"secret": torch.tensor([int.from_bytes(MARKER.encode()[:7], "big")])})
    with pytest.raises(PermissionError, match="refused this group's request"):
        stranger.fetch_committed(4, TIMEOUT).result(timeout=5)
    url = source.metadata().replace("state/", "committed/4")
    status, body = raw_get(url, {})
    assert status == 403 and MARKER.encode()[:7] not in body


def test_fetch_committed_needs_a_heal_first(transports):
    with pytest.raises(RuntimeError, match="no peer to fetch from"):
        transports().fetch_committed(1, TIMEOUT)
