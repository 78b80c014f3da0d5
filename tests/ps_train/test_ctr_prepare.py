"""``python -m ps_train.prepare criteo`` and ``data.prepared``: the oracle is ``read_criteo``.

Files are written in the released format by test_ctr_data's generators. Prepared arrays,
hashed into tables of any size, must equal what the reader gives for the same files (values,
order, malformed-line errors and counts, .gz, folders of day files), and a run from the
prepared folder must end with the same test metrics as a run from the TSV files.
"""

import gzip
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from ps_train.config import CriteoConfig
from ps_train.workloads.ctr.data import (
    CriteoFormatError,
    CtrBatchIterator,
    iter_ctr_eval_batches,
    load_criteo,
    read_criteo,
)
from ps_train.workloads.ctr.data.criteo import _parse
from ps_train.workloads.ctr.data.criteo_columns import parse_block
from ps_train.workloads.ctr.data.criteo_prepare import prepare_criteo
from ps_train.workloads.ctr.data.gunzip import open_text
from ps_train.workloads.ctr.data.loading import load_ctr_data
from ps_train.workloads.ctr.data.mapped import MappedCtrSplit, PreparedCriteo, load_prepared
from ps_train.workloads.ctr.data.prepared import MANIFEST_NAME, PREPARED_VERSION, PreparedDataError, read_manifest
from ps_train.workloads.ctr.data.progress import Progress
from tests.ps_train._app import make_cfg, read_json, run_app
from tests.ps_train.test_ctr_data import GOOD, _bad, _line, _random_rows, _write

SIZES = [2, 3, 10, 1000] + [10_000_000] * 22
SMALL_BLOCKS = dict(block_bytes=4096, workers=2, progress=False)  # many blocks, lines cut across reads


def _prepare(src, dst, **kw):
    return prepare_criteo(src, dst, **{**SMALL_BLOCKS, **kw})


def _all(folder, sizes):
    data = PreparedCriteo(str(folder))
    return MappedCtrSplit(data, 0, len(data), sizes)[0 : len(data)]


def _assert_same(got, split):
    dense, ids, labels = got
    assert torch.equal(dense, split.dense) and torch.equal(ids, split.ids) and torch.equal(labels, split.labels)


def _day_files(tmp_path):
    rng = np.random.default_rng(0)
    day0, day1 = _random_rows(rng, 300), _random_rows(rng, 200)
    # Edge cases: all missing, negatives, big integers, upper-case, short and zero-padded hex.
    day0[0] = (1, [None] * 13, [None] * 26)
    day0[1] = (
        0,
        [-5, 0, 1, 2**40, 10**17, 10**25, 123456789012345678901234567890] + [7] * 6,
        ["0000000A", "ffffffff", "1", "00000000000000000000ffffffff"] + ["68fd1e64"] * 22,
    )
    day0[2] = (1, [-1] * 13, ["FFFFFFFF", "0", "abc", "DeadBeef"] + [None] * 22)
    folder = tmp_path / "criteo"
    folder.mkdir()
    _write(folder / "day_0", day0)
    _write(folder / "day_1.gz", day1, gz=True)
    return folder


def test_prepared_arrays_equal_the_readers_for_any_table_sizes(tmp_path):
    folder = _day_files(tmp_path)
    m = _prepare(folder, tmp_path / "prep")
    for sizes in (SIZES, [100_000] * 26, [2] * 26):  # tables change without preparing again
        split, stats = read_criteo(str(folder), sizes)
        _assert_same(_all(tmp_path / "prep", sizes), split)
    assert (m.rows, m.lines, m.malformed, m.skip_malformed) == (500, 500, 0, False)
    assert [os.path.basename(s.path) for s in m.sources] == ["day_0", "day_1.gz"]
    assert [(s.lines, s.rows, s.size) for s in m.sources] == [
        (300, 300, os.path.getsize(folder / "day_0")),
        (200, 200, os.path.getsize(folder / "day_1.gz")),
    ]
    # One block for everything, one thread, gives the same folder contents.
    whole = prepare_criteo(folder, tmp_path / "whole", workers=1, progress=False)
    for name, spec in m.arrays.items():
        a, b = (np.load(p / spec.file) for p in (tmp_path / "prep", tmp_path / "whole"))
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert whole.rows == m.rows


def test_a_list_of_files_keeps_its_order_and_a_gzip_is_known_by_its_content(tmp_path):
    folder = _day_files(tmp_path)
    renamed = tmp_path / "part.tsv"
    renamed.write_bytes((folder / "day_1.gz").read_bytes())
    files = [str(renamed), str(folder / "day_0")]
    _prepare(files, tmp_path / "prep")
    split, _ = read_criteo(files, 1000)
    _assert_same(_all(tmp_path / "prep", [1000] * 26), split)


def test_a_gzip_of_several_members_reads_whole_and_a_read_is_bounded(tmp_path):
    rows = _random_rows(np.random.default_rng(5), 300)
    members = [gzip.compress("".join(_line(*r) for r in part).encode()) for part in (rows[:100], rows[100:])]
    path = tmp_path / "day_0.gz"
    path.write_bytes(b"".join(members))  # as `cat a.gz b.gz`
    _prepare(path, tmp_path / "prep")
    split, _ = read_criteo(str(path), 1000)
    _assert_same(_all(tmp_path / "prep", [1000] * 26), split)
    zeros = tmp_path / "zeros.gz"
    zeros.write_bytes(gzip.compress(bytes(64 << 20)))  # 64 MiB of text in ~64 KiB
    stream, raw = open_text(str(zeros))
    with raw:
        sizes = [len(stream.read(1 << 20)) for _ in range(65)]
    assert sizes == [1 << 20] * 64 + [0]


def test_manifest_records_format_arrays_and_sources(tmp_path):
    folder = _day_files(tmp_path)
    _prepare(folder, tmp_path / "prep")
    raw = json.loads((tmp_path / "prep" / MANIFEST_NAME).read_text())
    assert raw["version"] == PREPARED_VERSION and raw["format"] == "ps_train/criteo-prepared"
    assert {k: (v["dtype"], v["shape"]) for k, v in raw["arrays"].items()} == {
        "labels": ("<f4", [500]),
        "dense": ("<f4", [500, 13]),
        "hashes": ("<u4", [500, 26]),
        "missing": ("<u4", [500]),
    }
    st = os.stat(folder / "day_0")
    assert raw["sources"][0] == {
        "path": str(folder / "day_0"),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "lines": 300,
        "rows": 300,
        "malformed": 0,
    }
    hashes = np.load(tmp_path / "prep" / "hashes.npy", mmap_mode="r")
    missing = np.load(tmp_path / "prep" / "missing.npy")
    assert hashes[1, 1] == 0xFFFFFFFF and hashes[2, 3] == 0xDEADBEEF and missing[0] == (1 << 26) - 1


@pytest.mark.parametrize(
    "kind",
    [
        "too few fields",
        "too many fields",
        "empty line",
        "label",
        "empty label",
        "integer",
        "integer with spaces",
        "huge integer",
        "hex",
    ],
)
@pytest.mark.parametrize("gz", [False, True])
def test_a_malformed_line_gives_the_readers_error_and_no_folder(tmp_path, kind, gz):
    path = tmp_path / ("day_0.gz" if gz else "day_0")
    text = (GOOD * 200 + _bad(kind) + GOOD).encode()
    with gzip.open(path, "wb") if gz else open(path, "wb") as f:
        f.write(text)
    good = _write(tmp_path / "first.tsv", [(0, [1] * 13, ["0"] * 26)] * 4)
    with pytest.raises(CriteoFormatError) as want:
        read_criteo([good, str(path)], 100)
    with pytest.raises(CriteoFormatError) as got:
        _prepare([good, str(path)], tmp_path / "prep")
    assert (got.value.path, got.value.line) == (str(path), 201)
    assert str(got.value) == str(want.value)
    assert not (tmp_path / "prep").exists() and not [p for p in os.listdir(tmp_path) if "partial" in p]


ODD_LINES = [
    "\n",
    "\r\n",
    GOOD.replace("\n", "\r\n"),
    GOOD.replace("\n", "\r\r\n"),
    GOOD.replace("68fd1e64", "68fd\r1e64", 1),
    _line(1, [" 5"] + [1] * 12, ["0"] * 26),
    _line(1, ["+5"] + [1] * 12, ["0"] * 26),
    _line(1, ["0x10"] + [1] * 12, ["0"] * 26),
    _line(1, ["--5"] + [1] * 12, ["0"] * 26),
    _line(1, ["-"] + [1] * 12, ["0"] * 26),
    _line(1, ["5-"] + [1] * 12, ["0"] * 26),
    _line(1, ["-0"] + ["9" * 19] + ["0" * 30 + "7"] + [1] * 10, ["0"] * 26),
    _line(1, [1] * 13, ["0x10"] + ["0"] * 25),
    _line(1, [1] * 13, [" 68fd1e6"] + ["0"] * 25),
    _line(1, [1] * 13, ["68fd1e6g"] + ["0"] * 25),
    _line(1, [1] * 13, ["68FD1E64"] * 26),
    _line(1, [1] * 13, ["\x00" * 8] + ["0"] * 25),
    _line(1, [1] * 13, ["\xff" * 4] + ["0"] * 25),
    _line("1 ", [1] * 13, ["0"] * 26),
    _line(1, [1] * 13, ["NA", "null", "nan"] + ["0"] * 23),
    _line(1, ["NA"] + [1] * 12, ["0"] * 26),
    '1\t"2"' + "\t" * 38 + "\n",
    "\t" * 39 + "\n",
    "0" + "\t" * 39 + "\n",
]


@pytest.mark.parametrize("which", ["all", "40 fields"])  # "40 fields": pyarrow tokenizes the block as it is
def test_odd_lines_take_the_readers_values_or_its_messages(which):
    lines = [ln.encode("latin-1") for ln in ODD_LINES]
    if which == "40 fields":
        lines = [ln for ln in lines if ln.count(b"\t") == 39 and b"\r" not in ln.removesuffix(b"\r\n")]
    block = b"".join(lines[i % len(lines)] if i % 3 == 0 else GOOD.encode() for i in range(3 * len(lines)))
    cols = parse_block(block)
    mods = [s - 1 for s in SIZES]
    want_rows, want_bad = [], []
    for i, line in enumerate(block.split(b"\n")[:-1]):
        line = line[:-1] if line.endswith(b"\r") else line
        try:
            want_rows.append(_parse(line, mods))
        except Exception as e:  # noqa: BLE001 - the reader's _Malformed
            want_bad.append((i, str(e)))
    assert cols.lines == len(block.split(b"\n")) - 1
    assert cols.malformed == want_bad
    ids = np.where((cols.missing[:, None] >> np.arange(26)) & 1, 0, 1 + cols.hashes.astype(np.int64) % mods)
    assert np.array_equal(cols.labels, [r[0] for r in want_rows])
    assert np.array_equal(cols.dense, np.log1p(np.array([r[1] for r in want_rows])).astype(np.float32))
    assert np.array_equal(ids, [r[2] for r in want_rows])


@pytest.mark.parametrize("ending", ["\n", "\r\n"])
def test_empty_lines_and_all_empty_columns_in_a_tokenized_block(ending):
    good, empty = GOOD.encode(), _line(1, [None] * 13, [None] * 26).encode()
    cols = parse_block((good + b"\n" + empty * 2 + good).replace(b"\n", ending.encode()))
    assert cols.lines == 5 and len(cols) == 4
    assert cols.malformed == [(1, "1 tab-separated fields instead of 40 (an empty line, or not tab-separated)")]
    assert cols.missing.tolist() == [0, (1 << 26) - 1, (1 << 26) - 1, 0]
    only_empty = parse_block(empty * 3)  # columns without a single value
    assert len(only_empty) == 3 and not only_empty.hashes.any() and not only_empty.dense.any()


def test_a_hex_value_above_32_bits_is_malformed_in_prepared_data(tmp_path):
    path = tmp_path / "day_0"
    path.write_text(GOOD + _line(1, [1] * 13, ["1" + "0" * 8] + ["0"] * 25))
    with pytest.raises(
        CriteoFormatError,
        match=r"day_0, line 2: categorical feature C1 \(field 15\) is '100000000', "
        r"above 32 bits",
    ):
        _prepare(path, tmp_path / "prep")
    m = _prepare(path, tmp_path / "prep", skip_malformed=True)
    assert (m.rows, m.malformed) == (1, 1)


def test_skip_malformed_counts_and_skips_as_the_reader_does(tmp_path, caplog):
    a = tmp_path / "day_0"
    a.write_text(GOOD + _bad("label") + GOOD * 300 + _bad("hex") + "".join(ODD_LINES))
    b = tmp_path / "day_1.gz"
    b.write_bytes(gzip.compress((_bad("too few fields") + _line(0, [None] * 13, [None] * 26)).encode()))
    split, stats = read_criteo(str(tmp_path), SIZES, skip_malformed=True)
    m = _prepare(tmp_path, tmp_path / "prep", skip_malformed=True)
    _assert_same(_all(tmp_path / "prep", SIZES), split)
    assert (m.rows, m.lines, m.malformed) == (stats.samples, stats.lines, stats.malformed)
    assert [s.malformed for s in m.sources] == [stats.malformed_per_file[str(a)], stats.malformed_per_file[str(b)]]
    assert m.malformed_examples == stats.examples and m.skip_malformed
    # Training refuses it unless skip_malformed says so, as training from the files would.
    with pytest.raises(PreparedDataError, match=rf"skipped {stats.malformed} malformed .*set data.skip_malformed=true"):
        load_prepared(str(tmp_path / "prep"), SIZES, 0.2)
    train, test = load_prepared(str(tmp_path / "prep"), SIZES, 0.2, skip_malformed=True)
    assert len(train) + len(test) == stats.samples


def test_last_line_without_line_ending_and_a_truncated_gzip(tmp_path):
    plain = tmp_path / "a.tsv"
    plain.write_bytes((GOOD * 3).encode()[:-1])  # no final \n
    cr = tmp_path / "b.tsv"
    cr.write_bytes((GOOD * 3).encode()[:-1] + b"\r")  # the reader keeps that \r: malformed
    for path in (plain, cr):
        try:
            want = read_criteo([str(path)], 100, skip_malformed=True)
        except ValueError:
            want = None
        m = _prepare([str(path)], tmp_path / f"prep-{path.name}", skip_malformed=True)
        assert want is not None and (m.rows, m.malformed) == (want[1].samples, want[1].malformed)
        _assert_same(_all(tmp_path / f"prep-{path.name}", [100] * 26), want[0])
    rows = _random_rows(np.random.default_rng(1), 2000)
    full = gzip.compress("".join(_line(*r) for r in rows).encode())
    cut = tmp_path / "day_0.gz"
    cut.write_bytes(full[: len(full) // 2])
    with pytest.raises(CriteoFormatError, match=r"day_0\.gz, line \d+: the gzip stream is damaged or truncated"):
        _prepare([str(cut)], tmp_path / "prep")
    assert not (tmp_path / "prep").exists()


def test_output_is_atomic_and_replaced_only_when_asked(tmp_path):
    folder = _day_files(tmp_path)
    dst = tmp_path / "prep"
    _prepare(folder, dst)
    before = (dst / "labels.npy").stat().st_mtime_ns
    with pytest.raises(FileExistsError, match="--force"):
        _prepare(folder, dst)
    assert (dst / "labels.npy").stat().st_mtime_ns == before
    stale = tmp_path / ".prep.partial-999999999"  # left by a killed run (no such process)
    stale.mkdir()
    m = _prepare(folder, dst, force=True)
    assert m.rows == 500 and not stale.exists()
    assert sorted(os.listdir(tmp_path)) == ["criteo", "prep"]
    with pytest.raises(ValueError, match="holds the source"):
        _prepare(folder, folder, force=True)


def test_read_manifest_names_what_is_wrong(tmp_path):
    folder = _day_files(tmp_path)
    dst = tmp_path / "prep"
    _prepare(folder, dst)
    assert read_manifest(str(dst)).rows == 500
    with pytest.raises(FileNotFoundError, match="is not a folder.*python -m ps_train.prepare criteo"):
        read_manifest(str(tmp_path / "missing"))
    with pytest.raises(PreparedDataError, match="has no manifest.json.*data.root"):
        read_manifest(str(folder))
    manifest = json.loads((dst / MANIFEST_NAME).read_text())
    (dst / MANIFEST_NAME).write_text(json.dumps({**manifest, "version": 99}))
    with pytest.raises(PreparedDataError, match="format version 99, but this ps_train reads version 1"):
        read_manifest(str(dst))
    (dst / MANIFEST_NAME).write_text(json.dumps(manifest))
    with open(dst / "hashes.npy", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(PreparedDataError, match="hashes array is missing, truncated or changed"):
        read_manifest(str(dst))
    _prepare(folder, dst, force=True)
    with open(folder / "day_0", "a") as f:
        f.write(GOOD)
    with pytest.raises(PreparedDataError, match=r"was made from .*day_0 .*which has changed since"):
        load_ctr_data(CriteoConfig(prepared=str(dst), table_rows=100))
    (folder / "day_0").unlink()  # a source gone (e.g. the folder copied elsewhere) is fine
    train, test, best, _ = load_ctr_data(CriteoConfig(prepared=str(dst), table_rows=100))
    assert (len(train) + len(test), best) == (500, None)


def test_prepared_splits_batches_equal_those_of_the_tsv_files(tmp_path):
    folder = _day_files(tmp_path)
    _prepare(folder, tmp_path / "prep")
    cfg = dict(table_sizes=SIZES, test_fraction=0.3)
    train, test, _, _ = load_ctr_data(CriteoConfig(root=str(folder), **cfg))
    mtrain, mtest, _, _ = load_ctr_data(CriteoConfig(prepared=str(tmp_path / "prep"), **cfg))
    ftrain, ftest, _ = load_criteo(str(folder), SIZES, 0.3)
    assert (len(mtrain), len(mtest)) == (len(train), len(test)) == (len(ftrain), len(ftest)) == (350, 150)
    assert mtrain.table_sizes == SIZES and mtrain.num_dense == 13
    assert mtest.positive_rate() == pytest.approx(test.positive_rate())
    for rank in range(2):
        a, b = CtrBatchIterator(train, rank, 2, 32, seed=5), CtrBatchIterator(mtrain, rank, 2, 32, seed=5)
        for _ in range(3 * a.steps_per_epoch):  # across epochs
            assert all(torch.equal(x, y) for x, y in zip(next(a), next(b), strict=True))
    for x, y in zip(iter_ctr_eval_batches(test, 64), iter_ctr_eval_batches(mtest, 64), strict=True):
        assert all(torch.equal(u, v) for u, v in zip(x, y, strict=True))
    with pytest.raises(IndexError):
        mtest[torch.tensor([150])]


def test_progress_line_on_a_terminal_and_in_a_log():
    log = io.StringIO()
    p = Progress(1000, stream=log, every=0.0, label="prepare criteo")
    p.update(500, 250, "day_0")
    p.close()
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in log.getvalue()
    assert lines[0].startswith("prepare criteo: 500 lines   25.0%") and "lines/s" in lines[0] and "ETA" in lines[0]
    assert "(day_0)" in lines[0] and "ETA" not in lines[1] or lines[1].endswith("(day_0)")

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    p = Progress(1000, stream=tty, every=0.0)
    p.update(10, 100)
    p.update(20, 1000)
    p.close()
    assert tty.getvalue().count("\r") == 3 and tty.getvalue().endswith("\n") and tty.getvalue().count("\n") == 1


@pytest.mark.timeout(120)
def test_cli_prepares_reports_and_fails_with_the_readers_message(tmp_path):
    folder = _day_files(tmp_path)
    (tmp_path / "with_bad").mkdir()
    bad_folder = _day_files(tmp_path / "with_bad")
    (bad_folder / "day_2").write_text(GOOD + _bad("label"))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    cmd = [sys.executable, "-m", "ps_train.prepare", "criteo"]
    # Both at once: each is an interpreter starting on one core.
    procs = [
        subprocess.Popen(
            [*cmd, str(src), str(tmp_path / dst)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for src, dst in ((folder, "prep"), (bad_folder, "prep2"))
    ]
    try:
        ok, bad = ((p, p.communicate(timeout=100)[1]) for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert ok[0].returncode == 0, ok[1]
    assert "lines/s" in ok[1] and "500 rows from 500 lines of 2 file(s)" in ok[1]
    assert "data.prepared=" in ok[1] and "\r" not in ok[1]  # not a terminal: whole lines
    assert bad[0].returncode == 1 and f"{bad_folder / 'day_2'}, line 2: the label is '2'" in bad[1]
    assert not (tmp_path / "prep2").exists()


@pytest.mark.timeout(300)
def test_a_run_from_prepared_arrays_ends_like_a_run_from_the_tsv_files(tmp_path):
    rng = np.random.default_rng(3)
    data = tmp_path / "criteo"
    data.mkdir()
    _write(data / "day_0", _random_rows(rng, 700))
    _write(data / "day_1.gz", _random_rows(rng, 500), gz=True)
    _prepare(data, tmp_path / "prep")
    common = (
        "model=dlrm",
        "data=criteo",
        "data.table_rows=50",
        "train.batch_size=32",
        "train.steps=12",
        "cluster.num_servers=2",
        "cluster.num_trainers=2",
        "mode=sync",
        "checkpoint.every=0",
    )
    tsv = run_app(tmp_path / "tsv", *common, f"data.root={data}", timeout=240)
    mapped = run_app(
        tmp_path / "mapped", *common, f"data.prepared={tmp_path / 'prep'}", "data.root=/nonexistent", timeout=240
    )
    a, b = read_json(tmp_path / "tsv" / "metrics.json"), read_json(tmp_path / "mapped" / "metrics.json")
    assert tsv["steps"] == mapped["steps"] == 12
    for key in ("test_auc", "test_log_loss", "test_loss", "test_accuracy"):
        assert a[key] == b[key], key


def test_config_selects_a_prepared_folder(tmp_path):
    cfg = make_cfg("model=dlrm", "data=criteo", f"data.prepared={tmp_path}")
    assert isinstance(cfg.data, CriteoConfig) and cfg.data.prepared == str(tmp_path)
    assert make_cfg("model=dlrm", "data=criteo").data.prepared is None  # default: the TSV files in data.root
    assert any("data.prepared: empty" in p for p in CriteoConfig(prepared=" ").problems())
    with pytest.raises(FileNotFoundError, match="data.prepared=.*is not a folder"):
        load_ctr_data(CriteoConfig(prepared=str(tmp_path / "missing")))
    (tmp_path / MANIFEST_NAME).write_text("{}")
    with pytest.raises(ValueError, match=f"data.root='{tmp_path}' is a prepared folder.*data.prepared={tmp_path}"):
        load_ctr_data(CriteoConfig(root=str(tmp_path)))


def _peak_rss_mb(child):
    """The peak RSS of a started ``child`` once it exited (its own: ``wait4``'s rusage)."""
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    assert child.returncode == 0, child.stderr.read().decode() if child.stderr else ""
    return usage.ru_maxrss / 1024


@pytest.mark.timeout(300)
def test_memory_does_not_grow_with_the_input(tmp_path):
    # The same command on 20x the lines (80 blocks of 1 MiB instead of 4): the peak RSS is
    # that of a few blocks in flight, not of the input (~75 MB of text, ~50 MB of arrays here).
    text = "".join(_line(*r) for r in _random_rows(np.random.default_rng(4), 1000))
    (tmp_path / "small.tsv").write_text(text * 15)
    (tmp_path / "large.tsv").write_text(text * 300)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    # Both at once (each measures its own peak): the small one's start overlaps the large one's.
    children = {
        name: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ps_train.prepare",
                "criteo",
                str(tmp_path / f"{name}.tsv"),
                str(tmp_path / f"prep-{name}"),
                "--quiet",
                "--block-mb",
                "1",
            ],
            env=env,
            stderr=subprocess.PIPE,
        )
        for name in ("small", "large")
    }
    try:
        rss = {name: _peak_rss_mb(child) for name, child in children.items()}
    finally:
        for child in children.values():
            if child.returncode is None:
                child.kill()
                child.wait()
    assert read_manifest(str(tmp_path / "prep-large")).rows == 300_000
    assert rss["large"] - rss["small"] < 30, rss
