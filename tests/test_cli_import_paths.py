"""`module:Class` algorithm paths resolve from the directory the user runs in, through the
installed `sparsehi` console script too (its sys.path starts with the script's own bin
directory, not the working directory), and a bad checkpoint is one line in a real process.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sparsehi.algorithms.registry import resolve_algorithm

ROOT = Path(__file__).resolve().parents[1]
SMALL_RUN = ["--context", "96", "--batch", "1", "--decode-tokens", "2", "--num-layers", "1", "--modes", "sparse-gpu",
             "--top-k", "32", "--sink-tokens", "16", "--recent-tokens", "16", "--no-progress", "--no-forced"]


def _user_dir(tmp_path: Path) -> Path:
    """A working directory holding a package with a custom algorithm, as a user's would."""
    work = tmp_path / "work"
    (work / "userpkg").mkdir(parents=True)
    (work / "userpkg" / "__init__.py").write_text("")
    shutil.copy(ROOT / "examples" / "sink_window.py", work / "userpkg" / "window.py")
    return work


def _env() -> dict[str, str]:
    # this checkout's code, and nothing that would put the working directory on sys.path
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)


def _check_run(proc: subprocess.CompletedProcess, work: Path) -> None:
    assert proc.returncode == 0, proc.stderr[-2000:]
    payload = json.loads((work / "out" / "run.json").read_text())
    assert payload["sparse_config"]["algorithm"] == "userpkg.window:SinkWindow"


def test_console_script_resolves_module_from_working_directory(tmp_path):
    script = Path(sys.executable).parent / "sparsehi"
    if not script.exists():
        pytest.skip("the sparsehi console script is not installed next to this interpreter")
    work = _user_dir(tmp_path)
    proc = _run([str(script), "run", "--algorithm", "userpkg.window:SinkWindow", "--output-dir", "out", *SMALL_RUN],
                work)
    _check_run(proc, work)


def test_entry_point_from_elsewhere_resolves_module_from_working_directory(tmp_path):
    # what every console script does: a launcher outside the working directory calls main()
    launcher = tmp_path / "bin" / "launch.py"
    launcher.parent.mkdir()
    launcher.write_text("import sys\nfrom sparsehi.cli import main\nsys.exit(main())\n")
    work = _user_dir(tmp_path)
    proc = _run([sys.executable, str(launcher), "run", "--algorithm", "userpkg.window:SinkWindow",
                 "--output-dir", "out", *SMALL_RUN], work)
    _check_run(proc, work)


def test_bad_checkpoint_in_a_real_process_is_one_line_exit_2(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    (ck / "model.safetensors").write_bytes(b"\0" * 16)
    proc = _run([sys.executable, "-m", "sparsehi", "run", "--model-path", str(ck)], tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"sparsehi run: error: --model-path {ck / 'config.json'}: not valid JSON "
                     f"(Expecting value at line 1 column 40)"]


@pytest.fixture
def cwd_off_sys_path(tmp_path, monkeypatch):
    """A process whose sys.path lacks the working directory (as under a console script)."""
    work = _user_dir(tmp_path)
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "path", [p for p in sys.path
                                      if p not in ("", ".") and os.path.realpath(p) != str(work.resolve())])
    for name in [m for m in sys.modules if m == "userpkg" or m.startswith("userpkg.")]:
        monkeypatch.delitem(sys.modules, name)
    yield work
    for name in [m for m in sys.modules if m == "userpkg" or m.startswith("userpkg.")]:
        del sys.modules[name]


def test_resolve_algorithm_falls_back_to_the_working_directory(cwd_off_sys_path):
    cls = resolve_algorithm("userpkg.window:SinkWindow")
    assert cls.__name__ == "SinkWindow" and cls.__module__ == "userpkg.window"
    assert sys.path[-1] == os.getcwd()  # appended: searched after everything installed


def test_working_directory_never_shadows_sys_path(cwd_off_sys_path, tmp_path):
    # the same package name on sys.path and in the working directory: sys.path wins
    other = tmp_path / "site"
    (other / "userpkg").mkdir(parents=True)
    (other / "userpkg" / "__init__.py").write_text("")
    shutil.copy(ROOT / "examples" / "sink_window.py", other / "userpkg" / "window.py")
    sys.path.insert(0, str(other))
    cls = resolve_algorithm("userpkg.window:SinkWindow")
    assert Path(sys.modules[cls.__module__].__file__).resolve().parent.parent == other.resolve()


def test_failed_lookup_names_the_working_directory_and_leaves_sys_path(cwd_off_sys_path):
    before = list(sys.path)
    with pytest.raises(ValueError, match=r"cannot import module 'nopkg.mod' \(No module named 'nopkg'; "
                                         r"searched sys.path and the working directory"):
        resolve_algorithm("nopkg.mod:Cls")
    assert sys.path == before
