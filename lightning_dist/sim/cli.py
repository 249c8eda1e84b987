"""``lightning-dist simulate --config configs/sim/<name>.yaml``: one simulated run from a YAML file.

The model and datamodule are named with ``class_path``/``init_args`` as in LightningCLI; the
protocol by ``name`` plus its arguments; ``network`` and ``speed`` are
:class:`~lightning_dist.sim.network_model.NetworkModel` and :class:`~lightning_dist.sim.engine.SpeedModel`.
Every value can be overridden on the command line (``--workers 64``, ``--network.latency 0.01``).
Outputs go to ``--out``: ``metrics.csv``, ``workers.csv``, ``summary.json``, ``curves.png``.

Workers leaving and joining (:class:`~lightning_dist.sim.churn.Churn`) are a ``churn`` mapping::

    churn: {fraction: 0.3, leave_rate: 0.05, mean_absence: 10, seed: 1}   # random, seeded
    churn: {absences: {3: [[2.0, 5.0]], 9: [[1.5, null]]}}                 # explicit virtual times

(``--churn '{"fraction": 0.3, "leave_rate": 0.05, "mean_absence": 10}'`` on the command line).

Machines of several ranks (:mod:`lightning_dist.sim.machines`): ``ranks_per_node`` (``workers`` counts the
ranks), ``intra_node`` (a mapping like ``network``: the link between two ranks of one machine) and
``hierarchy`` (``node``: one learner per machine)::

    ranks_per_node: 8
    intra_node: {latency: 0.00001, node_mbit: 100000}
    hierarchy: node

The collectives' cost model (:mod:`lightning_dist.sim.collectives`) is ``collectives``: ``gloo_ring`` (the
default: Gloo's ring, what the strategies run on CPU) or ``nccl`` (NCCL's ring or tree, whichever its tuner
predicts faster, as a GPU cluster runs DDP; :mod:`lightning_dist.sim.nccl`)::

    collectives: nccl

Batched workers (:mod:`lightning_dist.sim.batched`): ``batched_workers: 256`` computes the steps in progress
together, up to 256 replicas a ``torch.func.vmap`` call (a local-update protocol and a modelled
``speed.step_seconds`` needed; equal to the per-worker path up to float32 rounding). It pays for many workers of a
small model (the MLP: 3-4x at 256-1024 workers); an attention model on CPU runs slower with it.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import lightning as L
from jsonargparse import ActionConfigFile, ArgumentParser

from lightning_dist.sim.churn import Churn
from lightning_dist.sim.engine import SpeedModel
from lightning_dist.sim.nccl import check_collectives
from lightning_dist.sim.network_model import NetworkModel
from lightning_dist.sim.protocols import make_protocol
from lightning_dist.sim.report import write_report
from lightning_dist.sim.simulation import Simulation


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="lightning-dist simulate", description=__doc__.splitlines()[0])
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_subclass_arguments(L.LightningModule, "model", required=True)
    parser.add_subclass_arguments(L.LightningDataModule, "data", required=True)
    parser.add_argument(
        "--protocol",
        type=dict[str, Any],
        required=True,
        help="name (parameter_server, periodic, fedavg, dynamic_avg, segmented_gossip) and its arguments",
    )
    parser.add_argument("--workers", type=int, required=True, help="number of virtual workers (>= 1)")
    parser.add_argument("--max_steps", type=int, required=True, help="optimizer steps per worker (>= 1)")
    parser.add_argument("--max_virtual_seconds", type=Optional[float], default=None)
    parser.add_argument("--eval_every", type=int, default=10, help="average steps per worker between evaluations")
    parser.add_argument("--evaluate_workers", type=bool, default=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--churn",
        type=Optional[dict[str, Any]],
        default=None,
        help="workers leaving and joining: {fraction, leave_rate, mean_absence, seed} (random) or "
        "{absences: {worker: [[leave, join], ...]}} (virtual seconds; join null: never back)",
    )
    parser.add_argument("--out", type=str, default="sim_out")
    parser.add_argument("--ranks_per_node", type=int, default=1, help="ranks per machine; workers is a multiple")
    parser.add_argument("--hierarchy", type=Optional[str], default=None,
                        help="None (every rank a learner) or node (one learner per machine, DDP inside it)")
    parser.add_argument("--collectives", type=str, default="gloo_ring",
                        help="the collectives' cost model: gloo_ring (Gloo's ring, as on CPU) or nccl (NCCL's ring or "
                        "tree, whichever is faster, as on a GPU cluster)")
    parser.add_argument("--batched_workers", type=Optional[int], default=None,
                        help="None (each worker's step on its own) or the replicas computed together in one vmap call")
    parser.add_class_arguments(NetworkModel, "network")
    parser.add_class_arguments(NetworkModel, "intra_node")
    parser.add_class_arguments(SpeedModel, "speed")
    for name in ("num_features", "num_classes"):
        parser.link_arguments(f"data.{name}", f"model.init_args.{name}", apply_on="instantiate")
    return parser


def make_churn(config: dict[str, Any]) -> Churn:
    """A :class:`Churn` from its config mapping; worker keys of ``absences`` may be strings of digits (JSON)."""
    arguments = dict(config)
    unknown = set(arguments) - {"absences", "fraction", "leave_rate", "mean_absence", "seed"}
    if unknown:
        raise ValueError(f"churn takes absences, fraction, leave_rate, mean_absence and seed; got {sorted(unknown)}")
    absences = arguments.get("absences")
    if isinstance(absences, dict):
        arguments["absences"] = {
            int(worker) if isinstance(worker, str) and worker.isdigit() else worker: pairs
            for worker, pairs in absences.items()
        }
    return Churn(**arguments)


def main(args: Optional[list[str]] = None) -> dict[str, Any]:
    parser = build_parser()
    config = parser.parse_args(args)
    # Checked before any model is built or data loaded: a bad protocol, network or speed fails fast.
    protocol_arguments = dict(config.protocol)
    if "name" not in protocol_arguments:
        raise ValueError(
            "protocol needs a name: one of parameter_server, periodic, fedavg, dynamic_avg, segmented_gossip"
        )
    protocol = make_protocol(protocol_arguments.pop("name"), **protocol_arguments)
    check_collectives(config.collectives)
    churn = None if config.churn is None else make_churn(config.churn)
    L.seed_everything(config.seed, verbose=False)
    objects = parser.instantiate_classes(config)
    simulation = Simulation(
        objects.model,
        objects.data,
        protocol,
        workers=config.workers,
        max_steps=config.max_steps,
        network=objects.network,
        speed=objects.speed,
        max_virtual_seconds=config.max_virtual_seconds,
        eval_every=config.eval_every,
        evaluate_workers=config.evaluate_workers,
        seed=config.seed,
        churn=churn,
        ranks_per_node=config.ranks_per_node,
        intra_node=objects.intra_node,
        hierarchy=config.hierarchy,
        collectives=config.collectives,
        batched_workers=config.batched_workers,
    )
    result = simulation.run()
    paths = write_report(result, config.out)
    summary = result.summary
    print(json.dumps({key: summary[key] for key in ("protocol", "workers", "num_learners", "virtual_seconds", "bytes",
                                                    "bytes_by_level", "final",
                                                    "wall_seconds", "overhead_ratio")}, indent=1))
    print(f"wrote {', '.join(str(path) for path in paths.values())}")
    return summary
