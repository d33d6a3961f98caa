import json
import subprocess
import sys

from nemo_rcgrpo.cli import main


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")


def test_score_file_with_good_and_bad_lines(tmp_path, capsys):
    good = {"id": "multi_turn_base_0", "turns": [
        ["cd(folder='document')", "mkdir(dir_name='temp')", "mv(source='final_report.pdf', destination='temp')"],
        [["cd(folder='temp')"], [{"name": "grep", "arguments": {"file_name": "final_report.pdf",
                                                               "pattern": "budget analysis"}}]],  # two steps
        ["sort('final_report.pdf')"],
        ["cd(folder='..')", "mv(source='previous_report.pdf',destination='temp')", "cd(folder='temp')",
         "diff(file_name1='final_report.pdf',file_name2='previous_report.pdf')"],
    ]}
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
    assert (first["id"], first["reward"], first["state_ok"], first["actions_ok"], first["official_valid"],
            first["num_errors"]) == ("multi_turn_base_0", 1.0, True, True, True, 0)
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
        capture_output=True, text=True, check=True,
    )
    assert "| miss_param | 200 | 100.00 | 100.00 |" in proc.stdout
    assert "| overall | 200 | 100.00 | 100.00 |" in proc.stdout
