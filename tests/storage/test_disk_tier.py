import errno
import json
import logging
import os
import stat

import pytest
import torch

from storage.block_hash import hash_block
from storage.disk_tier import DiskTier

SHAPE = (2, 2, 2, 4, 8)  # layers, K/V, kv heads, block size, head dim
NBYTES = 2 * 2 * 2 * 4 * 8 * 2  # float16: 512 bytes a block
NS = "tiny-model|float16|L2H2D8B4"


def name(i: int) -> bytes:
    return hash_block(None, [i], b"test")


def payload(i: int, dtype=torch.float16, shape=SHAPE) -> torch.Tensor:
    return (torch.arange(torch.Size(shape).numel()) + 1000 * i).reshape(shape).to(dtype)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def group_files(tier: DiskTier) -> list:
    return sorted(p for p in tier.path.iterdir() if p.suffix == ".kvg")


def open_tier(root, **kw) -> DiskTier:
    kw.setdefault("blocks_per_group", 2)
    return DiskTier(root, kw.pop("namespace", NS), kw.pop("capacity_bytes", 64 * NBYTES), **kw)


def test_blocks_are_written_in_groups_with_private_modes(tmp_path):
    root = tmp_path / "kv"
    tier = open_tier(root, blocks_per_group=3)
    assert mode(root) == 0o700 and mode(tier.path) == 0o700
    assert tier.put(name(0), payload(0)) == [] and tier.put(name(1), payload(1)) == []
    assert group_files(tier) == []  # still filling the first group
    assert torch.equal(tier.get(name(1)), payload(1))  # served from memory meanwhile
    tier.put(name(2), payload(2))
    [group] = group_files(tier)
    assert group.stat().st_size == 3 * NBYTES and mode(group) == 0o600
    assert tier.used_bytes == 3 * NBYTES
    tier.flush()
    assert mode(tier.path / "index.json") == 0o600
    tier.check_integrity()


def test_a_group_is_read_once_while_it_stays_in_the_reuse_buffer(tmp_path):
    tier = open_tier(tmp_path, blocks_per_group=3)
    for i in range(3):
        tier.put(name(i), payload(i))
    for i in (0, 1, 2, 0):
        assert torch.equal(tier.get(name(i)), payload(i))
    assert tier.num_group_reads == 1
    tier.flush()
    no_reuse = open_tier(tmp_path, blocks_per_group=3, reuse_buffer_groups=0)
    for i in (0, 1, 2):
        assert torch.equal(no_reuse.get(name(i)), payload(i))
    assert no_reuse.num_group_reads == 3


def test_a_new_instance_sees_the_blocks_with_their_exact_dtype_and_shape(tmp_path):
    blocks = {name(0): payload(0), name(1): payload(1, torch.bfloat16),
              name(2): payload(2, torch.float32, (2, 2, 1, 4, 8)),
              name(3): payload(3, torch.int64, (5,))}
    tier = open_tier(tmp_path)
    for h, p in blocks.items():
        tier.put(h, p)
    tier.close()
    again = open_tier(tmp_path)
    assert again.num_blocks == 4 and again.used_bytes == tier.used_bytes
    for h, p in blocks.items():
        got = again.get(h)
        assert got.dtype == p.dtype and got.shape == p.shape and torch.equal(got, p)
    again.check_integrity()


def test_another_namespace_never_sees_the_blocks(tmp_path):
    tier = open_tier(tmp_path)
    tier.put(name(0), payload(0))
    tier.close()
    other = open_tier(tmp_path, namespace="other-model|bfloat16|L2H2D8B4")
    assert other.path != tier.path and not other.contains(name(0)) and other.get(name(0)) is None


def test_an_index_naming_another_namespace_is_ignored_and_its_files_removed(tmp_path, caplog):
    tier = open_tier(tmp_path)
    tier.put(name(0), payload(0))
    tier.put(name(1), payload(1))
    tier.close()
    index = tier.path / "index.json"
    doc = json.loads(index.read_text())
    doc["namespace"] = "someone-else"
    index.write_text(json.dumps(doc))
    with caplog.at_level(logging.WARNING):
        again = open_tier(tmp_path)
    assert again.num_blocks == 0 and again.used_bytes == 0 and group_files(again) == []
    assert "ignored" in caplog.text
    again.check_integrity()


def test_blocks_after_the_last_index_snapshot_are_lost_and_their_files_removed(tmp_path):
    tier = open_tier(tmp_path, index_interval_groups=2)
    for i in range(6):  # the index is written after group {2, 3}, not after group {4, 5}
        tier.put(name(i), payload(i))
    assert len(group_files(tier)) == 3  # and then the process dies without flush()
    again = open_tier(tmp_path)
    assert [again.contains(name(i)) for i in range(6)] == [True] * 4 + [False] * 2
    assert len(group_files(again)) == 2 and again.used_bytes == 4 * NBYTES
    again.check_integrity()


def test_a_corrupt_byte_is_a_miss_and_the_entry_is_dropped(tmp_path, caplog):
    tier = open_tier(tmp_path)
    tier.put(name(0), payload(0))
    tier.put(name(1), payload(1))
    tier.close()
    [group] = group_files(tier)
    raw = bytearray(group.read_bytes())
    raw[NBYTES + 7] ^= 0xFF  # inside block 1
    group.write_bytes(bytes(raw))
    again = open_tier(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert again.get(name(1)) is None
    assert "checksum" in caplog.text
    assert not again.contains(name(1)) and again.get(name(1)) is None
    assert torch.equal(again.get(name(0)), payload(0))  # its neighbour is intact
    again.check_integrity()


def test_a_truncated_group_loses_only_the_blocks_past_its_end(tmp_path):
    tier = open_tier(tmp_path, reuse_buffer_groups=0)
    tier.put(name(0), payload(0))
    tier.put(name(1), payload(1))
    [group] = group_files(tier)
    os.truncate(group, NBYTES + 100)
    assert tier.get(name(1)) is None and not tier.contains(name(1))
    assert torch.equal(tier.get(name(0)), payload(0))
    tier.check_integrity()
    tier.close()
    os.truncate(group, NBYTES - 1)  # now block 0 is cut too: dropped when the index is loaded
    again = open_tier(tmp_path)
    assert again.num_blocks == 0 and group_files(again) == [] and again.used_bytes == 0
    again.check_integrity()


def test_a_missing_group_file_drops_the_whole_group(tmp_path):
    tier = open_tier(tmp_path)
    for i in range(4):
        tier.put(name(i), payload(i))
    first = group_files(tier)[0]
    first.unlink()
    assert tier.get(name(0)) is None
    assert [tier.contains(name(i)) for i in range(4)] == [False, False, True, True]
    assert tier.used_bytes == 2 * NBYTES
    tier.check_integrity()


def test_whole_groups_are_evicted_least_recently_used_first(tmp_path):
    tier = open_tier(tmp_path, capacity_bytes=4 * NBYTES)
    for i in range(4):
        assert tier.put(name(i), payload(i)) == []
    tier.get(name(0))  # group {0, 1} is now the most recently used
    assert tier.put(name(4), payload(4)) == sorted([name(2), name(3)])
    assert tier.used_bytes == 3 * NBYTES
    assert tier.put(name(5), payload(5)) == []
    assert tier.group_order() == [sorted([name(0), name(1)]), sorted([name(4), name(5)])]
    assert tier.put(name(6), payload(6)) == sorted([name(0), name(1)])
    assert tier.put(name(7), payload(7)) == []
    assert tier.group_order() == [sorted([name(4), name(5)]), sorted([name(6), name(7)])]
    assert tier.used_bytes == 4 * NBYTES
    assert tier.put(name(8), payload(8, shape=(4, *SHAPE[1:]))) == sorted([name(4), name(5)])
    assert tier.put(name(9), payload(9, shape=(9, *SHAPE[1:]))) == []  # over the whole budget
    assert not tier.contains(name(9))
    tier.check_integrity()


def test_a_smaller_budget_on_reopen_evicts_the_oldest_groups(tmp_path):
    tier = open_tier(tmp_path)
    for i in range(6):
        tier.put(name(i), payload(i))
    tier.get(name(0))
    tier.close()
    again = open_tier(tmp_path, capacity_bytes=4 * NBYTES)
    assert [again.contains(name(i)) for i in range(6)] == [True, True, False, False, True, True]
    again.check_integrity()


def test_discarded_bytes_are_reclaimed_with_their_group(tmp_path):
    tier = open_tier(tmp_path)
    tier.put(name(0), payload(0))
    tier.put(name(1), payload(1))
    assert tier.discard(name(0)) and not tier.discard(name(0))
    assert tier.used_bytes == 2 * NBYTES and tier.get(name(0)) is None
    tier.discard(name(1))
    assert tier.used_bytes == 0 and group_files(tier) == []
    tier.put(name(2), payload(2))
    tier.discard(name(2))  # pending: its bytes go when the group would have been written
    assert tier.flush() == [] and tier.used_bytes == 0 and group_files(tier) == []
    tier.check_integrity()


def test_enospc_disables_spilling_with_a_warning(tmp_path, monkeypatch, caplog):
    tier = open_tier(tmp_path)
    tier.put(name(0), payload(0))
    tier.put(name(1), payload(1))

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    tier.put(name(2), payload(2))
    with caplog.at_level(logging.WARNING):
        assert tier.put(name(3), payload(3)) == [name(2), name(3)]  # lost with the failed group
    monkeypatch.undo()
    assert "spilling disabled" in caplog.text and not tier.is_enabled
    assert not tier.contains(name(2)) and not tier.contains(name(3))
    assert len(group_files(tier)) == 1 and tier.used_bytes == 2 * NBYTES
    assert tier.put(name(4), payload(4)) == [] and not tier.contains(name(4))
    assert torch.equal(tier.get(name(1)), payload(1))  # what was written is still served
    assert tier.flush() == []
    tier.check_integrity()


def test_an_unusable_directory_disables_the_tier(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with caplog.at_level(logging.WARNING):
        tier = open_tier(blocker / "kv")
    assert not tier.is_enabled and "spilling disabled" in caplog.text
    assert tier.put(name(0), payload(0)) == [] and tier.get(name(0)) is None


def test_a_name_already_held_is_not_written_twice(tmp_path):
    tier = open_tier(tmp_path)
    tier.put(name(0), payload(0))
    tier.put(name(1), payload(1))
    tier.put(name(2), payload(2))
    tier.put(name(3), payload(3))
    tier.put(name(0), payload(0))  # marks group {0, 1} used
    assert tier.group_order()[-1] == sorted([name(0), name(1)])
    assert tier.used_bytes == 4 * NBYTES


@pytest.mark.parametrize("bad", [b"", b"{not json", b'{"format": 1}', b"[1, 2]"])
def test_an_unreadable_index_starts_empty(tmp_path, bad):
    tier = open_tier(tmp_path)
    tier.put(name(0), payload(0))
    tier.put(name(1), payload(1))
    tier.close()
    (tier.path / "index.json").write_bytes(bad)
    again = open_tier(tmp_path)
    assert again.num_blocks == 0 and group_files(again) == []
    again.check_integrity()
