"""Dynamic averaging (paper 004, Algorithm 1) in the simulator, with a coordinator node (node ``N``).

Every ``check_every`` steps each worker tests its local condition ``||f_i - r||^2 <= Delta``
against its copy of the reference model ``r``. A worker whose condition holds sends nothing and
trains on at once. A violator sends its model to the coordinator and waits for the balanced one.

How the coordinator learns of violations and balances them in virtual time (Algorithm 1 read
event by event, as the authors' platform, fraunhofer-iais/dlplatform, runs it):

- It idles until a violation report (the violator's model) has arrived. It then opens a
  balancing with ``B`` = every report that has arrived by then (reports arriving in the same
  virtual instant included), and runs
  :func:`~lightning_dist.algorithms.averaging.balancing_rounds` (the violation counter, then
  augmentation while the mean of ``B`` violates), the code the strategy runs.
- For every rank an augmentation adds it sends a 1-byte request. A worker answers a request at
  the end of the step during which it arrived (at once if it has finished training): it sends
  its model and waits for the balanced one. A rank whose own report is already queued at the
  coordinator is not asked: that model is its answer, and so is a report that crosses a
  request on its way.
- Each mean of ``B`` the rounds ask about costs one aggregation (``execute``). The final mean
  goes to every member of ``B``, which replaces its model with it; on a full synchronisation
  (``B`` = all workers) it is also every worker's new reference model.
- Reports that arrive during a balancing, other than answers, open the next one. The violation
  counter counts the reports that open balancings (``v += |B|``).

So only the violators, the ranks added to ``B`` and the coordinator spend virtual time or send
bytes; members wait from sending their model until the balanced one arrives, so the average of
all models is what it was (paper 004).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dist.algorithms.arguments import check_divergence_threshold, check_steps
from lightning_dist.algorithms.averaging import balancing_rounds, local_condition_holds, weighted_average
from lightning_dist.sim.engine import Message, Node
from lightning_dist.sim.protocols.base import Program, Protocol
from lightning_dist.sim.replica import check_finite

_MODEL = "model"  # worker -> coordinator: (model, violated): a violation report, or the answer to a request
_REQUEST = "request"  # coordinator -> worker: send your model (payload: the balancing's number)
_BALANCED = "balanced"  # coordinator -> member: (balancing number, mean, full synchronisation)


class DynamicAveraging(Protocol):
    """Args:
    divergence_threshold: ``Delta > 0``, squared L2 distance to the reference; default 0.7 (paper 004's MNIST study).
    check_every: ``b >= 1``, steps between local-condition checks; default 10.
    seed: seeds the augmentation of the balancing set.
    """

    name = "dynamic_avg"
    num_servers = 1
    arguments = ("divergence_threshold", "check_every", "seed")

    def __init__(self, divergence_threshold: float = 0.7, check_every: int = 10, seed: int = 0) -> None:
        self.divergence_threshold = check_divergence_threshold(divergence_threshold)
        self.check_every = check_steps("check_every", check_every, "steps between checks")
        self.seed = seed

    def setup(self, simulation) -> None:  # type: ignore[no-untyped-def]
        super().setup(simulation)
        self._generator = torch.Generator().manual_seed(self.seed)
        initial = simulation.replicas[0]
        self.reference = initial.vector.parameters_of(initial.get()).clone()
        self.references = [self.reference] * simulation.num_workers
        self.violation_counter = 0
        self.balancings = 0
        self._answered = [0] * simulation.num_workers  # the last balancing each worker took part in
        self.counts = {"checks": 0, "violations": 0, "full_syncs": 0, "partial_syncs": 0}

    # ------------------------------------------------------------------ workers

    def after_step(self, node: Node, rank: int, step: int) -> Program:
        if self._pending_request(node, rank):
            yield from self._join(node, rank, violated=False)
        if step % self.check_every:
            return
        self.counts["checks"] = max(self.counts["checks"], step // self.check_every)
        replica = self.simulation.replicas[rank]
        parameters = replica.vector.parameters_of(replica.get())
        if not local_condition_holds(parameters, self.references[rank], self.divergence_threshold):
            yield from self._join(node, rank, violated=True)

    def finish(self, node: Node, rank: int) -> Program:
        """After its last step a worker still answers requests: its model stays part of the average."""
        while True:
            request = yield node.recv(source=self.simulation.server, tag=_REQUEST)
            if request.payload > self._answered[rank]:
                yield from self._join(node, rank, violated=False)

    def _pending_request(self, node: Node, rank: int) -> bool:
        """Whether a request of a balancing this worker has not answered yet has arrived (taken from
        the mailbox). Requests that its own report answered arrive first and are dropped."""
        while (request := node.recv_nowait(source=self.simulation.server, tag=_REQUEST)) is not None:
            if request.payload > self._answered[rank]:
                return True
        return False

    def _join(self, node: Node, rank: int, violated: bool) -> Program:
        """Send this worker's model to the coordinator, wait, and take the balanced model."""
        replica = self.simulation.replicas[rank]
        model = replica.get()
        node.send(self.simulation.server, (model, violated), tag=_MODEL, nbytes=model.nbytes)
        message = yield node.recv(source=self.simulation.server, tag=_BALANCED)
        balancing, mean, full_sync = message.payload
        self._answered[rank] = balancing
        replica.set(mean)
        if full_sync:
            self.references[rank] = replica.vector.parameters_of(mean).clone()

    # ------------------------------------------------------------------ coordinator

    def server(self, node: Node) -> Program:
        reports: dict[int, Tensor] = {}  # violation reports waiting for a balancing
        while True:
            if not reports:
                message = yield node.recv(tag=_MODEL)
                reports[message.source] = self._receive_model(message)
            yield node.sleep(0)  # reports arriving in the same instant join B
            while (message := node.recv_nowait(tag=_MODEL)) is not None:
                reports[message.source] = self._receive_model(message)
            yield from self._balance(node, reports)

    def _receive_model(self, message: Message) -> Tensor:
        model, violated = message.payload
        check_finite(model, message.source)
        self.counts["violations"] += violated
        return model

    def _balance(self, node: Node, reports: dict[int, Tensor]) -> Program:
        """One balancing of Algorithm 1 over the queued reports; later reports stay in ``reports``."""
        self.balancings += 1
        balancing, workers = self.balancings, self.simulation.num_workers
        models = dict(reports)
        reports.clear()
        rounds = balancing_rounds(sorted(models), workers, self.violation_counter, self._generator)
        mean, averaged = None, None
        try:
            members, added = next(rounds)
            while True:
                yield from self._fetch(node, added, models, reports, balancing)
                mean = yield from node.execute(weighted_average, [models[r] for r in members], kind="aggregate")
                averaged = members
                within = local_condition_holds(
                    self._parameters(mean), self.reference, self.divergence_threshold
                )
                members, added = rounds.send(within)
        except StopIteration as done:
            members, self.violation_counter = done.value
        if members != averaged:  # a full synchronisation: the rounds stopped asking
            yield from self._fetch(node, [r for r in members if r not in models], models, reports, balancing)
            mean = yield from node.execute(weighted_average, [models[r] for r in members], kind="aggregate")
        full_sync = len(members) == workers
        if full_sync:
            self.reference = self._parameters(mean).clone()
        self.counts["full_syncs" if full_sync else "partial_syncs"] += 1
        for rank in members:
            node.send(rank, (balancing, mean, full_sync), tag=_BALANCED, nbytes=mean.nbytes)

    def _fetch(
        self, node: Node, ranks: list[int], models: dict[int, Tensor], reports: dict[int, Tensor], balancing: int
    ) -> Program:
        """Get the models of ``ranks``: from the queued reports, or by a request and the answer."""
        asked: set[int] = set()
        for rank in ranks:
            if rank in models:
                continue
            if rank in reports:
                models[rank] = reports.pop(rank)
            else:
                node.send(rank, balancing, tag=_REQUEST, nbytes=1)
                asked.add(rank)
        while asked:
            message = yield node.recv(tag=_MODEL)
            if message.source in asked:
                models[message.source] = self._receive_model(message)
                asked.discard(message.source)
            else:
                reports[message.source] = self._receive_model(message)

    def _parameters(self, vector: Tensor) -> Tensor:
        return self.simulation.replicas[0].vector.parameters_of(vector)

    def metrics(self) -> dict[str, float]:
        return {f"dynamic/{key}": float(value) for key, value in self.counts.items()}
