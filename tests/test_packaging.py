"""What a user's ``pip install`` gets: the suite runs on the editable install, which reads every file from the
checkout, so a file the wheel leaves out (the C sources compiled on first use) passes every other test and only
shows, as a slower fallback and a warning, once installed. The wheel is built here as pip builds it for a user,
from a copy of the checkout's tracked files (a build in the checkout reuses what an earlier one left in build/)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_carries_every_file_of_the_package(tmp_path):
    listed = subprocess.run(["git", "ls-files", "mpcomm"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, f"git ls-files in {ROOT}: {listed.stderr.strip()}"
    tracked = set(listed.stdout.split())
    assert {"mpcomm/__init__.py", "mpcomm/kernels.c", "mpcomm/native_calls.c"} <= tracked
    source, out = tmp_path / "source", tmp_path / "wheel"
    for name in ["pyproject.toml", "README.md", *tracked]:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, f"pip wheel of {ROOT}'s files: {built.stderr.strip()[-2000:]}"
    wheels = list(out.glob("mpcomm-*.whl"))
    assert len(wheels) == 1, f"pip wheel wrote {sorted(p.name for p in out.iterdir())}"
    with zipfile.ZipFile(wheels[0]) as wheel:
        carried = {name for name in wheel.namelist() if name.startswith("mpcomm/")}
    assert sorted(tracked - carried) == [], f"{wheels[0].name} leaves out files of the package (pyproject.toml's " \
                                            "[tool.setuptools.package-data])"
