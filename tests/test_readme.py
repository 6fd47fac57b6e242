"""The README is a front page: its first screen holds what kvoffload is, the two commands
and the ``vllm serve`` line; the commands are the ones CI runs and the config is one the
connector accepts; no paragraph is a wall and no commit hash dates it."""

import json
import re
import shlex
from pathlib import Path

from kvoffload.config import OffloadConfig

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FIRST_SCREEN = "\n".join(README.splitlines()[:40])


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", text, re.S)


def test_the_first_screen_holds_the_two_commands_and_the_vllm_serve_line():
    blocks = _code_blocks(FIRST_SCREEN)
    commands = blocks[0].strip().splitlines()
    assert len(commands) == 2
    assert commands[0].endswith("python -m kvsim trace replay")
    assert commands[1].endswith("python -m pytest")
    assert any(b.lstrip().startswith("vllm serve") for b in blocks[1:])


def test_ci_runs_the_readmes_test_command_verbatim():
    test_command = _code_blocks(README)[0].strip().splitlines()[1]
    assert f'"{test_command}"' in (ROOT / ".ci" / "run").read_text()


def test_the_vllm_serve_line_is_a_config_the_connector_accepts():
    serve = next(b for b in _code_blocks(README) if b.lstrip().startswith("vllm serve"))
    argv = shlex.split(serve.replace("\\\n", " "))
    transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector_module_path"] == "kvoffload.vllm"
    assert transfer["kv_load_failure_policy"] == "recompute"
    cfg = OffloadConfig.from_extra_config(transfer["kv_connector_extra_config"])
    assert cfg.backend == "disk" and cfg.disk_path == "/mnt/nvme0/kvoffload/kv"
    # The directory the README tells the operator to create and check is disk_path's.
    assert "install -d -m 700 /mnt/nvme0/kvoffload`" in " ".join(README.split())
    assert "python -m kvoffload --dir /mnt/nvme0/kvoffload" in README


def test_no_paragraph_is_a_wall_and_no_commit_hash_dates_the_readme():
    prose = re.sub(r"```.*?```", "", README, flags=re.S)
    for para in re.split(r"\n\s*\n", prose):
        if not para.lstrip().startswith("|"):  # a table's rows are cells, not a paragraph
            assert len(para.split()) <= 120, para[:80]
    assert not re.search(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b", README)


def test_every_doc_the_readme_links_exists():
    for link in re.findall(r"\]\(([^)#]+)\)", README):
        assert (ROOT / link).is_file(), link
