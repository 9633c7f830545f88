"""The repository stands alone: nothing in it points at files its users do not have.

The project was written beside a folder of source documents and house rules (`../shared/`) that is not
part of it. Every tracked file is read and any reference to that folder fails the test, with the place.
"""
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = re.compile(r"\.\./shared\b|\bshared/(STYLE|seeds|reference|tools)\b|STYLE\.md")


def test_no_file_points_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert len(files) > 50                                   # the listing worked: the whole tree is read
    found = []
    for name in files:
        path = ROOT / name
        if path.suffix in (".png", ".safetensors") or not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line) and name != "tests/test_repository.py":
                found.append(f"{name}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
