"""DownpourSGD's pushes and replies compressed (``compression="bf16"`` or ``"int8"``), with error feedback both ways.

A Downpour worker pushes its accumulated update and receives the global model: two full-size
float32 messages per push, all through the server's one port. Both directions compress with
:mod:`lightning_dist.algorithms.compression`'s codecs, each with its own way of losing nothing:

- **Push** (worker to server): the parameter update ``u`` of
  :func:`~lightning_dist.algorithms.parameter_server.push_message` plus the worker's residual ``e``
  is compressed, and ``e <- (u + e) - D(Q(u + e))`` is kept for the next push (error feedback, as
  in 1-bit SGD and EF-SGD): summed over pushes the decoded updates the server applies equal the
  true updates up to the final residual. A push the server refuses as too stale (``max_staleness``)
  is dropped, update and all (the worker goes on from the global model), and the residual owed from
  the pushes before it is owed again (:meth:`CompressedPushes.refused`): summed over the accepted
  pushes the identity holds as before. The buffers (BatchNorm statistics) travel as they are, in
  float32: they are absolute values, not deltas (see the parameter-server module), and few.
- **Reply** (server to worker): the server keeps, per worker, a *mirror* of the model that worker
  holds, in float32, and sends ``Q(w - mirror)`` over the parameters, the global model's change
  since the worker's last reply as the worker knows it; both sides add ``D(Q(w - mirror))`` to their
  mirror's parameters, so they stay equal bit for bit and the worker continues from its mirror. What
  a reply's compression drops is still in ``w - mirror`` at the next reply, so it is sent then: the
  mirror is the error feedback (as the model-difference replies of DoubleSqueeze, Tang et al. 2019,
  and of the compressed server in Streaming DiLoCo). The buffers travel as in a push, absolute and
  in float32, and both mirrors take them as they are: quantized as changes they share an int8 block
  (one scale) with parameter changes orders of magnitude larger, and a small running variance
  decoded below zero (issue 40). Buffers are never quantized into values they cannot take. The
  cost is one float32 model per worker on the server.

Bytes of a push and of a reply alike: the codec's size of the parameters plus 4 bytes a buffer
element (:func:`push_nbytes`, :func:`reply_nbytes`). A message is one ``uint8`` tensor (int8: the
float32 block scales first, so they stay 4-byte aligned, then the codes; the float32 buffers last).
Nothing here knows about processes: the strategy's transport and the simulator's parameter server
call the same classes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_dist.algorithms.compression import Encoded, decode, encode, encoded_nbytes, num_blocks


def pack(encoded: Encoded, tail: Tensor | None = None) -> Tensor:
    """``encoded`` (and an optional float32 ``tail``) as one ``uint8`` message."""
    parts = [encoded.scales, encoded.codes] + ([tail.to(torch.float32)] if tail is not None else [])
    return torch.cat([part.contiguous().view(torch.uint8) for part in parts])


def unpack(message: Tensor, num_elements: int, codec: str) -> tuple[Encoded, Tensor]:
    """The :class:`Encoded` vector of ``num_elements`` at the start of ``message``, and the float32 tail after it."""
    scale_bytes = 4 * num_blocks(num_elements) if codec == "int8" else 0
    end = encoded_nbytes(num_elements, codec)
    if codec == "int8":
        scales = message[:scale_bytes].view(torch.float32)
        codes = message[scale_bytes:end].view(torch.int8)
    else:
        scales, codes = message.new_empty(0, dtype=torch.float32), message[:end].clone().view(torch.bfloat16)
    # A slice at an offset that is not a multiple of 4 cannot be viewed as float32 in place.
    return Encoded(codes, scales), message[end:].clone().view(torch.float32)


def push_nbytes(num_parameters: int, num_buffers: int, codec: str) -> int:
    """Bytes of a compressed push: the parameter update in ``codec``, the buffers in float32."""
    return encoded_nbytes(num_parameters, codec) + 4 * num_buffers


def reply_nbytes(num_parameters: int, num_buffers: int, codec: str) -> int:
    """Bytes of a compressed reply: the parameters' change in ``codec``, the buffers in float32 (a push's size)."""
    return push_nbytes(num_parameters, num_buffers, codec)


class CompressedPushes:
    """A worker's side: compresses its pushes with error feedback and follows the server's replies.

    Args:
        codec: ``"bf16"`` or ``"int8"``.
        initial: the model the worker starts from, as the server's global model holds it (its
            float32 master): the first mirror, equal to the server's.
        num_parameters: how many leading elements are parameters (the rest are buffers).
    """

    def __init__(self, codec: str, initial: Tensor, num_parameters: int) -> None:
        self.codec = codec
        self.num_parameters = num_parameters
        self.mirror = initial.detach().to(torch.float32, copy=True)
        self.residual = torch.zeros(num_parameters, dtype=torch.float32, device=initial.device)
        self._owed = self.residual

    def encode_push(self, message: Tensor) -> Tensor:
        """A :func:`~lightning_dist.algorithms.parameter_server.push_message` compressed: what crosses the network."""
        value = message[: self.num_parameters].to(torch.float32) + self.residual
        encoded = encode(value, self.codec)
        self._owed = self.residual
        self.residual = value - decode(encoded, self.codec)
        return pack(encoded, message[self.num_parameters:])

    def refused(self) -> None:
        """The server dropped the last encoded push as too stale: its update goes with it, and the residual it
        replaced, owed from the accepted pushes before, is owed again (the next push carries it)."""
        self.residual = self._owed

    def decode_reply(self, reply: Tensor) -> Tensor:
        """The model to continue from (float32): the mirror's parameters moved by the server's compressed change, its
        buffers the server's."""
        encoded, buffers = unpack(reply, self.num_parameters, self.codec)
        self.mirror[: self.num_parameters] += decode(encoded, self.codec)
        self.mirror[self.num_parameters:] = buffers
        return self.mirror.clone()

    def state_dict(self) -> dict[str, Any]:
        return {"mirror": self.mirror.clone(), "residual": self.residual.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mirror = state["mirror"].to(self.mirror.device, torch.float32, copy=True)
        self.residual = state["residual"].to(self.residual.device, torch.float32, copy=True)


class CompressedReplies:
    """The server's side: decodes pushes, and answers each worker with the change since its mirror.

    Args:
        codec: ``"bf16"`` or ``"int8"``.
        initial: the global model every worker starts from (each worker's first mirror).
        num_parameters: how many leading elements are parameters.
        workers: number of workers (one mirror each).
    """

    def __init__(self, codec: str, initial: Tensor, num_parameters: int, workers: int) -> None:
        self.codec = codec
        self.num_parameters = num_parameters
        self.mirrors = initial.detach().to(torch.float32).repeat(workers, 1)

    def decode_push(self, push: Tensor) -> Tensor:
        """The push as :func:`~lightning_dist.algorithms.parameter_server.push_message` (float32): update, buffers."""
        encoded, buffers = unpack(push, self.num_parameters, self.codec)
        return torch.cat([decode(encoded, self.codec), buffers])

    def encode_reply(self, rank: int, vector: Tensor) -> Tensor:
        """``rank``'s reply for the global model ``vector``; ``rank``'s mirror moves as the worker's will."""
        vector = vector.to(torch.float32)
        mirror, buffers = self.mirrors[rank], vector[self.num_parameters:]
        encoded = encode(vector[: self.num_parameters] - mirror[: self.num_parameters], self.codec)
        mirror[: self.num_parameters] += decode(encoded, self.codec)
        mirror[self.num_parameters:] = buffers
        return pack(encoded, buffers)

    def push_like(self) -> Tensor:
        """An empty message of a push's size (for receiving one)."""
        num_buffers = self.mirrors.shape[1] - self.num_parameters
        return torch.empty(push_nbytes(self.num_parameters, num_buffers, self.codec), dtype=torch.uint8)

    def state_dict(self) -> dict[str, Any]:
        return {"mirrors": self.mirrors.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mirrors = state["mirrors"]
        if mirrors.shape != self.mirrors.shape:
            raise ValueError(f"reply mirrors in the checkpoint have shape {tuple(mirrors.shape)}; this model and "
                             f"world size give {tuple(self.mirrors.shape)}")
        self.mirrors.copy_(mirrors)
