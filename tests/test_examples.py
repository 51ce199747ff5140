"""The README's first Python snippet runs as written, and every examples/*.py runs in its quick mode, exits 0 and
prints the line that says what it checked and that the check passed."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

#: Each example's quick-mode runs: the flags, the modules it needs, and the lines it must print (regular
#: expressions).
QUICK = {
    "llama_layer.py": [(("--small",), (), [r"^checked against fastattn\.reference \(the same layer on the "
                                           r"reference ops, 5 calls\): max \|fast - reference\| = \S+, bound \S+ "
                                           r".*: passed$"])],
    "hf_generate.py": [(("--short",), ("torch", "transformers"),
                        [r"^checked: fastattn's 4 generated tokens equal eager's \(passed\)$",
                         r"^speed-up over sdpa at a context of 512 tokens: \d+\.\d\dx "]),
                       (("--short", "--cache", "q8_0"), ("torch", "transformers"),
                        [r"^checked: fastattn's 4 generated tokens over a Q8_0 cache equal eager's over the same "
                         r"values \(passed\)$",
                         r"^speed-up of fastattn over a Q8_0 QuantizedKVCache against sdpa with a DynamicCache at a "
                         r"context of 512 tokens: \d+\.\d\dx ",
                         r"^memory: the Q8_0 QuantizedKVCache holds \d+\.\d MB \(nbytes\), 0\.\d+x the float32 "
                         r"DynamicCache's \d+\.\d MB of K/V$"])],
}
RUNS = [(name, flags, needs, lines) for name, runs in QUICK.items() for flags, needs, lines in runs]


def readme_snippet() -> str:
    """The first ```python block of README.md."""
    found = re.search(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)
    assert found, "README.md has no ```python block"
    return found.group(1)


def test_readme_snippet_runs():
    code = readme_snippet()
    assert "fastattn." in code  # the snippet that shows the library
    namespace = {"__name__": "readme"}
    exec(compile(code, "README.md", "exec"), namespace)  # its asserts check fast against the reference


def test_every_example_has_a_quick_mode_here():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(QUICK)


@pytest.mark.parametrize("name, flags, needs, lines", RUNS, ids=[" ".join((r[0],) + r[1]) for r in RUNS])
def test_example_runs_in_its_quick_mode(name, flags, needs, lines):
    for module in needs:
        pytest.importorskip(module)
    # the script's own directory comes first on its sys.path: point it at this checkout's fastattn
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, str(EXAMPLES / name), *flags], capture_output=True, text=True, env=env,
                         timeout=900, cwd=str(ROOT))
    assert run.returncode == 0, run.stdout + run.stderr
    for line in lines:
        assert re.search(line, run.stdout, re.M), run.stdout
