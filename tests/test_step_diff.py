"""What each step adds, kept true: tests/step_diff.py against the READMEs and the train.py files.

No ranks: the files are read. A README whose generated block differs from what step_diff.py makes of the
code fails (rerun `python tests/step_diff.py --write`), and so does a trailing comment that differs between
a step and its parent on a line whose code they share, since a plain `diff` would show that line though
nothing in it changed.
"""
import step_diff

FOLDERS = list(step_diff.LINEAGE)


def test_lineage_covers_every_folder_as_its_docstring_says():
    assert FOLDERS == sorted(p.name for p in step_diff.ROOT.glob("[0-9][0-9]_*") if p.is_dir())
    for folder, parent in step_diff.LINEAGE.items():
        doc = (step_diff.ROOT / folder / "train.py").read_text().split('"""')[1]
        if parent:
            assert f"New in the step compared with {parent[:2]}" in doc, folder


def test_readmes_show_the_generated_steps():
    stale = [folder for folder in FOLDERS
             if step_diff.readme_block(folder) not in (step_diff.ROOT / folder / "README.md").read_text()]
    assert not stale, f"rerun `python tests/step_diff.py --write`: {stale}"


def test_lines_a_step_shares_with_its_parent_keep_the_parents_comment():
    drifted = [line for folder in FOLDERS for line in step_diff.drifted_comments(folder)]
    assert not drifted, "\n".join(drifted)


def test_the_command_prints_the_code_only_diff(capsys):
    step_diff.main(["04"])
    out = capsys.readouterr().out.splitlines()
    assert ("+    grad_norm = tensor_parallel.clip_grad_norm_tp(grad_owners, args.grad_clip, "
            "grid.tp_group)") in out
    assert "     optimizer.step(grad_norm)" in out                     # context: the whole step
    assert not any("#" in line for line in out)                      # code only
    step_diff.main(["--counts"])
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].split() == ["pair", "train.py", "step", "code"] and len(rows) == len(FOLDERS)


def test_a_tab_completed_folder_name_is_accepted(capsys):
    """A shell completes `04_tensor_parallel/` with its slash: the same folder as `04`."""
    step_diff.main(["04"])
    expected = capsys.readouterr().out
    for name in ("04_tensor_parallel/", "./04_tensor_parallel", "04_tensor_parallel"):
        step_diff.main([name])
        assert capsys.readouterr().out == expected, name
