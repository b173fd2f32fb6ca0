"""The command line's glibc malloc settings: added once by re-executing the same command line,
kept off by JAXRLVR_MALLOC=off, never applied to in-process callers, dropped for peer systems."""

import os
import subprocess
import sys

import pytest

from jaxrlvr import cli

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="glibc's malloc variables: Linux only"
)


def test_malloc_env_adds_what_is_missing_once():
    env = cli.malloc_env({"PATH": "/bin", "MALLOC_ARENA_MAX": "4", "JAXRLVR_JEMALLOC": "off"})
    assert env["MALLOC_ARENA_MAX"] == "4"  # a user's own setting is kept
    assert env["MALLOC_MMAP_THRESHOLD_"] == env["MALLOC_TRIM_THRESHOLD_"] == str(2**30)
    assert env["JAXRLVR_MALLOC_SET"] == "MALLOC_MMAP_THRESHOLD_,MALLOC_TRIM_THRESHOLD_"
    assert cli.malloc_env(env) is None  # already applied: no second re-exec
    assert cli.malloc_env({"JAXRLVR_MALLOC": "off"}) is None
    peer = cli.without_malloc_env(env)
    # only what jaxrlvr added goes
    assert peer == {"PATH": "/bin", "MALLOC_ARENA_MAX": "4", "JAXRLVR_JEMALLOC": "off"}


def test_jemalloc_is_preloaded_where_there_is_one(tmp_path):
    """``JAXRLVR_JEMALLOC=PATH`` (or a system libjemalloc) adds ``LD_PRELOAD`` and keeps its
    freed pages (``MALLOC_CONF``); a missing path, ``off``, or a user's own ``LD_PRELOAD``
    leaves glibc's malloc alone; a peer system gets neither."""
    lib = tmp_path / "libjemalloc.so.2"
    lib.write_bytes(b"")
    env = cli.malloc_env({"PATH": "/bin", "JAXRLVR_JEMALLOC": str(lib)})
    assert env["LD_PRELOAD"] == str(lib) and env["MALLOC_CONF"] == cli.JEMALLOC_CONF
    assert set(env["JAXRLVR_MALLOC_SET"].split(",")) == {
        *cli.MALLOC_ENV,
        "LD_PRELOAD",
        "MALLOC_CONF",
    }
    assert cli.without_malloc_env(env) == {"PATH": "/bin", "JAXRLVR_JEMALLOC": str(lib)}
    for setting in (str(tmp_path / "missing.so"), "off"):
        assert "LD_PRELOAD" not in cli.malloc_env({"JAXRLVR_JEMALLOC": setting})
    own = cli.malloc_env({"JAXRLVR_JEMALLOC": str(lib), "LD_PRELOAD": "libmine.so"})
    assert own["LD_PRELOAD"] == "libmine.so" and "LD_PRELOAD" not in own["JAXRLVR_MALLOC_SET"]


def test_command_line_reexecs_with_the_settings_and_same_arguments():
    """`jaxrlvr bench NAME` re-executes itself (the settings are in its environment, as a child
    process shows) and still parses the same arguments (the one-line error names them)."""
    probe = (
        "import os, sys, subprocess; from jaxrlvr import cli; "
        "sys.argv = ['jaxrlvr', 'bench', 'no-such-benchmark']; "
        "import atexit; atexit.register(lambda: print('ENV', os.environ.get('MALLOC_ARENA_MAX'), "
        "os.environ.get('JAXRLVR_MALLOC_SET'), flush=True)); sys.exit(cli.main())"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "JAXRLVR_MALLOC"))}
    env["JAXRLVR_JEMALLOC"] = "off"  # glibc's variables only, with or without a system jemalloc
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    assert out.returncode == 1  # SystemExit with the message
    assert "unknown benchmark 'no-such-benchmark'" in out.stdout + out.stderr
    assert "ENV 1 MALLOC_ARENA_MAX,MALLOC_MMAP_THRESHOLD_,MALLOC_TRIM_THRESHOLD_" in out.stdout
    off = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env={**env, "JAXRLVR_MALLOC": "off"},
    )
    assert "ENV None None" in off.stdout


def test_in_process_callers_are_not_reexecuted():
    before = dict(os.environ)
    with pytest.raises(SystemExit, match="unknown benchmark"):
        cli.main(["bench", "no-such-benchmark"])  # raised here: this process was not replaced
    added = set(os.environ) - set(before)
    assert not {k for k in added if k.startswith(("MALLOC_", "JAXRLVR_MALLOC"))}
