"""CTR data (synthetic generator, Criteo reader, batches) and CTR metrics.

The Criteo files here are written in the exact released format: 40 tab-separated fields
(label, I1-I13, C1-C26 as 8-character hex), empty fields for missing values, plain or gzip.
scikit-learn is the oracle for AUC and log loss.

One module, though past 400 lines: the tests of the CTR data path (ps_train/workloads/ctr/, ctr_metrics)
kept together. Its four sections are independent: the next one to grow moves to a module of
its own.
"""

import gzip
import logging
import math
import os
import tracemalloc

import numpy as np
import pytest
import torch
from sklearn.metrics import log_loss as sk_log_loss
from sklearn.metrics import roc_auc_score

from ps_train.workloads.ctr.data import (
    CriteoFormatError,
    CtrBatchIterator,
    CtrSplit,
    SyntheticCtr,
    find_criteo_files,
    iter_ctr_eval_batches,
    load_criteo,
    read_criteo,
    synthetic_ctr,
    time_split,
)
from ps_train.workloads.ctr.metrics import auc, ctr_metrics, format_ctr_metrics, log_loss

# ---------------------------------------------------------------- synthetic

SMALL = dict(num_dense=4, table_sizes=[20, 100, 400], zipf_alpha=1.05, test_fraction=0.3)


def _equal(a: CtrSplit, b: CtrSplit) -> bool:
    return (
        torch.equal(a.dense, b.dense)
        and torch.equal(a.ids, b.ids)
        and torch.equal(a.labels, b.labels)
        and a.table_sizes == b.table_sizes
    )


def test_synthetic_same_seed_same_data_other_seed_other_data():
    a_train, a_test, a_best = synthetic_ctr(3000, seed=7, **SMALL)
    b_train, b_test, b_best = synthetic_ctr(3000, seed=7, **SMALL)
    assert _equal(a_train, b_train) and _equal(a_test, b_test) and a_best == b_best
    c_train, c_test, _ = synthetic_ctr(3000, seed=8, **SMALL)
    assert not torch.equal(a_train.ids, c_train.ids) and not torch.equal(a_train.dense, c_train.dense)
    assert (len(a_train), len(a_test)) == (2100, 900)
    assert a_train.dense.dtype == torch.float32 and a_train.ids.dtype == torch.int64
    assert a_train.labels.dtype == torch.float32 and a_train.table_sizes == [20, 100, 400]


def test_synthetic_sample_i_does_not_depend_on_num_samples():
    gen = SyntheticCtr(4, [20, 100, 400], 1.05, seed=3)
    d1, i1, y1, p1 = gen.generate(1000)
    d2, i2, y2, p2 = gen.generate(70_000)  # spans two generation chunks
    assert np.array_equal(d1, d2[:1000]) and np.array_equal(i1, i2[:1000]) and np.array_equal(y1, y2[:1000])
    assert np.array_equal(gen.probabilities(d2, i2), p2)


def test_synthetic_huge_tables_stay_in_bounds_without_table_sized_memory():
    sizes = [10_000_000, 40_000_000, 2**31 - 1, 3, 1]
    tracemalloc.start()  # NumPy reports its buffers to tracemalloc
    try:
        train, test, _ = synthetic_ctr(20_000, 2, sizes, 1.05, seed=1, test_fraction=0.25)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # A single int64 array over the smallest big table would be 80 MB.
    assert peak < 40e6, f"peak {peak / 1e6:.1f} MB"
    for split in (train, test):
        assert split.table_sizes == sizes
        assert (split.ids >= 0).all()
        assert (split.ids < torch.tensor(sizes)).all()
    assert (train.ids[:, 4] == 0).all()
    assert train.ids[:, 2].max() > 2**30  # ids really spread over a 2**31-row table


def test_synthetic_ids_follow_a_scattered_power_law():
    rows = 10_000_000
    gen = SyntheticCtr(1, [rows], 1.05, seed=5)
    _, ids, _, _ = gen.generate(50_000)
    values, counts = np.unique(ids[:, 0], return_counts=True)
    order = np.argsort(-counts)
    hot = gen.hot_rows(0, 100)
    # The most frequent row gets a few percent of all draws; uniform would give 1e-7.
    assert counts[order[0]] / len(ids) > 0.02
    assert values[order[0]] == hot[0]
    assert set(values[order[:3]]) == set(hot[:3])
    # Frequency falls with rank ...
    freq = [(ids[:, 0] == r).sum() for r in hot[:4]]
    assert freq == sorted(freq, reverse=True)
    # ... but the hot rows are not rows 0..k: they are spread over the whole table, so every
    # quarter (range sharding) and every residue mod 4 (modulo sharding) gets some of them.
    assert set(hot[:100] * 4 // rows) == {0, 1, 2, 3}
    assert set(hot[:100] % 4) == {0, 1, 2, 3}
    assert len(set(hot[:10]) & set(range(10))) <= 1
    # Uniform ids with alpha = 0: no row stands out.
    _, uni, _, _ = SyntheticCtr(1, [1000], 0.0, seed=5).generate(50_000)
    assert np.bincount(uni[:, 0], minlength=1000).max() < 3 * 50


def test_synthetic_positive_rate_and_best_auc_are_those_of_the_hidden_model():
    sizes = [1000, 100_000, 50, 3]
    train, test, best = synthetic_ctr(40_000, 13, sizes, 1.1, seed=11, test_fraction=0.25)
    for split in (train, test):
        assert 0.2 <= split.positive_rate() <= 0.3
    assert 0.6 < best < 0.95
    probs = SyntheticCtr(13, sizes, 1.1, seed=11).probabilities(test.dense, test.ids)
    assert auc(probs, test.labels) == pytest.approx(best, abs=1e-12)
    assert roc_auc_score(test.labels.numpy(), probs) == pytest.approx(best, abs=1e-12)
    # Labels are Bernoulli(probs): the mean probability matches the click rate.
    assert probs.mean() == pytest.approx(test.positive_rate(), abs=0.02)


def test_logistic_regression_gets_close_to_the_best_auc():
    torch.manual_seed(0)
    train, test, best = synthetic_ctr(30_000, seed=3, **SMALL)
    sizes = train.table_sizes
    offsets = torch.tensor([0] + sizes[:-1]).cumsum(0)
    # One learned bias per (table, row) plus a linear dense part: the hidden model's class.
    rows = torch.nn.Embedding(sum(sizes), 1)
    torch.nn.init.zeros_(rows.weight)
    dense = torch.nn.Linear(train.num_dense, 1)
    opt = torch.optim.Adam([*rows.parameters(), *dense.parameters()], lr=0.05)

    def logits(d, i):
        return dense(d).squeeze(1) + rows(i + offsets).sum(dim=(1, 2))

    it = CtrBatchIterator(train, rank=0, world=1, batch_size=512, seed=0)
    for _ in range(3 * it.steps_per_epoch):
        d, i, y = next(it)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits(d, i), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        probs = torch.sigmoid(torch.cat([logits(d, i) for d, i, _ in iter_ctr_eval_batches(test, 1000)]))
    m = ctr_metrics(probs, test.labels, best_auc=best)
    assert best - 0.05 < m["auc"] < best + 0.01, format_ctr_metrics(m)
    assert m["log_loss"] < m["base_log_loss"]


def test_synthetic_rejects_bad_settings():
    with pytest.raises(ValueError, match="test_fraction"):
        synthetic_ctr(100, 2, [10], 1.0, 0, 1.0)
    with pytest.raises(ValueError, match="table_sizes"):
        synthetic_ctr(100, 2, [0], 1.0, 0, 0.5)
    with pytest.raises(ValueError, match="table_sizes"):
        synthetic_ctr(100, 2, [2**31 + 1], 1.0, 0, 0.5)
    with pytest.raises(ValueError, match="zipf_alpha"):
        synthetic_ctr(100, 2, [10], -1.0, 0, 0.5)
    with pytest.raises(ValueError, match="at least one"):
        synthetic_ctr(100, 0, [], 1.0, 0, 0.5)


# ---------------------------------------------------------------- Criteo format


def _line(label, ints, cats) -> str:
    """One line in the released format: missing values are empty fields."""
    assert len(ints) == 13 and len(cats) == 26
    fields = [str(label)] + ["" if v is None else str(v) for v in ints] + ["" if c is None else c for c in cats]
    return "\t".join(fields) + "\n"


def _random_rows(rng, n):
    rows = []
    for _ in range(n):
        ints = [None if rng.random() < 0.2 else int(rng.integers(-3, 5000)) for _ in range(13)]
        cats = [None if rng.random() < 0.2 else f"{int(rng.integers(2**32)):08x}" for _ in range(26)]
        rows.append((int(rng.integers(2)), ints, cats))
    return rows


def _write(path, rows, gz=False):
    text = "".join(_line(*r) for r in rows).encode()
    with gzip.open(path, "wb") if gz else open(path, "wb") as f:
        f.write(text)
    return str(path)


def _expected(rows, sizes):
    labels = np.array([r[0] for r in rows], dtype=np.float32)
    dense = np.array([[math.log(max(v or 0, 0) + 1) for v in r[1]] for r in rows], dtype=np.float32)
    ids = np.array(
        [[0 if c is None else 1 + int(c, 16) % (s - 1) for c, s in zip(r[2], sizes, strict=True)] for r in rows]
    )
    return dense, ids, labels


def test_read_criteo_values_hashing_and_file_order(tmp_path):
    rng = np.random.default_rng(0)
    day0, day1 = _random_rows(rng, 30), _random_rows(rng, 20)
    # Hand-made edge cases: all missing, negatives, upper-case and short/long hex.
    day0[0] = (1, [None] * 13, [None] * 26)
    day0[1] = (0, [-5, 0, 1, 2**40] + [7] * 9, ["0000000A", "ffffffff", "1", "0123456789abcdef"] + ["68fd1e64"] * 22)
    _write(tmp_path / "day_0", day0)
    _write(tmp_path / "day_1.gz", day1, gz=True)
    sizes = [2, 3, 10, 1000] + [10_000_000] * 22
    split, stats = read_criteo(str(tmp_path), sizes)  # a folder: day files in day order
    dense, ids, labels = _expected(day0 + day1, sizes)
    assert torch.equal(split.labels, torch.from_numpy(labels))
    assert torch.allclose(split.dense, torch.from_numpy(dense), rtol=1e-6, atol=0)
    assert torch.equal(split.ids, torch.from_numpy(ids))
    assert split.table_sizes == sizes and split.num_dense == 13 and split.num_tables == 26
    assert (split.ids < torch.tensor(sizes)).all() and (split.ids >= 0).all()
    # The all-missing line: dense 0, every id the empty row 0.
    assert (split.dense[0] == 0).all() and (split.ids[0] == 0).all()
    assert split.dense[1, 0] == 0 and split.dense[1, 2] == pytest.approx(math.log(2))
    assert split.ids[1, 1] == 1 + 0xFFFFFFFF % 2
    assert stats.lines == stats.samples == 50 and stats.malformed == 0
    assert [os.path.basename(f) for f in stats.files] == ["day_0", "day_1.gz"]

    # Explicit lists keep their order; gzip is recognised by content, not by the name.
    other = _write(tmp_path / "part.tsv", day1, gz=True)
    rev, _ = read_criteo([other, str(tmp_path / "day_0")], 1000)
    assert torch.equal(rev.labels, torch.from_numpy(np.concatenate([labels[30:], labels[:30]])))
    assert rev.table_sizes == [1000] * 26


def test_find_criteo_files_sorts_days_by_number(tmp_path):
    for name in ("day_10", "day_2.gz", "day_0.txt", "notes.md"):
        (tmp_path / name).write_text("")
    assert [os.path.basename(f) for f in find_criteo_files(tmp_path)] == ["day_0.txt", "day_2.gz", "day_10"]
    (tmp_path / "day_2").write_text("")
    with pytest.raises(ValueError, match="day_2"):
        find_criteo_files(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a folder"):
        find_criteo_files(tmp_path / "notes.md")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="train.txt"):
        read_criteo(str(empty), 100)


GOOD = _line(1, [1] * 13, ["68fd1e64"] * 26)


def _bad(kind):
    ints, cats = [1] * 13, ["68fd1e64"] * 26
    if kind == "too few fields":
        return "\t".join(GOOD.rstrip("\n").split("\t")[1:]) + "\n"
    if kind == "too many fields":
        return GOOD.rstrip("\n") + "\t\n"
    if kind == "empty line":
        return "\n"
    if kind == "label":
        return _line(2, ints, cats)
    if kind == "empty label":
        return _line("", ints, cats)
    if kind == "integer":
        return _line(0, ints[:4] + ["1.5"] + ints[5:], cats)
    if kind == "integer with spaces":
        return _line(0, ints[:4] + [" 5"] + ints[5:], cats)
    if kind == "huge integer":
        return _line(0, ints[:12] + ["9" * 400], cats)
    if kind == "hex":
        return _line(0, ints, cats[:6] + ["68fd1eXY"] + cats[7:])
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind, problem",
    [
        ("too few fields", "39 tab-separated fields instead of 40"),
        ("too many fields", "41 tab-separated fields instead of 40"),
        ("empty line", "1 tab-separated fields instead of 40"),
        ("label", "the label is '2', not 0 or 1"),
        ("empty label", "the label is '', not 0 or 1"),
        ("integer", "integer feature I5 (field 6) is '1.5', not an integer"),
        ("integer with spaces", "integer feature I5 (field 6) is ' 5', not an integer"),
        ("huge integer", "integer feature I13 (field 14) is too large"),
        ("hex", "categorical feature C7 (field 21) is '68fd1eXY', not a hex string"),
    ],
)
@pytest.mark.parametrize("gz", [False, True])
def test_malformed_line_error_names_file_line_and_problem(tmp_path, kind, problem, gz):
    path = tmp_path / ("day_0.gz" if gz else "day_0")
    text = (GOOD + GOOD + _bad(kind) + GOOD).encode()
    with gzip.open(path, "wb") if gz else open(path, "wb") as f:
        f.write(text)
    good = _write(tmp_path / "first.tsv", [(0, [1] * 13, ["0"] * 26)] * 4)
    with pytest.raises(CriteoFormatError) as info:
        read_criteo([good, str(path)], 100)
    err = info.value
    assert isinstance(err, ValueError)
    assert (err.path, err.line) == (str(path), 3)  # line numbers restart in each file
    assert str(err).startswith(f"{path}, line 3: {problem}")
    assert "data.skip_malformed=true" in str(err)  # the config flag that skips such lines


def test_skip_malformed_counts_skips_and_warns_once(tmp_path, caplog):
    a = tmp_path / "day_0"
    a.write_text(GOOD + _bad("label") + GOOD + _bad("hex"))
    b = tmp_path / "day_1"
    b.write_text(_bad("too few fields") + _line(0, [None] * 13, [None] * 26))
    with caplog.at_level(logging.WARNING, logger="ps_train.workloads.ctr"):
        split, stats = read_criteo(str(tmp_path), 100, skip_malformed=True)
    assert (stats.lines, stats.samples, stats.malformed) == (6, 3, 3)
    assert stats.malformed_per_file == {str(a): 2, str(b): 1}
    assert stats.examples[0].startswith(f"{a}, line 2: the label is '2'")
    assert split.labels.tolist() == [1.0, 1.0, 0.0] and (split.ids[2] == 0).all()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "skipped 3 malformed of 6 lines" in warnings[0].getMessage()
    # Nothing valid at all is an error, not an empty dataset.
    only_bad = tmp_path / "only_bad.tsv"
    only_bad.write_text(_bad("integer") + _bad("empty line"))
    with pytest.raises(ValueError, match="no valid samples"):
        read_criteo([str(only_bad)], 100, skip_malformed=True)


def test_crlf_lines_are_accepted_and_a_truncated_gzip_names_the_file(tmp_path):
    crlf = tmp_path / "crlf.tsv"
    crlf.write_bytes(GOOD.replace("\n", "\r\n").encode() * 2)
    split, _ = read_criteo([str(crlf)], 100)
    assert len(split) == 2 and split.ids[0, 25] == 1 + 0x68FD1E64 % 99

    rows = _random_rows(np.random.default_rng(1), 200)
    full = gzip.compress("".join(_line(*r) for r in rows).encode())
    cut = tmp_path / "day_0.gz"
    cut.write_bytes(full[: len(full) // 2])
    with pytest.raises(CriteoFormatError, match=r"day_0\.gz, line \d+: the gzip stream is damaged or truncated"):
        read_criteo([str(cut)], 100)


def test_table_size_checks_and_time_split(tmp_path):
    rows = _random_rows(np.random.default_rng(2), 10)
    path = _write(tmp_path / "day_0", rows)
    with pytest.raises(ValueError, match="26"):
        read_criteo(path, [100] * 25)
    with pytest.raises(ValueError, match="too few"):
        read_criteo(path, 1)
    with pytest.raises(FileNotFoundError, match="missing"):
        read_criteo([str(tmp_path / "missing")], 100)
    train, test, stats = load_criteo(path, 100, test_fraction=0.3)
    # The test split is the last lines: the most recent data.
    assert len(train) == 7 and len(test) == 3 and stats.samples == 10
    assert test.labels.tolist() == [float(r[0]) for r in rows[7:]]
    full, _ = read_criteo(path, 100)
    assert torch.equal(torch.cat([train.ids, test.ids]), full.ids)
    with pytest.raises(ValueError, match="empty test"):
        time_split(full, 0.01)


def test_ctr_split_rejects_ids_outside_their_table():
    with pytest.raises(ValueError, match="table 1 has ids in"):
        CtrSplit(torch.zeros(2, 1), torch.tensor([[0, 5], [1, 2]]), torch.zeros(2), [2, 5])
    with pytest.raises(ValueError, match="0 or 1"):
        CtrSplit(torch.zeros(2, 1), torch.zeros(2, 1, dtype=torch.int64), torch.tensor([0.0, 0.5]), [1])


# ---------------------------------------------------------------- metrics


@pytest.mark.parametrize("seed", range(5))
def test_auc_equals_sklearn_with_ties(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 3000))
    labels = rng.integers(0, 2, n)
    labels[:2] = [0, 1]
    scores = np.round(rng.normal(size=n) + labels * rng.random(), 1)  # many ties
    assert auc(scores, labels) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
    assert auc(torch.from_numpy(scores).float().unsqueeze(1), torch.from_numpy(labels)) == pytest.approx(
        roc_auc_score(labels, scores.astype(np.float32)), abs=1e-12
    )


def test_auc_extremes():
    assert auc([0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1]) == 1.0
    assert auc([0.9, 0.8, 0.2, 0.1], [0, 0, 1, 1]) == 0.0
    assert auc([0.5] * 4, [0, 1, 0, 1]) == 0.5


@pytest.mark.parametrize("seed", range(3))
def test_log_loss_equals_sklearn(seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, 500)
    probs = rng.uniform(0.001, 0.999, 500)
    assert log_loss(probs, labels) == pytest.approx(sk_log_loss(labels, probs), rel=1e-12)
    logits = np.log(probs) - np.log1p(-probs)
    assert log_loss(logits, labels, from_logits=True) == pytest.approx(sk_log_loss(labels, probs), rel=1e-9)
    # One class only is fine for log loss (sklearn needs to be told the labels).
    assert log_loss(probs, np.ones(500)) == pytest.approx(sk_log_loss(np.ones(500), probs, labels=[0, 1]))


def test_log_loss_clamps_certain_mistakes():
    assert log_loss([0.0, 1.0], [1, 0]) == pytest.approx(-math.log(1e-7))
    assert log_loss([1.0, 0.0], [1, 0]) == pytest.approx(-math.log1p(-1e-7))
    assert math.isfinite(log_loss([1000.0, -1000.0], [0, 1], from_logits=True))


def test_metric_errors():
    with pytest.raises(ValueError, match="empty input"):
        auc([], [])
    with pytest.raises(ValueError, match="empty input"):
        log_loss(np.zeros(0), np.zeros(0))
    with pytest.raises(ValueError, match="AUC is undefined"):
        auc([0.1, 0.7], [1, 1])
    with pytest.raises(ValueError, match="AUC is undefined"):
        ctr_metrics([0.1, 0.7], [0, 0])
    with pytest.raises(ValueError, match="differ in length"):
        auc([0.1, 0.2, 0.3], [0, 1])
    with pytest.raises(ValueError, match="NaN"):
        auc([float("nan"), 0.2], [0, 1])
    with pytest.raises(ValueError, match="0 or 1"):
        log_loss([0.2, 0.3], [0, 2])
    with pytest.raises(ValueError, match="from_logits=True"):
        log_loss([-2.0, 3.0], [0, 1])


def test_ctr_metrics_report_best_auc():
    m = ctr_metrics([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1], best_auc=0.9)
    assert m["auc"] == 0.75 and m["auc_gap"] == pytest.approx(0.15)
    assert m["base_log_loss"] == pytest.approx(math.log(2))
    assert format_ctr_metrics(m).startswith("AUC 0.7500 (best achievable 0.9000) log loss")


# ---------------------------------------------------------------- batches


def _indexed_split(n: int) -> CtrSplit:
    """Sample i has dense[i, 0] == i, so batches reveal which samples they hold."""
    dense = torch.arange(n, dtype=torch.float32).unsqueeze(1)
    return CtrSplit(dense, (torch.arange(n) % 7).unsqueeze(1), (torch.arange(n) % 2).float(), [7])


def test_trainers_get_disjoint_partitions_covering_the_split_each_epoch():
    split, world, batch = _indexed_split(36), 3, 4
    its = [CtrBatchIterator(split, r, world, batch, seed=9) for r in range(world)]
    assert its[0].steps_per_epoch == 3
    epochs = []
    for _ in range(2):
        seen = []
        for it in its:
            for _ in range(it.steps_per_epoch):
                d, i, y = next(it)
                assert d.shape == (batch, 1) and i.shape == (batch, 1) and y.shape == (batch,)
                assert torch.equal(i[:, 0], d[:, 0].long() % 7)  # rows stay aligned
                seen += d[:, 0].long().tolist()
        assert sorted(seen) == list(range(36))
        epochs.append(seen)
    assert epochs[0] != epochs[1]  # reshuffled per epoch


def test_resume_from_state_gives_the_same_next_batch():
    split = _indexed_split(50)
    it = CtrBatchIterator(split, 1, 2, 4, seed=3)  # 6 batches per epoch
    for _ in range(8):
        next(it)
    state = it.state_dict()
    assert (state["epoch"], state["offset"]) == (1, 8)
    resumed = CtrBatchIterator(split, 1, 2, 4, seed=3)
    resumed.load_state_dict(dict(state))
    for _ in range(6):  # across the next epoch boundary
        assert all(torch.equal(a, b) for a, b in zip(next(it), next(resumed), strict=True))
    with pytest.raises(ValueError, match="batch_size=4"):
        CtrBatchIterator(split, 1, 2, 5, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="not a full batch"):
        CtrBatchIterator(split, 0, 2, 26, seed=3)


def test_eval_batches_cover_the_split_in_order():
    split = _indexed_split(10)
    batches = list(iter_ctr_eval_batches(split, 4))
    assert [len(b[2]) for b in batches] == [4, 4, 2]
    assert torch.cat([b[0][:, 0] for b in batches]).tolist() == list(range(10))


# ---------------------------------------------------------------- interactions


def test_interaction_zero_leaves_the_hidden_model_additive_and_unchanged():
    a = SyntheticCtr(3, [50, 80], 1.05, seed=4)
    b = SyntheticCtr(3, [50, 80], 1.05, seed=4, interaction=0.0)
    dense, ids, _, probs = a.generate(2000)
    assert np.array_equal(b.probabilities(dense, ids), probs)


def test_interaction_takes_its_share_of_the_logit_variance_and_is_not_additive():
    share, std = 0.5, 1.4
    gen = SyntheticCtr(3, [200, 300, 400], 1.05, seed=4, signal_std=std, interaction=share)
    additive = SyntheticCtr(3, [200, 300, 400], 1.05, seed=4, signal_std=std)
    dense, ids, _, _ = gen.generate(60_000)
    z = gen.logits(dense, ids)
    assert np.var(z) == pytest.approx(std**2, rel=0.15)
    # The additive part is the additive model's, scaled to the remaining share of the variance.
    pairs = z - gen.bias - (additive.logits(dense, ids) - additive.bias) * np.sqrt(1 - share)
    assert np.var(pairs) == pytest.approx(share * std**2, rel=0.15)
    # Not a sum of per-feature effects: swapping one table's ids between two samples whose
    # other ids differ changes the sum of their logits.
    i, j = 0, 1
    swapped = ids[[i, j]].copy()
    swapped[:, 0] = swapped[::-1, 0]
    assert gen.logits(dense[[i, j]], swapped).sum() != pytest.approx(z[[i, j]].sum(), abs=1e-9)
    assert additive.logits(dense[[i, j]], swapped).sum() == pytest.approx(
        additive.logits(dense[[i, j]], ids[[i, j]]).sum(), abs=1e-9
    )


def test_interaction_needs_two_tables_and_a_share_below_one():
    with pytest.raises(ValueError, match="at least 2 tables"):
        SyntheticCtr(3, [50], 1.05, seed=1, interaction=0.3)
    with pytest.raises(ValueError, match=r"interaction=1.0: must be in \[0, 1\)"):
        SyntheticCtr(3, [50, 60], 1.05, seed=1, interaction=1.0)
