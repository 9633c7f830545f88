"""tests/worked_outputs.py, the maintainers' re-run of the folders' worked outputs: it finds every one.

The re-runs take minutes (one trainer run per block), so the suite does not make them; it checks that
every worked output in a folder's results/worked_outputs.md is found with a runnable command naming a
file that exists, that the READMEs hold none themselves (a re-run changes no README) and link every one,
and what the tool does to a block given a run's lines.
"""
import re
import shlex

import pytest

import worked_outputs as wo

FOLDERS = sorted(p for p in wo.ROOT.glob("[0-9][0-9]_*") if (p / "README.md").is_file())
LINK = re.compile(r"\(results/worked_outputs\.md#([\w-]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_worked_output_is_found_with_a_command_that_names_a_file():
    found = wo.find()
    assert {o.file.parents[1] for o in found} == {f for f in FOLDERS if (f / wo.RESULTS).is_file()}
    for o in found:
        assert o.runnable(), (o.file, o.line, o.command)
        script = next(word for word in shlex.split(o.command) if word.endswith(".py"))
        assert (wo.ROOT / script).is_file(), (o.file, o.line, o.command)


def test_the_readmes_link_every_worked_output_and_hold_none_themselves():
    problems = []
    for folder in FOLDERS:
        readme = (folder / "README.md").read_text()
        results = folder / wo.RESULTS
        headings = ([anchor(line.lstrip("#")) for line in results.read_text().splitlines()
                     if line.startswith("## ")] if results.is_file() else [])
        linked = LINK.findall(readme)
        problems += [f"{folder.name}/README.md links #{a}, which {wo.RESULTS} lacks"
                     for a in linked if a not in headings]
        problems += [f"{folder.name}/{wo.RESULTS}: #{h} is linked from no README line" for h in headings
                     if h not in linked]
        lines = readme.splitlines()
        for i, line in enumerate(lines):
            # a plain block under a paragraph naming a command is a worked output: it belongs in results/
            if line == "```" and re.search(r"`(?:torchrun|python) ", wo._paragraph_above(lines, i)):
                problems.append(f"{folder.name}/README.md:{i + 1}: a worked output; move it to {wo.RESULTS}")
    assert not problems, problems


def test_write_dates_the_file_on_the_line_that_says_so(monkeypatch):
    monkeypatch.setattr(wo, "written_line", lambda folder: f"{wo.WRITTEN}`... write {folder}` today.")
    text = "# 02: worked outputs\n\nLast written by `... write 02` on 2026-11-28.\n\n## A run\n"
    assert wo.dated(text, "02").splitlines()[2] == "Last written by `... write 02` today."
    assert wo.dated("# 03\n\n## A run\n", "03").splitlines()[:4] == [
        "# 03", "", "Last written by `... write 03` today.", ""]


def test_the_written_line_names_the_date_the_commit_and_the_machine():
    line = wo.written_line("05")
    assert line.startswith(f"{wo.WRITTEN}`python tests/worked_outputs.py write 05` on 20")
    assert re.search(r"at commit \S+: .+, \d+ cores, load average [\d.]+ when it began; Python 3\.\d+\.\d+, "
                     r"torch \d+\.\d+", line), line


def test_a_block_keeps_what_the_run_prints_and_takes_the_rest_from_it():
    block = "\n".join(["memory per rank (dp 4):",
                       "  parameters      3.13 MiB",
                       "step     1 | loss 5.7280 | tok/s 354",
                       "activations saved in step 1: peak 11.25 MiB",
                       "…",
                       "model: 0.82M parameters, LlamaConfig(vocab_size=320, hidd …",
                       "bubble: measured 153.0% (wall clock), replayed 18.8%"])
    printed = ["memory per rank (dp 4) (fp32):", "  parameters      3.13 MiB",
               "step     1 | loss 5.7280 | tok/s 619",
               "step     2 | loss 5.3690 | tok/s 4855", "activations saved in step 1: peak 10.75 MiB",
               "model: 0.82M parameters, LlamaConfig(vocab_size=320, hidden_size=128)",
               "bubble: measured 68.0% (wall clock), replayed 18.8%"]
    new, stale = wo.refreshed(block, printed)
    assert new.splitlines() == ["memory per rank (dp 4) (fp32):",
                                "  parameters      3.13 MiB",           # still printed: kept
                                "step     1 | loss 5.7280 | tok/s 619",
                                "activations saved in step 1: peak 10.75 MiB",
                                "…",
                                "model: 0.82M parameters, LlamaConfig(vocab_size=320, hidd …",
                                "bubble: measured 68.0% (wall clock), replayed 18.8%"]
    # Timings are refreshed but are not stale
    assert stale == [("memory per rank (dp 4):", "memory per rank (dp 4) (fp32):"),
                     ("activations saved in step 1: peak 11.25 MiB",
                      "activations saved in step 1: peak 10.75 MiB")]
    with pytest.raises(ValueError, match="no line like 'final loss 3.3'"):
        wo.refreshed("final loss 3.3", printed)


def test_a_line_is_refreshed_from_the_run_lines_after_the_one_before_it():
    """The block's lines are the run's in order: a label printed earlier (08's planner prints `  dp` in its
    bytes table before its overlap table) must not stand in for the line that follows the block's last."""
    printed = ["bytes per step", "  dp                              1.6430", "overlap t_comm/t_compute",
               "  dp           0.032  (intra-node)", "  tp           0.512  (intra-node)"]
    block = "overlap t_comm/t_compute\n  dp           0.064  (intra-node)\n  tp           0.512  (intra-node)"
    new, stale = wo.refreshed(block, printed)
    assert new.splitlines()[1] == "  dp           0.032  (intra-node)"
    assert stale == [("  dp           0.064  (intra-node)", "  dp           0.032  (intra-node)")]


def test_a_step_line_is_stale_when_its_loss_moved_though_its_timings_are_the_machines():
    rest = " | mfu n/a | hfu n/a | mem -"
    printed = ["step    10 | loss 3.3781 | lr 3.00e-03 | tok/s 5012" + rest]
    old = "step    10 | loss 3.3777 | lr 3.00e-03 | tok/s 5360" + rest
    new, stale = wo.refreshed(old, printed)
    assert new == printed[0] and stale == [(old, printed[0])]
    _, stale = wo.refreshed("step    10 | loss 3.3781 | lr 3.00e-03 | tok/s 6000" + rest, printed)
    assert stale == []     # only the throughput moved


def test_a_command_broken_after_python_at_a_line_end_is_still_found(tmp_path, monkeypatch):
    folder = tmp_path / "09_x" / "results"
    folder.mkdir(parents=True)
    (folder / "worked_outputs.md").write_text("# 09\n\n## A run\n\n`python\n09_x/train.py --steps 2` "
                                              "prints:\n\n```\nfinal loss 3.3\n```\n")
    monkeypatch.setattr(wo, "ROOT", tmp_path)
    assert [o.command for o in wo.find()] == ["python 09_x/train.py --steps 2"]


def test_every_plain_block_of_a_results_file_is_a_worked_output_the_tool_finds():
    found = wo.find()
    for file in sorted(wo.ROOT.glob(f"[0-9][0-9]_*/{wo.RESULTS}")):
        lines = file.read_text().splitlines()
        fences = [(i + 1, line) for i, line in enumerate(lines) if line.startswith("```")]
        plain = [at for at, line in fences[::2] if line == "```"]     # the opening fences of plain blocks
        assert plain == [o.line for o in found if o.file == file], (
            f"{file.relative_to(wo.ROOT)}: a block the tool does not find: name its command in backticks "
            "in the paragraph just above it")
