"""What one process tunes, the next reads: the launch configurations of ``kernels.autotune`` and the
``attention="auto"`` choices of ``kernels.dispatch.AttentionSelector``, each written by one Python
process and read back by a second one that times nothing; never across torch / Triton versions, never
a choice that cannot run any more, and never while a model is being traced."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from lightning_perf.kernels import dispatch
from lightning_perf.kernels.autotune import AutotuneCache

ROOT = Path(__file__).resolve().parents[2]

# a tuner and a selector that time by a table instead of CUDA events, on a pretend GPU
_FAKES = textwrap.dedent('''
    import json, sys, torch
    from lightning_perf.kernels import dispatch
    from lightning_perf.kernels.autotune import AutotuneCache, KernelTuner

    class Tuner(KernelTuner):
        def __init__(self, cache, times):
            super().__init__(cache)
            self.times, self.timed = times, []

        def device_name(self, device):
            return "Fake GPU 80GB"

        def _time(self, launch, cfg):
            self.timed.append(cfg["BLOCK"])
            return self.times[cfg["BLOCK"]]

    class Backends(dispatch.AttentionBackends):
        def __init__(self, missing=()):
            super().__init__()
            self.missing = set(missing)

        def unsupported(self, name, q, k, v):
            return f"{name} is not installed" if name in self.missing else None

    class Selector(dispatch.AttentionSelector):
        def __init__(self, times, missing=(), **kwargs):
            super().__init__(backends=Backends(missing), **kwargs)
            self.times, self.timed = times, []

        def can_time(self, q):
            return True

        def device_name(self, q):
            return "Fake GPU 80GB"

        def _time(self, name, q, k, v, causal):
            self.timed.append(name)
            return self.times[name]

    q, k = torch.zeros(2, 4, 16, 8), torch.zeros(2, 2, 16, 8)
''')


def _run(code: str, cache_dir: Path) -> dict:
    """``code`` (after the fakes) in a fresh Python process; what it prints last, as JSON."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), CACHE=str(cache_dir))
    proc = subprocess.run([sys.executable, "-c", _FAKES + textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_process_reads_the_tuned_configurations_and_times_nothing(tmp_path):
    code = '''
        import os
        tuner = Tuner(AutotuneCache(directory=os.environ["CACHE"]), {64: 2.0, 128: 0.5, 256: 1.0})
        configs = [dict(BLOCK=b) for b in (64, 128, 256)]
        best = tuner.pick("my_kernel", (1024, torch.bfloat16), configs, lambda cfg: None, torch.device("cuda"))
        print(json.dumps({"best": best, "timed": tuner.timed}))
    '''
    first = _run(code, tmp_path)
    assert first == {"best": {"BLOCK": 128}, "timed": [64, 128, 256]}
    second = _run(code.replace("0.5, 256", "9.0, 256"), tmp_path)  # the table changed: only a re-timing could see it
    assert second == {"best": {"BLOCK": 128}, "timed": []}
    # another torch or Triton version has files of its own: it tunes again, and both stay
    other = AutotuneCache(directory=tmp_path, software="torch-0.0--triton-0.0")
    assert other.load("my_kernel", "Fake GPU 80GB", "1024|torch.bfloat16") is None
    assert other.path("my_kernel", "Fake GPU 80GB") != AutotuneCache(directory=tmp_path).path("my_kernel",
                                                                                             "Fake GPU 80GB")


def test_a_second_process_reads_the_attention_choice_and_times_nothing(tmp_path):
    code = '''
        import os
        times = {"cudnn": 2.0, "flash": 1.5, "efficient": 3.0, "flex": 1.2, "fa3": 5.0, "fa4": 0.4}
        sel = Selector(times, cache=AutotuneCache(directory=os.environ["CACHE"]))
        best = sel.choose(q, k, k, True)
        key = sel.key(q, k, True)
        print(json.dumps({"best": best, "traced": sel.traced_choices[key], "timed": sel.timed}))
    '''
    first = _run(code, tmp_path)
    assert first["best"] == "fa4" and first["traced"] == "flex" and len(first["timed"]) == 6
    second = _run(code.replace('"fa4": 0.4', '"fa4": 9.0'), tmp_path)
    assert second == {"best": "fa4", "traced": "flex", "timed": []}
    # FA4 uninstalled since: the stored choice cannot run, so the shape is timed again
    third = _run(code.replace("Selector(times,", "Selector(times, missing=('fa4',),"), tmp_path)
    assert third["best"] == "flex" and "cudnn" in third["timed"]


class _Backends(dispatch.AttentionBackends):
    def unsupported(self, name, q, k, v):
        return None


class _Selector(dispatch.AttentionSelector):
    def __init__(self, **kwargs):
        super().__init__(backends=_Backends(), **kwargs)
        self.timed = []

    def can_time(self, q):
        return True

    def device_name(self, q):
        return "Fake GPU 80GB"

    def _time(self, name, q, k, v, causal):
        self.timed.append(name)
        return {"flash": 1.0}.get(name, 2.0)


def test_the_disk_is_never_read_while_tracing_and_each_shape_has_its_entry(tmp_path, monkeypatch):
    q, k = torch.zeros(2, 4, 16, 8), torch.zeros(2, 2, 16, 8)
    _Selector(cache=AutotuneCache(directory=tmp_path)).choose(q, k, k, True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    tracing = _Selector(cache=AutotuneCache(directory=tmp_path))
    # a compiled model's graph is what it would be without the disk: SDPA's own choice (None)
    assert tracing.choose(q, k, k, True) is None and tracing.timed == []
    monkeypatch.undo()
    (entries,) = [json.loads(p.read_text()) for p in tmp_path.iterdir()]
    (key,) = entries
    assert "q(2, 4, 16, 8)|kv2|torch.float32|causal=True" in key and entries[key]["choice"] == "flash"
    other = _Selector(cache=AutotuneCache(directory=tmp_path))
    assert other.choose(q, k, k, False) == "flash" and other.timed  # non-causal: its own entry, timed
