"""Data files as users hand them over: a byte-order mark, another encoding, a device instead of a file. Each
is read whole or refused with the file named; no row is lost silently."""

import json

import pytest

from tasks.aime24 import aime24
from tasks.longbench_v2 import longbench_v2 as lb
from tests.tasks.test_aime24 import H4_ROW
from tests.tasks.test_longbench_v2 import row


def _aime_ids(path) -> list[str]:
    loaded = aime24.load(source=str(path))
    assert not loaded.skipped, loaded.skipped
    return [s.id for s in loaded.samples]


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_byte_order_mark_loses_no_row(tmp_path, suffix):
    rows = [H4_ROW, H4_ROW | {"id": 61}]
    text = json.dumps(rows) if suffix == ".json" else "\n".join(json.dumps(r) for r in rows)
    path = tmp_path / f"aime{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert _aime_ids(path) == ["60", "61"]


def test_longbench_with_a_byte_order_mark(tmp_path):
    path = tmp_path / "data.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps([row()]).encode())
    assert len(lb.load(source=str(path)).samples) == 1


@pytest.mark.parametrize("load", [aime24.load, lb.load], ids=["aime24", "longbench_v2"])
def test_a_file_that_is_not_utf8_is_named(tmp_path, load):
    path = tmp_path / "latin1.json"
    path.write_bytes(json.dumps([H4_ROW | {"problem": "caf\u00e9"}], ensure_ascii=False).encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.json: not UTF-8 text"):
        load(source=str(path))


@pytest.mark.parametrize("load", [aime24.load, lb.load], ids=["aime24", "longbench_v2"])
def test_a_device_is_refused_not_read_forever(load):
    with pytest.raises(ValueError, match="/dev/zero is not a regular file or a folder"):
        load(source="/dev/zero")


def test_a_missing_source_is_named(tmp_path):
    with pytest.raises(ValueError, match="nothing-here.json does not exist"):
        aime24.load(source=str(tmp_path / "nothing-here.json"))
