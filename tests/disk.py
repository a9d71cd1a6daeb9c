"""A small real filesystem that fills up: a tmpfs (mounting one needs root), so a write past it
fails with ENOSPC as on a full disk; not RLIMIT_FSIZE, whose EFBIG differs."""

from __future__ import annotations

import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest


@contextmanager
def tmpfs(path: Path, size: str = "1m") -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"a full disk needs a small tmpfs, and mounting one failed: {done.stderr}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def fill(path: Path, leave: int = 0) -> None:
    """Fill the filesystem `path` is on, to `leave` bytes free."""
    with open(path / "ballast", "ab") as f:
        try:
            while (free := shutil.disk_usage(path).free - leave) > 0:
                f.write(b"\0" * min(free, 1 << 20))
                f.flush()
        except OSError:
            pass
