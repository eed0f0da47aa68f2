"""The wheel holds what runs and nothing else: every module of the package, the kernel sources,
the recipes and calibration data; no tests, docs or deployment files. Unpacked on its own, its
`pkv` imports and checks a shipped recipe by name (`pkv serve --config smollm2-cpu --check`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_DIRS = ("cli", "core", "csrc", "plugins", "quantize")


def checkout_files() -> list[str]:
    """The files a clean clone of this checkout has (tracked, or new and not ignored)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout.split()
    return [name for name in listed if (ROOT / name).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from a copy of the checkout's files: setuptools' build/ folder in a working tree
    # keeps modules that have since moved, and they would ship again.
    source = tmp_path_factory.mktemp("source")
    for name in checkout_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(out), str(source)],
                   check=True, capture_output=True, text=True)
    [built] = out.glob("pkv-*.whl")
    return built


def package_files() -> set[str]:
    """What the wheel must carry: the sources under pkv/ that run."""
    wanted = {"pkv/__init__.py"}
    for name in checkout_files():
        folder, suffix = name.split("/")[0], Path(name).suffix
        if (folder in RUNTIME_DIRS and suffix in (".py", ".cpp", ".h")
                or name.startswith("quantize/data/") and suffix == ".txt"
                or folder == "recipes" and suffix == ".yaml"):
            wanted.add(f"pkv/{name}")
    return wanted


def test_the_wheel_holds_every_runtime_file_and_no_tests_docs_or_deploy(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = package_files()
    missing = wanted - names
    assert not missing, f"not in the wheel: {sorted(missing)}"
    stray = sorted(n for n in names if n.startswith("pkv/") and n not in wanted)
    assert not stray, f"in the wheel but not a runtime file of this checkout: {stray[:10]}"
    assert not any(n.startswith(("pkv/tests/", "pkv/docs/", "pkv/deploy/")) for n in names)
    assert any(n.endswith(".dist-info/entry_points.txt") for n in names)


def test_the_unpacked_wheel_runs_on_its_own(wheel: Path, tmp_path: Path) -> None:
    zipfile.ZipFile(wheel).extractall(tmp_path)
    # Every pkv module the check loads must come from the wheel: the editable install of this
    # checkout would otherwise quietly supply what the wheel lacks.
    script = ("import sys\n"
              "from pkv.cli.main import app\n"
              "sys.argv = ['pkv', 'serve', '--config', 'smollm2-cpu', '--check']\n"
              "try:\n"
              "    app()\n"
              "except SystemExit as end:\n"
              "    code = end.code\n"
              "outside = sorted(name for name, m in sys.modules.items()\n"
              "                 if name.split('.')[0] == 'pkv' and getattr(m, '__file__', None)\n"
              f"                 and not m.__file__.startswith({str(tmp_path)!r}))\n"
              "print('outside the wheel:', outside)\n"
              "sys.exit(code)\n")
    # The wheel's copy first on the path, ahead of the editable install of this checkout.
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "config OK" in result.stdout + result.stderr
    assert "outside the wheel: []" in result.stdout
