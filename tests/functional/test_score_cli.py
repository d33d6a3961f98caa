import json
import subprocess
import sys

from nemo_rcgrpo.cli import main


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")


def test_score_file_with_good_and_bad_lines(tmp_path, capsys):
    good = {
        "id": "multi_turn_base_0",
        "turns": [
            ["cd(folder='document')", "mkdir(dir_name='temp')", "mv(source='final_report.pdf', destination='temp')"],
            [
                ["cd(folder='temp')"],
                [{"name": "grep", "arguments": {"file_name": "final_report.pdf", "pattern": "budget analysis"}}],
            ],  # two steps
            ["sort('final_report.pdf')"],
            [
                "cd(folder='..')",
                "mv(source='previous_report.pdf',destination='temp')",
                "cd(folder='temp')",
                "diff(file_name1='final_report.pdf',file_name2='previous_report.pdf')",
            ],
        ],
    }
    injected = {"id": "multi_turn_base_0", "turns": [["__import__('os').system('true')", "cd(folder='document')"]]}
    lines = [
        json.dumps(good),
        "{not json",
        json.dumps({"id": "multi_turn_nope_1", "turns": []}),
        json.dumps({"id": "multi_turn_base_0"}),
        json.dumps({"id": "multi_turn_base_0", "turns": "cd()"}),
        json.dumps({"id": "multi_turn_base_0", "turns": [[]] * 9}),
        json.dumps(injected),
        json.dumps(["a", "list"]),
    ]
    _write(tmp_path / "in.jsonl", lines)
    assert main(["score", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--quiet"]) == 0
    out = [json.loads(l) for l in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(out) == len(lines)
    first = out[0]
    assert (
        first["id"],
        first["reward"],
        first["state_ok"],
        first["actions_ok"],
        first["official_valid"],
        first["num_errors"],
    ) == ("multi_turn_base_0", 1.0, True, True, True, 0)
    assert [len(t) for t in first["observations"]] == [3, 2, 1, 4]
    assert json.loads(first["observations"][0][0]) == {"current_working_directory": "document"}
    assert out[1]["line"] == 2 and "not valid JSON" in out[1]["error"]
    assert "unknown task id" in out[2]["error"]
    assert "missing 'turns'" in out[3]["error"]
    assert "must be a list of turns" in out[4]["error"]
    assert "9 turns given" in out[5]["error"]
    inj = out[6]
    assert inj["reward"] == 0.0 and inj["num_errors"] == 1 and not inj["official_valid"]
    assert inj["official_error"] == "multi_turn:force_terminated"  # one of four turns given
    assert inj["observations"][0][0].startswith("Error: could not parse tool call")
    assert "must be a JSON object" in out[7]["error"]
    assert "6 line(s) could not be scored" in capsys.readouterr().err


def test_missing_input_file_is_a_clear_error(tmp_path, capsys):
    assert main(["score", str(tmp_path / "absent.jsonl"), str(tmp_path / "o.jsonl"), "--quiet"]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_console_script_ground_truth_summary():
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_rcgrpo.cli", "score", "--ground-truth", "--categories", "miss_param", "--quiet"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "| miss_param | 200 | 100.00 | 100.00 |" in proc.stdout
    assert "| overall | 200 | 100.00 | 100.00 |" in proc.stdout


def test_invalid_utf8_and_overlong_lines_are_error_records(tmp_path):
    good = json.dumps({"id": "multi_turn_base_0", "turns": [["cd(folder='document')"]]}).encode()
    bad_utf8 = b'{"id": "multi_turn_base_0", "turns": [["cd(folder=\'\xff\xfe\')"]]}'
    from nemo_rcgrpo.envs.bfcl.score import MAX_LINE_CHARS

    long_line = b'{"id": "' + b"x" * (MAX_LINE_CHARS + 10) + b'"}'
    long_id = json.dumps({"id": "y" * 100_000, "turns": []}).encode()  # an error record is bounded too
    (tmp_path / "in.jsonl").write_bytes(b"\n".join([good, bad_utf8, long_line, good, long_id]) + b"\n")
    assert main(["score", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--quiet"]) == 0
    out = [json.loads(l) for l in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r.get("error", "ok")[:24] for r in out] == [
        "ok",
        "line is not valid UTF-8 ",
        "line is longer than 4000",
        "ok",
        "unknown task id 'yyyyyyy",
    ]
    assert [r.get("line") for r in out] == [None, 2, 3, None, 5]
    assert len(json.dumps(out[4])) < 1500
    assert not (tmp_path / "out.jsonl.partial").exists()


def test_unusable_out_is_one_line_exit_2(tmp_path, capsys):
    _write(tmp_path / "in.jsonl", [json.dumps({"id": "multi_turn_base_0", "turns": []})])
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    for out, message in ((tmp_path / "adir", "is a directory"), (tmp_path / "afile" / "o.jsonl", "cannot write")):
        assert main(["score", str(tmp_path / "in.jsonl"), str(out), "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err and "\n" not in err and "Traceback" not in err


def test_output_is_bounded_per_line_and_written_atomically(tmp_path):
    from nemo_rcgrpo.envs.bfcl.score import MAX_RECORD_CHARS, write_scores

    # a short line whose calls produce long observations: 40 long directory names, then ls() 2000 times
    names = [f"d{i}" + "n" * 200 for i in range(40)]
    steps = [[f"mkdir(dir_name='{n}')" for n in names]] + [["ls()"] * 100 for _ in range(19)]
    line = json.dumps({"id": "multi_turn_base_0", "turns": [steps]})
    assert len(line) < 40_000
    _write(tmp_path / "in.jsonl", [line])
    assert main(["score", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--quiet"]) == 0
    text = (tmp_path / "out.jsonl").read_text()
    assert len(text) <= MAX_RECORD_CHARS + 1  # tens of MB before
    record = json.loads(text)
    assert record["observations_clipped"] is True and record["id"] == "multi_turn_base_0" and "reward" in record

    def records():
        yield {"id": "multi_turn_base_0", "reward": 1.0, "official_valid": True}
        raise KeyboardInterrupt  # a run stopped after one line

    out = tmp_path / "killed.jsonl"
    try:
        write_scores(records(), out)
    except KeyboardInterrupt:
        pass
    assert not out.exists()  # never a truncated OUT
    assert len((tmp_path / "killed.jsonl.partial").read_text().splitlines()) == 1  # what was scored is kept


def test_score_takes_the_tasks_of_another_task_source(tmp_path, capsys, one_folder_plugin):
    """--task-source picks a registered source's tasks (a plugin's with --plugins); the table reads categories
    from the tasks, not from BFCL's id pattern; a source not registered is one line, exit 2."""
    assert main(["score", "--ground-truth", "--task-source", "bfcl_micro", "--summary", "--quiet"]) == 0
    table = capsys.readouterr().out
    assert "| base | 1320 | 100.00 | 100.00 |" in table and "other" not in table
    _write(
        tmp_path / "in.jsonl",
        [
            json.dumps({"id": "one_0", "turns": [["mkdir(dir_name='reports')"]]}),
            json.dumps({"id": "one_0", "turns": [["mkdir(dir_name='report')"]]}),
        ],
    )
    assert (
        main(
            [
                "score",
                str(tmp_path / "in.jsonl"),
                str(tmp_path / "out.jsonl"),
                "--quiet",
                "--task-source",
                "one_folder",
                "--plugins",
                "one_folder_tasks",
            ]
        )
        == 0
    )
    out = [json.loads(l) for l in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [(r["id"], r["category"], r["reward"]) for r in out] == [("one_0", "base", 1.0), ("one_0", "base", 0.0)]
    capsys.readouterr()
    assert main(["score", "--ground-truth", "--task-source", "nope", "--quiet"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: task_source='nope': no task_source of that name; registered: "
        "['bfcl', 'bfcl_micro', 'one_folder'] (a plugin's task_source needs "
        "plugins=[its module])"
    )


def test_output_is_bounded_in_proportion_to_the_input(tmp_path):
    from nemo_rcgrpo.envs.bfcl import BFCLSuite
    from nemo_rcgrpo.envs.bfcl.score import OUTPUT_CHARS_PER_INPUT_CHAR, OUTPUT_FLOOR_CHARS

    # 16 KB of lines each making 12 long-context transaction histories of 65 KB: 36 MB of output before
    line = json.dumps({"id": "multi_turn_long_context_148", "turns": [["get_transaction_history()"] * 12]})
    lines = 16_384 // (len(line) + 1)
    _write(tmp_path / "in.jsonl", [line] * lines)
    size_in = (tmp_path / "in.jsonl").stat().st_size
    assert main(["score", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--quiet"]) == 0
    size_out = (tmp_path / "out.jsonl").stat().st_size
    assert size_out <= OUTPUT_FLOOR_CHARS + OUTPUT_CHARS_PER_INPUT_CHAR * size_in  # about 2.1 MB; 2,200 x before
    assert size_out / size_in < 150
    records = [json.loads(l) for l in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(records) == lines and all("reward" in r for r in records)  # every score is written
    clipped = [r for r in records if r.get("observations_clipped")]
    assert clipped and "... [clipped " in clipped[-1]["observations"][0][0]
    # the ground truth of the same task is written whole
    task = BFCLSuite(categories=("long_context",))["multi_turn_long_context_148"]
    _write(tmp_path / "gt.jsonl", [json.dumps({"id": task.id, "turns": [list(t) for t in task.ground_truth]})])
    assert main(["score", str(tmp_path / "gt.jsonl"), str(tmp_path / "gt_out.jsonl"), "--quiet"]) == 0
    assert "observations_clipped" not in (tmp_path / "gt_out.jsonl").read_text()
