"""The README's Python examples run as written (those that need a GPU are only compiled)."""

import os
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)\n```", README.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example(index, tmp_path, monkeypatch):
    code = BLOCKS[index]
    compiled = compile(code, f"README.md[python block {index}]", "exec")
    if 'accelerator="gpu"' in code:
        pytest.skip("needs GPUs: compiled only")
    monkeypatch.chdir(tmp_path)
    texts = tmp_path / "my_texts"
    texts.mkdir()
    (texts / "a.txt").write_text("def main():\n    return 42\n" * 400)
    (texts / "b.txt").write_text("import os\nprint(os.getcwd())\n" * 400)
    os.environ.setdefault("PYTHONHASHSEED", "0")
    exec(compiled, {"__name__": "__readme__"})
