"""A live peer's state for a replica group that is behind, over HTTP authenticated with a per-run secret.

Under ``fault_tolerance`` a restarted group receives an up-to-date peer's state in two parts: the small one inside the
quorum, through torchft's checkpoint transport (``/state/<step>``), and the committed model with the protocol and
optimizer states afterwards, in the background while every group trains, from the same peer's server
(``/committed/<step>``, published after the window's commit). torchft's own (``HTTPTransport``) listens on every
interface without authentication and loads what arrives with pickle: whoever reaches its port can run code in the
receiver or read the model, and two runs that share a Lighthouse can feed each other state.
:class:`AuthenticatedStateTransport` replaces it.

Threat model. Every request carries a fresh nonce and an HMAC-SHA256 under the run's secret (:func:`run_secret`)
over its method, the server's address, its path and the nonce; the server refuses a wrong MAC or a nonce it has
seen, and then sends nothing of the state. Every response carries an HMAC over the request's nonce, the step and the
payload, which the receiver checks before decoding, and it decodes with ``torch.load(weights_only=True)`` only. So a
stranger or another run cannot make a group load anything but tensors and plain values, cannot read the state
without the secret, cannot replay a request nor relay it to this server from another (torchft's unauthenticated
Manager server hands out the URL, which could name theirs), and a tampered or replayed response is refused. Not
protected: traffic is not encrypted, so someone on the path can read the state; torchft's Manager server, its Gloo
group and the torchrun store are not authenticated and are out of this module's reach (they carry tensors and small
control messages, not pickled code). The server listens on one named address, never on every interface.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import io
import ipaddress
import logging
import os
import pickle
import re
import secrets
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import torch
from torch.utils._pytree import tree_map_only
from torchft.checkpointing.transport import CheckpointTransport

log = logging.getLogger(__name__)

SECRET_ENV = "LIGHTNING_DIST_FT_SECRET"
SECRET_FILE_ENV = "LIGHTNING_DIST_FT_SECRET_FILE"
MIN_SECRET_BYTES = 16

NONCE_HEADER = "X-Lightning-Dist-Nonce"
MAC_HEADER = "X-Lightning-Dist-MAC"
STEP_HEADER = "X-Lightning-Dist-Step"
_NONCE_FORMAT = re.compile(r"[0-9a-f]{32}")


def run_secret() -> bytes:
    """The run's shared secret: ``LIGHTNING_DIST_FT_SECRET``, or the contents of the file named by
    ``LIGHTNING_DIST_FT_SECRET_FILE`` without surrounding whitespace; at least :data:`MIN_SECRET_BYTES` bytes."""
    value, path = os.environ.get(SECRET_ENV), os.environ.get(SECRET_FILE_ENV)
    wanted = (f"set {SECRET_ENV} or {SECRET_FILE_ENV} (a file holding it), one of them, to a secret of at least "
              f"{MIN_SECRET_BYTES} bytes shared by every replica group of this run")
    if value is not None and path is not None:
        raise ValueError(f"both {SECRET_ENV} and {SECRET_FILE_ENV} are set: {wanted}")
    if path is not None:
        try:
            with open(path, "rb") as file:
                secret = file.read().strip()
        except OSError as error:
            raise ValueError(f"{SECRET_FILE_ENV}={path} cannot be read ({error}): {wanted}") from error
    else:
        secret = (value or "").encode()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the secret for fault tolerance's state transfers is missing or shorter than "
                         f"{MIN_SECRET_BYTES} bytes: {wanted}")
    return secret


def request_mac(secret: bytes, method: str, authority: str, path: str, nonce: str) -> str:
    """The MAC a request for ``path`` at the server ``authority`` (``host:port`` as in its URL) carries; no field
    holds a NUL, so the joined message has one reading."""
    fields = [b"request"] + [field.encode("latin-1") for field in (method, authority, path, nonce)]
    return hmac.new(secret, b"\0".join(fields), hashlib.sha256).hexdigest()


def response_mac(secret: bytes, nonce: str, step: str, payload_digest: bytes) -> str:
    """The MAC a response carries: over the request's nonce, the served step and the payload's SHA-256 (computed
    once per state, not once per request; the fixed-length digest comes last)."""
    message = b"\0".join([b"response", nonce.encode("latin-1"), step.encode("latin-1"), payload_digest])
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def _matches(received: str | None, expected: str) -> bool:
    return hmac.compare_digest((received or "").encode("latin-1"), expected.encode("latin-1"))


STATE, COMMITTED = "state", "committed"
"""What a server serves: torchft's state for a quorum's heal, and the committed state published after a window."""


@dataclass
class _Served:
    """One kind of state a server serves: its step, its encoding (None: nothing may be sent) and that's SHA-256."""

    step: int = -1
    payload: bytes | None = None
    digest: bytes = b""


class AuthenticatedStateTransport(CheckpointTransport[Any]):
    """torchft's checkpoint transport for this package: the state a peer heals from, encoded once with
    ``torch.save`` and served over HTTP to holders of ``secret`` only, decoded with ``weights_only=True`` (see
    the module).

    Args:
        host: the one address (an IPv4 or IPv6 literal) the server listens on and peers fetch from.
        secret: the run's shared secret (:func:`run_secret`).
        timeout: how long a request waits for a state to be served, a socket waits, and
            :meth:`disallow_checkpoint` waits for responses in flight.
        on_receive: called as :meth:`recv_checkpoint` starts, before the transfer.
    """

    def __init__(self, host: str, secret: bytes, timeout: timedelta,
                 on_receive: Callable[[], None] | None = None) -> None:
        address = ipaddress.ip_address(host)
        if address.is_unspecified:
            raise ValueError(f"{host} names every interface: give the one address peers reach this host at")
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the secret is {len(secret)} bytes, fewer than {MIN_SECRET_BYTES}: see {SECRET_ENV}")
        self._secret = secret
        self._timeout = timeout
        self._on_receive = on_receive
        self._served = threading.Condition()  # guards everything below
        self._slots = {STATE: _Served(), COMMITTED: _Served()}
        self._responding = 0
        self._seen_nonces: set[str] = set()
        self._source: str | None = None  # where the last recv_checkpoint fetched from (the peer's metadata)

        transport = self

        class Handler(BaseHTTPRequestHandler):
            timeout = transport._timeout.total_seconds()  # a stalled client cannot hold a thread forever

            def do_GET(self) -> None:
                transport._respond(self)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("lightning_dist: state server: " + format, *args)

        class Server(ThreadingHTTPServer):
            address_family = socket.AF_INET6 if address.version == 6 else socket.AF_INET

        self._server = Server((host, 0), Handler)
        port = self._server.socket.getsockname()[1]
        self._authority = f"[{host}]:{port}" if address.version == 6 else f"{host}:{port}"
        self._url = f"http://{self._authority}/state/"
        self._thread = threading.Thread(target=self._serve, name="lightning_dist-state-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            self._server.serve_forever(poll_interval=0.1)
        finally:
            self._server.server_close()

    def metadata(self) -> str:
        """Where peers fetch this rank's state: ``http://host:port/state/``, the step appended."""
        return self._url

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        """Serve ``state_dict`` (its tensors copied to the host) as the state of ``step`` until
        :meth:`disallow_checkpoint`."""
        self._hold(STATE, step, state_dict)

    def disallow_checkpoint(self) -> None:
        """Stop serving the state, once the responses in flight have been sent (torchft's contract: the state may
        be changed after this returns); torchft calls it at every ``should_commit``."""
        with self._served:
            self._slots[STATE].payload = None
            if not self._served.wait_for(lambda: self._responding == 0, self._timeout.total_seconds()):
                raise TimeoutError(f"a peer still fetches this group's state of step {self._slots[STATE].step} from "
                                   f"{self._url} after {self._timeout}")

    def publish(self, step: int, state: Any) -> None:
        """Serve ``state`` as the committed state of ``step`` (at ``/committed/<step>``) until the next
        :meth:`publish` or :meth:`withdraw`; encoded now, so ``state`` may change once this returns."""
        self._hold(COMMITTED, step, state)

    def withdraw(self) -> None:
        """Stop serving the committed state (a response in flight still completes: it holds the encoding)."""
        with self._served:
            self._slots[COMMITTED] = _Served()

    def _hold(self, kind: str, step: int, state: Any) -> None:
        buffer = io.BytesIO()
        torch.save(tree_map_only(torch.Tensor, lambda tensor: tensor.cpu(), state), buffer)
        payload = buffer.getvalue()
        served = _Served(step, payload, hashlib.sha256(payload).digest())
        with self._served:
            self._slots[kind] = served
            self._served.notify_all()

    def _respond(self, request: BaseHTTPRequestHandler) -> None:
        nonce = request.headers.get(NONCE_HEADER, "")
        expected = request_mac(self._secret, request.command, self._authority, request.path, nonce)
        authentic = _matches(request.headers.get(MAC_HEADER), expected)
        with self._served:
            fresh = _NONCE_FORMAT.fullmatch(nonce) is not None and nonce not in self._seen_nonces
            if authentic and fresh:
                self._seen_nonces.add(nonce)
        if not (authentic and fresh):
            log.warning("lightning_dist: refused a request for this group's state from %s: %s",
                        request.client_address[0], "it replays an earlier request" if authentic else
                        "its MAC is wrong (another run, a client without this run's secret, or a relay)")
            request.send_error(403)
            return
        wanted = re.fullmatch(rf"/({STATE}|{COMMITTED})/(\d+)", request.path)
        if wanted is None:
            request.send_error(404, f"expected /{STATE}/<step> or /{COMMITTED}/<step>")
            return
        kind, wanted_step = wanted[1], int(wanted[2])

        def ready() -> bool:  # a joiner may ask for the committed state before this group has published it
            slot = self._slots[kind]
            return slot.payload is not None and (kind == STATE or slot.step >= wanted_step)

        with self._served:
            if not self._served.wait_for(ready, self._timeout.total_seconds()):
                request.send_error(503, f"no {kind} of step {wanted_step} served within {self._timeout}")
                return
            slot = self._slots[kind]
            step, payload, digest = slot.step, slot.payload, slot.digest
            self._responding += 1
        try:
            status = 200 if wanted_step == step else 409  # another step: answered, so the receiver names both
            if status == 409:
                payload, digest = b"", hashlib.sha256(b"").digest()
            request.send_response(status)
            request.send_header("Content-Type", "application/octet-stream")
            request.send_header("Content-Length", str(len(payload)))
            request.send_header(STEP_HEADER, str(step))
            request.send_header(MAC_HEADER, response_mac(self._secret, nonce, str(step), digest))
            request.end_headers()
            request.wfile.write(payload)
        except OSError as error:
            log.warning("lightning_dist: sending this group's state to %s failed: %s", request.client_address[0],
                        error)
        finally:
            with self._served:
                self._responding -= 1
                self._served.notify_all()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        """Fetch the state of ``step`` from the peer at ``metadata``, authenticate it, and decode its tensors and
        plain values (``PermissionError``: not authentic; ``ConnectionError``: not fetched; ``ValueError``: another
        step, or content that is not tensors and plain values). The peer is remembered for
        :meth:`fetch_committed`."""
        if self._on_receive is not None:
            self._on_receive()
        self._source = metadata
        return self._fetch(f"{metadata}{step}", step, timeout)

    def fetch_committed(self, step: int, timeout: timedelta) -> Future[Any]:
        """The committed state of ``step`` from the peer the last :meth:`recv_checkpoint` fetched from, fetched in a
        thread of its own (what its future raises: as :meth:`recv_checkpoint`)."""
        if self._source is None:
            raise RuntimeError("fetch_committed before any recv_checkpoint: no peer to fetch from")
        url = f"{self._source.removesuffix(f'{STATE}/')}{COMMITTED}/{step}"
        future: Future[Any] = Future()

        def fetch() -> None:
            try:
                future.set_result(self._fetch(url, step, timeout))
            except BaseException as error:  # handed to the waiting thread, which decides
                future.set_exception(error)

        threading.Thread(target=fetch, name="lightning_dist-committed-state", daemon=True).start()
        return future

    def _fetch(self, url: str, step: int, timeout: timedelta) -> Any:
        parts = urlsplit(url)
        nonce = secrets.token_hex(16)
        headers = {NONCE_HEADER: nonce, MAC_HEADER: request_mac(self._secret, "GET", parts.netloc, parts.path, nonce)}
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout.total_seconds())
        try:
            connection.request("GET", parts.path, headers=headers)
            response = connection.getresponse()
            payload = response.read()
        except (OSError, http.client.HTTPException) as error:
            raise ConnectionError(f"fetching this group's state from {url} failed: {error!r}") from error
        finally:
            connection.close()
        if response.status == 403:
            raise PermissionError(f"the peer at {url} refused this group's request: its secret differs (another run "
                                  f"shares this Lighthouse, or this group's {SECRET_ENV} or {SECRET_FILE_ENV} differs)")
        if response.status not in (200, 409):
            raise ConnectionError(f"the peer at {url} answered {response.status} {response.reason}")
        served = response.getheader(STEP_HEADER, "")
        if not _matches(response.getheader(MAC_HEADER),
                        response_mac(self._secret, nonce, served, hashlib.sha256(payload).digest())):
            raise PermissionError(f"the state from {url} failed authentication (sent by another run, or altered)")
        if served != str(step):
            raise ValueError(f"the peer at {url} serves the state of step {served}, this group asked for step {step}")
        return _decode(payload, url)

    def shutdown(self, wait: bool = True) -> None:
        """Stop the server (``wait``: and return once it has stopped)."""
        if wait:
            self._server.shutdown()
            self._thread.join()
        else:
            threading.Thread(target=self._server.shutdown, daemon=True).start()


def _decode(payload: bytes, url: str) -> Any:
    try:
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        reason = re.search(r"WeightsUnpickler error: ([^\n]*)", str(error))  # torch's advice around it is to unpickle
        raise ValueError(f"the state from {url} holds something that is not a tensor or a plain value, which is not "
                         f"loaded: {reason[1] if reason else error}") from error
    except Exception as error:  # an authentic payload that torch.load cannot read: a sender's fault
        raise ValueError(f"the state from {url} cannot be decoded: {error}") from error
