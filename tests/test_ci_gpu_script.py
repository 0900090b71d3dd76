"""The prepared GPU session script (.ci/gpu) must still run when a session is lent a GPU: its stages'
commands name flags the experiments accept and a marker pytest knows. CI has no GPU, so this checks the
script's dry run (which prints each stage's command and runs nothing) against the experiments' own parsers."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _dry(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / ".ci" / "gpu"), "--dry", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_dry_run_lists_every_stage_and_writes_nothing(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / ".ci" / "gpu"), "--dry"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")})
    assert proc.returncode == 0, proc.stderr
    assert re.findall(r"^== (\w+) ", proc.stdout, flags=re.M) == [
        "tests", "kernels", "gpt2", "audit", "overhead", "three_gpt2", "three_audit", "unfold_gpt2", "unfold_audit"]
    assert not (tmp_path / "out").exists()  # a dry run creates no folder and no log


def test_unknown_stage_is_refused_before_anything_runs():
    proc = _dry("tests", "bogus")
    assert proc.returncode == 2 and "unknown stage 'bogus'" in proc.stderr
    assert "==" not in proc.stdout


def test_stage_commands_parse():
    """Each experiment stage's arguments parse with that experiment's own argparse (``--help`` lists them),
    and the tests stage's marker is registered."""
    proc = _dry()
    commands = [shlex.split(line.split(": ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("== ")]
    seen: dict[str, str] = {}  # experiment -> its --help (one subprocess each: a torch import apiece)
    for cmd in commands:
        if cmd[1:3] == ["-m", "pytest"]:
            marker = cmd[cmd.index("-m", 3) + 1]
            markers = subprocess.run([sys.executable, "-m", "pytest", "--markers", "-p", "no:cacheprovider"],
                                     cwd=ROOT, capture_output=True, text=True, timeout=120).stdout
            assert f"@pytest.mark.{marker}:" in markers, f"pytest marker {marker!r} is not registered"
            continue
        assert cmd[1:3] == ["-m", "experiments"]
        name = cmd[3]
        if name not in seen:
            seen[name] = subprocess.run([sys.executable, "-m", "experiments", name, "--help"], cwd=ROOT,
                                        capture_output=True, text=True, timeout=120).stdout
        help_text = seen[name]
        for flag in (a for a in cmd[4:] if a.startswith("--")):
            assert flag in help_text, f"{name}: {flag} is not an option of the experiment"
    assert set(seen) == {"sync-audit", "overhead", "kernels"}
