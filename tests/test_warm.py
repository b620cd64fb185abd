"""The warm interpreter of ``_warm.py``: forked commands and ranks start as fresh processes would
(their own random streams, the caller's environment, no test modules imported), a failure fails, and
a hang is killed with the stacks of where it hung."""

import os
import subprocess
import time

import pytest
import torch
from _spawn import spawn
from _warm import context, python



@pytest.fixture(autouse=True)
def _served():
    """(Started here, not at import: ranks import this module.)"""
    if context() is None:
        pytest.skip("the environment differs from the fork server's")

_PROBE = """
import json, os, random, sys
forked = "torch" in sys.modules  # imported by the server; a fresh interpreter has not yet
import numpy, torch
print(json.dumps({"torch": torch.rand(2).tolist(), "numpy": numpy.random.rand(2).tolist(),
                  "random": random.random(), "env": os.environ.get("PL_GLOBAL_SEED"), "cwd": os.getcwd(),
                  "loaded": sorted(m for m in ("pytest", "_pytest", "_spawn", "_warm") if m in sys.modules),
                  "forked": forked}))
"""


def test_forked_commands_start_as_fresh_interpreters(tmp_path, monkeypatch):
    import json

    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "a run-time variable: still forked")
    # a run-time variable differs between the two: both are still forked, each under its own value
    runs = [python([script], cwd=tmp_path, timeout=60, env={**os.environ, "PL_GLOBAL_SEED": str(i)}) for i in range(2)]
    assert [r.returncode for r in runs] == [0, 0], [r.stderr[-2000:] for r in runs]
    a, b = (json.loads(r.stdout) for r in runs)
    assert a["forked"] and b["forked"]
    assert (a["env"], b["env"]) == ("0", "1") and a["cwd"] == b["cwd"] == str(tmp_path)
    assert a["loaded"] == b["loaded"] == []
    for stream in ("torch", "numpy", "random"):
        assert a[stream] != b[stream], stream  # not the server's one stream continued twice


def test_variables_libraries_write_at_run_time_keep_processes_forked(tmp_path, monkeypatch):
    """Inductor's first compile and ``Trainer(deterministic=True)`` write variables into the test
    process that no import reads: later commands and ranks are still forked, and see the values."""
    import json

    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    cache_dir()  # what Inductor runs when it first compiles: sets TORCHINDUCTOR_CACHE_DIR
    monkeypatch.setenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "12345")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert context() is not None
    script = tmp_path / "probe.py"
    script.write_text("import json, os, sys\nprint(json.dumps({'cache': os.environ.get('TORCHINDUCTOR_CACHE_DIR'), "
                      "'cublas': os.environ.get('CUBLAS_WORKSPACE_CONFIG'), 'torch': 'torch' in sys.modules}))\n")
    run = python([script], cwd=tmp_path, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    seen = json.loads(run.stdout)
    # forked: torch is there before the script imports it (a fresh interpreter would not have it)
    assert seen == {"cache": os.environ["TORCHINDUCTOR_CACHE_DIR"], "cublas": ":4096:8", "torch": True}


def test_forked_command_failures_and_exit_codes_reach_the_caller(tmp_path):
    (tmp_path / "raises.py").write_text("raise ValueError('from the example')\n")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")
    raised = python([tmp_path / "raises.py"], timeout=60)
    assert raised.returncode == 1 and "ValueError: from the example" in raised.stderr
    assert python([tmp_path / "exits.py"], timeout=60).returncode == 3
    missing = python(["-m", "no_such_module_here"], timeout=60)
    assert missing.returncode == 1 and "No module named no_such_module_here" in missing.stderr


def test_a_hung_command_is_killed_with_its_stacks(tmp_path):
    (tmp_path / "hangs.py").write_text("import time\n\ndef wait_forever():\n    while True:\n        time.sleep(0.05)\n\n"
                                       "wait_forever()\n")
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as info:
        python([tmp_path / "hangs.py"], timeout=1)
    assert time.monotonic() - start < 30
    assert "wait_forever" in str(info.value) and "hangs.py" in str(info.value)


_LAUNCHER = """
import json, os, subprocess, sys
forked = "torch" in sys.modules
rank = int(os.environ.get("LOCAL_RANK", 0))
print(json.dumps({"rank": rank, "forked": forked, "argv": sys.argv[1:]}), flush=True)
if rank == 0:  # as Lightning's launcher starts the other ranks: this script again, LOCAL_RANK set
    ranks = [subprocess.Popen([sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]],
                              env={**os.environ, "LOCAL_RANK": str(r)}) for r in (1, 2)]
    if sys.argv[1:] == ["hang"]:
        open("rank_pids", "w").write(" ".join(str(p.pid) for p in ranks))
    codes = [p.wait() for p in ranks]
    other = subprocess.run([sys.executable, "-c", "import sys; print('torch' in sys.modules)"],
                           capture_output=True, text=True).stdout.strip()
    print(json.dumps({"codes": codes, "other": other}))
elif sys.argv[1:] == ["hang"]:
    import time

    def wait_forever():
        while True:
            time.sleep(0.05)

    wait_forever()
else:
    sys.exit(rank + 3)
"""


def test_a_commands_launched_ranks_are_forked_and_write_to_its_output(tmp_path):
    """A forked command that starts itself again per rank, as Lightning's launcher does, gets those
    ranks forked too: their output in its own, their exit codes back; other commands it runs are
    real processes."""
    import json

    (tmp_path / "launch.py").write_text(_LAUNCHER)
    run = python([tmp_path / "launch.py", "go"], cwd=tmp_path, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    ranks = sorted((x for x in lines if "rank" in x), key=lambda x: x["rank"])
    assert ranks == [{"rank": r, "forked": True, "argv": ["go"]} for r in range(3)], lines
    assert lines[-1] == {"codes": [4, 5], "other": "False"}, lines


def test_a_hung_launched_rank_is_killed_with_its_stacks(tmp_path):
    (tmp_path / "launch.py").write_text(_LAUNCHER)
    with pytest.raises(subprocess.TimeoutExpired) as info:
        python([tmp_path / "launch.py", "hang"], cwd=tmp_path, timeout=5)
    assert "wait_forever" in str(info.value)  # the ranks' stacks, from the command's stderr
    pids = [int(pid) for pid in (tmp_path / "rank_pids").read_text().split()]
    deadline = time.monotonic() + 30  # killed (a signal takes a moment to land)
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    """Running or sleeping: not gone, not a zombie waiting for its parent (or init) to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_hung_fresh_command_is_killed_with_what_it_started(tmp_path):
    (tmp_path / "hangs.py").write_text("import subprocess, sys, time\n"
                                       "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                                       "open('child_pid', 'w').write(str(child.pid))\n"
                                       "time.sleep(600)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        python([tmp_path / "hangs.py"], cwd=tmp_path, timeout=3, fresh=True)
    child = int((tmp_path / "child_pid").read_text())
    deadline = time.monotonic() + 30  # killed (a signal takes a moment to land)
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def _rank_draws(rank: int, world: int, out_dir) -> list[float]:
    return torch.rand(4).tolist()


def _rank_hangs(rank: int, world: int, out_dir) -> None:
    while True:
        time.sleep(0.05)


def test_forked_ranks_draw_their_own_streams_and_a_hang_fails_with_stacks(tmp_path):
    a, b = spawn(_rank_draws, 2, tmp_path / "draws", timeout=60)
    assert a != b
    with pytest.raises(pytest.fail.Exception, match="(?s)did not finish in 1.0s.*_rank_hangs"):
        spawn(_rank_hangs, 2, tmp_path / "hangs", timeout=1.0)
