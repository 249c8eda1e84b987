"""``benchmarks/fault_tolerance/failure.py``'s bookkeeping on hand-written journals: where the kill falls, the work
it loses with the option and under a torchrun restart, and the rejoin's timeline and bytes."""

from benchmarks.fault_tolerance.failure import DILOCO_PERIOD, GROUPS, KILL_STEPS, draw_kill, restart_record


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
    survivor = [event("window", 20.0, began=19.0, step=100, committed=True)]
    returned = [event("up", 25.5, rx=1000), event("joined", 40.0, rx=28_001_000),
                event("train_start", 40.1, rx=28_001_000, step=150), event("step", 40.5, rx=35_000_000, step=151)]
    launch = {"way": "restarted", "kill": {"group": 3, "step": 109},
              "journals": {"0.0": survivor, "3.0": victim, "3.1": returned}}
    record = restart_record(launch)
    # The window at step 100 was not committed, so the work lost goes back to the commit at step 50.
    assert record["steps_lost"] == 109 - 50
    assert record["survivor_windows_discarded"] == 0
    assert record["up_after_kill_s"] == 0.5 and record["training_after_kill_s"] == 15.5
    assert record["training_after_up_s"] == 15.0 and record["joined_after_up_s"] == 14.5
    assert record["joined_at_step"] == 150 and record["recovery_received_bytes"] == 28_000_000


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
