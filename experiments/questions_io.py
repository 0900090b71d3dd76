"""Output plumbing for the ablation and the open-question experiments: JSON, PNG, wandb, markdown.

Every number that reaches RESULTS.md or OPEN_QUESTIONS.md goes JSON → render function → markdown, so a
re-render (``--render-only``) reproduces the text from the stored measurements and nothing is typed by hand.
"""
from __future__ import annotations

import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Iterable

import torch

__all__ = ["ROOT", "RESULTS", "write_json", "read_json", "new_figure", "save_figure", "wandb_run",
           "replace_section", "md_table", "fmt", "mean_sd", "environment", "checkout_commit", "at_commit", "env_prefix",
           "SWITCHES"]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"


def environment() -> dict[str, Any]:
    """Where the numbers were measured (they are CPU numbers and noisy: say so next to them)."""
    return {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpu_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": checkout_commit()}


# The library's switches that change what a measurement runs (the cache directory does not).
SWITCHES = ("NONANS_TRITON_ONE_LAUNCH", "NONANS_TRITON_FOLD_DECIDE", "NONANS_FUSED_BACKEND", "NONANS_NATIVE",
            "NONANS_NATIVE_SIMD", "NONANS_NS5_BACKEND", "NONANS_NS5_METHOD", "NONANS_NS5_TRITON_MIN_DIM")


def env_prefix() -> str:
    """The switches of :data:`SWITCHES` set in this process, as the shell prefix of the command that repeats a
    run (``NONANS_TRITON_ONE_LAUNCH=1 python -m experiments ...``): a JSON's command must say what it ran."""
    return "".join(f"{k}={shlex.quote(os.environ[k])} " for k in SWITCHES if k in os.environ)


#: The code every measurement runs: what a JSON's "commit" is checked against (``checkout_commit``).
MEASURED_CODE = ("nonans_optim", "kernels", "experiments")


def checkout_commit(*paths: str) -> str:
    """The checkout's short commit, marked "+changes" when ``paths`` (the code the numbers measure, relative
    to the repository; :data:`MEASURED_CODE` when none is given) differ from it; "unknown" outside a git
    checkout. Recorded in every experiment's JSON (``environment()``, ``step_time.machine_info()``), so that
    which published table describes older code can be read off ``git log <commit>..``."""
    paths = paths or MEASURED_CODE
    def git(*a: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)
    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode != 0:
            return "unknown"
        dirty = git("diff", "--quiet", "HEAD", "--", *paths).returncode != 0
    except OSError:  # no git on this machine
        return "unknown"
    return head.stdout.strip() + ("+changes" if dirty else "")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo; ``platform.processor()`` elsewhere), for the machine line of a
    published table: the same seed gave different bench outcomes on two 2-core machines (2026-11-27), and
    timings differ more, so a number names the CPU it came from."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def at_commit(env: dict[str, Any]) -> str:
    """" at commit <c>" for a rendered "measured <date>", where the run recorded one (runs since 2026-11-26;
    older JSON renders as it did)."""
    return f" at commit {env['commit']}" if env.get("commit") else ""


def write_json(path: Path, data: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=float, allow_nan=True))
    return path


def read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def new_figure(ncols: int = 1, nrows: int = 1, size: tuple[float, float] = (5.0, 3.6)):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(nrows, ncols, figsize=(size[0] * ncols, size[1] * nrows), squeeze=False)
    return fig, axes


def save_figure(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


class _NoWandb:
    def log(self, *_a, **_k) -> None:
        return None

    def finish(self) -> None:
        return None


def wandb_run(project: str, name: str, config: dict[str, Any]):
    """A wandb run in offline mode when wandb is installed (``NONANS_WANDB=0`` turns it off); else a no-op."""
    if os.environ.get("NONANS_WANDB", "1") == "0":
        return _NoWandb()
    try:
        import wandb
    except ImportError:
        return _NoWandb()
    return wandb.init(project=project, name=name, config=config, mode="offline", reinit=True,
                      dir=str(RESULTS))


def replace_section(path: Path, name: str, body: str, *, title: str | None = None) -> None:
    """Replace the text between ``<!-- name:begin -->`` and ``<!-- name:end -->`` (append the markers if the
    file or the section is missing); every other byte of the file is left as it was."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = path.read_text() if path.exists() else ""
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + block + tail
    else:
        prefix = "" if not text else ("\n" if text.endswith("\n") else "\n\n")
        heading = f"## {title}\n\n" if title else ""
        text = text + prefix + heading + block + "\n"
    path.write_text(text)


def attach_baseline(data: dict[str, Any], baseline: str | None) -> dict[str, Any]:
    """``data`` with the JSON at ``baseline`` (the same command's output from another commit, its own
    baseline dropped) under "baseline", for a table that shows both; ``data`` unchanged when None."""
    if baseline:
        base = json.loads(Path(baseline).read_text())
        base.pop("baseline", None)
        data["baseline"] = base
    return data


def publish(data: dict[str, Any], out: Path, text: str, results_md: str, key: str, title: str) -> None:
    """Write a benchmark's JSON, print its rendered table and (unless ``results_md`` is '') put the table
    into that file's ``key`` section — the one path from a command's output to RESULTS.md."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2))
    print(text)
    if results_md:
        replace_section(Path(results_md), key, text, title=title)


def fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)
        if x != 0 and (abs(x) >= 1e5 or abs(x) < 10 ** -(digits)):
            return f"{x:.{max(1, digits - 1)}e}"
        return f"{x:.{digits}g}" if abs(x) >= 1 else f"{x:.{digits}f}".rstrip("0").rstrip(".") or "0"
    return str(x)


def mean_sd(xs: Iterable[float]) -> tuple[float, float]:
    xs = [float(x) for x in xs]
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c if isinstance(c, str) else fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
