"""Worker for the fault-tolerance tests: one replica group's job (torchrun, 1 or more ranks) of a periodic-averaging fit
whose windows run through torchft; each rank writes ``<out>/<name>/group<g>_rank<r>[_restart].pt``.

Usage: torchrun ... fault_tolerant.py spec.json GROUP [restart] (tests/helpers/launch.py's ``run_replica_groups``);
with ``"plain": true`` the same fit without the option on ``run_nodes``' nodes (``GROUP_RANK`` is the group), the
baseline a run without failures must equal. The spec names the Lighthouse, the groups, the strategy's arguments, and
the failure to inject into this group: ``{"kill": {"group": 2, "step": 6}}`` exits this job's processes right after
that optimizer step (inside a window), ``{"kill": {"group": 2, "window": 2, "all_reduce": 3}}`` during the third
all-reduce of its second window (inside the exchange; ``"exchange": 1``: the first batch of point-to-point transfers
of a compressed one; ``"rejoined": true`` instead of ``"window"``: in the first window with every group after one with
fewer, where a restarted group joins; ``"local_rank": j``: on that local rank only; ``"fail_only": true``: the failure
reaches that rank's exchange, torchft's error reported there, and its process lives on). A restarted job (the
``restart`` argument) injects nothing there; with ``"heal_fails": true`` its first transfer of a peer's state fails
(the checkpoint transport raises, as when the peer is lost mid-transfer; a list of local ranks: on those ranks only),
and with ``"fetch_fails": true`` its first fetch of a peer's committed state after a heal fails likewise.
``"timeout"``: the option's, in seconds (30). Each window records the model before and after it and, under
``compression``, the compressed state of every bucket before and after it.

``"restart_from_last": true`` starts a restarted job with ``ckpt_path`` at its group's newest checkpoint (as
``ckpt_path: last``). A ``copy`` job (``run_replica_groups``' ``duplicate_group``) runs with ``"copy_secret"`` as its
secret if given (another run's group), and with ``"copy_after_setup"`` waits until every group has ended a set-up
window. Every job's groups, Lighthouse and secret come from ``run_replica_groups``.

``"start_barrier"`` makes every group's job wait, once its torchft Manager heartbeats, for the others' to, so the
first quorum has every group (a group whose Manager the Lighthouse has not heard of yet is not waited for);
``"copy_in_barrier"``: the copy's job too.
``"await_restart": STEP`` holds the other groups after optimizer step STEP until every restarted (or copied) job asks
for its first quorum (then ``"hold_s"`` seconds more), so it rejoins a run still in progress however slowly it starts
(the Lighthouse forms a quorum of the previous one's groups without waiting for a newcomer that has not asked yet);
the restarted jobs start training only once a group holds there, so they join there however quickly they start.
``"restart_after_end"``: a restarted job starts only once every other group's job has written its results.
``"step_sleep"`` slows every optimizer step.

``"checkpoint"`` writes each group's checkpoint at every epoch's end (``"checkpoint": STEPS``: every STEPS optimizer
steps); ``"resume_from": NAME`` resumes every group from its own first-epoch checkpoint of run NAME
(``"resume_step": S``: the one written at step S), with this run's layout. ``"model": "cnn"`` trains the user CNN
of ``helpers.user_models`` (BatchNorm, Adam, a StepLR schedule per epoch) instead of the package's MLP (SGD, with
``"momentum"`` if given).
"""

import hashlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_dist.algorithms.averaging as averaging
from lightning_dist.algorithms.outer import diloco_outer_optimizer
from lightning_dist.comm.peer_state import SECRET_ENV
from lightning_dist.comm.quorum import QuorumCommunicator
from lightning_dist.data.datamodules import DigitsDataModule
from lightning_dist.models import MLPClassifier
from lightning_dist.strategies import PeriodicAveragingStrategy, TorchFT

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for helpers.user_models
from helpers.user_models import DigitsCNN, DigitsImages  # noqa: E402


class Record(Callback):
    """The model after every optimizer step (and its window, if one ended there), with the global step."""

    def __init__(self, group: int, kill_step: int | None, step_sleep: float,
                 hold: tuple[int, list[Path], float] | None = None) -> None:
        self.group, self.kill_step, self.step_sleep, self.hold = group, kill_step, step_sleep, hold
        self.after_step: dict[int, torch.Tensor] = {}
        self.batches: list[tuple[int, int, str]] = []  # (epoch, batch_idx, fingerprint) of every batch trained on

    def setup(self, trainer, pl_module, stage):
        torch.rand(17 + self.group)  # every group's generator in another state before it meets the others

    def on_train_start(self, trainer, pl_module):
        self.start = trainer.strategy.model_vector.get().clone()
        windows = trainer.strategy._windows
        self.anchor = None if windows is None else windows.anchor.clone()  # the committed model training starts with
        self.optimizer = optimizer_summary(trainer.optimizers[0])
        self.start_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after_step[trainer.global_step] = trainer.strategy.model_vector.get().clone()
        self.batches.append((trainer.current_epoch, batch_idx, fingerprint(batch)))
        if trainer.global_step == self.kill_step:
            os._exit(17)  # a crash: no clean-up, no goodbye to the quorum
        if self.hold is not None and trainer.global_step == self.hold[0]:
            step, marks, seconds, holding = self.hold
            holding.touch()
            wait_for(lambda: all(mark.exists() for mark in marks), f"the restarted jobs' marks {marks}")
            time.sleep(seconds)
        time.sleep(self.step_sleep)


def record_windows(strategy: PeriodicAveragingStrategy, kill: dict | None, first_quorum: Path | None = None,
                   setup_mark: Path | None = None):
    """Keep every window's replica before the exchange, and whether it was committed; inject the exchange failure.
    With ``first_quorum``, that file is created as this job asks for its first quorum; with ``setup_mark``, as it
    ends a set-up window."""
    windows: list[dict] = []
    end_window = strategy.end_window
    calls = {"window": 0, "all_reduce": 0, "exchange": 0, "fewer": False}

    def due(quorum: QuorumCommunicator) -> bool:  # the window the failure is injected into
        if kill.get("rejoined"):  # the first with every group after one with fewer: a restarted group's join
            return calls["fewer"] and quorum.manager.num_participants() == quorum.groups
        return calls["window"] == kill.get("window")

    def dying(name: str, call):
        def counted(self, *args):
            calls[name] += 1
            if kill and calls[name] == kill.get(name) and due(self):
                if kill.get("local_rank", LOCAL_RANK) != LOCAL_RANK:
                    return call(self, *args)
                if kill.get("fail_only"):  # the failure reaches this rank only; its process lives on
                    self.manager.report_error(RuntimeError("injected: this rank's exchange failed"))
                else:
                    os._exit(17)
            return call(self, *args)
        return counted

    def recorded(purpose: str) -> bool:
        calls["window"] += 1
        calls["all_reduce"] = calls["exchange"] = 0
        if first_quorum is not None and calls["window"] == 1:
            first_quorum.touch()
        before = strategy.model_vector.get().clone()
        rng_before = torch.get_rng_state()
        compression = compression_state(strategy)
        catching_up = strategy._heal is not None or strategy._windows.catching_up  # this window sends zeros after a heal
        committed = end_window(purpose)
        calls["fewer"] |= strategy._windows.quorum.membership.groups < strategy._windows.quorum.groups
        if setup_mark is not None and purpose == "setup":
            setup_mark.touch()
        optimizer = strategy.optimizers[0] if strategy.optimizers else None
        windows.append({"purpose": purpose, "before": before, "after": strategy.model_vector.get().clone(),
                        "committed": committed, "healed": strategy._windows.quorum.healed,
                        "catching_up": catching_up,
                        "behind": strategy._windows.quorum.behind,
                        "compression_before": compression, "compression_after": compression_state(strategy),
                        "rank": strategy._windows.quorum.rank, "averaged": strategy._windows.averaged,
                        "optimizer": None if optimizer is None else optimizer_summary(optimizer),
                        "local_steps": strategy._local_steps, "rng_before": rng_before,
                        "rng_after": torch.get_rng_state(),
                        "membership": strategy._windows.quorum.membership.__dict__})
        return committed

    QuorumCommunicator.all_reduce_sum_ = dying("all_reduce", QuorumCommunicator.all_reduce_sum_)
    QuorumCommunicator.exchange = dying("exchange", QuorumCommunicator.exchange)
    strategy.end_window = recorded
    return windows


def compression_state(strategy: PeriodicAveragingStrategy) -> list[dict] | None:
    """Every bucket's compressed state (common model, residuals), copied; None without compression."""
    if not strategy.compression:
        return None
    return [{key: None if value is None else value.clone() for key, value in bucket.state_dict().items()}
            for bucket in strategy._buckets]


def optimizer_summary(optimizer: torch.optim.Optimizer) -> dict:
    """The learning rate (the schedule's state) and every parameter's optimizer state, copied."""
    return {"lr": optimizer.param_groups[0]["lr"],
            "state": {index: {key: value.clone() if torch.is_tensor(value) else value for key, value in state.items()}
                      for index, state in optimizer.state_dict()["state"].items()}}


LOCAL_RANK = int(os.environ.get("LOCAL_RANK", 0))


def fingerprint(batch) -> str:
    """A digest of a batch's inputs: equal for the same samples in the same order only."""
    return hashlib.sha256(batch[0].contiguous().numpy().tobytes()).hexdigest()


def epoch_orders(trainer: L.Trainer, epochs: set[int]) -> dict[int, list[str]]:
    """Every batch of this job's train loader (its shard) in each of ``epochs``, as fingerprints in order: what an
    epoch read whole from its start gives (the loader's sampler set to each epoch)."""
    loader = trainer.train_dataloader
    orders = {}
    for epoch in sorted(epochs):
        loader.sampler.set_epoch(epoch)
        orders[epoch] = [fingerprint(batch) for batch in loader]
    return orders


def fail_first_heal() -> None:
    """The checkpoint transport raises on this process's first transfer of a peer's state."""
    from lightning_dist.comm.peer_state import AuthenticatedStateTransport

    receive, calls = AuthenticatedStateTransport.recv_checkpoint, []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # as the transfer fails: after the transport marked the group as being healed
            self._on_receive()
            raise ConnectionError("injected: the peer's state did not arrive")
        return receive(self, *args, **kwargs)

    AuthenticatedStateTransport.recv_checkpoint = failing


def fail_first_fetch() -> None:
    """This process's first fetch of a peer's committed state fails (as when the peer is lost before it is sent)."""
    from concurrent.futures import Future

    from lightning_dist.comm.peer_state import AuthenticatedStateTransport

    fetch, calls = AuthenticatedStateTransport.fetch_committed, []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            return fetch(self, *args, **kwargs)
        failed = Future()
        failed.set_exception(ConnectionError("injected: the peer's committed state did not arrive"))
        return failed

    AuthenticatedStateTransport.fetch_committed = failing


def wait_for(condition, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout} s for {what}")
        time.sleep(0.05)


def after_manager(strategy: PeriodicAveragingStrategy, then) -> None:
    """Call ``then()`` once this rank's torchft Manager exists (it heartbeats to the Lighthouse from then on)."""
    make = strategy.replica_group_hierarchy

    def made():
        hierarchy = make()
        then()
        return hierarchy

    strategy.replica_group_hierarchy = made


def wait_for_others(barrier: Path, job: str, jobs: int) -> None:
    """Mark this rank of ``job`` at ``barrier`` and wait for every rank of the ``jobs`` jobs to have marked it."""
    barrier.mkdir(parents=True, exist_ok=True)
    (barrier / f"{job}_{os.environ['LOCAL_RANK']}").touch()
    ranks = int(os.environ["LOCAL_WORLD_SIZE"])
    wait_for(lambda: len(list(barrier.iterdir())) >= jobs * ranks, f"the other groups at {barrier}")
    time.sleep(0.5)  # the others' heartbeats reach the Lighthouse (every 100 ms)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    plain = spec.get("plain", False)
    group = int(os.environ["GROUP_RANK"]) if plain else int(sys.argv[2])
    restart = len(sys.argv) > 3
    torch.set_num_threads(1)
    averaging.AVERAGE_BUCKET = spec.get("bucket", averaging.AVERAGE_BUCKET)
    out = Path(spec["out"]) / spec["name"]
    out.mkdir(parents=True, exist_ok=True)
    kills = spec.get("kill") or []
    kills = [kills] if isinstance(kills, dict) else kills  # one failure, or a list of them (one per group)
    kill = None if restart else next((kill for kill in kills if kill["group"] == group), None)
    restarted_mark = Path(spec["out"]) / f"{spec['name']}_restarted{group}"
    if restart and "copy_secret" in spec and sys.argv[3] == "copy":  # the copy is another run's group
        os.environ[SECRET_ENV] = spec["copy_secret"]
    if restart and spec.get("copy_after_setup") and sys.argv[3] == "copy":
        wait_for(lambda: all((Path(spec["out"]) / f"{spec['name']}_setup{other}").exists()
                             for other in range(spec["groups"])), "every group's set-up")

    L.seed_everything(0, workers=True, verbose=False)
    if spec.get("model") == "cnn":
        datamodule, model = DigitsImages(batch_size=16), DigitsCNN()
    else:
        datamodule = DigitsDataModule(batch_size=16)
        model = MLPClassifier(num_features=datamodule.num_features, num_classes=datamodule.num_classes, hidden_size=32,
                              momentum=spec.get("momentum", 0.0))
    kwargs = dict(spec.get("strategy", {}))
    if kwargs.pop("diloco", False):
        kwargs["outer_optimizer"] = diloco_outer_optimizer
    if plain:
        strategy = PeriodicAveragingStrategy(**kwargs)
        windows = []
    else:
        option = TorchFT(num_replica_groups=spec["groups"], min_replicas=spec.get("min_replicas", 1),
                         replica_group=group, lighthouse=spec["lighthouse"], max_retries=spec.get("max_retries", 10),
                         timeout=timedelta(seconds=spec.get("timeout", 30)),
                         quorum_timeout=timedelta(seconds=120))
        strategy = PeriodicAveragingStrategy(fault_tolerance=option, **kwargs)
        windows = record_windows(strategy, kill, restarted_mark if restart else None,
                                 None if restart else Path(spec["out"]) / f"{spec['name']}_setup{group}")
        failing = spec.get("heal_fails")
        if restart and (failing is True or int(os.environ["LOCAL_RANK"]) in (failing or ())):
            fail_first_heal()
        if restart and spec.get("fetch_fails"):
            fail_first_fetch()
        if spec.get("start_barrier") and (not restart or spec.get("copy_in_barrier") and sys.argv[3] == "copy"):
            job, jobs = f"{group}{sys.argv[3] if restart else ''}", spec["groups"] + bool(spec.get("copy_in_barrier"))
            after_manager(strategy, lambda: wait_for_others(Path(spec["out"]) / f"{spec['name']}_barrier", job, jobs))
    restarted_marks = [Path(spec["out"]) / f"{spec['name']}_restarted{other}" for other in spec.get("restarted", ())]
    holding = Path(spec["out"]) / f"{spec['name']}_holding"
    hold = ((spec["await_restart"], restarted_marks, spec.get("hold_s", 0.0), holding)
            if "await_restart" in spec and not restart and not kill else None)
    if restart and "await_restart" in spec:  # started at once, it would join before the others reach the step
        wait_for(holding.exists, f"a group holding at step {spec['await_restart']} ({holding})")
    if restart and spec.get("restart_after_end"):  # started again once every other group's job has ended its fit
        wait_for(lambda: all((out / f"group{other}_rank0.pt").exists() for other in range(spec["groups"])
                             if other != group), "the other groups' results")
    record = Record(group, kill.get("step") if kill else None, spec.get("step_sleep", 0.0), hold)
    callbacks: list[Callback] = [record]
    if spec.get("checkpoint"):  # every group its own file at every epoch's end, or every N steps
        every = ({"every_n_train_steps": spec["checkpoint"]} if type(spec["checkpoint"]) is int
                 else {"every_n_epochs": 1})
        callbacks.append(ModelCheckpoint(dirpath=out / f"ckpt_group{group}", save_top_k=-1, filename="{epoch}-{step}",
                                         **every))
    ckpt_path = None
    if restart and spec.get("restart_from_last"):  # the group's newest file, as a restarted job with ckpt_path=last
        files = (out / f"ckpt_group{group}").glob("*.ckpt")
        ckpt_path = str(max(files, key=lambda path: int(path.stem.rsplit("step=", 1)[1])))
    if spec.get("resume_from"):
        written = f"*-step={spec['resume_step']}.ckpt" if "resume_step" in spec else "epoch=0-*.ckpt"
        ckpt_path = str(next((Path(spec["out"]) / spec["resume_from"] / f"ckpt_group{group}").glob(written)))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                        num_nodes=spec["groups"] if plain else 1,
                        max_steps=spec["max_steps"], callbacks=callbacks, logger=False,
                        enable_checkpointing=bool(spec.get("checkpoint")),
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=spec.get("val_batches", 0), deterministic=True)
    started = time.monotonic()
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    suffix = "_restart" if restart else ""
    torch.save({"windows": windows, "after_step": record.after_step, "final": strategy.model_vector.get(),
                "start": record.start, "start_anchor": record.anchor,
                "start_optimizer": record.optimizer, "start_step": record.start_step,
                "global_step": trainer.global_step, "fit_s": time.monotonic() - started, "comm": strategy.comm.stats,
                "syncs": strategy._syncs, "ckpt_path": ckpt_path, "batches": record.batches,
                "epoch_orders": epoch_orders(trainer, {epoch for epoch, _, _ in record.batches}),
                "metrics": strategy.protocol_metrics()},
               out / f"group{group}_rank{os.environ['LOCAL_RANK']}{suffix}.pt")


if __name__ == "__main__":
    main()
