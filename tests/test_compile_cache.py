"""compile_cache: the setting's directory; a second process loads what the first compiled."""

import os
import subprocess
import sys
import textwrap
import threading

import pytest

from jaxrlvr import compile_cache

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from jaxrlvr import compile_cache
    compile_cache.enable(sys.argv[1])
    counter = compile_cache.CompileCounter().start()
    import jax, jax.numpy as jnp
    jax.jit(lambda x: jnp.sin(x) * 2.0 + 1.0)(jnp.ones(7)).block_until_ready()
    print(json.dumps(counter.as_dict()))
    """
)


def _run(setting: str) -> dict:
    import json

    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, setting], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_resolve_settings(tmp_path, monkeypatch):
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.resolve("auto") == str(tmp_path / "jaxrlvr" / "jax-compile")
    assert compile_cache.resolve("off") is None and compile_cache.resolve("") is None
    assert compile_cache.resolve(str(tmp_path / "c")) == str(tmp_path / "c")
    monkeypatch.setenv(compile_cache.ENV, "off")
    assert compile_cache.resolve("auto") is None  # the env var turns "auto" off
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "e"))
    assert compile_cache.resolve("auto") == str(tmp_path / "e")
    assert compile_cache.resolve(str(tmp_path / "c")) == str(tmp_path / "c")  # explicit wins
    with pytest.raises(ValueError, match="run.compile_cache"):
        compile_cache.resolve(3)


def test_second_process_loads_instead_of_compiling(tmp_path):
    """The first process compiles the jitted function (and JAX's helper programs) and writes them;
    a second process with the same directory compiles nothing and loads as many; with the cache
    off every process compiles."""
    directory = str(tmp_path / "cache")
    first = _run(directory)
    assert first["compiles"] >= 1 and first["cache_hits"] == 0
    assert os.listdir(directory)
    second = _run(directory)
    assert second["compiles"] == 0
    assert second["cache_hits"] == first["compiles"]
    off = _run("off")
    assert off["compiles"] == first["compiles"] and off["cache_hits"] == 0


def test_enable_refuses_a_second_directory(tmp_path):
    script = textwrap.dedent(
        """
        import sys
        from jaxrlvr import compile_cache
        assert compile_cache.enable(sys.argv[1]) == sys.argv[1]
        assert compile_cache.enable(sys.argv[1]) == sys.argv[1]  # same directory: a no-op
        assert compile_cache.enable("off") is None
        try:
            compile_cache.enable(sys.argv[1] + "-other")
        except ValueError as e:
            print(e)
        """
    )
    a = str(tmp_path / "a")
    out = subprocess.run(
        [sys.executable, "-c", script, a], capture_output=True, text=True, check=True
    )
    assert "already caches compiles in" in out.stdout and os.path.isdir(a)


def test_trim_removes_least_recently_used_programs_past_the_cap(tmp_path):
    """Oldest entries go first until the rest fit; JAX's ``-atime`` files (an entry whose
    ``-atime`` went missing stopped every later write when JAX's own cap was on) are removed."""
    for i, age in enumerate([300, 100, 200]):  # seconds ago
        path = tmp_path / f"p{i}-cache"
        path.write_bytes(b"x" * 1000)
        t = 1_700_000_000 - age
        os.utime(path, (t, t))
    (tmp_path / "p0-atime").write_bytes(b"12345678")
    assert compile_cache.trim(str(tmp_path), 2000) == 1000
    assert sorted(os.listdir(tmp_path)) == ["p1-cache", "p2-cache"]  # p0 was the oldest
    assert compile_cache.trim(str(tmp_path), 1000) == 1000
    assert os.listdir(tmp_path) == ["p1-cache"]
    assert compile_cache.trim(str(tmp_path), 1000) == 0


def test_a_process_killed_mid_write_leaves_a_usable_cache(tmp_path):
    """An entry without its ``-atime`` file (what a process killed inside JAX's locked LRU write
    left in CI) neither warns nor stops the next process from caching."""
    directory = tmp_path / "cache"
    directory.mkdir()
    (directory / "jit_orphan-0123-cache").write_bytes(b"not a program")
    out = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", _SCRIPT, str(directory)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "Error writing persistent compilation cache" not in out.stderr
    assert _run(str(directory))["compiles"] == 0


def test_compile_in_background_waits_for_after_and_beside_hands_back_errors():
    """``compile_in_background(after=event)`` compiles nothing before the event is set (the
    run's first step compiles alone), then each program in turn, ``then(i)`` after each;
    ``beside`` returns what the function returns and raises
    what it raised, from the caller's ``result()``."""

    class Lowered:  # the one method compile_in_background calls on a ``jax.stages.Lowered``
        def __init__(self, name):
            self.name = name

        def compile(self):
            compiled.append(self.name)

    class Broken:
        def compile(self):
            raise RuntimeError("XLA failed")

    compiled, done, gate = [], [], threading.Event()
    programs = [Lowered("a"), Broken(), Lowered("b")]
    thread = compile_cache.compile_in_background(programs, after=gate, then=done.append)
    thread.join(timeout=0.5)
    assert thread.is_alive() and compiled == [] and done == []
    gate.set()
    thread.join(timeout=10)
    # The one that failed is skipped, and said done (a ``generate`` waiting for it goes on).
    assert not thread.is_alive() and compiled == ["a", "b"] and done == [0, 1, 2]

    assert compile_cache.beside(lambda x, *, y: x + y, 2, y=3).result(timeout=10) == 5
    with pytest.raises(ValueError, match="no program"):
        compile_cache.beside(lambda: (_ for _ in ()).throw(ValueError("no program"))).result(10)
