"""``python -m ps_train.prepare criteo``'s input side: gzip through each installed inflater
(python-isal's, the standard library's fallback) gives the arrays of the plain text, which
equal ``read_criteo``'s; a damaged stream is named whichever inflates it; and the command
starts without torch or Hydra (a converter needs numpy and pyarrow only).
"""

import gzip
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from ps_train.workloads.ctr.data import CriteoFormatError, read_criteo
from ps_train.workloads.ctr.data.criteo_prepare import prepare_criteo
from ps_train.workloads.ctr.data.gunzip import INFLATERS, Gunzip, inflater
from ps_train.workloads.ctr.data.mapped import MappedCtrSplit, PreparedCriteo
from tests.ps_train.test_ctr_data import _line, _random_rows

ARRAYS = ("labels.npy", "dense.npy", "hashes.npy", "missing.npy")
# isal where its wheel installed (a core dependency there), the standard library's everywhere.
NAMES = ["isal", "zlib"]


def _inflater_or_skip(name):
    if name not in INFLATERS:
        pytest.skip(f"{name} is not installed on this platform (its wheel does not exist here)")
    return name


def _text(seed, n):
    return "".join(_line(*r) for r in _random_rows(np.random.default_rng(seed), n)).encode()


def _arrays(folder):
    return {name: np.load(folder / name) for name in ARRAYS}


@pytest.mark.parametrize("name", NAMES)
def test_gzip_and_plain_input_give_identical_arrays(tmp_path, name):
    gunzip = _inflater_or_skip(name)
    text = _text(0, 1500)
    plain = tmp_path / "day_0"
    plain.write_bytes(text)
    one = tmp_path / "one.gz"
    one.write_bytes(gzip.compress(text, compresslevel=6))
    # Several members (as `cat a.gz b.gz`), one of them empty, cut inside a line.
    cut = len(text) // 3 + 17
    several = tmp_path / "several.gz"
    several.write_bytes(gzip.compress(text[:cut]) + gzip.compress(b"") + gzip.compress(text[cut:], compresslevel=1))
    # Small blocks and raw reads: lines and members cross every boundary.
    kw = dict(workers=2, block_bytes=4096, progress=False, gunzip=gunzip)
    want = prepare_criteo(plain, tmp_path / "from_plain", **kw)
    for src in (one, several):
        got = prepare_criteo(src, tmp_path / f"from_{src.stem}", **kw)
        assert (got.rows, got.lines) == (want.rows, want.lines) == (1500, 1500)
        a, b = _arrays(tmp_path / "from_plain"), _arrays(tmp_path / f"from_{src.stem}")
        for array in ARRAYS:
            assert a[array].dtype == b[array].dtype and np.array_equal(a[array], b[array]), (src.name, array)
    # ... and those arrays are the reader's (the oracle of test_ctr_prepare, here for this inflater).
    sizes = [1000] * 26
    split, _ = read_criteo(str(several), sizes)
    data = PreparedCriteo(str(tmp_path / "from_several"))
    dense, ids, labels = MappedCtrSplit(data, 0, len(data), sizes)[0 : len(data)]
    assert torch.equal(dense, split.dense) and torch.equal(ids, split.ids) and torch.equal(labels, split.labels)


@pytest.mark.parametrize("name", NAMES)
def test_each_inflater_reads_bounded_pieces_of_a_highly_compressed_file(tmp_path, name):
    gunzip = inflater(_inflater_or_skip(name))
    path = tmp_path / "zeros.gz"
    path.write_bytes(gzip.compress(bytes(24 << 20)) + gzip.compress(b"tail"))  # 24 MiB of text in ~24 KiB
    with open(path, "rb") as raw:
        stream = Gunzip(raw, gunzip)
        sizes = [len(stream.read(1 << 20)) for _ in range(26)]
    assert sizes == [1 << 20] * 24 + [4, 0]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("damage", ["crc", "length", "truncated"])
def test_a_damaged_gzip_is_named_whichever_inflater_reads_it(tmp_path, name, damage):
    gunzip = _inflater_or_skip(name)
    text = _text(1, 400)
    packed = bytearray(gzip.compress(text))
    if damage == "crc":  # the trailer: CRC-32, then the length, little-endian
        packed[-8] ^= 0xFF
    elif damage == "length":
        packed[-4] ^= 0x01
    else:
        packed = packed[: len(packed) * 2 // 3]
    path = tmp_path / "day_0.gz"
    path.write_bytes(bytes(packed))
    with pytest.raises(CriteoFormatError, match=r"day_0\.gz, line \d+: the gzip stream is damaged or truncated"):
        prepare_criteo(path, tmp_path / "prep", workers=2, block_bytes=4096, progress=False, gunzip=gunzip)
    assert not (tmp_path / "prep").exists()


def test_an_unknown_inflater_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "day_0").write_bytes(_text(2, 10))
    with pytest.raises(ValueError, match=r"--gunzip igzip: unknown; choose one of \['auto', 'isal', 'zlib'\]"):
        prepare_criteo(tmp_path / "day_0", tmp_path / "prep", progress=False, gunzip="igzip")
    assert not (tmp_path / "prep").exists()
    assert inflater().name == next(iter(INFLATERS)) and list(INFLATERS)[-1] == "zlib"


@pytest.mark.timeout(120)
def test_without_isal_the_standard_library_inflates(tmp_path):
    # As on a platform without isal's wheel: its import fails, and the command converts .gz.
    text = _text(4, 200)
    (tmp_path / "gz").mkdir()
    (tmp_path / "gz" / "day_0.gz").write_bytes(gzip.compress(text))
    (tmp_path / "day_0").write_bytes(text)
    args = ["criteo", str(tmp_path / "gz"), str(tmp_path / "from_gz"), "--quiet"]
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["isal"] = None  # an import of isal now raises ImportError
        from ps_train.workloads.ctr.data.gunzip import INFLATERS, inflater
        from ps_train.prepare import main
        print(list(INFLATERS), inflater().name, main({args!r}))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=100)
    assert out.stdout.strip() == "['zlib'] zlib 0", out.stdout + out.stderr
    prepare_criteo(tmp_path / "day_0", tmp_path / "from_plain", progress=False)
    a, b = _arrays(tmp_path / "from_plain"), _arrays(tmp_path / "from_gz")
    assert all(np.array_equal(a[array], b[array]) for array in ARRAYS)


@pytest.mark.timeout(120)
def test_the_command_converts_without_importing_torch_or_hydra(tmp_path):
    # A fresh interpreter runs the command's main on plain and gzipped files, then lists what
    # it imported: the whole path (arguments, reading, inflating, parsing, writing).
    text = _text(3, 300)
    (tmp_path / "day_0").write_bytes(text)
    (tmp_path / "day_1.gz").write_bytes(gzip.compress(text))
    script = textwrap.dedent(
        f"""
        import sys
        from ps_train.prepare import main
        code = main(["criteo", {str(tmp_path)!r}, {str(tmp_path / "prep")!r}, "--quiet"])
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "hydra", "omegaconf", "tensorboard"))
        print(code, heavy)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=100)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0 []", out.stdout + out.stderr
    assert "600 rows from 600 lines of 2 file(s)" in out.stderr
