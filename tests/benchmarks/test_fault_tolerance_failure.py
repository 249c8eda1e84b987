"""``benchmarks/fault_tolerance/failure.py``'s bookkeeping on hand-written journals: where the kill falls, the work
it loses with the option and under a torchrun restart, and the rejoin's timeline and bytes."""

import subprocess
import time

from benchmarks.fault_tolerance.failure import (DILOCO_PERIOD, GROUPS, KILL_STEPS, draw_kill, healed_after,
                                                restart_record, wait_groups)
from benchmarks.fault_tolerance.goodput import FULL, TARGET_AT, draw_kills, target_of


def event(kind, time, rx=0, **fields):
    return {"event": kind, "time": time, "tx": 0, "rx": rx, **fields}


def test_the_kill_is_seeded_and_falls_between_windows_after_the_first():
    kills = [draw_kill(seed) for seed in range(50)]
    assert kills == [draw_kill(seed) for seed in range(50)]
    assert all(KILL_STEPS[0] <= kill["step"] < KILL_STEPS[1] and kill["step"] % DILOCO_PERIOD for kill in kills)
    assert {kill["group"] for kill in kills} == set(range(GROUPS))


def test_with_the_option_the_killed_group_loses_its_steps_since_its_last_commit_and_rejoins_later():
    victim = [event("up", 0.0), event("window", 10.0, began=9.0, step=50, committed=True),
              event("window", 20.0, began=19.0, step=100, committed=False), event("kill", 25.0, step=109)]
    survivor = [event("window", 20.0, began=19.0, step=100, committed=True),
                event("window", 41.0, began=38.0, step=150, committed=True),
                event("window", 54.0, began=50.0, step=200, committed=True),
                event("window", 66.0, began=61.0, step=250, committed=True)]
    returned = [event("up", 25.5, rx=1000), event("joined", 40.0, rx=28_001_000),
                event("train_start", 40.1, rx=28_001_000, step=150), event("step", 40.5, rx=35_000_000, step=151),
                event("window", 54.5, began=53.0, step=200, committed=True)]
    launch = {"way": "restarted", "kill": {"group": 3, "step": 109},
              "journals": {"0.0": survivor, "3.0": victim, "3.1": returned}}
    record = restart_record(launch)
    # The window at step 100 was not committed, so the work lost goes back to the commit at step 50.
    assert record["steps_lost"] == 109 - 50
    assert record["survivor_windows_discarded"] == 0
    assert record["up_after_kill_s"] == 0.5 and record["training_after_kill_s"] == 15.5
    assert record["training_after_up_s"] == 15.0 and record["joined_after_up_s"] == 14.5
    assert record["joined_at_step"] == 150 and record["recovery_received_bytes"] == 28_000_000
    # The survivors' window where it was healed (step 150) and where it caught up (200), against their others
    # after the first (steps 100 and 250: 1 s and 5 s); it contributes from the end of its catch-up window.
    assert (record["heal_window_s"], record["catch_up_window_s"]) == (3.0, 4.0)
    assert record["other_windows_median_s"] == 3.0 and record["contributing_after_kill_s"] == 29.5


def test_a_torchrun_restart_redoes_every_groups_steps_since_the_checkpoint():
    first = {f"{group}.0": [event("train_start", 0.0, step=0)] for group in range(GROUPS)}
    first["2.0"].append(event("kill", 30.0, step=66))
    again = {f"{group}.1": [event("up", 33.0), event("train_start", 50.0, step=50), event("step", 51.0, step=51)]
             for group in range(GROUPS)}
    launch = {"way": "torchrun_restart", "kill": {"group": 2, "step": 66}, "journals": {**first, **again}}
    record = restart_record(launch)
    assert record["resumed_step"] == 50 and record["steps_lost"] == GROUPS * (66 - 50)
    assert record["training_after_kill_s"] == 21.0


def test_no_kill_no_record():
    assert restart_record({"way": "no_failure", "kill": None, "journals": {}}) is None


def test_goodputs_kills_are_seeded_one_a_minute_and_its_target_is_the_no_failure_runs_loss_late_in_its_run():
    kills = draw_kills(0, FULL)
    assert kills == draw_kills(0, FULL) and [kill["after"] for kill in kills] == [60.0 * (i + 1) for i in range(10)]
    assert {kill["group"] for seed in range(5) for kill in draw_kills(seed, FULL)} == set(range(GROUPS))
    curve = [{"seconds": float(second), "val_loss": 5.0 - second / 100} for second in range(0, 201, 10)]
    assert TARGET_AT == 0.8 and target_of(curve) == 5.0 - 160 / 100


def test_a_group_joining_a_run_in_progress_counts_in_the_curve_from_the_end_of_its_heal_window():
    at = [{"event": "up", "time": 0.0}, {"event": "window", "time": 5.0, "step": 0}]
    joiner = at + [{"event": "joined", "time": 5.0, "step": 0}, {"event": "train_start", "time": 5.1, "step": 200},
                   {"event": "snapshot", "time": 6.0}, {"event": "window", "time": 12.0, "step": 250}]
    assert healed_after(joiner) == 12.0  # its copies while it trains from its start model are left out
    fresh = at + [{"event": "joined", "time": 5.0, "step": 0}, {"event": "train_start", "time": 5.1, "step": 0}]
    assert healed_after(fresh) == 0.0  # a group of a fresh run holds the run's state from the start
    restarted_by_torchrun = at + [{"event": "train_start", "time": 5.1, "step": 200}]
    assert healed_after(restarted_by_torchrun) == 0.0  # resumed from its checkpoint: no heal
    assert healed_after(joiner[:-1]) == float("inf")  # still healing when the run ended


def test_a_straggling_first_group_is_stopped_once_another_group_has_ended():
    """Every group is polled: a group 0 still waiting (as one restarted after the others' end does) is stopped
    ``straggler_s`` after group 1's clean end, not at the launch's timeout."""
    groups = [subprocess.Popen(["sleep", "60"]), subprocess.Popen(["true"])]
    began = time.monotonic()
    assert wait_groups(groups, timeout_s=60, straggler_s=1) == [None, 0]
    assert time.monotonic() - began < 10
