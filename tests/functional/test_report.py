"""`rcgrpo report`: one self-contained HTML page of a run, checked in a real headless browser (Debian's chromium,
driven by playwright): it renders, a known rollout's transcript is on the page, the filters select what they say,
and model output planted with markup stays text."""

import json

import pytest

from nemo_rcgrpo.train import main as train_main
from nemo_rcgrpo.utils.report import collect
from nemo_rcgrpo.utils.report import main as report_main

from ..conftest import CHROMIUM

HOSTILE = '</script><script>window.pwned = 1</script><img src=x onerror="window.pwned = 2"><b>bold</b>'


@pytest.fixture(scope="module")
def run(data_dir, tmp_path_factory):
    """Two RC-GRPO steps with mixed rewards (scripted generation: gold or a verified failure per rollout) and a
    held-out evaluation after each; one dumped rollout then gets markup in its text and a tool result."""
    run_dir = tmp_path_factory.mktemp("report") / "rc"
    assert (
        train_main(
            [
                "--config-name=rcgrpo_smollm_cpu",
                "model.path=tiny-llama",
                "rl.stage1_recipe=null",
                f"data.dir={data_dir}",
                f"run_dir={run_dir}",
                "rl.group_size=4",
                "rl.tasks_per_step=2",
                "rl.max_turns=8",
                "rl.sampling.max_new_tokens=256",
                "rl.max_total_tokens=4096",
                "trainer.max_steps=2",
                "trainer.export_hf=false",
                "logging.progress=false",
                "logging.tensorboard=false",
                "generation=scripted",
                "generation.scripted.success_high=0.8",
                "generation.scripted.success_low=0.2",
                "rl.eval_every=1",
                "rl.eval_tasks=2",
            ]
        )
        == 0
    )
    dump = run_dir / "rollouts" / "step_2.jsonl"
    records = [json.loads(l) for l in dump.read_text().splitlines()]
    victim = next(r for r in records if r["messages"] and r["messages"][0]["role"] == "assistant")
    victim["messages"][0]["content"] = HOSTILE + victim["messages"][0]["content"]
    victim["messages"].append({"role": "tool", "content": HOSTILE})
    victim["error"] = HOSTILE  # and in a field the summary line shows
    victim["reward_details"] = {"note": HOSTILE, "nan": float("nan")}  # JSON has no NaN: the page must still load
    dump.write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def test_collect_reads_every_rollout_and_resolves_prompts(run):
    report = collect(run)
    train = [e for e in report["episodes"] if e["source"] == "train"]
    dumped = [json.loads(l) for s in (1, 2) for l in (run / "rollouts" / f"step_{s}.jsonl").read_text().splitlines()]
    assert len(train) == len(dumped) == 16
    assert [(e["step"], e["task"], e["reward"], e["advantage"]) for e in train] == [
        (r["step"], r["task_id"], r["reward"], r["advantage"]) for r in dumped
    ]
    # each turn's weight version: step s's rollouts were generated on the weights after s - 1 updates
    assert [e["versions"] for e in train] == [r["turn_versions"] for r in dumped]
    assert {v for e in train for v in e["versions"]} == {0, 1} and all(
        set(e["versions"]) == {e["step"] - 1} for e in train
    )
    # the prompt is dumped once per group and token; every rollout gets it back, with its own reward goal
    assert sum(r["prompt"] is not None for r in dumped) < len(dumped)
    assert all(e["prompt"] and f"<|{e['token']}_reward|>" in e["prompt"] for e in train)
    assert [e["step"] for e in report["evals"]] == [1, 2]
    assert len([e for e in report["episodes"] if e["source"] == "eval"]) == 4


@pytest.mark.browser
def test_report_in_a_headless_browser(run, tmp_path):
    from playwright.sync_api import sync_playwright

    out = tmp_path / "report.html"
    assert report_main([str(run), "-o", str(out)]) == 0
    html = out.read_text()
    assert "http://" not in html and "https://" not in html  # nothing to fetch: the page is the file
    dumped = [json.loads(l) for s in (1, 2) for l in (run / "rollouts" / f"step_{s}.jsonl").read_text().splitlines()]
    total = len(dumped) + 4  # and the 4 held-out episodes
    flags = [
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
    ]
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=flags)
        page = browser.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(out.as_uri())
        assert errors == [] and page.evaluate("window.pwned") is None  # planted markup ran nothing
        assert page.locator("#count").inner_text() == f"{total} of {total} rollouts"
        assert page.locator("img[alt='training dynamics']").count() == 1
        assert page.locator("#evals tr").count() == 3  # header + steps 1 and 2
        # a known rollout: its task, reward and its first tool result are on the page once opened
        known = next(r for r in dumped if any(m["role"] == "tool" and m["content"] != HOSTILE for m in r["messages"]))
        result = next(m["content"] for m in known["messages"] if m["role"] == "tool")
        page.select_option("#f-step", f"train {known['step']}")
        page.select_option("#f-task", known["task_id"])
        cards = page.locator("details.ep")
        assert cards.count() == sum(r["step"] == known["step"] and r["task_id"] == known["task_id"] for r in dumped)
        assert result not in page.locator("#episodes").inner_text()  # bodies are built when a rollout is opened
        for i in range(cards.count()):
            cards.nth(i).locator("summary").first.click()
        assert result in page.locator("#episodes").inner_text()
        assert f"weights v{known['weight_version']}" in cards.first.locator("summary").first.inner_text()
        # filters: reward 1 and token high select exactly those rollouts of the dumps
        page.select_option("#f-step", "all")
        page.select_option("#f-task", "all")
        page.select_option("#f-token", "high")
        page.select_option("#f-reward", "1")
        want = sum(r["reward_token"] == "high" and r["reward"] == 1.0 for r in dumped) + sum(
            json.loads(l)["reward"] == 1.0
            for s in (1, 2)
            for l in (run / "eval" / f"step_{s}.jsonl").read_text().splitlines()
        )
        assert 0 < want < total
        assert page.locator("#count").inner_text() == f"{want} of {total} rollouts"
        assert {cards.nth(i).get_attribute("data-token") for i in range(cards.count())} == {"high"}
        assert {cards.nth(i).get_attribute("data-reward") for i in range(cards.count())} == {"1"}
        # the planted markup is on the page as text, not as elements
        page.select_option("#f-token", "all")
        page.select_option("#f-reward", "all")
        assert page.locator("details.ep b").count() == 0 and page.locator("details.ep img").count() == 0
        for i in range(cards.count()):
            cards.nth(i).locator("summary").first.click()
        assert page.locator("#episodes").inner_text().count(HOSTILE) >= 3  # message, tool result, error
        page.screenshot(path=str(tmp_path / "report.png"), full_page=False)
        assert errors == [] and page.evaluate("window.pwned") is None
        browser.close()
    assert (tmp_path / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_long_runs_keep_the_last_steps_that_fit(run, monkeypatch):
    import nemo_rcgrpo.utils.report as report

    monkeypatch.setattr(report, "MAX_ROLLOUTS", 10)  # 8 rollouts a step: only the last step fits
    kept = collect(run)
    assert {e["step"] for e in kept["episodes"]} == {2} and "last 1 of 2 steps" in kept["note"]
    assert {e["step"] for e in collect(run, everything=True)["episodes"]} == {1, 2}
    assert {e["step"] for e in collect(run, last_steps=2)["episodes"]} == {1, 2} and not collect(run, 2)["note"]


def test_bad_folders_are_one_line_errors(tmp_path, capsys):
    assert report_main([str(tmp_path / "absent")]) == 2
    (tmp_path / "empty").mkdir()
    assert report_main([str(tmp_path / "empty")]) == 2
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("stage: rcgrpo\n")
    assert report_main([str(tmp_path / "run"), "--last-steps", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 3 and "holds no run" in err and "give at least 1" in err
