"""Main job: dynamic vs periodic model averaging on MNIST-1D, 4 CPU processes, a minute or two.

    python examples/compare_averaging.py [--ranks 4] [--epochs 10]

Each strategy is one real multi-process Lightning fit, launched with torchrun over Gloo; the
script prints final validation accuracy and the bytes each strategy sent. The benchmark in
``benchmarks/averaging/run.py`` is the full study (8 ranks, several periods and thresholds).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

RUNS = {
    "periodic_avg (period=10)": ("PeriodicAveragingStrategy", {"period": 10}),
    "dynamic_avg (Delta=1.0, b=10)": ("DynamicAveragingStrategy", {"divergence_threshold": 1.0, "check_every": 10}),
}


def worker(spec_path: str) -> None:
    """One rank of one fit (run by torchrun)."""
    import lightning as L

    import lightning_dist
    from lightning_dist.data.datamodules import MNIST1DDataModule
    from lightning_dist.models import MLPClassifier

    spec = json.loads(Path(spec_path).read_text())
    L.seed_everything(0, verbose=False)
    datamodule = MNIST1DDataModule(num_samples=4000, batch_size=32, partition="iid", seed=0)
    model = MLPClassifier(datamodule.num_features, datamodule.num_classes, hidden_size=64, learning_rate=0.05, momentum=0.9)
    strategy = getattr(lightning_dist, spec["class"])(**spec["kwargs"])
    trainer = L.Trainer(accelerator="cpu", devices=spec["ranks"], strategy=strategy, max_epochs=spec["epochs"],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=datamodule)
    (metrics,) = trainer.validate(model, datamodule=datamodule, verbose=False)
    stats = strategy.comm_stats
    if trainer.is_global_zero:
        Path(spec["out"]).write_text(json.dumps({"val_acc": metrics["val_acc"], "protocol_bytes": stats.protocol_bytes,
                                                 "bytes_sent": stats.bytes_sent, "syncs": stats.syncs}))


def launch(name: str, ranks: int, epochs: int, workdir: Path) -> dict:
    class_name, kwargs = RUNS[name]
    out = workdir / f"{class_name}.json"
    spec = workdir / f"{class_name}.spec.json"
    spec.write_text(json.dumps({"class": class_name, "kwargs": kwargs, "ranks": ranks, "epochs": epochs, "out": str(out)}))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
               f"--master_port={port}", __file__, "--worker", str(spec)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    print(f"MNIST-1D, MLP, {args.ranks} CPU processes (Gloo), {args.epochs} epochs, iid partitions")
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for name in RUNS:
            try:
                results[name] = launch(name, args.ranks, args.epochs, Path(workdir))
            except subprocess.CalledProcessError as error:
                sys.exit(f"{name} failed:\n{error.stderr[-4000:]}")
            print(f"  finished {name}")
    baseline = results[next(iter(RUNS))]["protocol_bytes"]
    print(f"\n{'strategy':32} {'val_acc':>8} {'protocol MB':>12} {'all MB':>8} {'syncs':>6} {'bytes vs periodic':>18}")
    for name, result in results.items():
        ratio = result["protocol_bytes"] / baseline
        print(f"{name:32} {result['val_acc']:8.4f} {result['protocol_bytes'] / 1e6:12.3f} "
              f"{result['bytes_sent'] / 1e6:8.3f} {result['syncs']:6d} {ratio:18.3f}")


if __name__ == "__main__":
    main()
