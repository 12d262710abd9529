"""Model files and paths that are legal, odd or hostile: each loads and runs, or ends in one clean error
(a BarellmError), never a hang, a crash or a bare exception."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import barellm
from barellm.errors import BarellmError, FormatError
from barellm.formats import sniff
from barellm.formats.blm import BLMFile
from barellm.formats.gguf import GGUFFile

from tiny_model import write_tiny_llama

CLI = [sys.executable, "-m", "barellm"]


# --- paths that are not regular files ----------------------------------------------------------------------

@pytest.fixture()
def odd_paths(tmp_path):
    """A named pipe, a socket and a character device, as model paths."""
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    sock_path = tmp_path / "sock.gguf"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    yield {"named pipe": fifo, "socket": sock_path, "character device": Path("/dev/zero")}
    sock.close()


def test_non_regular_paths_are_refused_before_any_read(odd_paths):
    import threading

    # a reader that blocks on the pipe is set free after a while (by opening its other end), so that a
    # regression fails here instead of hanging the test run
    done, hung = threading.Event(), []

    def unblock() -> None:
        if not done.wait(10):
            hung.append(True)
            while not done.is_set():
                try:
                    os.close(os.open(odd_paths["named pipe"], os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass
                done.wait(0.1)

    watchdog = threading.Thread(target=unblock, daemon=True)
    watchdog.start()
    try:
        for kind, path in odd_paths.items():
            for opener in (sniff, GGUFFile, BLMFile, barellm.load):
                with pytest.raises(FormatError, match=f"{kind}|not a regular file"):
                    opener(path)
    finally:
        done.set()
        watchdog.join()
    assert not hung, "reading the named pipe blocked"


@pytest.mark.parametrize("command", [["run", "{path}", "hi", "-n", "1"], ["inspect", "{path}"],
                                     ["verify", "{path}"], ["convert", "{path}", "-o", "{out}"]])
def test_the_command_line_does_not_hang_on_a_named_pipe(tmp_path, command):
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    args = [a.format(path=fifo, out=tmp_path / "o.blm") for a in command]
    proc = subprocess.run(CLI + args, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                          env=dict(os.environ, BARELLM_HOME=str(tmp_path / "home")))
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert err.startswith("error:") and "named pipe" in err and "\n" not in err, err
    assert not (tmp_path / "o.blm").exists()


def test_a_checkpoint_file_that_is_a_named_pipe_is_refused(tmp_path):
    from barellm.store.convert import convert

    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "config.json").write_text("{}")
    os.mkfifo(root / "model.safetensors")
    with pytest.raises(BarellmError):
        convert(root, tmp_path / "out.blm")
    os.unlink(root / "config.json")
    os.mkfifo(root / "config.json")
    with pytest.raises(FormatError, match="directory without config.json|named pipe"):
        sniff(root)


def test_tiny_model_still_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("BARELLM_HOME", str(tmp_path / "home"))
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    assert sniff(path) == "gguf"
    barellm.load(str(path), engine="reference", context=32)


# --- legal files the native engine used to refuse with a bare exception ------------------------------------

BF16, Q5_1 = 30, 7


@pytest.mark.parametrize("embd_type", [BF16, Q5_1])
@pytest.mark.parametrize("tied", [False, True])
def test_bf16_and_q5_1_embeddings_run_natively(tmp_path, monkeypatch, embd_type, tied):
    pytest.importorskip("barellm.runtime.engine", reason="native engine not built")
    import numpy as np

    monkeypatch.setenv("BARELLM_HOME", str(tmp_path / "home"))
    path = write_tiny_llama(tmp_path / "tiny.gguf", embd_type=embd_type, tied=tied)
    ids = [5, 80, 120, 33, 200, 7]
    native = barellm.load(str(path), context=32)
    assert native.engine_name == "native"
    reference = barellm.load(str(path), engine="reference", context=32)
    a, b = native.logits(ids), reference.logits(ids)
    # the embedding rows are dequantized exactly; what differs is the matmuls' quantized activations
    assert np.abs(a - b).max() < 0.05 * np.abs(b).max()
    assert (a.argmax(1) == b.argmax(1)).all()


def test_a_plan_the_native_core_refuses_is_a_clean_error_and_auto_falls_back(tmp_path, monkeypatch):
    pytest.importorskip("barellm.runtime.engine", reason="native engine not built")
    from barellm.runtime import engine

    monkeypatch.setenv("BARELLM_HOME", str(tmp_path / "home"))
    path = write_tiny_llama(tmp_path / "tiny.gguf")

    def refuse(*args, **kwargs):
        raise ValueError("op 0: embedding table of type 99 cannot be read a row at a time")

    monkeypatch.setattr(engine.nat, "Plan", refuse)
    with pytest.raises(FormatError, match="native engine cannot run this model: op 0: embedding table of type 99"):
        barellm.load(str(path), engine="native", context=32)
    with pytest.warns(RuntimeWarning, match="op 0: embedding table of type 99.*reference"):
        model = barellm.load(str(path), context=32)
    assert model.engine_name == "reference"
    assert model.generate("the cat", max_tokens=3, temperature=0)


def test_the_native_core_names_what_it_refuses(tmp_path, monkeypatch):
    # the op's own message, not "op 0: <class 'ValueError'>"
    pytest.importorskip("barellm.runtime.engine", reason="native engine not built")
    from barellm.runtime import engine

    monkeypatch.setenv("BARELLM_HOME", str(tmp_path / "home"))
    model = barellm.load(str(write_tiny_llama(tmp_path / "tiny.gguf")), engine="native", context=32)
    native = model.engine
    specs = [native._op_spec(op) for op in native.ops]
    specs[0]["table"] = (BF16, 1, 10, 64, specs[0]["table"][4])  # a layout a table cannot have
    with pytest.raises(ValueError, match=r"^op 0( \(token_embd\))?: .*type 30"):
        engine.nat.Plan(native._pool, specs, native._tok, native._pos, native._slot, native._rows, native.chunk,
                        native.chunk, native.n_vocab, native.n_ctx, native.n_slots)


# --- token texts ---------------------------------------------------------------------------------------

def test_a_special_token_that_is_not_utf8_is_a_format_error_naming_it(tmp_path, monkeypatch):
    import tiny_model

    monkeypatch.setenv("BARELLM_HOME", str(tmp_path / "home"))
    original = tiny_model.tiny_llama_metadata

    def with_bad_token(**kw):
        md, n = original(**kw)
        md["tokenizer.ggml.tokens"] = ["<|endoftext|>", "<|im_\udcffstart|>"] + md["tokenizer.ggml.tokens"][2:]
        return md, n

    monkeypatch.setattr(tiny_model, "tiny_llama_metadata", with_bad_token)
    path = tiny_model.write_tiny_llama(tmp_path / "bad.gguf")
    for eng in ("reference", "auto"):
        with pytest.raises(FormatError, match=r"tokenizer.ggml.tokens\[1\]: special token b'<\|im_\\xffstart\|>' "
                                              "is not valid UTF-8"):
            barellm.load(str(path), engine=eng, context=32)


# --- memory asked for, against memory available ------------------------------------------------------------

@pytest.mark.parametrize("engine", ["reference", "native"])
def test_a_context_that_does_not_fit_is_refused_before_allocating_naming_one_that_does(tmp_path, monkeypatch,
                                                                                       engine):
    import re
    import resource

    from barellm import cpu
    from barellm.errors import InvalidRequest

    if engine == "native":
        pytest.importorskip("barellm.runtime.engine", reason="native engine not built")
    monkeypatch.setenv("BARELLM_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(cpu, "available_memory", lambda: 256 << 20)
    # an 80 KB model whose file claims a context of 2^24 tokens (several GiB of KV cache)
    path = write_tiny_llama(tmp_path / "big-context.gguf", ctx=1 << 24)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(InvalidRequest) as err:
        barellm.load(str(path), engine=engine, context=1 << 24)
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) < 64 << 10  # KiB: nothing was allocated
    message = str(err.value)
    assert "\n" not in message
    assert re.search(rf"a context of 16777216 tokens needs [\d.]+ GiB of memory \({engine} engine: KV cache "
                     r"[\d.]+ GiB.*\), but 256.0 MiB is available; --context \d+ would fit", message), message
    fit = int(re.search(r"--context (\d+)", message).group(1))
    assert 1024 <= fit < 1 << 24
    model = barellm.load(str(path), engine=engine, context=fit)  # what it names does fit
    assert model.n_ctx == fit
    with pytest.raises(InvalidRequest, match="not even a context of 16 tokens fits"):
        monkeypatch.setattr(cpu, "available_memory", lambda: 4 << 10)
        barellm.load(str(path), engine=engine, context=1024)


def test_a_large_kv_cache_is_mentioned_before_it_is_allocated(monkeypatch, capsys):
    from barellm import cpu

    monkeypatch.setattr(cpu, "available_memory", lambda: 64 << 30)
    cpu.check_memory("native", 1 << 20, 2048, 100)
    assert capsys.readouterr().err == "barellm: the KV cache for a context of 1048576 tokens takes 2.00 GiB\n"
    cpu.check_memory("native", 4096, 2048, 100)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(cpu, "available_memory", lambda: None)  # unknown: nothing is refused
    cpu.check_memory("native", 1 << 24, 1 << 20)


def test_the_command_line_refuses_a_context_that_does_not_fit_in_one_line(tmp_path):
    path = write_tiny_llama(tmp_path / "big-context.gguf", ctx=1 << 24)
    code = ("import sys; import barellm.cpu as c; c.available_memory = lambda: 2 << 30; "
            "from barellm.__main__ import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "run", str(path), "hi", "-n", "2", "-c", "16777216",
                           "--engine", "reference"], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, env=dict(os.environ, BARELLM_HOME=str(tmp_path / "home")))
    assert proc.returncode == 1
    err = proc.stderr.strip()
    assert err.startswith("error: a context of 16777216 tokens needs") and "--context" in err, err
    assert "\n" not in err


# --- the data section's integrity ----------------------------------------------------------------------------

def _flip_data_byte(path: Path, tensor: str) -> None:
    with BLMFile(path) as f:
        info = f.tensors[tensor]
    with open(path, "r+b") as fh:
        fh.seek(info.offset + info.nbytes // 2)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0x5A]))


@pytest.fixture()
def tiny_blm(tmp_path, monkeypatch):
    from barellm.store.convert import convert

    monkeypatch.setenv("BARELLM_HOME", str(tmp_path / "home"))
    return convert(write_tiny_llama(tmp_path / "tiny.gguf"), tmp_path / "tiny.blm")


def test_a_corrupt_tensor_the_load_sample_covers_is_a_clean_error(tiny_blm):
    barellm.load(str(tiny_blm), engine="reference", context=32)
    _flip_data_byte(tiny_blm, "blk.1.ffn_norm.weight")  # small tensors are checked at every load
    for engine in ("reference", "auto"):
        with pytest.raises(FormatError, match=r"tiny.blm: tensor data checksum mismatch in 1 of \d+ tensors checked "
                                              r"at load .*'blk.1.ffn_norm.weight' \(stored 0x"):
            barellm.load(str(tiny_blm), engine=engine, context=32)


def test_load_samples_larger_tensors_and_verify_checks_them_all(tiny_blm, monkeypatch):
    import random

    from barellm.formats import blm

    _flip_data_byte(tiny_blm, "blk.0.ffn_up.weight")
    # with nothing sampled the corruption goes unseen at load; --verify sees it
    monkeypatch.setattr(blm, "SAMPLE_ALWAYS", 0)
    monkeypatch.setattr(blm, "SAMPLE_BUDGET", 0)
    barellm.load(str(tiny_blm), engine="reference", context=32)
    with pytest.raises(FormatError, match=r"mismatch in 1 of \d+ tensors: 'blk.0.ffn_up.weight'"):
        barellm.load(str(tiny_blm), engine="reference", context=32, verify=True)
    # a budget that holds the tensor finds it sooner or later: each load picks another sample
    with BLMFile(tiny_blm) as f:
        size = f.tensors["blk.0.ffn_up.weight"].nbytes
        found = 0
        for seed in range(40):
            try:
                blm.check_sample(f, budget=3 * size, rng=random.Random(seed))
            except FormatError as e:
                assert "'blk.0.ffn_up.weight'" in str(e)
                found += 1
        assert 0 < found < 40


def test_a_corrupt_cached_conversion_is_converted_again(tmp_path, monkeypatch, capsys):
    from barellm.store.converted import conversion_of

    monkeypatch.setenv("BARELLM_HOME", str(tmp_path / "home"))
    gguf = write_tiny_llama(tmp_path / "tiny.gguf")
    reference = barellm.load(str(gguf), engine="reference", context=32).logits([5, 6, 7])
    cached = conversion_of(gguf)
    _flip_data_byte(cached, "output_norm.weight")
    capsys.readouterr()
    again = barellm.load(str(gguf), engine="reference", context=32)
    assert "the cached conversion is corrupt" in capsys.readouterr().err
    assert (again.logits([5, 6, 7]) == reference).all()
    barellm.load(str(gguf), engine="reference", context=32, verify=True)  # repaired: every tensor checks out


def test_the_command_line_verify_option(tiny_blm):
    _flip_data_byte(tiny_blm, "blk.0.attn_q.weight")
    code = ("import sys; from barellm.formats import blm; blm.SAMPLE_ALWAYS = blm.SAMPLE_BUDGET = 0; "
            "from barellm.__main__ import main; sys.exit(main(sys.argv[1:]))")
    env = dict(os.environ, BARELLM_HOME=str(tiny_blm.parent / "home"))
    run = [sys.executable, "-c", code, "run", str(tiny_blm), "hi", "-n", "1", "--engine", "reference"]
    assert subprocess.run(run, capture_output=True, timeout=120, env=env, stdin=subprocess.DEVNULL).returncode == 0
    proc = subprocess.run(run + ["--verify"], capture_output=True, text=True, timeout=120, env=env,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: ") and "'blk.0.attn_q.weight'" in proc.stderr
    assert proc.stderr.count("\n") == 1
