"""The repository stands alone: nothing in it points at files its users do not have.

The project was written beside a folder of source documents, house rules and a digest of the papers
(`../shared/`) that is not part of it. Every tracked file is read: a path into that folder, a reference
to the digest's item numbers or to line numbers of its copies of the papers fails the test, with the
place. Errata are cited by number (E6, ...) and every number cited must be explained in the README.
"""
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = re.compile(r"\.\./shared\b|\bshared/(STYLE|seeds|reference|tools)\b|STYLE\.md|seed[ _-]digest|"
                     r"\bthe seeds?'s?\b|\[PB\] L\d+|\b(SG|DP|Z|TP|SP|CP|PP|EP|C|K)-\d+\b")
ERRATUM = re.compile(r"\b(?:errat(?:um|a)|\[PB\]) (E\d+)|\((E\d+)\)|^\s*(E\d+):|\b(E\d+) (?:and|identity)|"
                     r"(?<=[ (])(E\d+)(?=[:)])")


def tracked_text_files():
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split("\0")
    for name in filter(None, names):
        path = ROOT / name
        if path.suffix not in (".png", ".safetensors") and path.is_file() and name != "tests/test_repository.py":
            yield name, path.read_text(errors="replace").splitlines()


def test_no_file_points_outside_the_repository():
    files = dict(tracked_text_files())
    assert len(files) > 50                                   # the listing worked: the whole tree is read
    found = [f"{name}:{number}: {line.strip()}" for name, lines in files.items()
             for number, line in enumerate(lines, 1) if OUTSIDE.search(line)]
    assert not found, "\n".join(found)


def test_every_cited_erratum_is_explained_in_the_readme():
    files = dict(tracked_text_files())
    explained = set(re.findall(r"^\| (E\d+) \|", "\n".join(files["README.md"]), re.M))
    cited = {(name, number, next(g for g in match.groups() if g))
             for name, lines in files.items() for number, line in enumerate(lines, 1)
             for match in ERRATUM.finditer(line)}
    assert {"E6", "E16"} <= {erratum for _, _, erratum in cited}        # the pattern finds the citations
    missing = [f"{name}:{number}: {erratum}" for name, number, erratum in sorted(cited) if erratum not in explained]
    assert not missing, "\n".join(missing)


def test_readme_gpu_figures_are_generated_from_the_committed_results():
    """No GPU figure is typed by hand: the README's section is what kernels/report.py makes of the
    results files (rerun `python kernels/report.py --write` after committing new ones)."""
    from importlib import import_module
    assert import_module("kernels.report").section() in (ROOT / "README.md").read_text()
