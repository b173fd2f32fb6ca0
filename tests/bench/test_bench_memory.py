"""``jaxrlvr bench memory --tiny``: the GRPO update of a tiny model lowered and compiled (never
run) in a worker on fake CPU devices; the record carries XLA's memory analysis and no
"Involuntary full rematerialization" warning."""

import json

import pytest

from jaxrlvr.bench import memory


@pytest.mark.slow  # one worker process compiling a tiny update: ~30 s on 2 shared cores
def test_tiny_memory_record(tmp_path, capsys):
    path = tmp_path / "memory.json"
    code = memory.main(["--tiny", "--fsdp", "2", "--chunk", "on", "--json", str(path)])
    assert code == 0, capsys.readouterr().out
    (record,) = json.loads(path.read_text())
    assert record["case"]["fsdp"] == 2 and record["case"]["chunk_size"] == 16
    assert record["devices"] == 2
    b = record["bytes"]
    assert b["total"] == b["arguments"] + b["outputs"] + b["temporaries"] - b["aliased"] > 0
    assert record["remat_warnings"] == 0
    assert "fsdp" in capsys.readouterr().out


def test_bad_flag_is_named(capsys):
    with pytest.raises(SystemExit) as info:
        memory.main(["--chunk", "maybe"])
    assert info.value.code == 2
    assert "jaxrlvr bench memory: error: --chunk: 'maybe' is not one of off, on" in (
        capsys.readouterr().err
    )
