"""Checks of the protocols' parameters, shared by the strategies and the simulator's protocols.

Each raises a ValueError that names the parameter, its meaning and the allowed range, so a bad
value fails the same way whether it reaches a Trainer or a simulation.
"""

from __future__ import annotations

import functools
import importlib
import math
import numbers
from collections.abc import Mapping

from torch.optim import Optimizer

from lightning_dist.algorithms.compression import CODECS, Codec
from lightning_dist.algorithms.sparse_compression import SparseCodec
from lightning_dist.algorithms.outer import OuterOptimizerFactory


def check_count(name: str, value: object, minimum: int, maximum: int | None = None, meaning: str = "") -> int:
    """An integer (Python's or NumPy's) in ``[minimum, maximum]`` (no upper bound when ``maximum`` is None).

    ``meaning`` is appended to the message as given, e.g. ``" (gossip needs a peer)"``.
    """
    # bool is an int subclass; True as a count is a bug, not a request for one.
    integer = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not integer or value < minimum or (maximum is not None and value > maximum):  # type: ignore[operator]
        allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an integer {allowed}{meaning}; got {value!r}")
    return int(value)  # type: ignore[call-overload]


def check_number(name: str, value: object, minimum: float, strict: bool, meaning: str = "") -> float:
    """A finite real number ``> minimum`` (``strict``) or ``>= minimum``; ``meaning`` as in :func:`check_count`."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not real or (value <= minimum if strict else value < minimum):  # type: ignore[operator]
        bound = ">" if strict else ">="
        raise ValueError(f"{name} must be a finite number {bound} {minimum:g}{meaning}; got {value!r}")
    return float(value)  # type: ignore[arg-type]


def check_steps(name: str, value: object, meaning: str) -> int:
    """An integer ``>= 1`` (a count of optimizer steps, segments, replicas, ...)."""
    return check_count(name, value, 1, meaning=f" ({meaning})")


def check_divergence_threshold(value: object) -> float:
    """Paper 004's ``Delta``: a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(
            "divergence_threshold must be None (measured in the run) or a finite number > 0 (squared L2 distance); "
            f"got {value!r}"
        )
    return float(value)


def check_dynamic_schedule(
    divergence_threshold: object, check_every: object, calibration_steps: object
) -> tuple[float | None, int, int]:
    """Dynamic averaging's ``Delta`` (None: calibrated in the run), ``b`` and the calibration window.

    With the threshold to be measured, ``calibration_steps`` must be a multiple of ``check_every``:
    the threshold is measured at a check. A set threshold does not use it (so ``check_every=3`` with
    a set threshold needs no ``calibration_steps``).
    """
    threshold = None if divergence_threshold is None else check_divergence_threshold(divergence_threshold)
    check_every = check_steps("check_every", check_every, "optimizer steps between local-condition checks")
    calibration_steps = check_steps(
        "calibration_steps", calibration_steps, "local steps whose drift sets the threshold when it is None"
    )
    if threshold is None and calibration_steps % check_every:
        raise ValueError(
            f"calibration_steps must be a multiple of check_every={check_every} (the drift is measured at a check); "
            f"got {calibration_steps}"
        )
    return threshold, check_every, calibration_steps


def check_sync_overhead(value: object) -> float | None:
    """The share of computing time a synchronization may cost when ``Delta`` is measured: None or a number > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(
            "sync_overhead must be None (Delta is the drift after calibration_steps) or a finite number > 0 (the "
            f"largest share of computing time a full synchronization may cost); got {value!r}"
        )
    return float(value)


def check_client_fraction(value: object) -> float:
    """FedAvg's ``C``: a number in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and 0 < value <= 1):
        raise ValueError(f"client_fraction must lie in (0, 1]; got {value!r}")
    return float(value)


def check_option(name: str, value: object, options: tuple[str, ...], meaning: str) -> str | None:
    """``value`` if it is None or one of ``options``; else a ValueError naming ``name``, the options and ``meaning``."""
    if value is not None and value not in options:
        raise ValueError(
            f"{name} must be None or one of {', '.join(repr(option) for option in options)} ({meaning}); got {value!r}"
        )
    return value  # type: ignore[return-value]


def check_compression(value: object, sparse_unsupported: str | None = None) -> Codec | None:
    """``compression``: None (models travel in their dtype), one of :data:`~lightning_dist.algorithms.compression.CODECS`
    or a :class:`~lightning_dist.algorithms.sparse_compression.SparseCodec`; ``sparse_unsupported``: what refuses the
    latter, named in the error (None: it is taken)."""
    if isinstance(value, SparseCodec):
        if sparse_unsupported is not None:
            raise ValueError(f"compression={value!r} is not built for {sparse_unsupported} yet; use 'int8' or 'bf16'")
        return value
    return check_option("compression", value, CODECS,
                        "what a full synchronization sends: the model delta in that format, with error feedback; or a "
                        "lightning_dist.algorithms.sparse_compression.SparseCodec")


HIERARCHIES = ("node",)


def check_hierarchy(value: object) -> str | None:
    """``hierarchy``: None (every rank a learner) or ``"node"`` (one learner per node)."""
    return check_option("hierarchy", value, HIERARCHIES,
                        "None: every rank is a learner; 'node': DDP inside each node, the protocol between nodes")


def check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False; got {value!r}")
    return value


def check_outer_optimizer(value: object, client_fraction: float = 1.0) -> OuterOptimizerFactory | None:
    """DiLoCo's ``outer_optimizer`` (:mod:`lightning_dist.algorithms.outer`): None, a callable that
    builds a ``torch.optim.Optimizer`` from a list of tensors, the import path of one (a string such
    as ``"lightning_dist.algorithms.outer.diloco_outer_optimizer"``), or ``{"class_path": ...,
    "init_args": {...}}`` naming an Optimizer class (the form a LightningCLI YAML uses; the
    simulator's config passes it as a plain mapping). Returns the factory, or None.

    Refused with ``client_fraction < 1`` (FedAvg): the outer gradient ``reference - mean`` assumes every
    averaged replica started the round from the reference model, and FedAvg's non-participants keep
    training their own models, so a round's participants did not (their earlier local progress would
    be counted again as this round's update).
    """
    value = _from_namespace(value)
    if value is None:
        return None
    if isinstance(value, str):
        value = _import("outer_optimizer", value)
    elif isinstance(value, Mapping):
        unknown = set(value) - {"class_path", "init_args"}
        class_path, init_args = value.get("class_path"), value.get("init_args", {})
        if unknown or not isinstance(class_path, str) or not isinstance(init_args, Mapping) or "params" in init_args:
            raise ValueError(
                "outer_optimizer as a mapping must be {'class_path': 'module.OptimizerClass', 'init_args': {...}} "
                f"(without params: the outer step passes its reference tensor); got {dict(value)!r}"
            )
        optimizer_class = _import("outer_optimizer's class_path", class_path)
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise ValueError(
                f"outer_optimizer's class_path must name a torch.optim.Optimizer subclass; got {class_path!r}"
            )
        value = functools.partial(optimizer_class, **init_args)
    if not callable(value):
        raise ValueError(
            "outer_optimizer must be None, a callable building a torch.optim.Optimizer from a list of tensors, or "
            f"{{'class_path': ..., 'init_args': ...}}; got {value!r}"
        )
    if client_fraction < 1:
        raise ValueError(
            f"outer_optimizer needs client_fraction=1 (got {client_fraction}): DiLoCo's outer gradient, the "
            "reference model minus the average, assumes every averaged replica started the round from the "
            "reference, and FedAvg's non-participants keep training their own models"
        )
    return value


def outer_optimizer_config(value: object) -> object:
    """``outer_optimizer`` as a config records it (JSON): an import path as given, a mapping as a plain dict,
    a callable by name."""
    value = _from_namespace(value)
    if isinstance(value, Mapping):
        return {key: dict(item) if isinstance(item, Mapping) else item for key, item in value.items()}
    if value is None or isinstance(value, str) or not callable(value):
        return value
    name = getattr(value, "__qualname__", None)
    return f"{value.__module__}.{name}" if name is not None else repr(value)


def _from_namespace(value: object) -> object:
    """A jsonargparse Namespace back to ``{class_path, init_args}``; anything else as it is.

    A simulator config's ``protocol`` is a ``dict[str, Any]``, in which jsonargparse resolves a
    ``class_path`` mapping into a Namespace of the class's arguments, with ``params`` (the tensors,
    which the outer step passes) filled with None; that entry is dropped.
    """
    if isinstance(value, Mapping) or not callable(getattr(value, "as_dict", None)):
        return value
    plain = value.as_dict()  # type: ignore[attr-defined]
    init_args = plain.get("init_args")
    if isinstance(init_args, Mapping) and "params" in init_args and init_args["params"] is None:
        plain["init_args"] = {key: item for key, item in init_args.items() if key != "params"}
    return plain


def _import(name: str, path: str) -> object:
    """The object at dotted import path ``path`` (``module.attribute``); a ValueError naming ``name`` otherwise."""
    module_name, _, attribute = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"{name} {path!r} cannot be imported: {error}") from error
