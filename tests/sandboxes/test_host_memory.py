"""Host memory of read_file, read_lints, diff(), grep, terminal output and edit_file is bounded by
what they return, not by the file's size or line count, on both backends.

A 30 MB file of 15 million 2-byte lines (each an undefined name, so lint output is worst-case) is
written in the sandbox; the operations then run in a child process whose peak RSS growth per
operation is measured (``benchmarks/bench_host_memory.py``'s child mode). Before issue 42 read_file
grew the host by ~1.1 GB and read_lints by several GB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.sandboxes.conftest import _docker_skip_reason

REPO = Path(__file__).resolve().parents[2]
LIMIT_MIB = 300


OPS = ("read_file", "read_lints", "diff", "grep", "run_terminal", "edit_file")


@pytest.mark.parametrize("backend", ["local", pytest.param("docker", marks=pytest.mark.docker)])
def test_host_memory_is_bounded_on_a_file_of_short_lines(backend):
    """One child process per backend builds the sandbox and its 30 MB file once, then measures each
    operation's peak RSS growth in turn (VmHWM is reset before each)."""
    if os.geteuid() != 0:
        pytest.skip("the benchmark child builds sandboxes as root")
    if backend == "docker" and (reason := _docker_skip_reason()):
        pytest.skip(reason)
    root = tempfile.mkdtemp(prefix="flowstate-mem-", dir="/tmp")
    os.chmod(root, 0o711)
    try:
        done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_host_memory.py"), "--child",
                               ",".join(OPS), "--root", root, "--backend", backend],
                              capture_output=True, text=True, timeout=600, check=False)
    finally:
        subprocess.run(["rm", "-rf", root], check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = {entry["op"]: entry for entry in json.loads(done.stdout.strip().splitlines()[-1])["ops"]}
    assert sorted(figures) == sorted(OPS)
    for entry in figures.values():
        assert "error" not in entry, entry
        assert entry["growth_mib"] < LIMIT_MIB, entry
        assert entry["output_bytes"] < 40 * 1024 * 1024, entry
    assert figures["read_file"]["output_head"].startswith("big.py (lines 1-2000 of 15000000)")
    assert "over 262144 bytes" in figures["read_lints"]["output_head"]
    assert figures["grep"]["output_head"].startswith("big.py:1:x\n")
    assert "over edit_file's 8 MiB limit" in figures["edit_file"]["output_head"]
    assert figures["run_terminal"]["output_bytes"] <= 16 * 1024 * 1024 + 4096


def test_read_file_caps_bytes_and_keeps_numbering(sandbox):
    from sandboxes.tool_impl.handlers import READ_FILE_MAX_BYTES
    from sandboxes.tools import ToolCall, execute_tool_calls

    def read(**arguments):
        return execute_tool_calls(sandbox=sandbox, calls=[ToolCall(id="c", name="read_file", arguments=arguments)])[0]

    sandbox.exec("python3 -c \"open('wide.txt','w').write(('y' * 1000 + '\\n') * 1500)\"; "
                 "python3 -c \"open('one.txt','w').write('z' * 2000000)\"; printf 'a\\nb\\nc' > tail.txt")
    wide = read(path="wide.txt")
    assert wide.ok and len(wide.output.encode()) < READ_FILE_MAX_BYTES + 4096
    last = wide.meta["end_line"]
    assert 400 < last < 1500
    assert f"call read_file with start_line={last + 1} to continue" in wide.output
    nxt = read(path="wide.txt", start_line=last + 1)
    assert nxt.output.splitlines()[1].lstrip().startswith(f"{last + 1}\t")
    one = read(path="one.txt")
    assert one.ok and "[line cut at" in one.output and len(one.output.encode()) < READ_FILE_MAX_BYTES
    tail = read(path="tail.txt", start_line=2)
    assert tail.output == "tail.txt (lines 2-3 of 3)\n     2\tb\n     3\tc\n"
