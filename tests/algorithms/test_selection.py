"""Paper 000's instance selectors and the loss history, checked in one process against hand-computed cases."""

import math

import numpy as np
import pytest
import torch

from lightning_dist.algorithms.selection import (
    SELECTORS,
    LossHistory,
    active_bias_weights,
    merge_histories,
    select_active_bias,
    select_hem,
    select_random,
    select_records,
    select_spl,
    spl_threshold,
)

NAN = float("nan")


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def mask(n: int, true=None) -> torch.Tensor:
    out = torch.zeros(n, dtype=torch.bool)
    out[list(range(n)) if true is None else list(true)] = True
    return out


def history_from(rows: list[list[float]]) -> LossHistory:
    """rows[e][i] = loss of record i in epoch e (NaN: not read that epoch)."""
    history = LossHistory(len(rows[0]))
    for row in rows:
        losses = torch.tensor(row)
        seen = torch.nonzero(~torch.isnan(losses)).reshape(-1)
        history.record(seen, losses[seen])
        history.end_epoch()
    return history


# ----------------------------------------------------------------------------- loss history


def test_history_keeps_latest_loss_and_per_epoch_statistics_by_hand():
    history = LossHistory(4)
    history.record(torch.tensor([0, 2]), torch.tensor([1.0, 3.0]))
    history.record(torch.tensor([0]), torch.tensor([2.0]))  # read twice in epoch 0: the last loss counts
    history.end_epoch()
    history.record(torch.tensor([0, 2, 3]), torch.tensor([4.0, 3.0, 1.0]))
    history.end_epoch()
    assert torch.equal(history.visits, torch.tensor([3, 0, 2, 1]))
    assert torch.equal(history.epochs_recorded, torch.tensor([2, 0, 2, 1]))
    assert history.latest[[0, 2, 3]].tolist() == [4.0, 3.0, 1.0] and math.isnan(history.latest[1])
    # record 0: epochs (2, 4) -> mean 3, population variance 1; record 2: (3, 3) -> 0; record 3: one epoch -> 0
    assert history.mean[[0, 2, 3]].tolist() == [3.0, 3.0, 1.0]
    assert history.variance().tolist() == [1.0, 0.0, 0.0, 0.0]
    assert torch.equal(history.seen, torch.tensor([True, False, True, True]))
    assert history.epochs_completed == 2


def test_history_repeated_index_in_one_batch_keeps_the_last_and_counts_both():
    history = LossHistory(3)
    history.record(torch.tensor([1, 2, 1]), torch.tensor([5.0, 6.0, 7.0]))
    assert history.latest[1] == 7.0 and history.visits[1] == 2


def test_history_variance_matches_numpy_on_a_ragged_history():
    rows = [[1.0, 2.0, 3.0, 4.0], [2.0, 2.0, 3.0, NAN], [3.0, 2.0, 5.0, 1.0], [0.5, NAN, 1.0, 2.0]]
    history = history_from(rows)
    expected = np.nanvar(np.array(rows, dtype=np.float64), axis=0)
    assert torch.allclose(history.variance(), torch.from_numpy(expected), rtol=0, atol=1e-12)


def test_history_state_round_trip_and_bad_input():
    history = history_from([[1.0, NAN], [2.0, 3.0]])
    restored = LossHistory(2)
    restored.load_state_dict(history.state_dict())
    for name in ("visits", "epochs_recorded", "mean"):
        assert torch.equal(getattr(restored, name), getattr(history, name))
    assert torch.equal(restored.variance(), history.variance()) and restored.epochs_completed == 2
    with pytest.raises(ValueError, match="same training dataset"):
        LossHistory(3).load_state_dict(history.state_dict())
    with pytest.raises(ValueError, match="indices"):
        history.record(torch.tensor([2]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="one entry per index"):
        history.record(torch.tensor([0, 1]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="num_records"):
        LossHistory(0)


def test_merged_history_keeps_a_record_held_once_unchanged_and_combines_one_held_twice():
    """Rank A trained records 0 and 2 in epochs 0-1, rank B records 1 and 2 in epochs 2-4 (a reshuffling
    sampler), and B is stopped mid-epoch 5 having read record 1 again. The merge for records {0, 2, 3}: record 0
    is A's, bit for bit; record 2's statistics are those of its five per-epoch losses taken together
    (numpy's mean and population variance), its visits add up and its latest loss is B's (more visits);
    record 1 (B's, outside the records) and record 3 (nobody's) are unseen."""
    a_rows = [[0.3, NAN, 2.0, NAN], [0.7, NAN, 1.0, NAN]]
    b_rows = [[NAN, 5.0, 4.0, NAN], [NAN, 4.0, 8.0, NAN], [NAN, 3.0, 7.5, NAN]]
    a, b = history_from(a_rows), LossHistory(4)
    for _ in range(2):
        b.end_epoch()  # B's first two epochs read other records
    for row in b_rows:
        b.record(torch.tensor([1, 2]), torch.tensor(row[1:3]))
        b.end_epoch()
    b.record(torch.tensor([1]), torch.tensor([2.5]))
    merged = merge_histories([a, b], records=torch.tensor([0, 2, 3]))
    assert merged.mean[0] == a.mean[0] and merged.variance()[0] == a.variance()[0] and merged.latest[0] == 0.7
    record_2 = np.array([2.0, 1.0, 4.0, 8.0, 7.5])
    assert merged.mean[2].item() == pytest.approx(record_2.mean(), rel=1e-15)
    assert merged.variance()[2].item() == pytest.approx(record_2.var(), rel=1e-14)
    assert merged.epochs_recorded.tolist() == [2, 0, 5, 0] and merged.visits.tolist() == [2, 0, 5, 0]
    assert merged.latest[2] == 7.5 and all(math.isnan(merged.latest[i]) for i in (1, 3))
    assert merged.epochs_completed == 5 and torch.equal(merged.seen, torch.tensor([True, False, True, False]))
    # All records kept: B's loss of record 1 in its unfinished epoch goes on into the epoch's end.
    everything = merge_histories([a, b])
    everything.end_epoch()
    assert everything.epochs_recorded[1] == 4 and everything.mean[1].item() == pytest.approx(np.mean([5, 4, 3, 2.5]))
    with pytest.raises(ValueError, match="same dataset"):
        merge_histories([a, LossHistory(5)])


# ----------------------------------------------------------------------------- random


def test_random_picks_k_distinct_eligible_records_reproducibly():
    eligible = mask(10, [1, 3, 4, 7, 9])
    picked = select_random(eligible, 3, gen(1))
    assert len(set(picked.tolist())) == 3 and set(picked.tolist()) <= {1, 3, 4, 7, 9}
    assert torch.equal(picked, select_random(eligible, 3, gen(1)))
    assert sorted(select_random(eligible, 5, gen(2)).tolist()) == [1, 3, 4, 7, 9]
    # Uniform: over many draws every eligible record is picked about 3/5 of the time.
    counts = torch.zeros(10)
    g = gen(3)
    for _ in range(2000):
        counts[select_random(eligible, 3, g)] += 1
    assert torch.allclose(counts[[1, 3, 4, 7, 9]] / 2000, torch.full((5,), 0.6), atol=0.05)
    assert counts[[0, 2, 5, 6, 8]].sum() == 0


@pytest.mark.parametrize("k", [0, 6, 2.0, True])
def test_k_outside_the_eligible_range_is_refused(k):
    with pytest.raises(ValueError, match="k must be an integer with 1 <= k <= 5"):
        select_random(mask(10, range(5)), k, gen())


# ----------------------------------------------------------------------------- HEM


def test_hem_picks_exactly_the_top_k_deterministically():
    latest = torch.tensor([0.5, NAN, 2.0, 0.05, 3.0, 1.0, 2.0])
    eligible = mask(7)
    assert select_hem(latest, eligible, 3).tolist() == [4, 2, 6]  # ties (2.0, 2.0): lower index first
    assert select_hem(latest, mask(7, [0, 1, 3, 5]), 2).tolist() == [5, 0]  # ineligible records never picked
    # Records without a loss come after every recorded one, by index.
    assert select_hem(latest, eligible, 7).tolist() == [4, 2, 6, 5, 0, 3, 1]
    assert torch.equal(select_hem(latest, eligible, 4, gen(0)), select_hem(latest, eligible, 4, gen(99)))


# ----------------------------------------------------------------------------- SPL


def test_spl_threshold_starts_at_0_1_and_grows_by_1_2_per_epoch():
    assert spl_threshold(0) == pytest.approx(0.1)
    assert spl_threshold(1) == pytest.approx(0.12)
    assert spl_threshold(3) == pytest.approx(0.1 * 1.2**3)
    assert spl_threshold(2, initial=1.0, growth=2.0) == 4.0
    with pytest.raises(ValueError, match="epoch"):
        spl_threshold(-1)


def test_spl_never_picks_above_the_threshold_when_enough_records_are_below():
    latest = torch.tensor([0.09, 0.5, 0.01, 0.2, 0.05, 0.3, 0.07, NAN])
    below = {0, 2, 4, 6}
    g = gen(0)
    for _ in range(200):
        picked = select_spl(latest, mask(8), 3, 0.1, g).tolist()
        assert len(set(picked)) == 3 and set(picked) <= below
    assert set(select_spl(latest, mask(8), 4, 0.1, g).tolist()) == below


def test_spl_samples_candidates_proportionally_to_their_loss():
    latest = torch.tensor([0.08, 0.02, 0.5])  # candidates 0 and 1 with weights 0.8 : 0.2
    g = gen(1)
    first = torch.tensor([select_spl(latest, mask(3), 1, 0.1, g).item() for _ in range(3000)])
    assert (first == 0).float().mean() == pytest.approx(0.8, abs=0.03)
    assert not (first == 2).any()


def test_spl_with_fewer_candidates_than_k_takes_them_all_and_tops_up_at_random():
    # The reference implementation crashed here (0 < candidates < k).
    latest = torch.tensor([0.05, 0.5, 0.6, 0.0, 0.9, NAN])  # candidates: 0 and 3 (loss 0.0: weight 0)
    for seed in range(20):
        picked = select_spl(latest, mask(6), 4, 0.1, gen(seed)).tolist()
        assert len(set(picked)) == 4 and {0, 3} <= set(picked)


def test_spl_without_candidates_is_random_selection():
    latest = torch.full((6,), NAN)
    assert torch.equal(select_spl(latest, mask(6), 3, 0.1, gen(5)), select_random(mask(6), 3, gen(5)))
    above = torch.full((6,), 2.0)
    assert len(set(select_spl(above, mask(6), 3, 0.1, gen(5)).tolist())) == 3


# ----------------------------------------------------------------------------- Active Bias


def test_active_bias_weights_equal_the_formula_on_a_tiny_history():
    rows = [[1.0, 2.0, 3.0, 4.0], [2.0, 2.0, 3.0, NAN], [4.0, 2.0, 5.0, 1.0]]
    history = history_from(rows)
    weights = active_bias_weights(history.variance(), history.epochs_recorded)
    # By hand: record 0 has losses (1, 2, 4): mean 7/3, var = ((4/3)^2 + (1/3)^2 + (5/3)^2) / 3 = 14/9, c = 3.
    var0 = 14 / 9
    assert weights[0].item() == pytest.approx(math.sqrt(var0 + var0**2 / 3))
    assert weights[1].item() == 0.0  # constant loss: no variance
    array = np.array(rows)
    for i in range(4):
        column = array[:, i][~np.isnan(array[:, i])]
        var, c = column.var(), len(column)
        assert weights[i].item() == pytest.approx(math.sqrt(var + var**2 / c))
    assert active_bias_weights(torch.tensor([0.5]), torch.tensor([0])).item() == 0.0  # no epoch recorded


def test_active_bias_samples_proportionally_to_the_weights():
    weights = torch.tensor([3.0, 1.0, 0.0, 0.0])
    g = gen(2)
    first = torch.tensor([select_active_bias(weights, mask(4), 1, g).item() for _ in range(3000)])
    assert (first == 0).float().mean() == pytest.approx(0.75, abs=0.03)
    assert set(first.tolist()) == {0, 1}


def test_active_bias_tops_up_with_random_indices_when_too_few_weights_are_positive():
    # The reference implementation topped up with weight values instead of record indices.
    weights = torch.tensor([0.0, 2.5, 0.0, 0.0, 7.0, 0.0, 0.0, 0.0])
    eligible = mask(8, [0, 1, 2, 3, 4, 5])
    for seed in range(20):
        picked = select_active_bias(weights, eligible, 4, gen(seed))
        assert picked.dtype == torch.int64 and len(set(picked.tolist())) == 4
        assert {1, 4} <= set(picked.tolist()) <= {0, 1, 2, 3, 4, 5}


def test_active_bias_falls_back_to_random_until_two_epochs_are_recorded():
    history = history_from([[1.0, 2.0, 3.0, 4.0, 5.0]])
    assert torch.equal(select_records("active_bias", history, mask(5), 3, gen(4)), select_random(mask(5), 3, gen(4)))


# ----------------------------------------------------------------------------- dispatch


def test_select_records_dispatches_every_selector_and_uses_the_epoch_threshold():
    history = history_from([[0.09, 0.15, 2.0, 0.11], [0.05, 0.11, 2.0, 0.13]])  # 2 epochs: SPL lambda = 0.12
    for selector in SELECTORS:
        picked = select_records(selector, history, mask(4), 2, gen(0))
        assert len(set(picked.tolist())) == 2
    assert select_records("hem", history, mask(4), 1, gen(0)).tolist() == [2]
    assert set(select_records("spl", history, mask(4), 2, gen(0)).tolist()) == {0, 1}  # 0.05, 0.11 < 0.12
    loose = select_records("spl", history, mask(4), 2, gen(0), spl_initial=0.2, spl_growth=1.0)
    assert set(loose.tolist()) <= {0, 1, 3}
    assert 0 in select_records("spl", history, mask(4), 2, gen(0), spl_initial=0.06, spl_growth=1.0).tolist()
    with pytest.raises(ValueError, match="selector must be one of"):
        select_records("easy", history, mask(4), 2, gen(0))
