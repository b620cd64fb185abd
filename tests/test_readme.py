"""The Python examples of README.md and of every page in docs/ run as written, each as its own script
in its own process (multi-process examples launch their ranks the way a user's script would).
Examples that need GPUs (``accelerator="gpu"`` or ``device="cuda"`` in the block) are only compiled."""

import re
from pathlib import Path

import pytest
from _warm import python

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GPU_MARKERS = ('accelerator="gpu"', 'device="cuda"')


def _blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)\n```", page.read_text(), flags=re.S)


EXAMPLES = [(page.relative_to(ROOT).as_posix(), i, code) for page in PAGES for i, code in enumerate(_blocks(page))]


def test_every_docs_page_has_an_example():
    docs = [p for p in PAGES if p.parent.name == "docs"]
    assert docs, "docs/ has no pages"
    assert all(_blocks(p) for p in docs), [p.name for p in docs if not _blocks(p)]


@pytest.mark.parametrize("page,index,code", EXAMPLES, ids=[f"{p}[{i}]" for p, i, _ in EXAMPLES])
def test_example(page, index, code, tmp_path):
    compile(code, f"{page}[python block {index}]", "exec")
    if any(marker in code for marker in GPU_MARKERS):
        pytest.skip("needs GPUs: compiled only")
    texts = tmp_path / "my_texts"
    texts.mkdir()
    (texts / "a.txt").write_text("def main():\n    return 42\n" * 400)
    (texts / "b.txt").write_text("import os\nprint(os.getcwd())\n" * 400)
    script = tmp_path / f"example_{Path(page).stem}_{index}.py"
    script.write_text(code + "\n")
    # forked from the warm interpreter, unless it sets environment variables for its imports to read
    proc = python([script], cwd=tmp_path, timeout=600, fresh="os.environ" in code)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
