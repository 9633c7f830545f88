"""tests/worked_outputs.py, the maintainers' re-run of the READMEs' worked outputs: it finds every one.

The re-runs take minutes (one trainer run per block), so the suite does not make them; it checks that
every "Worked output" section of 01-08 has a block the tool finds with a runnable command naming a file
that exists, and what the tool does to a block given a run's lines.
"""
import re
import shlex

import pytest

import worked_outputs as wo


def test_every_worked_output_section_has_a_block_with_its_command():
    found = wo.find()
    missing = []
    for readme in sorted(wo.ROOT.glob("[0-9][0-9]_*/README.md")):
        lines = readme.read_text().splitlines()
        for i, line in enumerate(lines):
            if re.match(r"#+ Worked outputs?$", line):
                end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("#")), len(lines))
                if not any(o.readme == readme and i < o.line <= end for o in found):
                    missing.append(f"{readme.relative_to(wo.ROOT)}:{i + 1}")
    assert not missing, ("worked outputs whose command the tool cannot find: name it in backticks in the "
                         f"paragraph above the block: {missing}")
    for o in found:
        if o.runnable():
            script = next(word for word in shlex.split(o.command) if word.endswith(".py"))
            assert (wo.ROOT / script).is_file(), (o.readme, o.line, o.command)


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
