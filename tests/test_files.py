"""files.file_digests: a file's sha256 is read again only when the file changed since it was hashed."""

from __future__ import annotations

import hashlib
import json
import os

from trt_lookahead.files import DIGESTS_FILE, file_digests


def test_a_digest_is_remembered_until_the_file_changes_even_with_its_mtime_put_back(tmp_path):
    a, b, cache = tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "cache"
    a.write_bytes(b"x" * 5000)
    b.write_bytes(b"y" * 70)
    hashed: list[str] = []
    want = [hashlib.sha256(b"x" * 5000).hexdigest(), hashlib.sha256(b"y" * 70).hexdigest()]
    assert file_digests([a, b], lambda p: hashed.append(p.name), cache) == want and hashed == ["a.bin", "b.bin"]
    index = json.loads((cache / DIGESTS_FILE).read_text())
    stat = a.stat()
    assert index[str(a.resolve())] == [5000, stat.st_mtime_ns, stat.st_ctime_ns, want[0]]
    hashed.clear()
    assert file_digests([a, b], lambda p: hashed.append(p.name), cache) == want and hashed == []
    a.write_bytes(b"z" + b"x" * 4999)  # same size, mtime put back: the ctime still moved
    os.utime(a, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    changed = hashlib.sha256(b"z" + b"x" * 4999).hexdigest()
    assert file_digests([a, b], lambda p: hashed.append(p.name), cache) == [changed, want[1]] and hashed == ["a.bin"]


def test_a_broken_or_unwritable_index_only_costs_the_hashing(tmp_path):
    a, cache = tmp_path / "a.bin", tmp_path / "cache"
    a.write_bytes(b"abc")
    want = [hashlib.sha256(b"abc").hexdigest()]
    cache.mkdir()
    for damage in ("{", "[1, 2]", json.dumps({str(a.resolve()): "no"}), json.dumps({str(a.resolve()): [3]})):
        (cache / DIGESTS_FILE).write_text(damage)
        hashed: list[str] = []
        assert file_digests([a], hashed.append, cache) == want and len(hashed) == 1
        assert json.loads((cache / DIGESTS_FILE).read_text())[str(a.resolve())][3] == want[0]  # rewritten whole
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert file_digests([a], cache=blocked / "cache") == want  # no index can be made under a file
    assert not (blocked / "cache").exists()
