"""DataReader: the round-robin rule, order, resume, back-pressure, shutdown, bad input."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
import weakref

import lmdb
import numpy as np
import pytest

from nccltree.data import (
    DataError,
    DataReader,
    EndOfData,
    ReaderClosed,
    encode_record,
    write_lmdb,
)
from nccltree.data.order import epoch_permutation


def index_db(path, n: int, shape=(2,)):
    """Record i holds the value i everywhere and has label i."""
    X = np.broadcast_to(np.arange(n, dtype=np.int64).reshape(n, *([1] * len(shape))), (n, *shape))
    write_lmdb(path, np.ascontiguousarray(X), np.arange(n))
    return path


def take(reader: DataReader, rounds: int) -> list[list[list[int]]]:
    """rounds x ranks x labels, releasing each batch."""
    out = []
    for _ in range(rounds):
        row = []
        for r in range(reader.ranks):
            with reader.next_batch(r, timeout=10) as b:
                assert (b.x[:, 0] == b.y).all()  # the data travels with its label
                row.append(b.y.tolist())
        out.append(row)
    return out


def wait_for(cond, what: str, deadline: float = 10.0) -> None:
    end = time.monotonic() + deadline
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "nccltree-DataReader"]


@pytest.fixture
def db10(tmp_path):
    return index_db(tmp_path / "db10", 10)


@pytest.fixture(params=["extension", "numpy"])
def small_path(request, monkeypatch):
    """Run a test on both ways of assembling small records: the ``_records`` extension
    and the numpy fallback used when the package was built without Python headers."""
    from nccltree.data import decode

    if request.param == "numpy":
        monkeypatch.setattr(decode, "_records_gather", lambda: None)
    elif decode._records_gather() is None:
        pytest.skip("built without the nccltree._records extension")
    return request.param


# -- the round-robin rule ----------------------------------------------------------------


@pytest.mark.usefixtures("small_path")
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("batch_size", [1, 3, 4])
@pytest.mark.slow
def test_round_robin_rule(db10, ranks, batch_size):
    n, rounds = 10, 7  # 7 rounds wrap around the 10 records several times
    with DataReader(db10, batch_size, ranks) as r:
        got = take(r, rounds)
    with DataReader(db10, ranks * batch_size, 1) as single:
        ref = take(single, rounds)
    for i in range(rounds):
        start = i * ranks * batch_size
        for rank in range(ranks):
            # record g of the endless sequence goes to rank g mod ranks
            want = [g % n for g in range(start, start + ranks * batch_size) if g % ranks == rank]
            assert got[i][rank] == want
        # the union of the ranks' batch i is exactly the single-rank batch i
        interleaved = [got[i][j % ranks][j // ranks] for j in range(ranks * batch_size)]
        assert interleaved == ref[i][0]


def test_records_and_labels_have_record_shape(tmp_path):
    path = index_db(tmp_path / "db", 6, shape=(2, 3))
    with DataReader(path, 4) as r, r.next_batch() as b:
        x, y = b
        assert x.shape == (4, 2, 3) and x.dtype == np.int64 and y.dtype == np.int64
        assert (x == y[:, None, None]).all()
        assert len(b) == 4 and b.index == 0 and b.position == 0


@pytest.mark.parametrize("shuffle", [None, 4])
@pytest.mark.parametrize("procs,ranks", [(2, 1), (3, 1), (2, 2)])
def test_multi_process_filter_matches_single_process(db10, procs, ranks, shuffle):
    rounds, bs = 4, 3
    with DataReader(db10, bs, ranks * procs, shuffle=shuffle) as single:
        ref = take(single, rounds)
    for p in range(procs):
        with DataReader(db10, bs, ranks, process_rank=p, process_count=procs, shuffle=shuffle) as r:
            got = take(r, rounds)
        for i in range(rounds):
            for local in range(ranks):
                assert got[i][local] == ref[i][p * ranks + local]


# -- order: shuffle, epochs, resume ------------------------------------------------------


def test_shuffle_is_a_seeded_permutation_per_epoch(db10):
    with DataReader(db10, 5, 2, shuffle=7) as r:
        a = take(r, 4)  # 40 positions = 4 epochs
    with DataReader(db10, 5, 2, shuffle=7) as r:
        assert take(r, 4) == a
    with DataReader(db10, 10, 1, shuffle=7) as single:
        ref = take(single, 4)
    seq = [x for row in ref for x in row[0]]
    for e in range(4):
        assert seq[10 * e : 10 * e + 10] == epoch_permutation(7, e, 10).tolist()
        assert sorted(seq[10 * e : 10 * e + 10]) == list(range(10))
    assert seq[:10] != seq[10:20]  # a new permutation every epoch
    for i in range(4):  # the round-robin rule applies to the permuted sequence
        assert a[i][0] == ref[i][0][0::2] and a[i][1] == ref[i][0][1::2]
    with DataReader(db10, 5, 2, shuffle=8) as r:
        assert take(r, 4) != a


@pytest.mark.parametrize("drop_last", [False, True])
def test_epochs_end(db10, drop_last):
    # 2 epochs = 20 records; rounds of 3 ranks x 3 = 9: two full rounds, then 2 records
    with DataReader(db10, 3, 3, epochs=2, drop_last=drop_last) as r:
        assert r.batches_per_rank == (2 if drop_last else 3)
        per_rank = [[b.y.tolist() for b in r.batches(rank)] for rank in range(3)]
        assert all(len(p) == r.batches_per_rank for p in per_rank)  # same count on every rank
        with pytest.raises(EndOfData, match="rank 1"):
            r.next_batch(1)
        assert r.position == (18 if drop_last else 20)
        assert r.stats()["phase"] == "ended"
    seq = sorted(x for p in per_rank for b in p for x in b)
    expect = sorted([g % 10 for g in range(18 if drop_last else 20)])
    assert seq == expect
    if not drop_last:
        assert [len(p[2]) for p in per_rank] == [1, 1, 0]  # short, and empty, last batches


def test_evaluation_pass_with_shuffle_covers_each_record_once(db10):
    with DataReader(db10, 4, 2, epochs=1, shuffle=3) as r:
        seen = [y for rank in range(2) for b in r.batches(rank) for y in b.y.tolist()]
    assert sorted(seen) == list(range(10))


@pytest.mark.parametrize("shuffle", [None, 5])
def test_resume_from_position(db10, shuffle):
    ranks, bs = 3, 2
    with DataReader(db10, bs, ranks, shuffle=shuffle) as r:
        first = take(r, 3)
        pos = r.position
        assert pos == 3 * ranks * bs
        rest = take(r, 4)
    with DataReader(db10, bs, ranks, start=pos, shuffle=shuffle) as resumed:
        assert take(resumed, 4) == rest
        assert resumed.position == pos + 4 * ranks * bs
    assert first  # (the first part is what the snapshot covered)


def test_position_counts_rounds_served_to_every_rank(db10):
    with DataReader(db10, 2, 2) as r:
        r.next_batch(0).release()
        assert r.position == 0  # rank 1 has not had batch 0 yet
        r.next_batch(1).release()
        assert r.position == 4
        r.next_batch(0).release()
        assert r.position == 4


def test_start_mid_sequence_follows_the_rule(db10):
    with DataReader(db10, 2, 2, start=13) as r:
        got = take(r, 2)
    # positions 13..16 then 17..20: g mod 2 picks the rank
    assert got == [[[4, 6], [3, 5]], [[8, 0], [7, 9]]]


# -- transforms and device hand-off ------------------------------------------------------


@pytest.mark.usefixtures("small_path")
def test_transforms_mean_and_scale(tmp_path):
    X = np.random.default_rng(0).integers(0, 256, (8, 3, 2, 2), dtype=np.uint8)
    write_lmdb(tmp_path / "db", X, np.zeros(8, int))
    mean = [10.0, 20.0, 30.0]
    with DataReader(tmp_path / "db", 8, mean=mean, scale=0.5) as r, r.next_batch() as b:
        assert b.x.dtype == np.float32
        want = (X.astype(np.float32) - np.array(mean, np.float32)[:, None, None]) * 0.5
        np.testing.assert_allclose(b.x, want, rtol=1e-6)
    with DataReader(tmp_path / "db", 8, dtype="float32") as r, r.next_batch() as b:
        assert b.x.dtype == np.float32
        np.testing.assert_array_equal(b.x, X)
    full_mean = X.mean(0)
    with DataReader(tmp_path / "db", 8, mean=full_mean) as r, r.next_batch() as b:
        np.testing.assert_allclose(b.x, X - full_mean.astype(np.float32), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="one per channel"):
        DataReader(tmp_path / "db", 2, mean=[1.0, 2.0])
    with pytest.raises(ValueError, match="float type"):
        DataReader(tmp_path / "db", 2, dtype="int32")


def test_large_records_with_transform(tmp_path):
    # records above the small-record size take the per-record copy path
    X = np.random.default_rng(1).integers(0, 256, (5, 40000), dtype=np.uint8)
    write_lmdb(tmp_path / "db", X, np.arange(5))
    with DataReader(tmp_path / "db", 3, epochs=1) as r:
        got = [(b.x.copy(), b.y.tolist()) for b in r.batches()]
    np.testing.assert_array_equal(np.concatenate([g[0] for g in got]), X)
    assert [y for g in got for y in g[1]] == list(range(5))
    with DataReader(tmp_path / "db", 5, scale=2.0) as r, r.next_batch() as b:
        np.testing.assert_array_equal(b.x, X.astype(np.float32) * 2)


@pytest.mark.parametrize("native", [True, False], ids=["gather", "per-record"])
def test_large_records_are_served_unchanged(tmp_path, monkeypatch, native):
    # the large-record copy (native gather over all cores, or one by one without the
    # native library) serves exactly the records, in the rule's order, to every rank
    from nccltree import _native
    from nccltree.data import decode

    calls = []

    def counting_gather(*args):
        calls.append(len(args[1]))
        return _native.gather(*args)

    monkeypatch.setattr(decode, "_native_gather", lambda: counting_gather if native else None)
    X = np.random.default_rng(2).integers(0, 256, (11, 3, 12001), dtype=np.uint8)
    write_lmdb(tmp_path / "db", X, np.arange(11) * 3)
    with DataReader(tmp_path / "db", 2, 2, shuffle=4, epochs=1) as r:
        got = {0: [], 1: []}
        for _ in range(2):
            for rank in (0, 1):
                with r.next_batch(rank) as b:
                    got[rank].append((b.x.copy(), b.y.tolist()))
    assert (sum(calls) >= 8) if native else not calls
    order = epoch_permutation(4, 0, 11)[:8]
    for rank in (0, 1):
        idx = [int(i) for i in order[rank::2]]
        np.testing.assert_array_equal(np.concatenate([g[0] for g in got[rank]]), X[idx])
        assert [y for g in got[rank] for y in g[1]] == [3 * i for i in idx]


def test_device_hand_off(db10, make_devices):
    devs = make_devices(2)
    with DataReader(db10, 3, 2, device=devs) as r:
        for _ in range(5):
            for rank in range(2):
                with r.next_batch(rank) as b:
                    x = devs[rank].to_host(b.x)
                    y = devs[rank].to_host(b.y)
                    np.testing.assert_array_equal(x[:, 0], y)
                    np.testing.assert_array_equal(b.y_host, y)
    with pytest.raises(ValueError, match="one per rank"):
        DataReader(db10, 3, 2, device=devs[:1])


# -- back-pressure, stall counters -------------------------------------------------------


@pytest.mark.parametrize("prefetch,slots", [(2, 2), (0, 1)])
def test_prefetch_back_pressure(db10, prefetch, slots):
    with DataReader(db10, 2, 2, prefetch=prefetch) as r:
        # nobody consumes: the reader fills every buffer and then blocks
        wait_for(lambda: r.stats()["phase"] == "waiting", "the reader to block")
        st = r.stats()
        assert st["records_read"] == slots * 4 and st["queued"] == [slots, slots]
        held = [r.next_batch(0), r.next_batch(1)]
        assert r.stats()["records_read"] == slots * 4  # taking is not releasing
        held[0].release()
        assert r.stats()["records_read"] == slots * 4  # rank 1 still holds its buffer
        held[1].release()
        wait_for(lambda: r.stats()["records_read"] == (slots + 1) * 4, "one more round")
        wait_for(lambda: r.stats()["phase"] == "waiting", "the reader to block again")
        assert r.stats()["records_read"] == (slots + 1) * 4


def test_holding_every_buffer_is_an_error_not_a_hang(db10):
    with DataReader(db10, 2, prefetch=2) as r:
        a, b = r.next_batch(), r.next_batch()
        with pytest.raises(RuntimeError, match="holds all 2"):
            r.next_batch()
        a.release()
        r.next_batch(timeout=10).release()
        b.release()


def test_waiting_is_counted_and_logged(db10, caplog):
    with DataReader(db10, 2, 2, prefetch=1, log_on_wait="rank {rank} starves") as r:
        held = r.next_batch(0)  # rank 0 keeps its only buffer, so the reader stalls
        r.next_batch(1).release()
        waited = r.stats()["wait_s"][1]
        with caplog.at_level("INFO", logger="nccltree.queue"):
            with pytest.raises(TimeoutError, match="rank 1"):
                r.next_batch(1, timeout=0.05)
        assert "rank 1 starves" in caplog.text
        st = r.stats()
        assert st["wait_s"][1] > waited
        assert st["batches_served"] == [1, 1]
        held.release()
        r.next_batch(1, timeout=10).release()


# -- shutdown ----------------------------------------------------------------------------


def test_close_wakes_a_waiting_rank(db10):
    before = len(reader_threads())
    r = DataReader(db10, 2, 2, prefetch=1)
    held = r.next_batch(0)
    r.next_batch(1).release()
    caught: list[BaseException] = []

    def rank1() -> None:
        try:
            r.next_batch(1)
        except BaseException as e:  # noqa: BLE001 -- recorded for the assertion
            caught.append(e)

    t = threading.Thread(target=rank1)
    t.start()
    wait_for(lambda: r.stats()["waiting"][1] or caught, "rank 1 to wait")
    r.close()
    t.join(10)
    assert not t.is_alive()
    assert len(caught) == 1 and isinstance(caught[0], ReaderClosed)
    assert "closed" in str(caught[0])
    held.release()  # after close: harmless
    with pytest.raises(ReaderClosed):
        r.next_batch(0)
    r.close()
    assert len(reader_threads()) == before


def test_garbage_collection_stops_the_thread(db10):
    before = len(reader_threads())
    r = DataReader(db10, 2, 2)
    r.next_batch(0).release()
    ref = weakref.ref(r)
    wait_for(lambda: ref().stats()["phase"] == "waiting", "the reader to block")
    assert len(reader_threads()) == before + 1
    del r
    gc.collect()
    assert ref() is None
    assert len(reader_threads()) == before


def test_context_manager_and_ended_reader_clean_up(db10):
    before = len(reader_threads())
    with DataReader(db10, 4, epochs=1) as r:
        assert [len(b) for b in r.batches()] == [4, 4, 2]
    assert r.closed and len(reader_threads()) == before


def test_released_batch_cannot_be_used(db10):
    with DataReader(db10, 2) as r:
        b = r.next_batch()
        b.release()
        b.release()  # a second release does nothing
        with pytest.raises(RuntimeError, match="released"):
            b.x  # noqa: B018


# -- bad input ---------------------------------------------------------------------------


def test_bad_arguments(db10):
    for kwargs, match in [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 2, "prefetch": -1}, "prefetch"),
        ({"batch_size": 2, "ranks": 0}, "ranks"),
        ({"batch_size": 2, "epochs": 0}, "epochs"),
        ({"batch_size": 2, "start": -1}, "start"),
        ({"batch_size": 2, "shuffle": -3}, "shuffle"),
        ({"batch_size": 2, "process_rank": 2, "process_count": 2}, "process_rank"),
        ({"batch_size": 2, "format": "tfrecord"}, "format"),
        ({"batch_size": 2, "log_on_wait": 3}, "log_on_wait"),
        ({"batch_size": 2, "epochs": 1, "start": 11}, "past the end"),
    ]:
        with pytest.raises((ValueError, TypeError), match=match):
            DataReader(db10, **kwargs)
    with DataReader(db10, 2, 2) as r:
        with pytest.raises(ValueError, match="rank must be"):
            r.next_batch(2)


def test_arguments_follow_the_one_rule(db10):
    # numpy integers are integers; bool and floats are not; NaN and inf are not numbers
    with DataReader(
        db10, np.int64(4), ranks=np.int32(2), prefetch=np.uint8(2), epochs=np.int64(1)
    ) as r:
        assert r.batch_size == 4 and type(r.batch_size) is int
        with r.next_batch(np.int64(1), timeout=np.float64(10)) as b:
            assert b.rank == 1 and len(b) == 4
        for bad in (True, 0.0):
            with pytest.raises(TypeError, match="rank must be an integer"):
                r.next_batch(bad)
        for bad in (float("nan"), float("inf"), -1.0):
            with pytest.raises(ValueError, match="timeout must be"):
                r.next_batch(0, timeout=bad)
    for kwargs, exc, match in [
        ({"batch_size": True}, TypeError, "batch_size must be an integer"),
        ({"batch_size": 2.0}, TypeError, "batch_size must be an integer"),
        ({"batch_size": 2, "ranks": np.bool_(True)}, TypeError, "ranks must be an integer"),
        ({"batch_size": 2, "scale": float("nan")}, ValueError, "scale must be a number"),
        ({"batch_size": 2, "scale": float("inf")}, ValueError, "scale must be finite"),
        ({"batch_size": 2, "scale": "0.5"}, TypeError, "scale must be a real number"),
        ({"batch_size": 2, "scale": True}, TypeError, "scale must be a real number"),
    ]:
        with pytest.raises(exc, match=match):
            DataReader(db10, **kwargs)
    with DataReader(db10, 2, scale=np.float64(0.5)) as r, r.next_batch() as b:
        assert b.x.dtype == np.float32


def test_batch_larger_than_tiny_database_with_drop_last(tmp_path):
    path = index_db(tmp_path / "tiny", 3)
    with pytest.raises(ValueError, match="no batch at all"):
        DataReader(path, 4, epochs=1, drop_last=True)
    with pytest.raises(ValueError, match="no batch at all"):
        DataReader(path, 1, ranks=2, process_count=2, epochs=1, drop_last=True)
    with DataReader(path, 4, epochs=1) as r:  # without drop_last: one short batch
        assert [b.y.tolist() for b in r.batches()] == [[0, 1, 2]]
    with DataReader(path, 4) as r:  # endless: batches wrap around the database
        assert take(r, 2) == [[[0, 1, 2, 0]], [[1, 2, 0, 1]]]


def test_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError):
        DataReader(tmp_path / "nope", 2)
    (tmp_path / "file").write_bytes(b"not lmdb at all" * 100)
    with pytest.raises(DataError, match="not a readable LMDB"):
        DataReader(tmp_path / "file", 2)
    env = lmdb.open(str(tmp_path / "empty"))
    env.close()
    with pytest.raises(DataError, match="empty"):
        DataReader(tmp_path / "empty", 2)


def _raw_db(path, values) -> None:
    env = lmdb.open(str(path), map_size=1 << 24)
    with env.begin(write=True) as txn:
        for i, v in enumerate(values):
            txn.put(b"%08d" % i, v)
    env.close()


@pytest.mark.usefixtures("small_path")
@pytest.mark.parametrize("size", [4, 40000])  # the small- and the large-record path
def test_undecodable_record_is_raised_with_its_key(tmp_path, size):
    good = [encode_record(np.full(size, i, np.uint8), i) for i in range(6)]
    good[4] = good[4][:-1]  # truncated
    _raw_db(tmp_path / "db", good)
    with DataReader(tmp_path / "db", 2, 1) as r:
        assert r.next_batch().y.tolist() == [0, 1]  # batches before the bad one are fine
        r.next_batch().release()  # (the first batch was dropped unreleased: prefetch 4)
        with pytest.raises(DataError, match="record '00000004'.*bytes"):
            r.next_batch()
        with pytest.raises(DataError, match="'00000004'"):
            r.next_batch()  # and it stays failed
        assert r.stats()["phase"] == "failed"


@pytest.mark.parametrize(
    "other",
    [np.zeros(3, np.float32), np.zeros((2, 2), np.float32), np.zeros(4, np.int32)],
    ids=["shape", "same-size-shape", "dtype"],
)
@pytest.mark.usefixtures("small_path")
def test_mixed_records_are_rejected(tmp_path, other):
    values = [encode_record(np.zeros(4, np.float32), i) for i in range(5)]
    values[3] = encode_record(other, 3)
    _raw_db(tmp_path / "db", values)
    with DataReader(tmp_path / "db", 5) as r:
        with pytest.raises(DataError, match="'00000003'.*differs"):
            r.next_batch()


def test_garbage_record_in_shuffled_datum_db(tmp_path):
    from test_data_format import datum_bytes

    values = [datum_bytes(1, 1, 2, data=bytes([i, i]), label=i) for i in range(4)]
    values[2] = b"\x0a\x05ab"  # a length-delimited field 1 running past the end
    _raw_db(tmp_path / "db", values)
    with DataReader(tmp_path / "db", 4, shuffle=1) as r:
        with pytest.raises(DataError, match="'00000002'.*Datum"):
            r.next_batch()


@pytest.mark.subprocess
def test_process_exits_with_an_open_reader_and_a_waiting_thread(db10):
    code = f"""
import threading
from nccltree.data import DataReader
r = DataReader({str(db10)!r}, 2, 2, prefetch=1)
held = r.next_batch(0)                       # rank 0 keeps its only buffer: the reader stalls
r.next_batch(1).release()
threading.Thread(target=r.next_batch, args=(1,), daemon=True).start()   # ...and rank 1 waits
print("ok", flush=True)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
