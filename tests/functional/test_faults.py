"""Faults injected into real stage-1 runs of the tiny model: corrupt checkpoints, a second writer, NaN training,
folders that cannot be written, a full disk. Each ends in one line (or a note and a good resume), never a
traceback on the console, never a trusted corrupt checkpoint, a NaN export or a second writer."""

import contextlib
import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nemo_rcgrpo.utils.checkpoint import MANIFEST, checkpoint_dir, verify_checkpoint
from nemo_rcgrpo.utils.logging import read_metrics

REPO = Path(__file__).resolve().parents[2]


def _args(data_dir, run_dir, *extra):
    return [
        "--config-name=sft_smollm_cpu",
        "model.path=tiny-qwen2",
        f"run_dir={run_dir}",
        f"data.dir={data_dir}",
        "chat.max_length=900",
        "data.max_examples=16",
        "trainer.global_batch_size=2",
        "trainer.micro_batch_size=1",
        "trainer.save_every=2",
        "logging.progress=false",
        "logging.tensorboard=false",
        *extra,
    ]


def _main(args, capsys):
    from nemo_rcgrpo.train import main

    capsys.readouterr()
    code = main(args)
    out = capsys.readouterr()
    return code, out.err


def _last_line(err: str) -> str:
    lines = err.strip().splitlines()
    return lines[-1] if lines else ""


def test_a_corrupt_checkpoint_is_never_loaded_and_the_run_resumes_from_the_newest_good_one(data_dir, tmp_path, capsys):
    """16 flipped bytes in the final step_3's weights: the run again names it, sets it aside, resumes from step_2
    and ends with the weights of an uninterrupted run (the flip was trusted before checkpoints were verified)."""
    common = ("trainer.max_steps=3", "trainer.export_hf=false")
    a, b = tmp_path / "a", tmp_path / "b"
    assert _main(_args(data_dir, a, *common), capsys)[0] == 0
    assert _main(_args(data_dir, b, *common), capsys)[0] == 0
    model = checkpoint_dir(b) / "step_3" / "model.pt"
    data = bytearray(model.read_bytes())
    for i in range(16):  # inside the tensor data
        data[len(data) // 2 + i] ^= 0x55
    model.write_bytes(bytes(data))
    code, err = _main(_args(data_dir, b, *common), capsys)  # the same command: it goes back to step 2
    assert code == 0, err
    notes = [line for line in err.splitlines() if "fails verification" in line]
    assert (
        len(notes) == 1
        and "step_3" in notes[0]
        and "model.pt differs" in notes[0]
        and "resuming from" in notes[0]
        and notes[0].rstrip().endswith("step_2")
    ), err
    assert (checkpoint_dir(b) / "corrupt-step_3").is_dir()
    assert [m["step"] for m in read_metrics(b)] == [1, 2, 3]
    sa = torch.load(checkpoint_dir(a) / "step_3" / "model.pt", weights_only=True)
    sb = torch.load(checkpoint_dir(b) / "step_3" / "model.pt", weights_only=True)
    assert all(torch.allclose(sa[k], sb[k], atol=1e-6) for k in sa)
    assert (
        verify_checkpoint(checkpoint_dir(b) / "step_3") is None and (checkpoint_dir(b) / "step_3" / MANIFEST).is_file()
    )


def test_an_edited_step_and_a_deleted_file_leave_no_checkpoint_to_trust(data_dir, tmp_path, capsys):
    run = tmp_path / "r"
    assert (
        _main(_args(data_dir, run, "trainer.max_steps=2", "trainer.save_every=1", "trainer.export_hf=false"), capsys)[0]
        == 0
    )
    state = checkpoint_dir(run) / "step_2" / "trainer_state.json"  # valid JSON, a step on, the same size
    state.write_text(json.dumps({**json.loads(state.read_text()), "step": 3}, indent=1))
    (checkpoint_dir(run) / "step_1" / "optimizer.pt").unlink()
    code, err = _main(
        _args(data_dir, run, "trainer.max_steps=2", "trainer.save_every=1", "trainer.export_hf=false"), capsys
    )
    line = _last_line(err)
    assert (
        code == 2
        and line.startswith("error: no checkpoint in")
        and "step_2: trainer_state.json differs" in line
        and "step_1: optimizer.pt is missing" in line
        and "remove" in line
        and "Traceback" not in err
    ), err


def test_non_finite_training_stops_with_one_line_and_saves_nothing_from_it(data_dir, tmp_path, capsys):
    """lr=1e30: step 1's update blows the weights up, step 2's loss is not finite. The run stops there with one
    line and exit 2; step 2 has no checkpoint, there is no export, and metrics.jsonl records the NaN as such."""
    run = tmp_path / "nan"
    code, err = _main(
        _args(
            data_dir,
            run,
            "trainer.max_steps=4",
            "trainer.save_every=1",
            "trainer.lr=1e30",
            "trainer.warmup_steps=0",
            "trainer.schedule=constant",
        ),
        capsys,
    )
    line = _last_line(err)
    assert (
        code == 2
        and line.startswith("error: non-finite")
        and "at step 2" in line
        and "nothing was saved from this step" in line
        and "step_1" in line
        and "Traceback" not in err
    ), err
    assert sorted(p.name for p in checkpoint_dir(run).iterdir()) == ["step_1"]
    assert not (run / "hf").exists()
    last = read_metrics(run)[-1]
    assert last["step"] == 2 and not math.isfinite(last["loss"])
    raw = (run / "metrics.jsonl").read_text().splitlines()[-1]
    assert '"loss": "nan"' in raw or '"loss": "inf"' in raw, raw  # strict JSON, the value said as such


def test_skip_mode_applies_no_non_finite_update(data_dir, tmp_path, capsys):
    """trainer.on_nonfinite=skip: steps 2 and 3 have non-finite gradients, their updates are skipped (a note each)
    and the run goes on; the weights after step 3 are those after step 1."""
    run = tmp_path / "skip"
    code, err = _main(
        _args(
            data_dir,
            run,
            "trainer.max_steps=3",
            "trainer.save_every=1",
            "trainer.keep_last=3",
            "trainer.lr=1e30",
            "trainer.warmup_steps=0",
            "trainer.schedule=constant",
            "trainer.on_nonfinite=skip",
            "trainer.export_hf=false",
        ),
        capsys,
    )
    notes = [line for line in err.splitlines() if "its update was skipped" in line]
    assert code == 0 and len(notes) == 2 and "step 2" in notes[0] and "step 3" in notes[1], err
    assert [m["skipped_updates"] for m in read_metrics(run)] == [0.0, 1.0, 1.0]
    one = torch.load(checkpoint_dir(run) / "step_1" / "model.pt", weights_only=True)
    three = torch.load(checkpoint_dir(run) / "step_3" / "model.pt", weights_only=True)
    assert all(torch.equal(one[k], three[k]) for k in one)


@contextlib.contextmanager
def _tmpfs(path: Path, size: str, read_only: bool = False):
    """A small tmpfs mounted at ``path`` (needs root: CI runs as root; elsewhere the test says why it skips)."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if proc.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


EARLY = ("the run's config", "the data statistics", "the metrics")  # a few KB: which one fills the disk depends on
# the file system's page accounting and what the run logged first; each is named


@pytest.mark.parametrize(
    "size, what", [("8k", EARLY), ("16k", EARLY), ("24m", ("checkpoint step_2",)), ("200m", ("the HF export",))]
)
def test_a_full_disk_is_one_line_naming_what_and_the_newest_checkpoint(data_dir, tmp_path, capsys, size, what):
    """The run folder on a tmpfs of 8 KB, 16 KB, 24 MB and 200 MB (a tiny-qwen2 checkpoint is about 150 MB, its
    export about 50 MB): whichever write hits the full disk, one line naming it and exit 2, no traceback, and
    nothing partial where a resume would read it (every step_N there verifies, the export is whole or absent)."""
    with _tmpfs(tmp_path / "disk", size) as disk:
        run = disk / "run"
        code, err = _main(
            _args(data_dir, run, "trainer.max_steps=2", "logging.tensorboard=true", "trainer.save_every=100"), capsys
        )
        line = _last_line(err)
        assert code == 2 and any(
            line.startswith(f"error: no space left on device while writing {w} in ") for w in what
        ), err
        assert "Traceback" not in err, err
        steps = sorted(checkpoint_dir(run).glob("step_*")) if checkpoint_dir(run).is_dir() else []
        assert all(verify_checkpoint(step) is None for step in steps)
        if steps:
            assert line.endswith(f"; the newest complete checkpoint is {steps[-1]}"), line
        else:
            assert line.endswith("; no checkpoint was written"), line
        assert (what == ("the HF export",)) == bool(steps)
        assert not (run / "hf").exists()
        assert not [p for p in run.iterdir() if p.name.startswith(".tmp-hf")]  # the staged export is removed


def test_folders_that_cannot_be_written_are_refused_before_the_model_loads(data_dir, tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    code, err = _main(_args(data_dir, a_file, "trainer.max_steps=1"), capsys)
    assert code == 2 and _last_line(err) == f"error: run_dir {a_file} is a file, not a folder; choose another run_dir"
    code, err = _main(_args(data_dir, a_file / "run", "trainer.max_steps=1"), capsys)
    assert code == 2 and "cannot be made" in _last_line(err)
    with _tmpfs(tmp_path / "ro", "1m", read_only=True) as ro:
        code, err = _main(_args(data_dir, ro / "run", "trainer.max_steps=1"), capsys)
        line = _last_line(err)
        assert code == 2 and "cannot be written (a read-only file system" in line and "Traceback" not in err, err
        from nemo_rcgrpo.evaluation.run import main as eval_main

        capsys.readouterr()
        code = eval_main(["policy=oracle", "protocol=paper", "limit=1", f"out_dir={ro / 'eval'}"])
        err = capsys.readouterr().err
        assert code == 2 and "out_dir" in _last_line(err) and "read-only" in _last_line(err), err


def _popen(data_dir, run_dir, *extra):
    args = _args(
        data_dir,
        run_dir,
        "data.max_examples=64",
        "trainer.epochs=5000",
        "trainer.max_steps=100000",
        "trainer.save_every=1000",
        "trainer.export_hf=false",
        *extra,
    )
    return subprocess.Popen(
        [sys.executable, str(REPO / "nemo_rcgrpo" / "train.py"), *args],
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def test_one_run_per_folder_and_a_killed_runs_lock_is_taken_over(data_dir, tmp_path, capsys):
    run = tmp_path / "locked"
    first = _popen(data_dir, run)
    try:
        deadline = time.time() + 240
        while not (run / "metrics.jsonl").is_file():  # the first run is training
            assert first.poll() is None and time.time() < deadline, first.communicate()
            time.sleep(0.2)
        code, err = _main(
            _args(
                data_dir,
                run,
                "data.max_examples=64",
                "trainer.epochs=5000",
                "trainer.max_steps=100000",
                "trainer.save_every=1000",
                "trainer.export_hf=false",
            ),
            capsys,
        )
        line = _last_line(err)
        assert (
            code == 2
            and line.startswith(f"error: run_dir {run} is in use by another run (host ")
            and f"pid {first.pid}," in line
        ), err
        assert sorted(p.name for p in run.glob("config*.yaml")) == ["config.yaml"]  # the second wrote nothing
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    # the kernel released the killed run's lock: the next invocation takes it over and runs
    code, err = _main(
        _args(
            data_dir,
            run,
            "data.max_examples=64",
            "trainer.epochs=5000",
            "trainer.max_steps=100000",
            "trainer.stop_after=1",
            "trainer.save_every=1000",
            "trainer.export_hf=false",
        ),
        capsys,
    )
    assert code == 0, err
