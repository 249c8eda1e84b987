"""Dynamic averaging's coordinator in the simulator (``topology="server"``, node ``N``): Algorithm 1 of paper 004
event by event, the threshold's calibration, churn.

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

Churn (``topology="server"``, :mod:`lightning_dist.sim.churn`): the coordinator balances among the
workers present. A balancing runs Algorithm 1 over the workers present when it opens (the
violation counter compares with their number; ``B`` = all of them is a full synchronisation and
sets the reference); the coordinator stops waiting for a member that leaves, and the mean is over
the members whose models it holds and who are still present. Reports of a worker that left are
dropped. A joiner sends a 1-byte request and starts from the reference model (the last full
synchronisation's mean, buffers included), as its own reference, going on from its own step;
a request arriving during a balancing is answered after it, with the new reference if it set one.
Once ``Delta`` has been measured it travels with the reference model (8 bytes more).

Churn before ``Delta`` is measured: the calibration waits for the workers present only. A worker that
leaves is not waited for and its report, if the coordinator holds it, is dropped (if every reporter
leaves, the coordinator waits for reports again). Until the first report has arrived a joiner is
admitted at once and starts, as above, from the reference model, then still the initial model, as
its own reference; like every worker without ``Delta`` it reports at its first check from
``calibration_steps`` on, its drift measured from the initial model over the steps it took (one back
after its report was lost on the wire reports again at its next check, or after its last step if it
has none left). A joiner whose request arrives after the first report (during the calibration) waits
for its end and starts from its mean, with ``Delta``, as a joiner during a balancing does: admitted at
once, it would make every reporter wait for its steps up to ``calibration_steps``.

:class:`DynamicCoordinator` is mixed into :class:`~lightning_dist.sim.protocols.dynamic.DynamicAveraging` and works on
its state (the reference model, ``Delta``, the membership, the counters); the workers' side stays there.
"""

from __future__ import annotations

from torch import Tensor

from lightning_dist.algorithms.averaging import (
    balancing_rounds,
    calibrated_threshold,
    local_condition_holds,
    weighted_average,
)
from lightning_dist.sim.engine import Message, Node
from lightning_dist.sim.protocols.base import Program
from lightning_dist.sim.protocols.dynamic_calibration import PROBE, echo
from lightning_dist.sim.protocols.membership import JOIN, LEFT
from lightning_dist.sim.replica import check_finite

MODEL = "model"  # worker -> coordinator: (model, violated): a violation report, or the answer to a request
REQUEST = "request"  # coordinator -> worker: send your model (payload: the balancing's number)
BALANCED = "balanced"  # coordinator -> member: (balancing number, mean, full synchronisation)
DRIFT = "drift"  # worker -> coordinator: (model, ||f_i - r||^2): a calibration report
CALIBRATED = "calibrated"  # coordinator -> reporter: (mean, Delta): the calibration's full synchronisation
FLOAT_BYTES = 8  # a float64 on the wire: a drift, or the measured Delta


class DynamicCoordinator:
    """The coordinator node's program and its balancing (see the module docstring)."""

    def server(self, node: Node) -> Program:
        if self.threshold is None:
            yield from self._calibrate(node)
        reports: dict[int, Tensor] = {}  # violation reports waiting for a balancing
        while True:
            if not reports:
                message = yield node.recv_any((MODEL, JOIN, LEFT))
                if message.tag != MODEL:
                    self.membership.handle(message)
                    self._admit(node)
                    continue
                reports[message.source] = self._receive_model(message)
            yield node.sleep(0)  # reports arriving in the same instant join B
            while (message := node.recv_nowait(tag=MODEL)) is not None:
                reports[message.source] = self._receive_model(message)
            for rank in [rank for rank in reports if rank not in self.membership.members]:
                del reports[rank]  # its worker left
            if reports:
                yield from self._balance(node, reports)
            self._admit(node)

    def _calibrate(self, node: Node) -> Program:
        """Measure ``Delta`` from the calibration reports of every worker present, then the first full
        synchronisation (module docstring: the threshold, and churn before it is measured)."""
        reports: dict[int, tuple[Tensor, float]] = {}  # rank -> (model, drift)
        while not reports or not self.membership.members <= reports.keys():
            message = yield node.recv_any((DRIFT, PROBE, JOIN, LEFT))
            if message.tag == PROBE:  # a worker probing the network before it chooses its period
                echo(node, message)
                continue
            if message.tag == DRIFT:
                check_finite(message.payload[0], message.source)
                reports[message.source] = message.payload
            else:
                self.membership.handle(message)
            reports = {rank: report for rank, report in reports.items() if rank in self.membership.members}
            if not reports:  # no calibration under way: a joiner starts at once, from the initial model
                self._admit(node)
        ranks = sorted(reports)
        self.calibration_period = self.calibration.period
        self.threshold = calibrated_threshold([reports[rank][1] for rank in ranks], self.calibration_period)
        mean = yield from node.execute(weighted_average, [reports[rank][0] for rank in ranks], kind="aggregate")
        mean = self._synchronised(mean)
        for rank in ranks:
            if rank in self.membership.members:  # not one that left during the aggregation
                node.send(rank, (mean, self.threshold), tag=CALIBRATED, nbytes=mean.nbytes + FLOAT_BYTES)
        self._admit(node)

    def _admit(self, node: Node) -> None:
        """Admit the waiting joiners with the reference model and ``Delta``: 8 bytes more once ``Delta`` is measured
        (a set one is part of every worker's configuration)."""
        measured = self.divergence_threshold is None and self.threshold is not None
        nbytes = self.reference_model.nbytes + (FLOAT_BYTES if measured else 0)
        self.membership.admit(node, (self.reference_model, self.threshold), nbytes)

    def _synchronised(self, mean: Tensor) -> Tensor:
        """A full synchronisation's result from the mean of every present worker's model: DiLoCo's outer step from
        it if any. It becomes the reference model; counted as a full synchronisation."""
        if self.outer is not None:
            mean = self.outer.step(mean)
        self.reference = self._parameters(mean).clone()
        self.reference_model = mean
        self.counts["full_syncs"] += 1
        return mean

    def _receive_model(self, message: Message) -> Tensor:
        model, violated = message.payload
        check_finite(model, message.source)
        self.counts["violations"] += violated
        return model

    def _balance(self, node: Node, reports: dict[int, Tensor]) -> Program:
        """One balancing of Algorithm 1 over the queued reports; later reports stay in ``reports``."""
        self.balancings += 1
        balancing = self.balancings
        present = sorted(self.membership.members)  # Algorithm 1's m learners: those present now
        position = {rank: index for index, rank in enumerate(present)}
        models = dict(reports)
        reports.clear()
        rounds = balancing_rounds([position[rank] for rank in sorted(models)], len(present), self.violation_counter,
                                  self._generator)
        mean, averaged = None, None
        try:
            members, added = next(rounds)
            while True:
                members = [present[index] for index in members]
                yield from self._fetch(node, [present[index] for index in added], models, reports, balancing)
                held = self._held(members, models)
                if not held:
                    return  # every member left: nothing to balance
                mean = yield from node.execute(weighted_average, held, kind="aggregate")
                averaged = members
                within = local_condition_holds(self._parameters(mean), self.reference, self.threshold)
                members, added = rounds.send(within)
        except StopIteration as done:
            members, self.violation_counter = done.value
            members = [present[index] for index in members]
        if members != averaged:  # a full synchronisation: the rounds stopped asking
            yield from self._fetch(node, [r for r in members if r not in models], models, reports, balancing)
            held = self._held(members, models)
            if not held:
                return
            mean = yield from node.execute(weighted_average, held, kind="aggregate")
        full_sync = len(members) == len(present)
        if full_sync:
            mean = self._synchronised(mean)
        else:
            self.counts["partial_syncs"] += 1
        for rank in members:
            if rank in self.membership.members:
                node.send(rank, (balancing, mean, full_sync), tag=BALANCED, nbytes=mean.nbytes)

    def _held(self, members: list[int], models: dict[int, Tensor]) -> list[Tensor]:
        """The models of ``members`` the coordinator holds whose workers are still present, in member order."""
        return [models[rank] for rank in members if rank in models and rank in self.membership.members]

    def _fetch(
        self, node: Node, ranks: list[int], models: dict[int, Tensor], reports: dict[int, Tensor], balancing: int
    ) -> Program:
        """Get the models of ``ranks``: from the queued reports, or by a request and the answer."""
        asked: set[int] = set()
        for rank in ranks:
            if rank in models or rank not in self.membership.members:
                continue
            if rank in reports:
                models[rank] = reports.pop(rank)
            else:
                node.send(rank, balancing, tag=REQUEST, nbytes=1)
                asked.add(rank)
        while asked:
            message = yield node.recv_any((MODEL, JOIN, LEFT))
            if message.tag != MODEL:  # a joiner waits for the balancing's end; a member that left is not waited for
                self.membership.handle(message)
                asked &= self.membership.members
            elif message.source in asked:
                models[message.source] = self._receive_model(message)
                asked.discard(message.source)
            else:
                reports[message.source] = self._receive_model(message)
