"""The command line's answers to bad input: a few lines naming the file or option and the fix, the
traceback only on request; generate's sampling arguments; a sharded checkpoint consolidated and then
sampled; a GPU recipe on the CPU; ``--help`` with a recipe's values."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from _warm import python

from lightning_perf.cli import cpu_overrides, default_config_path, recipe_dir, user_error_message

# one step of the default recipe without its loggers and performance callbacks, on synthetic tokens
TINY = ["--trainer.max_steps", "1", "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false",
        "--trainer.logger", "false", "--trainer.callbacks", "[]", "--data.source", "synthetic",
        "--data.seq_len", "16", "--data.batch_size", "2"]
TINY_MODEL = ["--model.config_overrides", "{n_layer: 1, n_embd: 32, n_head: 2, n_kv_head: 2, block_size: 32}"]


def _cli(args, cwd, timeout=300):
    return python(["-m", "lightning_perf", *map(str, args)], cwd=cwd, timeout=timeout)


def _short_error(proc, *needles: str) -> str:
    """The error block of a failed command: rc 1 (or 2 for argument errors), no traceback, at most three
    lines from the error on, naming every needle."""
    assert proc.returncode in (1, 2), (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    err = proc.stderr
    assert "Traceback" not in err, err[-3000:]
    block = err[err.index(": error: ") :].rstrip().splitlines()
    assert len(block) <= 3, block
    text = "\n".join(block)
    for needle in needles:
        assert needle in text, (needle, text)
    return text


def _token_dir(path: Path, train_tokens: int, val_tokens: int) -> Path:
    from lightning_perf.data import write_token_file

    rng = np.random.default_rng(0)
    write_token_file(path / "train", rng.integers(0, 256, train_tokens), vocab_size=260)
    write_token_file(path / "val", rng.integers(0, 256, val_tokens), vocab_size=260)
    return path


# ---- errors found at setup -------------------------------------------------------------------


def test_missing_data_dir_is_short_and_says_how_to_make_it(tmp_path):
    proc = _cli(["fit", *TINY, "--data.source", "memmap", "--data.data_dir", "nodir"], tmp_path)
    _short_error(proc, "data_dir nodir does not exist", "lightning-perf prepare", "--out_dir nodir",
                 "LIGHTNING_PERF_DEBUG=1")


def test_layout_that_does_not_divide_the_world_is_short(tmp_path):
    proc = _cli(["fit", *TINY, "--trainer.strategy", "Parallel3DStrategy", "--trainer.devices", "3",
                 "--trainer.strategy.init_args.tensor_parallel_size", "2"], tmp_path)
    _short_error(proc, "world size 3 is not divisible by tp(2)", "multiple of 2 processes")


def test_short_validation_split_is_refused_unless_validation_is_off(tmp_path):
    data = _token_dir(tmp_path / "data", 2000, 10)
    args = ["fit", *TINY, *TINY_MODEL, "--data.source", "memmap", "--data.data_dir", data,
            "--trainer.default_root_dir", tmp_path / "run"]
    proc = _cli([*args, "--trainer.limit_val_batches", "1"], tmp_path)
    _short_error(proc, "val split", "seq_len + 1 = 17", "limit_val_batches=0")
    proc = _cli(args, tmp_path)  # TINY: --trainer.limit_val_batches 0
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "`max_steps=1` reached" in proc.stdout + proc.stderr


def test_garbage_ckpt_path_is_refused_before_it_is_read(tmp_path):
    (tmp_path / "garbage.ckpt").write_text("hello, I am not a checkpoint\n")
    proc = _cli(["fit", *TINY, "--ckpt_path", "garbage.ckpt"], tmp_path)
    _short_error(proc, "--ckpt_path garbage.ckpt: not a checkpoint")
    proc = _cli(["fit", *TINY, "--ckpt_path", "nowhere.ckpt"], tmp_path)
    _short_error(proc, "--ckpt_path nowhere.ckpt: no such file")
    # the traceback on request, with the same exit status
    proc = _cli(["fit", *TINY, "--ckpt_path", "garbage.ckpt", "--debug"], tmp_path)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "not a checkpoint" in proc.stderr


def test_debug_environment_variable_keeps_the_traceback(tmp_path, monkeypatch, capsys):
    from lightning_perf.cli import DEBUG_ENV, main

    (tmp_path / "garbage.ckpt").write_text("nope")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as short:
        main(["fit", *TINY, "--ckpt_path", "garbage.ckpt"])
    assert short.value.code == 1 and "not a checkpoint" in capsys.readouterr().err
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(ValueError, match="not a checkpoint"):  # the exception itself, for its traceback
        main(["fit", *TINY, "--ckpt_path", "garbage.ckpt"])


def test_lightning_checkpoint_of_another_shape_names_the_first_tensor(tmp_path):
    from lightning_perf.models.gpt.module import GPTLightningModule

    module = GPTLightningModule("tiny", config_overrides={"n_layer": 1, "n_embd": 64, "n_head": 2, "n_kv_head": 2})
    module.configure_model()
    torch.save({"state_dict": module.state_dict(), "pytorch-lightning_version": "2.6.0", "epoch": 0,
                "global_step": 0}, tmp_path / "other.ckpt")
    proc = _cli(["fit", *TINY, *TINY_MODEL, "--ckpt_path", "other.ckpt"], tmp_path)
    text = _short_error(proc, "--ckpt_path other.ckpt does not fit this model", "size mismatch for model.",
                        "--model.config_overrides")
    assert "more)" in text  # the count of the other tensors, not their list


@pytest.fixture(scope="module")
def zero_checkpoint(tmp_path_factory):
    """A sharded checkpoint of one ZeRO-2 step of a small GPT (one CPU process)."""
    cwd = tmp_path_factory.mktemp("zero")
    checkpoint = ("[{class_path: ModelCheckpoint, init_args: {dirpath: run/ckpt, every_n_train_steps: 1, "
                  "save_last: true}}]")
    proc = _cli(["fit", *TINY, *TINY_MODEL, "--trainer.strategy", "zero2", "--trainer.default_root_dir", "run",
                 "--trainer.callbacks", checkpoint], cwd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ckpt = cwd / "run" / "ckpt" / "last.ckpt"
    assert (ckpt / ".metadata").is_file(), sorted(p.name for p in ckpt.parent.iterdir())
    return ckpt


def test_sharded_checkpoint_of_another_shape_names_the_size_mismatch(zero_checkpoint, tmp_path):
    """DCP reports the mismatch as the cause of the cause; the message shows that line."""
    wider = "{n_layer: 1, n_embd: 64, n_head: 2, n_kv_head: 2, block_size: 32}"
    proc = _cli(["fit", *TINY, "--model.config_overrides", wider,
                 "--trainer.strategy", "zero2", "--ckpt_path", zero_checkpoint, "--trainer.default_root_dir", "run"],
                tmp_path)
    _short_error(proc, f"--ckpt_path {zero_checkpoint} does not fit this model", "Size mismatch", "64")


def test_consolidated_zero_checkpoint_generates(zero_checkpoint, tmp_path):
    from lightning_perf.cli import load_module
    from lightning_perf.models.gpt.convert import pack_state_and_config
    from lightning_perf.parallel.checkpointing.checkpoint import consolidated_state_dict

    out = tmp_path / "model.pt"
    proc = _cli(["consolidate", "--ckpt_dir", zero_checkpoint, "--out", out], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "model.pt.json" in proc.stdout
    proc = _cli(["generate", "--ckpt_path", out, "--prompt", "def ", "--max_new_tokens", "8", "--temperature", "0",
                 "--top_k", "none", "--device", "cpu"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("def ")
    # the module generate built holds the sharded checkpoint's weights, under its trained config
    module = load_module(str(out))
    assert module.config.n_embd == 32 and module.config.n_layer == 1
    reference = consolidated_state_dict(zero_checkpoint)
    assert reference.keys() == module.model.state_dict().keys()
    for key, value in module.model.state_dict().items():
        torch.testing.assert_close(value, reference[key], rtol=0, atol=0)
    # convert reads the same hyper-parameters: no --config needed
    assert pack_state_and_config(out)[1] == module.config
    # without them, the message says where they should have been
    (tmp_path / "model.pt.json").unlink()
    proc = _cli(["generate", "--ckpt_path", out, "--device", "cpu"], tmp_path)
    assert proc.returncode != 0 and "model.pt.json" in proc.stderr and "consolidate" in proc.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--top_k", "0"], "--top_k must be >= 1"),
        (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
        (["--temperature", "inf"], "--temperature must be a finite number >= 0"),
        (["--temperature", "-0.5"], "--temperature must be a finite number >= 0"),
        (["--max_new_tokens", "-1"], "--max_new_tokens must be >= 0"),
    ],
)
def test_generate_checks_its_arguments_before_loading(tmp_path, flags, message):
    # the checkpoint does not exist: the argument must be refused before anything is read
    proc = _cli(["generate", "--ckpt_path", tmp_path / "absent.ckpt", *flags], tmp_path, timeout=120)
    _short_error(proc, message)
    assert proc.returncode == 2 and "checkpoint not found" not in proc.stderr


def test_generate_refuses_a_garbage_file_in_one_line(tmp_path):
    (tmp_path / "garbage.ckpt").write_text("hello\n")
    proc = _cli(["generate", "--ckpt_path", "garbage.ckpt"], tmp_path, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "cannot load checkpoint garbage.ckpt: not a file written by torch.save" in proc.stderr


def test_library_generate_refuses_what_the_command_refuses():
    from lightning_perf.models import GPT, GPTConfig, generate

    model = GPT(GPTConfig.from_name("tiny", n_layer=1, n_embd=32, n_head=2, n_kv_head=2))
    prompt = torch.tensor([[1, 2, 3]])
    for kwargs in ({"temperature": -1.0}, {"temperature": float("nan")}, {"top_k": 0}):
        with pytest.raises(ValueError):
            generate(model, prompt, 2, **kwargs)
    greedy = generate(model, prompt, 4, temperature=0)
    assert torch.equal(greedy, generate(model, prompt, 4, temperature=0.0, seed=5))


def test_generate_errors_have_the_commands_error_form(tmp_path):
    proc = _cli(["generate", "--ckpt_path", "absent.ckpt"], tmp_path, timeout=120)
    _short_error(proc, "checkpoint not found: absent.ckpt", "last.ckpt")
    assert proc.stderr.startswith("lightning-perf generate: error: checkpoint not found")  # as the others read
    (tmp_path / "texts").mkdir()  # a directory that holds no checkpoint is not called a sharded one
    proc = _cli(["generate", "--ckpt_path", "texts"], tmp_path, timeout=120)
    text = _short_error(proc, "texts is a directory but no checkpoint")
    assert "sharded" not in text


def test_consolidate_names_a_missing_directory(tmp_path):
    proc = _cli(["consolidate", "--ckpt_dir", "absent", "--out", "model.pt"], tmp_path, timeout=120)
    text = _short_error(proc, "absent does not exist")
    assert "lightning-perf consolidate: error: absent does not exist" in proc.stderr
    assert "is not a checkpoint directory" not in text
    (tmp_path / "plain").mkdir()
    proc = _cli(["consolidate", "--ckpt_dir", "plain", "--out", "model.pt"], tmp_path, timeout=120)
    _short_error(proc, "plain is not a checkpoint directory (expected extra.pt inside)")


def test_mistyped_model_preset_gets_the_closest_names(tmp_path):
    proc = _cli(["fit", *TINY, "--model.config", "tinyy"], tmp_path)
    _short_error(proc, "--model.config tinyy: no GPT preset", "Did you mean tiny?", "gpt2-124m")
    assert "lightning-perf fit: error: --model.config tinyy" in proc.stderr
    proc = _cli(["fit", *TINY, "--model.config", "gpt2-125m"], tmp_path)
    _short_error(proc, "Did you mean gpt2-124m")


def test_model_preset_and_accelerator_checks_pass_what_runs():
    from lightning_perf.cli.errors import _check_accelerator, _check_model_preset

    for name in ("tiny", "GPT2-124M", None, {"class_path": "x"}):
        _check_model_preset(name)
    for accelerator in ("cpu", "auto", None):
        _check_accelerator(accelerator)
    with pytest.raises(SystemExit, match="prog: error: --model.config llama-9b: .*Did you mean llama-8b"):
        _check_model_preset("llama-9b", "prog")


def test_gpu_recipe_without_a_gpu_names_the_cpu_ways(tmp_path, monkeypatch):
    import os

    from lightning.pytorch.accelerators import CUDAAccelerator, MPSAccelerator

    from lightning_perf.cli.errors import _check_accelerator

    # a machine without a GPU, also where the tests run on one: no device visible to the command
    proc = python(["-m", "lightning_perf", "fit", "--config", "gpt2-124m"], cwd=tmp_path, timeout=300,
                  env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: False))
    monkeypatch.setattr(MPSAccelerator, "is_available", staticmethod(lambda: False))
    text = _short_error(proc, "trainer.accelerator is 'gpu'", "--trainer.accelerator cpu",
                        "lightning-perf fit --config gpt-tiny-cpu")
    assert "lightning-perf fit: error: trainer.accelerator is 'gpu'" in proc.stderr
    assert "No supported gpu backend" not in proc.stderr and "(for the traceback" not in text
    for accelerator in ("gpu", "cuda"):
        with pytest.raises(SystemExit, match="--trainer.accelerator cpu"):
            _check_accelerator(accelerator)


# ---- which errors are short ------------------------------------------------------------------


def test_user_errors_and_bugs_are_told_apart():
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lightning_perf.data import TokenDataModule

    try:
        TokenDataModule(seq_len=0)
    except ValueError as e:
        assert "seq_len" in user_error_message(e)
    assert user_error_message(MisconfigurationException("No GPU")) == "No GPU"
    assert user_error_message(FileNotFoundError("x.bin is missing")) == "x.bin is missing"
    # a ValueError from outside the pack, a KeyError, a plain RuntimeError: bugs, whose traceback is needed
    try:
        int("twelve")
    except ValueError as e:
        assert user_error_message(e) is None
    assert user_error_message(KeyError(101)) is None and user_error_message(RuntimeError("boom")) is None
    # a size mismatch two causes deep is found and named with the checkpoint
    try:
        try:
            try:
                raise ValueError(
                    "Size mismatch between saved torch.Size([8]) and current: torch.Size([4]) for model.0.weight")
            except ValueError as inner:
                raise RuntimeError("CheckpointException ranks:dict_keys([0])") from inner
        except RuntimeError as middle:
            raise RuntimeError("reading checkpoint ck failed (raise ValueError()") from middle
    except RuntimeError as outer:
        message = user_error_message(outer, ["fit", "--ckpt_path", "ck"])
        assert user_error_message(outer, ["fit"]) is None  # no checkpoint loaded: not a misfit, a bug
    assert message is not None and message.startswith("--ckpt_path ck does not fit this model: Size mismatch")
    assert "for model.0.weight" in message


# ---- a GPU recipe on the CPU; --help -----------------------------------------------------------


def _recipe(name: str) -> str:
    return str(recipe_dir() / f"{name}.yaml")


def test_cpu_overrides_switch_only_what_the_command_line_leaves():
    flags, switched = cpu_overrides(["fit", "--config", _recipe("gpt2-124m"), "--trainer.accelerator", "cpu"])
    assert flags == ["--trainer.precision", "32-true", "--model.compile", "null", "--data.num_workers", "0"]
    assert switched == ["trainer.precision bf16-mixed -> 32-true", "model.compile reduce-overhead -> null",
                        "data.num_workers 4 -> 0"]
    flags, _ = cpu_overrides(["fit", "--config", _recipe("gpt-1.3b-tp2"), "--trainer.accelerator=cpu",
                              "--trainer.precision", "bf16-mixed", "--data.num_workers=2"])
    assert flags == ["--trainer.strategy.init_args.compile", "null"]
    # no switch without --trainer.accelerator cpu, or on a CPU recipe
    assert cpu_overrides(["fit", "--config", _recipe("gpt2-124m")]) == ([], [])
    assert cpu_overrides(["fit", "--config", str(default_config_path()), "--trainer.accelerator", "cpu"]) == ([], [])


def test_gpu_recipe_runs_a_step_on_the_cpu(tmp_path):
    start = time.monotonic()
    proc = _cli(["fit", "--config", "gpt2-124m", "--trainer.accelerator", "cpu", "--model.config", "tiny",
                 *TINY_MODEL, "--data.source", "synthetic", "--data.seq_len", "16", "--data.batch_size", "2",
                 "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar",
                 "false"], tmp_path)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert ("a GPU recipe on the CPU: trainer.precision bf16-mixed -> 32-true, model.compile reduce-overhead -> "
            "null, data.num_workers 4 -> 0") in proc.stderr
    assert "`max_steps=1` reached" in proc.stdout + proc.stderr
    assert elapsed < 120, elapsed  # compiled with CUDA graphs' mode, one step took minutes


def test_help_shows_the_recipes_values(tmp_path):
    out = _cli(["fit", "--config", "gpt2-124m", "--help"], tmp_path).stdout
    section = lambda name: out[out.index(f"\n  --{name} "):][:600].split("\n  --")[1]  # noqa: E731
    assert "default: reduce-overhead" in section("model.compile")
    assert "default: 20000" in section("trainer.max_steps")
    assert "default: 4" in section("data.num_workers")
    default = _cli(["fit", "--help"], tmp_path).stdout
    assert "default: 200)" in default[default.index("\n  --trainer.max_steps "):][:600]  # gpt-tiny-cpu's
