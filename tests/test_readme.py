"""The README's Python examples run as written, each as its own script (multi-process examples launch
their ranks the way a user's script would). Examples that need GPUs are only compiled."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)\n```", README.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example(index, tmp_path):
    code = BLOCKS[index]
    compile(code, f"README.md[python block {index}]", "exec")
    if 'accelerator="gpu"' in code or 'device="cuda"' in code:
        pytest.skip("needs GPUs: compiled only")
    texts = tmp_path / "my_texts"
    texts.mkdir()
    (texts / "a.txt").write_text("def main():\n    return 42\n" * 400)
    (texts / "b.txt").write_text("import os\nprint(os.getcwd())\n" * 400)
    script = tmp_path / f"readme_example_{index}.py"
    script.write_text(code + "\n")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
