"""run_command: the one table of which failure ends a command with which line on stderr and which exit code; any
other exception propagates with its traceback."""

import errno
import importlib
import signal
import sys
from pathlib import Path

import pytest

from nemo_rcgrpo.utils.run_command import FAILURES, CommandError, explain, run_command

ROOT = Path(__file__).resolve().parents[3]


def _raising(error: BaseException):
    def command() -> int:
        raise error

    return command


def _ends(error: BaseException, capfd, **hooks) -> tuple[str, int]:
    code = run_command(_raising(error), **hooks)
    out, err = capfd.readouterr()
    assert out == "" and err.endswith("\n") and err.count("\n") == 1, err  # one line, on stderr
    return err.rstrip("\n"), code


def test_every_class_the_table_names_exists_and_is_an_exception():
    """The table names classes ("module.Class") rather than importing them: a class renamed or moved is caught here."""
    for failure in FAILURES:
        for name in failure.names:
            module, _, cls = name.rpartition(".")
            found = getattr(importlib.import_module(module), cls)
            assert isinstance(found, type) and issubclass(found, BaseException), name


USER_ERRORS = [
    "nemo_rcgrpo.utils.config.ConfigError",
    "nemo_rcgrpo.envs.contract.PluginContractError",
    "nemo_rcgrpo.envs.bfcl.tasks.BFCLDataError",
    "nemo_rcgrpo.envs.interfaces.DataError",
    "nemo_rcgrpo.models.hf.ModelFilesError",
    "nemo_rcgrpo.utils.checkpoint.CheckpointError",
    "nemo_rcgrpo.generation.vllm_client.GeneratorError",
    "nemo_rcgrpo.generation.vllm_client.GeneratorUnavailable",
    "nemo_rcgrpo.recipes.run_loop.NonFiniteTraining",
    "nemo_rcgrpo.utils.run_lock.RunLocked",
    "nemo_rcgrpo.utils.run_lock.FolderNotWritable",
    "nemo_rcgrpo.utils.report.ReportError",
    "nemo_rcgrpo.models.megatron.convert.ConversionError",
    "builtins.ValueError",
    "builtins.FileNotFoundError",
    "builtins.FileExistsError",
    "builtins.PermissionError",
    "builtins.OSError",
]


@pytest.mark.parametrize("name", USER_ERRORS)
def test_a_failure_the_user_can_act_on_is_one_error_line_and_exit_2(name, capfd):
    module, _, cls = name.rpartition(".")
    error = getattr(importlib.import_module(module), cls)("what went wrong, and what to change")
    assert _ends(error, capfd) == ("error: what went wrong, and what to change", 2)


def test_a_failure_a_command_words_itself_has_its_own_exit_code(capfd):
    assert _ends(CommandError("give IN.jsonl (and OUT.jsonl), or --ground-truth"), capfd) == (
        "error: give IN.jsonl (and OUT.jsonl), or --ground-truth",
        2,
    )
    assert _ends(CommandError("the server exited", exit_code=1), capfd) == ("error: the server exited", 1)


def test_an_incomplete_evaluation_exits_3(capfd):
    from nemo_rcgrpo.evaluation.run import EvaluationIncomplete

    assert _ends(EvaluationIncomplete("endpoint dead (scored 3 of 8 episodes)"), capfd) == (
        "error: evaluation stopped: endpoint dead (scored 3 of 8 episodes)",
        3,
    )


def test_a_class_of_an_entry_run_as_a_module_is_known_by_its_module_name(monkeypatch, capfd):
    """``python -m nemo_rcgrpo.evaluation.run``: its EvaluationIncomplete is ``__main__``'s class, not the package's."""
    import importlib.machinery
    import types

    main = types.ModuleType("__main__")
    main.__spec__ = importlib.machinery.ModuleSpec("nemo_rcgrpo.evaluation.run", None)
    monkeypatch.setitem(sys.modules, "__main__", main)
    incomplete = type("EvaluationIncomplete", (RuntimeError,), {"__module__": "__main__"})
    assert _ends(incomplete("stopped"), capfd) == ("error: evaluation stopped: stopped", 3)
    stray = type("EvaluationIncomplete", (RuntimeError,), {"__module__": "elsewhere"})
    with pytest.raises(RuntimeError):
        run_command(_raising(stray("not the evaluation's")))


def test_a_clean_stop_on_a_signal_says_so_and_exits_128_plus_the_signal(capfd):
    from nemo_rcgrpo.utils.signals import StopRequested

    stop = StopRequested(signal.SIGTERM, 7, "runs/x/checkpoints/step_7")
    assert _ends(stop, capfd) == (str(stop), 128 + signal.SIGTERM)
    assert str(stop).startswith("stopped by SIGTERM after step 7 (checkpoint runs/x/checkpoints/step_7)")


def test_a_full_disk_gets_the_commands_own_line(capfd):
    from nemo_rcgrpo.utils.run_lock import DiskFull

    full = OSError(errno.ENOSPC, "No space left on device")
    named = DiskFull("checkpoint step_3", "runs/x")
    assert _ends(full, capfd) == ("error: [Errno 28] No space left on device", 2)  # no hook: the error's text
    assert _ends(named, capfd) == ("error: no space left on device while writing checkpoint step_3 in runs/x", 2)
    hook = {"disk_full": lambda e: f"{e}; the newest complete checkpoint is runs/x/checkpoints/step_2"}
    assert _ends(named, capfd, **hook) == (
        "error: no space left on device while writing checkpoint step_3 in "
        "runs/x; the newest complete checkpoint is runs/x/checkpoints/step_2",
        2,
    )
    assert _ends(full, capfd, disk_full=lambda e: "no space left on device while writing the results in out") == (
        "error: no space left on device while writing the results in out",
        2,
    )
    # another OSError is not a full disk: its own text, whatever the hook
    assert _ends(PermissionError(errno.EACCES, "Permission denied", "out"), capfd, **hook) == (
        "error: [Errno 13] Permission denied: 'out'",
        2,
    )


def test_an_interrupt_propagates_unless_the_command_words_it(capfd):
    from nemo_rcgrpo.utils.signals import Abandoned

    with pytest.raises(KeyboardInterrupt):
        run_command(_raising(KeyboardInterrupt()))
    with pytest.raises(Abandoned):
        run_command(_raising(Abandoned(signal.SIGTERM)))
    assert capfd.readouterr().err == ""
    said = {"interrupted": lambda e: f"interrupted by a second {signal.Signals(getattr(e, 'signum', 2)).name}"}
    assert _ends(KeyboardInterrupt(), capfd, **said) == ("interrupted by a second SIGINT", 130)
    assert _ends(Abandoned(signal.SIGTERM), capfd, **said) == ("interrupted by a second SIGTERM", 143)


@pytest.mark.parametrize(
    "error",
    [RuntimeError("a bug"), KeyError("field"), TypeError("bad call"), AssertionError("invariant"), SystemExit(2)],
)
def test_an_unexpected_exception_is_not_swallowed(error, capfd):
    """A bug keeps its traceback: the exception itself comes out of run_command, and nothing is printed."""
    with pytest.raises(type(error)) as raised:
        run_command(_raising(error), disk_full=lambda e: "full", interrupted=lambda e: "interrupted")
    assert raised.value is error
    assert capfd.readouterr() == ("", "")
    assert explain(RuntimeError("a bug")) is None


def test_a_command_that_succeeds_returns_its_code(capfd):
    assert run_command(lambda: 0) == 0
    assert run_command(lambda: 5) == 5  # prepare-data's re-executed child: its exit code as it is
    assert capfd.readouterr() == ("", "")


def test_no_entry_point_words_its_failures_itself():
    """Every command's failures go through run_command: no module prints an ``error:`` line of its own."""
    own = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "nemo_rcgrpo").rglob("*.py"))
        if p.name != "run_command.py" and ('print(f"error:' in p.read_text() or 'print("error:' in p.read_text())
    ]
    assert not own, own
