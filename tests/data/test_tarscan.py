"""The memory-mapped tar header scan (vitflow.data.sources.tarscan) against the standard library's
tarfile: the same members, offsets and sizes in the ustar, GNU and pax formats (long names,
non-ASCII names, directories), the same samples through iter_samples, and truncated or
non-tar files reported as tarfile reports them."""

import io
import os
import random
import tarfile

import pytest

from vitflow.data.sources import tarscan
from vitflow.data.wds.shards import iter_samples


def _write(path, fmt, n=30, seed=0):
    rng = random.Random(seed)
    with tarfile.open(path, "w", format=fmt) as tf:
        ti = tarfile.TarInfo("folder")
        ti.type = tarfile.DIRTYPE
        tf.addfile(ti)
        for i in range(n):
            deep = "d/" * rng.randint(0, 60 if fmt != tarfile.USTAR_FORMAT else 20)
            name = f"{deep}{i:06d}" + ("é" if i % 5 == 0 and fmt != tarfile.USTAR_FORMAT else "")
            for ext, data in ((".jpg", rng.randbytes(rng.randint(0, 3000))), (".cls", str(i).encode())):
                ti = tarfile.TarInfo(name + ext)
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
    return path


def _members_tarfile(path):
    with tarfile.open(path) as tf:
        return [(m.name, m.offset_data, m.size) for m in tf if m.isfile()]


def _samples(path, mapped: bool, monkeypatch):
    with monkeypatch.context() as m:
        if not mapped:
            m.setattr(tarscan, "mapped", lambda f: None)  # iter_samples falls back to tarfile
        with open(path, "rb") as f:
            return [(s.key, s.members, s.error is not None) for s in iter_samples(str(path), f, read_images=False)]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_scan_gives_tarfiles_members_offsets_and_sizes(tmp_path, fmt, monkeypatch):
    path = _write(tmp_path / "s.tar", fmt)
    with open(path, "rb") as f, tarscan.mapped(f) as mm:
        scanned = list(tarscan.scan(mm))
    expected = _members_tarfile(path)
    assert len(expected) == 60 and scanned == expected
    assert any(len(name) > 100 for name, _, _ in expected) or fmt == tarfile.USTAR_FORMAT
    mapped = _samples(path, True, monkeypatch)
    assert mapped == _samples(path, False, monkeypatch)
    assert [s[1]["cls"] for s in mapped] == [str(i).encode() for i in range(30)]


def test_truncated_and_non_tar_files(tmp_path, monkeypatch):
    raw = _write(tmp_path / "s.tar", tarfile.GNU_FORMAT, n=12).read_bytes()
    whole = _samples(tmp_path / "s.tar", True, monkeypatch)
    # cut inside a sample's image: the samples before it whole; it marked, its image's span past the end
    members = _members_tarfile(tmp_path / "s.tar")
    name, offset, size = next(m for m in members[10:] if m[0].endswith(".jpg") and m[2] > 600)
    cut = tmp_path / "cut.tar"
    cut.write_bytes(raw[:offset + size // 2])
    got = _samples(cut, True, monkeypatch)
    assert got[:-1] == whole[:len(got) - 1]
    last_offset, last_size = got[-1][1]["jpg"]
    assert got[-1][0] == name.rsplit(".", 1)[0] and last_offset + last_size > cut.stat().st_size
    assert got[-1][2] and got == _samples(cut, False, monkeypatch)
    # cut inside a label: that sample is marked, as tarfile marks it
    name, offset, size = next(m for m in members[12:] if m[0].endswith(".cls") and m[2] > 1)
    cut.write_bytes(raw[:offset + 1])
    got = _samples(cut, True, monkeypatch)
    assert got[-1][2] and got[-1][0] == name.rsplit(".", 1)[0]
    assert got[-1] == _samples(cut, False, monkeypatch)[-1]
    # cut inside a header: the whole samples before it only
    cut.write_bytes(raw[:members[8][1] - 512 + 100])
    assert _samples(cut, True, monkeypatch) == whole[:4]
    # no tar at all: one bad sample, as tarfile.open's refusal gives
    junk = tmp_path / "junk.tar"
    junk.write_bytes(os.urandom(4096))
    (key, _, bad), = _samples(junk, True, monkeypatch)
    assert bad and key == ""
