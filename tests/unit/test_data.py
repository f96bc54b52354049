"""Unit tests for hdet_scale.train.data (byte-level LM data)."""

from __future__ import annotations

import math
import os
import pathlib
import threading

import pytest
import torch

from hdet_scale.errors import HDETConfigError
from hdet_scale.train.data import (
    ByteBatches,
    Corpus,
    default_corpus_files,
    load_corpus,
    unigram_entropy,
)


def _u8(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


def _make_tree(root: pathlib.Path, n: int = 12) -> list[str]:
    names = []
    for i in range(n):
        sub = root / ("a" if i % 2 else "b")
        sub.mkdir(exist_ok=True)
        p = sub / f"f{i:02d}.txt"
        p.write_bytes(f"file {i:02d} ".encode() * 20)
        names.append(p.relative_to(root).as_posix())
    (root / ".hidden").write_bytes(b"HIDDEN" * 50)
    (root / "blob.bin").write_bytes(b"BIN\x00" * 50)
    return names


# ----------------------------------------------------------------- unigram entropy


def test_unigram_entropy_uniform_over_four_symbols_is_ln4():
    data = _u8([0, 1, 2, 3] * 25)
    assert unigram_entropy(data) == pytest.approx(math.log(4), abs=1e-12)


def test_unigram_entropy_single_symbol_is_zero():
    assert unigram_entropy(_u8([7] * 100)) == pytest.approx(0.0, abs=1e-12)


def test_unigram_entropy_hand_computed_skewed():
    # p = (1/2, 1/4, 1/4): H = 0.5 ln 2 + 2 * 0.25 ln 4 = 1.5 ln 2
    data = _u8([10, 10, 200, 255])
    assert unigram_entropy(data) == pytest.approx(1.5 * math.log(2), abs=1e-12)


def test_unigram_entropy_all_256_values_is_ln256():
    data = torch.arange(256, dtype=torch.int64).to(torch.uint8).repeat(3)
    assert unigram_entropy(data) == pytest.approx(math.log(256), abs=1e-12)


def test_unigram_entropy_rejects_empty_and_wrong_dtype():
    with pytest.raises(ValueError):
        unigram_entropy(torch.empty(0, dtype=torch.uint8))
    with pytest.raises(ValueError):
        unigram_entropy(torch.zeros(4, dtype=torch.int64))


# ----------------------------------------------------------------- corpus


def test_default_corpus_files_sorted_and_filtered():
    files = default_corpus_files()
    assert len(files) > 50
    import sysconfig

    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    rels = [f.relative_to(root).as_posix() for f in files]
    assert rels == sorted(rels)
    assert all(r.endswith(".py") for r in rels)
    banned = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    assert not any(banned & set(r.split("/")[:-1]) for r in rels)
    assert "os.py" in rels


def test_load_default_corpus_budget_and_types():
    c = load_corpus(None, 0.1, 200_000, seed=0)
    assert isinstance(c, Corpus)
    assert c.train.dtype == torch.uint8 and c.train.dim() == 1
    assert c.val.dtype == torch.uint8 and c.val.dim() == 1
    assert c.train.numel() == 180_000
    assert c.val.numel() == 20_000
    assert c.train_files >= 1 and c.val_files >= 1
    assert "stdlib" in c.source


def test_folder_split_by_file_is_deterministic_and_disjoint(tmp_path):
    names = _make_tree(tmp_path, n=12)
    a = load_corpus(str(tmp_path), 0.3, 10**9, seed=5)
    b = load_corpus(str(tmp_path), 0.3, 10**9, seed=5)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.train_files + a.val_files == len(names)  # hidden + binary skipped
    assert a.train_files >= 1 and a.val_files >= 1

    train_text, val_text = bytes(a.train.tolist()), bytes(a.val.tolist())
    assert b"HIDDEN" not in train_text + val_text
    assert b"BIN" not in train_text + val_text
    for i in range(12):
        tag = f"file {i:02d} ".encode()
        # every file is in exactly one split
        assert (tag in train_text) != (tag in val_text)
    # total = file bytes + one separator between consecutive files of a split
    file_bytes = 12 * len(b"file 00 ") * 20
    assert a.train.numel() + a.val.numel() == file_bytes + (a.train_files - 1) + (a.val_files - 1)


def test_folder_split_files_concatenated_in_sorted_order(tmp_path):
    _make_tree(tmp_path, n=12)
    c = load_corpus(str(tmp_path), 0.3, 10**9, seed=1)
    text = bytes(c.train.tolist())
    present = [i for i in range(12) if f"file {i:02d} ".encode() in text]
    by_position = sorted(present, key=lambda i: text.index(f"file {i:02d} ".encode()))
    # sorted relative paths: a/f01, a/f03, ..., a/f11, b/f00, b/f02, ..., b/f10
    sorted_order = list(range(1, 12, 2)) + list(range(0, 12, 2))
    assert by_position == [i for i in sorted_order if i in present]
    assert len(present) >= 2


def test_split_depends_on_seed(tmp_path):
    _make_tree(tmp_path, n=12)
    splits = {
        bytes(load_corpus(str(tmp_path), 0.5, 10**9, seed=s).val.tolist()) for s in range(6)
    }
    assert len(splits) > 1


def test_each_split_gets_a_file_even_with_extreme_fraction(tmp_path):
    (tmp_path / "x.txt").write_bytes(b"x" * 100)
    (tmp_path / "y.txt").write_bytes(b"y" * 100)
    for frac in (0.001, 0.999):
        c = load_corpus(str(tmp_path), frac, 10**9, seed=0)
        assert c.train_files == 1 and c.val_files == 1
        assert c.train.numel() == 100 and c.val.numel() == 100


def test_single_file_split_by_position(tmp_path):
    p = tmp_path / "one.txt"
    p.write_bytes(bytes(range(1, 101)))  # text: no NUL, all ASCII
    c = load_corpus(str(p), 0.2, 10**9, seed=0)
    assert c.train.tolist() == list(range(1, 81))
    assert c.val.tolist() == list(range(81, 101))
    c = load_corpus(str(p), 0.2, 50, seed=0)  # max_bytes truncates first
    assert c.train.tolist() == list(range(1, 41))
    assert c.val.tolist() == list(range(41, 51))


def test_comma_separated_paths(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "p.txt").write_bytes(b"P" * 10)
    (tmp_path / "q.txt").write_bytes(b"Q" * 10)
    c = load_corpus(f"{tmp_path / 'd'},{tmp_path / 'q.txt'}", 0.5, 10**9, seed=0)
    assert c.train_files == 1 and c.val_files == 1
    assert sorted([c.train.tolist()[0], c.val.tolist()[0]]) == [ord("P"), ord("Q")]


def test_budget_stops_adding_files(tmp_path):
    _make_tree(tmp_path, n=12)
    c = load_corpus(str(tmp_path), 0.25, 400, seed=0)
    assert c.train.numel() == 300
    assert c.val.numel() == 100
    assert c.train_files == 2 and c.val_files == 1  # 160-byte files + separators


def test_missing_path_error_names_key(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(HDETConfigError, match="data.path") as err:
        load_corpus(str(missing), 0.1, 1000, seed=0)
    assert str(missing) in str(err.value)


def test_folder_without_readable_files_error_names_key(tmp_path):
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01" * 10)
    (tmp_path / ".hidden").write_text("hi")
    with pytest.raises(HDETConfigError, match="data.path"):
        load_corpus(str(tmp_path), 0.1, 1000, seed=0)


def _binary_files(d: pathlib.Path) -> dict[str, tuple[pathlib.Path, str]]:
    """Files that are not UTF-8 text: ``{name: (path, the reason's words)}``."""
    torch.save({"w": torch.zeros(8)}, d / "weights.pt")  # a zip archive: NUL bytes in its header
    (d / "latin1.txt").write_bytes("caf\u00e9 au lait\n".encode("latin-1") * 10)  # 0xE9: invalid UTF-8
    (d / "late_nul.txt").write_bytes(b"a" * 60_000 + b"\x00" + b"b" * 100)  # a NUL inside the first 64 KiB
    return {"weights.pt": (d / "weights.pt", "NUL byte"), "latin1.txt": (d / "latin1.txt", "invalid UTF-8 at byte 3"),
            "late_nul.txt": (d / "late_nul.txt", "NUL byte at byte 60000")}


def test_a_file_that_is_not_text_is_refused_naming_it(tmp_path):
    """A binary file named in data.path (a .pt file, a program, Latin-1 text) is not
    trained on as text: the error names the file, why (NUL byte / invalid UTF-8 and
    where) and what data.path takes."""
    for name, (path, why) in _binary_files(tmp_path).items():
        with pytest.raises(HDETConfigError) as err:
            load_corpus(str(path), 0.1, 10**6, seed=0)
        msg = str(err.value)
        assert msg.startswith("data.path:") and str(path) in msg and "not UTF-8 text" in msg and why in msg, msg
    with pytest.raises(HDETConfigError, match="not UTF-8 text"):
        load_corpus("/bin/ls", 0.1, 10**6, seed=0)


def test_text_is_judged_by_its_first_64_kib_only(tmp_path):
    """A character cut by the 64 KiB boundary, and anything after it, do not make a file
    binary (a large text file is not read twice in full)."""
    cut = tmp_path / "cut.txt"
    cut.write_bytes(b"a" * (64 * 1024 - 1) + "\u00e9".encode() + b"tail")  # 2-byte char across the boundary
    late = tmp_path / "late.txt"
    late.write_bytes(b"a" * (64 * 1024) + b"\x00\xff")
    for p in (cut, late):
        c = load_corpus(str(p), 0.1, 10**6, seed=0)
        assert c.train.numel() + c.val.numel() == p.stat().st_size


def test_a_folder_skips_files_that_are_not_text(tmp_path):
    """Inside a folder, the same rule skips files (a source tree holds images and build
    outputs); only its text files are read."""
    _binary_files(tmp_path)
    (tmp_path / "notes.txt").write_text("plain text " * 20)
    (tmp_path / "more.txt").write_text("more text " * 20)
    c = load_corpus(str(tmp_path), 0.5, 10**6, seed=0)
    assert c.train_files + c.val_files == 2
    got = bytes(c.train.tolist()) + bytes(c.val.tolist())
    assert b"caf" not in got and b"PK" not in got and b"\x00" not in got


def _in_thread(fn, timeout_s: float = 10.0):
    """``fn()``'s exception (or None), failing if it has not returned within
    ``timeout_s``: a FIFO opened for reading blocks until a writer comes."""
    out = []

    def run():
        try:
            fn()
            out.append(None)
        except Exception as e:  # noqa: BLE001 (handed back to the test)
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), "load_corpus blocked (it opened the FIFO)"
    return out[0]


def test_a_device_or_fifo_is_not_a_regular_file_and_never_blocks(tmp_path):
    """/dev/null and a FIFO are named as not a regular file, which kind (not 'does not
    exist'), without opening it (a FIFO's open would wait for a writer forever). A FIFO
    inside a folder is skipped, again without opening it. A broken link is named."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for path, kind in (("/dev/null", "character device"), (str(fifo), "FIFO")):
        err = _in_thread(lambda: load_corpus(path, 0.1, 1000, seed=0))
        assert isinstance(err, HDETConfigError), err
        assert f"data.path: {path!r} is not a regular file but a {kind}" in str(err), str(err)
        assert "does not exist" not in str(err)
    folder = tmp_path / "folder"
    folder.mkdir()
    os.mkfifo(folder / "pipe.txt")
    (folder / "a.txt").write_text("a" * 100)
    (folder / "b.txt").write_text("b" * 100)
    assert _in_thread(lambda: load_corpus(str(folder), 0.5, 1000, seed=0)) is None
    link = tmp_path / "link.txt"
    link.symlink_to(tmp_path / "gone.txt")
    with pytest.raises(HDETConfigError, match="broken symbolic link"):
        load_corpus(str(link), 0.1, 1000, seed=0)


@pytest.mark.parametrize("frac", [0.0, 1.0, -0.1, 1.5])
def test_bad_val_fraction_error_names_key(tmp_path, frac):
    (tmp_path / "x.txt").write_text("hello world")
    with pytest.raises(HDETConfigError, match="data.val_fraction"):
        load_corpus(str(tmp_path / "x.txt"), frac, 1000, seed=0)


# ----------------------------------------------------------------- batches


def _data(n: int = 5000) -> torch.Tensor:
    g = torch.Generator().manual_seed(123)
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.int64).to(torch.uint8)


def test_batch_shapes_dtypes_and_shift():
    data = _data()
    bb = ByteBatches(data, seq_len=16, micro_batch_size=3, seed=0, rank=0, world_size=1)
    x, y = bb.batch(0)
    assert x.shape == (3, 16) and y.shape == (3, 16)
    assert x.dtype == torch.int64 and y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    # each row is a contiguous window of the data
    full = data.to(torch.int64)
    for row_x, row_y in zip(x, y):
        window = torch.cat([row_x, row_y[-1:]])
        starts = [s for s in range(len(full) - 16) if torch.equal(full[s : s + 17], window)]
        assert starts


def test_same_global_batch_regardless_of_world_layout():
    data = _data()
    ref = ByteBatches(data, 32, 8, seed=7, rank=0, world_size=1)
    for step in (0, 1, 17):
        xr, yr = ref.batch(step)
        parts = [
            ByteBatches(data, 32, 2, seed=7, rank=r, world_size=4).batch(step) for r in range(4)
        ]
        assert torch.equal(torch.cat([p[0] for p in parts]), xr)
        assert torch.equal(torch.cat([p[1] for p in parts]), yr)
        # different ranks get different windows
        assert not torch.equal(parts[0][0], parts[1][0])


def test_batches_deterministic_and_vary_by_step_and_seed():
    data = _data()
    a = ByteBatches(data, 16, 4, seed=1, rank=0, world_size=1)
    b = ByteBatches(data, 16, 4, seed=1, rank=0, world_size=1)
    c = ByteBatches(data, 16, 4, seed=2, rank=0, world_size=1)
    assert torch.equal(a.batch(3)[0], b.batch(3)[0])
    assert torch.equal(a.batch(3)[0], a.batch(3)[0])
    assert not torch.equal(a.batch(3)[0], a.batch(4)[0])
    assert not torch.equal(a.batch(3)[0], c.batch(3)[0])


def test_batches_do_not_touch_global_rng():
    data = _data()
    before = torch.random.get_rng_state()
    bb = ByteBatches(data, 16, 4, seed=1, rank=1, world_size=2)
    bb.batch(0)
    bb.batch(5)
    bb.eval_batches(3)
    assert torch.equal(before, torch.random.get_rng_state())


def test_eval_batches_cover_data_evenly_and_ignore_rank():
    data = torch.arange(1000, dtype=torch.int64).remainder(256).to(torch.uint8)
    bb0 = ByteBatches(data, 10, 2, seed=0, rank=0, world_size=2)
    bb1 = ByteBatches(data, 10, 2, seed=9, rank=1, world_size=2)
    e0, e1 = bb0.eval_batches(3), bb1.eval_batches(3)
    assert len(e0) == 3
    for (x0, y0), (x1, y1) in zip(e0, e1):
        assert x0.shape == (2, 10) and x0.dtype == torch.int64
        assert torch.equal(x0, x1) and torch.equal(y0, y1)
        assert torch.equal(x0[:, 1:], y0[:, :-1])
    starts = [int(x[i, 0]) for x, _ in e0 for i in range(2)]
    # 6 windows evenly spread over the 990 window starts [0, 989]: 0, 198, ..., 989 (mod 256)
    expected = [round(i * 989 / 5) % 256 for i in range(6)]
    assert starts == expected


def test_too_small_data_error_names_keys_and_sizes():
    data = _data(100)
    with pytest.raises(HDETConfigError) as err:
        ByteBatches(data, 128, 2, seed=0, rank=0, world_size=1, key="data.train")
    msg = str(err.value)
    assert "data.seq_len" in msg and "data.train" in msg
    assert "100 bytes" in msg and "130" in msg
    # long enough for one window, not enough distinct windows for the global batch
    with pytest.raises(HDETConfigError) as err:
        ByteBatches(_data(40), 32, 4, seed=0, rank=0, world_size=4, key="data.val")
    msg = str(err.value)
    assert "deepspeed.train_micro_batch_size_per_gpu" in msg and "data.val" in msg
    assert "40 bytes" in msg and "48" in msg
    # exactly enough works
    ByteBatches(_data(48), 32, 4, seed=0, rank=3, world_size=4).batch(0)


def test_a_run_dir_inside_data_path_or_data_inside_run_dir_is_refused(tmp_path):
    """run_dir inside the data folder would make the run's own files training data (a
    resume then refused for a 13-byte split: the ``latest`` file). Both overlaps are
    refused by real path, links included; separate folders pass."""
    import os

    from hdet_scale.errors import HDETConfigError
    from hdet_scale.train.data_place import check_apart

    data = tmp_path / "data"
    data.mkdir()
    (tmp_path / "link").symlink_to(data)
    for run_dir in (data / "run", data, tmp_path / "link" / "run"):
        with pytest.raises(HDETConfigError, match="holds run_dir .* put run_dir outside data.path"):
            check_apart(f"{tmp_path / 'other.txt'},{data}", str(run_dir))
    with pytest.raises(HDETConfigError, match="is inside run_dir .* keep the data outside run_dir"):
        check_apart(str(data / "corpus.txt"), str(tmp_path))
    check_apart(str(data), str(tmp_path / "runs" / "a"))
    check_apart(str(tmp_path / "data2"), str(data))  # a name prefix is not a parent
    check_apart(None, str(data))
    assert os.path.exists(data)


def test_a_link_in_a_data_folder_into_run_dir_is_refused(tmp_path):
    """check_apart compares data.path's own parts with run_dir, but a link inside a data
    folder to the run's folder (or a file in it) would make the run's metrics and
    checkpoint files training data: refused while the folder is walked, naming the link;
    the same folder with the link pointing elsewhere loads, and without run_dir (the
    library's load_corpus) it is read as before."""
    from hdet_scale.errors import HDETConfigError
    from hdet_scale.train.data import load_corpus

    data, run_dir, other = tmp_path / "data", tmp_path / "runs" / "a", tmp_path / "other"
    for d in (data, run_dir, other):
        d.mkdir(parents=True)
    (data / "a.txt").write_text("x = 1\n" * 200)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n' * 50)
    (other / "b.txt").write_text("y = 2\n" * 200)
    for target, name in ((run_dir, "runs"), (run_dir / "metrics.jsonl", "m.jsonl")):
        link = data / name
        link.symlink_to(target)
        with pytest.raises(HDETConfigError, match=rf"data.path: '{link}.*' leads into run_dir '{run_dir}'"):
            load_corpus(str(data), 0.3, 10**9, seed=0, run_dir=str(run_dir))
        with_runs = load_corpus(str(data), 0.3, 10**9, seed=0)  # no run_dir: the library's reading
        assert b'{"step": 1}' in bytes(with_runs.train.tolist()) + bytes(with_runs.val.tolist())
        link.unlink()
    (data / "runs").symlink_to(other)
    c = load_corpus(str(data), 0.3, 10**9, seed=0, run_dir=str(run_dir))
    assert c.train_files + c.val_files == 2
    # a link to a run_dir that holds nothing yet (a fresh start), whose resume of the same
    # command would be refused; and a link to a folder that holds run_dir. Both refused at
    # the start, naming the link.
    (data / "runs").unlink()
    fresh = tmp_path / "fresh"
    for target, how in ((fresh, "leads into"), (tmp_path / "runs", "holds")):
        (data / "zlink").symlink_to(target, target_is_directory=True)
        fresh.mkdir(exist_ok=True)
        with pytest.raises(HDETConfigError, match=rf"data.path: '{data / 'zlink'}' {how} run_dir '.*' \(it links to "):
            load_corpus(str(data), 0.3, 10**9, seed=0, run_dir=str(fresh if how == "leads into" else run_dir))
        (data / "zlink").unlink()


# ----------------------------------------------------------------- links, large folders, commas


def test_a_linked_folder_inside_a_data_folder_is_read_once_and_a_link_cycle_ends(tmp_path):
    """A folder linked inside a data.path folder (``linkdir -> /tmp/real``, a corpus
    assembled with ``cp -rs`` or links) is walked like linked files are read (os.walk
    does not follow links, which would skip it without a word); a link to an ancestor (a
    cycle) ends, and a file or folder reached by two paths is read once."""
    from hdet_scale.train.data_files import collect

    real = tmp_path / "real"
    real.mkdir()
    for name in ("x.txt", "y.txt", "z.txt"):
        (real / name).write_text(f"{name} " * 10)
    fold = tmp_path / "fold"
    fold.mkdir()
    (fold / "a.txt").write_text("aaaaa")
    (fold / "linkdir").symlink_to(real)
    (fold / "again").symlink_to(real)  # the same folder through a second link
    (fold / "loop").symlink_to(fold)  # a link to an ancestor
    (real / "up").symlink_to(tmp_path)  # a cycle through the linked folder
    (fold / "sub").mkdir()
    (fold / "sub" / "s.txt").write_text("sub " * 5)
    (fold / "ab").symlink_to(fold / "sub")  # sorts first, but the folder keeps its own path
    files, _ = collect(str(fold))
    keys = [key for key, _ in files]
    assert keys == ["a.txt", "again/x.txt", "again/y.txt", "again/z.txt", "sub/s.txt"], keys
    c = load_corpus(str(fold), 0.5, 10**6, seed=0)
    assert c.train_files + c.val_files == 5


def test_a_large_folder_examines_only_the_files_it_reads(tmp_path, monkeypatch, capsys):
    """A file is opened only when the reading comes to it, with the same result (files,
    order, split), and a long scan prints one progress line: data.path=/usr (117k files)
    would otherwise spend 42 s before anything is printed, in the launcher and again in
    each rank, checking every file's first 64 KiB for being text although only
    data.max_bytes (4 MB) are read."""
    from hdet_scale.train import data_files
    from hdet_scale.train.data_read import read_splits

    for i in range(400):
        (tmp_path / f"f{i:04d}.txt").write_text(f"file {i:04d} " * 10)
    (tmp_path / "f0000.bin").write_bytes(b"\x00" * 100)  # not text: skipped when reached
    files, _ = data_files.collect(str(tmp_path))
    assert len(files) == 401 and files.judged <= 2  # collect opens only the folder's first files
    train, val = read_splits(files, 0.1, 2000, seed=0)
    assert 3 <= files.judged < 60, files.judged
    assert sum(map(len, train)) + len(train) - 1 == 1800 and sum(map(len, val)) + len(val) - 1 == 200
    everything = load_corpus(str(tmp_path), 0.1, 10**9, seed=0)  # reads (and judges) every file
    assert everything.train_files + everything.val_files == 400
    assert bytes(everything.train.tolist()).startswith(b"\n".join(train))  # the same files, in order
    monkeypatch.setattr(data_files, "PROGRESS_AFTER_S", 0.0)
    data_files.collect(str(tmp_path))
    err = capsys.readouterr().err
    assert err.count("hdet-train: reading data.path: ") == 1 and "files so far..." in err, err


def test_a_path_with_a_comma_is_named_when_its_parts_do_not_exist(tmp_path):
    """data.path=/tmp/x,y with an existing folder ``/tmp/x,y`` is not only "'/tmp/x' does
    not exist": data.path is split at commas, so a path with a comma cannot be given; the
    message says so and names the path."""
    comma = tmp_path / "x,y"
    comma.mkdir()
    (comma / "a.txt").write_text("hello")
    with pytest.raises(HDETConfigError) as err:
        load_corpus(str(comma), 0.1, 1000, seed=0)
    msg = str(err.value)
    assert f"data.path: {str(tmp_path / 'x')!r} does not exist" in msg, msg
    assert f"{str(comma)!r} (a path with a comma) cannot be given" in msg, msg
    assert "rename it or link it under a name without a comma" in msg, msg
    with pytest.raises(HDETConfigError) as err:  # an ordinary missing path gets no such note
        load_corpus(str(tmp_path / "nope"), 0.1, 1000, seed=0)
    assert "a path with a comma" not in str(err.value)


def test_an_item_that_adds_no_file_leaves_the_split_as_without_it(tmp_path):
    """``data.path=docs,docs`` (and ``docs,docs/config.md``) reads each file once and
    moves no file between the splits: an item that adds no file changes no key (with its
    item's index as a prefix of every key, 173808 / 6304 train / val bytes would become
    160281 / 19831); the split is bit-equal to the folder alone. Two items that both add
    files still hash apart (a.txt in two folders)."""
    (tmp_path / "d").mkdir()
    names = _make_tree(tmp_path / "d", n=12)
    alone = load_corpus(str(tmp_path / "d"), 0.3, 10**9, seed=5)
    assert 1 <= alone.val_files < len(names)
    for path in (f"{tmp_path / 'd'},{tmp_path / 'd'}", f"{tmp_path / 'd'},{tmp_path / 'd' / names[0]}",
                 f"{tmp_path / 'd'},{tmp_path / 'd'},{tmp_path / 'd'}/"):
        again = load_corpus(path, 0.3, 10**9, seed=5)
        assert torch.equal(again.train, alone.train) and torch.equal(again.val, alone.val), path
        assert (again.train_files, again.val_files) == (alone.train_files, alone.val_files)
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "extra.txt").write_text("extra text " * 20)
    both = load_corpus(f"{tmp_path / 'd'},{tmp_path / 'd'},{tmp_path / 'e'}", 0.3, 10**9, seed=5)
    without = load_corpus(f"{tmp_path / 'd'},{tmp_path / 'e'}", 0.3, 10**9, seed=5)
    assert torch.equal(both.train, without.train) and torch.equal(both.val, without.val)


# A real unreadable file: root reads a mode-000 file, so as root the child drops to
# "nobody" (after its imports: /root, where the interpreter lives, is closed to it) and
# reads the folder by a relative path (pytest's tmp folder is closed to it too).
_AS_NOBODY = """
import os, sys
from hdet_scale.errors import HDETConfigError
from hdet_scale.train.data import load_corpus
os.chdir(sys.argv[1])
if os.geteuid() == 0:
    try:
        os.setgroups([]); os.setgid(65534); os.setuid(65534)
    except OSError as e:
        print("SKIP", e); sys.exit(0)
try:
    c = load_corpus(sys.argv[2], 0.1, 10**6, seed=0)
    print("LOADED", c.train_files + c.val_files)
except HDETConfigError as e:
    print("REFUSED", e)
"""


def _load_as_nobody(cwd: pathlib.Path, path: str) -> str:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _AS_NOBODY, str(cwd), path], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    if out.stdout.startswith("SKIP"):
        pytest.skip(f"cannot drop root's privileges here: {out.stdout}")
    return out.stdout.strip()


def test_unreadable_files_in_a_folder_are_refused_naming_them(tmp_path):
    """A folder of 28 text files, 16 of them ``chmod 000``, would train on the other 12
    (42% of the corpus) without a word: refused before any rank starts: how many, the
    first three paths, the OS's reason and the fix. An unreadable subfolder is counted
    too; the readable files named alone still load."""
    tmp_path = tmp_path / "w"  # pytest's own folder is mode 700: "nobody" could not search it
    (tmp_path / "corpus").mkdir(parents=True)
    for d in (tmp_path, tmp_path / "corpus"):
        d.chmod(0o755)  # whatever the umask
    for i in range(28):
        (tmp_path / "corpus" / f"f{i:02d}.txt").write_text(f"text {i:02d} " * 20)
        (tmp_path / "corpus" / f"f{i:02d}.txt").chmod(0o644)
    for i in range(16):
        (tmp_path / "corpus" / f"f{i:02d}.txt").chmod(0)
    (tmp_path / "corpus" / "data.bin").write_bytes(b"\x00" * 10)  # not text: still skipped, not named
    msg = _load_as_nobody(tmp_path, "corpus")
    assert msg == ("REFUSED data.path: 16 files in folder 'corpus' cannot be read (Permission denied): "
                   "'corpus/f00.txt', 'corpus/f01.txt', 'corpus/f02.txt' and 13 more; make them readable by this "
                   "user (chmod, or ask their owner), or name only the readable files or subfolders in data.path "
                   "(comma-separated)"), msg
    (tmp_path / "corpus" / "sub").mkdir()
    (tmp_path / "corpus" / "sub" / "x.txt").write_text("x" * 100)
    (tmp_path / "corpus" / "sub").chmod(0)
    msg = _load_as_nobody(tmp_path, "corpus")
    assert msg.startswith("REFUSED data.path: 16 files and 1 folder in folder 'corpus' cannot be read "
                          "(Permission denied): ") and " and 14 more; " in msg, msg
    assert _load_as_nobody(tmp_path, "corpus/sub") == "REFUSED data.path: folder 'corpus/sub' cannot be read: " \
                                                      "Permission denied"
    readable = ",".join(f"corpus/f{i:02d}.txt" for i in range(16, 28))
    assert _load_as_nobody(tmp_path, readable) == "LOADED 12"


def test_data_read_by_neither_split_gets_a_note(tmp_path):
    """A folder of two files (39,504 and 120,077 bytes) with data.max_bytes=200000 trains
    on the smaller alone and validates on 20,000 bytes of the larger: 100 kB read by
    neither split. The note names it; none when both splits are full (max_bytes is what
    binds) or the validation split has room. (With seed 0, ``v.txt`` hashes to validation
    (0.07 < val_fraction 0.1) and ``t.txt`` to training.)"""
    from hdet_scale.train.config import load_run_config
    from hdet_scale.train.data import load_corpus
    from hdet_scale.train.run_notes import split_note

    folder = tmp_path / "two"
    folder.mkdir()
    (folder / "t.txt").write_text("t" * 39504)
    (folder / "v.txt").write_text("v" * 120077)

    def read(max_bytes):
        run = load_run_config(None, ["wandb.enabled=false", f"data.path={folder}", f"data.max_bytes={max_bytes}",
                                     "data.val_fraction=0.1", "seed=0", f"run_dir={tmp_path / 'run'}"])
        d = run["data"]
        corpus = load_corpus(d["path"], d["val_fraction"], d["max_bytes"], run["seed"], run["run_dir"])
        return (len(corpus.train), len(corpus.val)), split_note(run, len(corpus.train), len(corpus.val))

    sizes, notes = read(200000)
    assert sizes == (39504, 20000)
    assert notes == ["data: the validation split is full at 20000 bytes (data.val_fraction x data.max_bytes) and the "
                     "training split has 39504 of its 180000: the split is by file, so what the files held out for "
                     "validation hold beyond that is read by neither split (to train on it, give more or smaller "
                     "files, or a single file, which is split by position; to validate on it, raise "
                     "data.val_fraction)"]
    assert read(40000) == ((36000, 4000), [])  # both shares full: max_bytes binds, as documented
    # everything read, but 75% of it validates (val_fraction 0.1)
    sizes, notes = read(2_000_000)
    assert sizes == (39504, 120077)
    assert notes == ["data: validation holds 120077 of the 159581 bytes read (75%; data.val_fraction=0.1): with "
                     "several files the split is by file, so a few files split unevenly (to train on more, give "
                     "more or smaller files, or a single file, which is split by position)"]
    (folder / "t.txt").write_text("t" * 1_000_000)  # training's share: no note
    assert read(2_000_000) == ((1_000_000, 120077), [])


def test_a_wandb_dir_inside_data_path_is_refused_before_the_start(tmp_path):
    """wandb.dir inside data.path would put W&B's logs into the training data of the
    resume (the train/val split moving from 53759/27306 bytes to 85703/5454), without a
    word: refused by the run's checks (every rank, before any collective); outside it, or
    with W&B off, the same config passes that check."""
    from hdet_scale.train.config import load_run_config
    from hdet_scale.train.validate import validate

    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("hello world, some text to train on\n" * 20000)
    args = [f"data.path={data}", f"run_dir={tmp_path / 'run'}", "wandb.enabled=true", "wandb.mode=offline",
            "train.steps=40", "backend=ddp", "nproc=2"]
    run = load_run_config(None, [*args, f"wandb.dir={data / 'wb'}"])
    with pytest.raises(HDETConfigError, match=r"wandb.dir: .* is inside data.path .*: W&B's logs would be read as "
                                              r"training data \(at a resume\); put wandb.dir outside data.path"):
        validate(run, 2, build_model=False)
    validate(load_run_config(None, [*args, f"wandb.dir={tmp_path / 'wb'}"]), 2, build_model=False)
    validate(load_run_config(None, [*args[:2], "wandb.enabled=false", *args[4:], f"wandb.dir={data / 'wb'}"]), 2,
             build_model=False)


def test_one_text_file_beside_an_empty_one_names_why_a_split_is_empty(tmp_path):
    """``data.path=small.txt,empty.txt`` says that files are split by file once there
    are two (small.txt went to validation) and names the way out, not only "yields no
    readable, non-empty files for the train split"; the same text alone trains (split by
    position)."""
    (tmp_path / "small.txt").write_text("some text for the run\n" * 20)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(HDETConfigError) as err:
        load_corpus(str(tmp_path), 0.1, 10**6, seed=0)
    text = str(err.value)
    assert "its 2 text files (empty ones included) are split by file" in text, text
    assert "remove the empty or unreadable files (one text file is split by position)" in text, text
    (tmp_path / "empty.txt").unlink()
    c = load_corpus(str(tmp_path), 0.1, 10**6, seed=0)
    assert len(c.train) + len(c.val) == len(("some text for the run\n" * 20).encode())
