"""Host segments left by a dead creator are removed; live ones and foreign files are not."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from fastcomm.workspace import SHM_PREFIX, remove_stale_segments  # noqa: E402


def test_only_segments_of_dead_creators_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / f"{SHM_PREFIX}{dead}-abc").write_bytes(b"x")
    (tmp_path / f"{SHM_PREFIX}{os.getpid()}-def").write_bytes(b"x")
    (tmp_path / f"{SHM_PREFIX}notapid-ghi").write_bytes(b"x")
    (tmp_path / "other-file").write_bytes(b"x")
    removed = remove_stale_segments(tmp_path)
    assert removed == [f"{SHM_PREFIX}{dead}-abc"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{SHM_PREFIX}{os.getpid()}-def", f"{SHM_PREFIX}notapid-ghi", "other-file"])
