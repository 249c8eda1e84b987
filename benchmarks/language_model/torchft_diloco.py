"""torchft's DiLoCo and Streaming DiLoCo (``torchft.local_sgd.DiLoCo``, torchft 0.2.0) on ``network.py``'s task: the
baseline a user of DiLoCo would reach for, run beside this package's strategies in the same launch.

``benchmarks/language_model/worker.py`` calls :func:`fit_run` for a run of kind ``"torchft"``::

    {"name": "torchft_streaming_diloco", "kind": "torchft", "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True},
     "torchft": {"sync_every": 50, "fragments": 5, "fragment_sync_delay": 5, "fragment_update_alpha": 0.5}}

What is the same as the package's runs (``worker.fit_run``): the seed (``L.seed_everything`` before the model), so
the same initial weights; ``TransformerLM`` with the spec's arguments; the same batches (``StdlibTextDataModule``,
this rank's ``train_loader(world, rank)``, ``set_epoch`` every epoch as Lightning does); the inner optimizer and its
schedule from ``TransformerLM.configure_optimizers`` (AdamW, decay on the matrices only, linear warmup stepped after
every optimizer step); deterministic algorithms; one thread per rank. Timing and recording are ``worker.Snapshots``'
and ``recording.collect``'s: after every optimizer step rank 0 decides (a broadcast of two numbers on the launch's
process group) whether to copy the parameters (every ``budget_s / snapshots`` seconds) and whether the budget is
spent; each copy keeps the clock and the bytes ``/sys/class/net/eth0`` has sent; every step's end is kept
(``step_ends``), and the optimizer-step hook's time at every fragment merge (``rounds``, as ``after_local_step``'s
for the strategies). After training, the replicas' mean at each copy is scored on the same validation windows.

torchft's set-up, one replica group per rank (every rank its own replica, as the strategies' learners):

- the Lighthouse (``torchft._torchft.LighthouseServer``, in rank 0's process, ``min_replicas`` = world size) binds
  rank 0's address, which every rank reaches: in ``network.py``'s namespaces that is node 0's ``eth0``
  (``10.77.0.1``, the launch's ``MASTER_ADDR``), so the other ranks' heartbeats and quorum requests cross the
  capped links; its port goes to the other ranks over the launch's process group;
- each rank starts a ``TCPStore`` on its own address (the replica group's store: the Manager's, and the rendezvous
  of torchft's Gloo group when this replica is the quorum's first), a ``ProcessGroupGloo`` (Gloo binds
  ``GLOO_SOCKET_IFNAME`` = ``eth0``, as the strategies' groups) and a ``Manager`` (``rank=0, world_size=1``,
  ``min_replica_size`` = world size, ``use_async_quorum=False`` as DiLoCo requires, ``init_sync=False``: every
  replica starts from the same seeded weights) whose ``ManagerServer`` advertises this rank's address (torchft's
  default, ``socket.gethostname()``, names the host, which resolves outside the namespaces). So every byte torchft
  moves between replicas (heartbeats, quorums, the store, the all-reduces) crosses the capped ``eth0``; a rank's
  traffic with its own Manager, store and (on rank 0) Lighthouse stays inside its namespace, as rank 0's with the
  launch's store does;
- one quorum is formed before the clock starts (``manager.start_quorum()``: torchft's Gloo group connects there),
  as the strategies' process group is set up by Lightning before training; DiLoCo's own quorums, one per fragment
  synchronization, are inside the timed window;
- ``DiLoCo(manager, fragments, AdamW, [SGD(fragment) for each fragment], sync_every, fragment_sync_delay,
  fragment_update_alpha)``: one outer optimizer per fragment (DiLoCo takes a list), SGD with the run's ``outer``
  arguments (the package's ``DILOCO_OUTER``: lr 0.7, Nesterov momentum 0.9). With a single outer optimizer over
  the whole model a fragment's outer step would also step the other fragments with their last inner gradients,
  which are still set when DiLoCo's step hook runs. The all-reduces are torchft's default, one per parameter
  tensor (``use_bucketization=False``; ``"use_bucketization": true`` in the run's ``torchft`` turns on its flat
  buckets), in float32 (``should_quantize`` needs Triton and a GPU).

Fragments (:func:`model_fragments`): torchft synchronizes whole modules; the model's parameter-owning modules (the
embeddings, each block's LayerNorms and linear layers, the final LayerNorm), in parameter order, are cut into ``P``
contiguous groups with the largest group as small as possible (:func:`balanced_groups`), so each exchange carries
about ``1 / P`` of the model without cutting a tensor (the package's streaming cuts the flat vector into ``P`` equal
ranges, which may cut one; the Streaming DiLoCo paper groups whole blocks, which here would make the embeddings'
fragment a sixth of a block's). The tied head and token embedding are one parameter, in one fragment.

Schedule, as the package's streaming (``lightning_dist/algorithms/streaming.py``, which follows torchft): fragment
``(j - 1) mod P`` at the ``j``-th multiple of ``sync_every / P`` steps, its pseudo-gradient's all-reduce started
``fragment_sync_delay`` steps before, then ``theta_p <- OuterOpt(theta_p, mean pseudo-gradient)`` and every
replica's fragment ``<- alpha * local + (1 - alpha) * theta_p``. torchft picks the fragment from the Manager's
step, which counts committed synchronizations; a failed commit (none is expected here) would repeat the fragment,
so the run records the commits (``torchft.commits``, ``torchft.expected_commits``).

Bytes. The wire counters see everything torchft sends between namespaces; two differences from the strategies' runs
are not torchft's training: the strategies broadcast rank 0's model at set-up (in the wire bytes from the first
copy on: about 16.6 MB over 4 ranks, none of it in the timed window), which torchft with ``init_sync=False`` does
not need (the replicas start equal), and they average the replicas once after fit (in ``wire_sent_bytes``, after the
last copy), which DiLoCo does not do. torchft's control traffic (heartbeats every 100 ms, quorums) was 0.26 MB in
15 s of 4 ranks, against 0.10 MB for the strategies' per-step decision broadcast alone.

What cannot run here, and why: torchft's ``should_quantize`` (its all-reduce in fp8 needs Triton and a GPU; not
used, as said), and its healing: a replica that joins late or falls behind fetches a checkpoint from another over
HTTP (``HTTPTransport``), at the address ``http://<socket.gethostname()>:<port>``, which on this host names
127.0.0.1 (``/etc/hosts``), so in a namespace it would reach the fetching replica's own loopback, not the sender.
Healing is never triggered here (every replica is in every quorum from the first, at the same step, with
``init_sync=False``); a run that needed it would time out and fail. Everything in the benchmark's path runs in
the namespaces: the Lighthouse, the four Managers, their stores, torchft's Gloo group.
"""

from __future__ import annotations

import functools
import os
import socket
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import nn

TIMEOUT = timedelta(minutes=10)  # collectives, quorums, commits: the strategies' default timeout
QUORUM_TIMEOUT = timedelta(minutes=10)  # a replica may wait a whole synchronization of another for its quorum


def balanced_groups(sizes: Sequence[int], groups: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of ``groups`` contiguous, non-empty runs of ``sizes`` whose largest sum is as small as
    possible (the linear partition problem, by dynamic programming); among equal maxima the earliest cuts."""
    count = len(sizes)
    if not 1 <= groups <= count:
        raise ValueError(f"cannot cut {count} modules into {groups} non-empty fragments")
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    inf = float("inf")
    # best[k][i]: the smallest largest sum of the first i units cut into k groups; cut[k][i]: its last group's start.
    best = [[inf] * (count + 1) for _ in range(groups + 1)]
    cut = [[0] * (count + 1) for _ in range(groups + 1)]
    best[0][0] = 0
    for k in range(1, groups + 1):
        for i in range(k, count + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, stop = [], count
    for k in range(groups, 0, -1):
        start = cut[k][stop]
        bounds.append((start, stop))
        stop = start
    return bounds[::-1]


class Fragment(nn.Module):
    """A module holding some of a model's parameters (the same ``Parameter`` objects), what ``DiLoCo`` takes as one
    fragment. Parameter ``a.b.c`` of the model is registered as ``a__b__c``."""

    def __init__(self, named: Sequence[tuple[str, nn.Parameter]]) -> None:
        super().__init__()
        self.model_names = [name for name, _ in named]
        for name, parameter in named:
            self.register_parameter(name.replace(".", "__"), parameter)


def parameter_units(model: nn.Module) -> list[list[tuple[str, nn.Parameter]]]:
    """The model's parameters grouped by the module that owns them, in ``model.named_parameters()`` order; a
    parameter shared by two modules (a tied head) belongs to the first."""
    owner: dict[int, str] = {}
    for module_name, module in model.named_modules():
        for name, parameter in module.named_parameters(recurse=False):
            owner.setdefault(id(parameter), module_name)
    units: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for name, parameter in model.named_parameters():  # each parameter once, in the model vector's order
        units.setdefault(owner[id(parameter)], []).append((name, parameter))
    return list(units.values())


def model_fragments(model: nn.Module, fragments: int) -> list[Fragment]:
    """``fragments`` modules covering every parameter of ``model`` once: its parameter-owning modules in order, cut
    into contiguous groups of nearly equal size (:func:`balanced_groups`)."""
    units = parameter_units(model)
    bounds = balanced_groups([sum(p.numel() for _, p in unit) for unit in units], fragments)
    return [Fragment([named for unit in units[start:stop] for named in unit]) for start, stop in bounds]


def own_address() -> str:
    """The address this rank is reached at: the source address of its route to ``MASTER_ADDR`` (in a namespace of
    ``benchmarks/common/netns.py`` its ``eth0`` address; on one host, loopback's)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))  # UDP: no packet is sent
        return probe.getsockname()[0]


def port_of(address: str) -> int:
    """The port of a ``http://host:port`` address (torchft's servers advertise ``socket.gethostname()``)."""
    return int(address.rstrip("/").rsplit(":", 1)[1])


def fit_run(spec: dict[str, Any], run: dict[str, Any]) -> dict[str, Any] | None:
    """Train ``spec``'s model with torchft's DiLoCo as ``run["torchft"]`` says, for the spec's budget; return rank 0's
    result (``recording.collect``'s, with ``torchft`` added), None on the other ranks."""
    import lightning as L
    import torch.distributed as dist
    from torch.nn.utils import parameters_to_vector
    from torchft import Manager, ProcessGroupGloo
    from torchft._torchft import LighthouseServer
    from torchft.local_sgd import DiLoCo

    from benchmarks.language_model.recording import collect, wire_bytes
    from lightning_dist.data import StdlibTextDataModule
    from lightning_dist.models import TransformerLM

    settings = dict(run["torchft"])
    sync_every, fragments = int(settings["sync_every"]), int(settings.get("fragments", 1))
    delay, alpha = int(settings.get("fragment_sync_delay", 0)), float(settings.get("fragment_update_alpha", 0.0))
    bucketize = bool(settings.get("use_bucketization", False))
    stride = sync_every // fragments

    seed = int(spec["seed"])
    L.seed_everything(seed, workers=True, verbose=False)
    datamodule = StdlibTextDataModule(seed=seed, **spec["data"])
    model = TransformerLM(**spec["model"])
    if not dist.is_initialized():  # a launch whose first run is torchft's: Lightning has not set the group up yet
        dist.init_process_group("gloo", timeout=TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.use_deterministic_algorithms(True)
    datamodule.setup("fit")
    loader = datamodule.train_loader(world, rank)
    configured = model.configure_optimizers()
    optimizer = configured["optimizer"] if isinstance(configured, dict) else configured
    scheduler = configured["lr_scheduler"]["scheduler"] if isinstance(configured, dict) else None
    parts = model_fragments(model, fragments)
    outer_optimizers = [torch.optim.SGD(part.parameters(), **run["outer"]) for part in parts]
    model.train()

    wire_start = wire_bytes()
    host = own_address()
    lighthouse = None
    if rank == 0:
        lighthouse = LighthouseServer(bind=f"{host}:0", min_replicas=world)
    shared = [f"http://{host}:{port_of(lighthouse.address())}" if lighthouse is not None else None]
    dist.broadcast_object_list(shared, src=0)
    store = dist.TCPStore(host_name=host, port=0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    group = ProcessGroupGloo(timeout=TIMEOUT)
    manager = Manager(
        pg=group,
        load_state_dict=lambda state: (model.load_state_dict(state["model"]),
                                       optimizer.load_state_dict(state["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
        min_replica_size=world, use_async_quorum=False, timeout=TIMEOUT, quorum_timeout=QUORUM_TIMEOUT,
        connect_timeout=TIMEOUT, rank=0, world_size=1, store_addr=host, store_port=store.port,
        lighthouse_addr=shared[0], replica_id=f"{run['name']}_{rank}", hostname=host, init_sync=False,
    )
    manager.start_quorum()  # torchft's Gloo group connects here, before the clock, as Lightning's does in setup
    first_quorum = manager._quorum_id
    diloco = DiLoCo(manager, parts, optimizer, outer_optimizers, sync_every=sync_every, use_bucketization=bucketize,
                    fragment_sync_delay=delay, fragment_update_alpha=alpha)

    rounds: list[tuple[int, float]] = []
    hook = diloco._step_post_hook  # DiLoCo.__enter__ registers this attribute: timed at the merges
    steps_done = [0]

    def timed_hook(*args: Any) -> None:
        began = time.monotonic()
        hook(*args)
        steps_done[0] += 1
        if steps_done[0] % stride == 0:
            rounds.append((steps_done[0], time.monotonic() - began))

    diloco._step_post_hook = timed_hook

    budget = float(spec["budget_s"])
    every_s = budget / int(spec["snapshots"])
    steps: list[int] = []
    times: list[float] = []
    wire: list[tuple[int, int]] = []
    vectors: list[torch.Tensor] = []
    step_ends: list[float] = []

    def take(step: int) -> None:
        steps.append(step)
        times.append(time.monotonic())
        tx, rx = wire_bytes()
        wire.append((tx - wire_start[0], rx - wire_start[1]))
        vectors.append(parameters_to_vector(model.parameters()).detach().float().clone())

    dist.barrier()
    start = time.monotonic()
    next_copy = start + every_s
    take(0)
    step, epoch, stop = 0, 0, False
    with diloco:
        while not stop:
            loader.sampler.set_epoch(epoch)
            for batch in loader:
                loss = model.per_example_loss(batch).mean()  # training_step's loss, without its logging
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()  # DiLoCo's hook: a fragment's exchange starts or merges
                if scheduler is not None:
                    scheduler.step()
                step += 1
                now = time.monotonic()
                step_ends.append(now)
                decision = torch.tensor([now >= next_copy, now - start >= budget], dtype=torch.uint8)
                dist.broadcast(decision, src=0)
                copy, stop = bool(decision[0]), bool(decision[1])
                if copy or stop:
                    take(step)
                    next_copy = max(next_copy + every_s, now)
                if stop:
                    break
            epoch += 1
        # An exchange started within the last fragment_sync_delay steps is still in flight on every rank: let it end
        # before torchft's group goes.
        for fragment in diloco._fragments:
            for work in fragment._allreduce_work:
                work.wait()
    fit_end = time.monotonic()
    wire_end = wire_bytes()
    commits, quorum_id = manager.current_step(), manager._quorum_id

    dist.barrier()
    manager.shutdown(wait=True)
    group.shutdown()
    dist.barrier()  # every Manager is down before the Lighthouse it heartbeats to, every group before the stores
    if lighthouse is not None:
        lighthouse.shutdown()
    del store

    local = {"start": start, "fit_end": fit_end, "steps": steps, "times": times, "wire": wire,
             "wire_total": (wire_end[0] - wire_start[0], wire_end[1] - wire_start[1]), "step_ends": step_ends,
             "rounds": rounds, "distances": []}
    result = collect(spec, run, model, datamodule, vectors, local, step)
    if result is not None:
        result["torchft"] = {
            **settings, "version": _version(), "fragment_parameters": [sum(p.numel() for p in part.parameters())
                                                                     for part in parts],
            "fragment_modules": [sorted({name.rsplit(".", 1)[0] for name in part.model_names}) for part in parts],
            "commits": commits, "expected_commits": step // stride, "quorum_id_first": first_quorum,
            "quorum_id_last": quorum_id, "min_replica_size": world, "use_bucketization": bucketize,
        }
    return result


@functools.cache
def _version() -> str:
    from importlib.metadata import version

    return version("torchft")
