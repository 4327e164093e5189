"""Every command that README.md, docs/*.md and the comment headers of the Snakefile, config/*.yaml and
profiles/*/config.yaml show works as written.

A command is collected from a shell code block (```bash, ```sh, ```shell, ```console or a bare ```;
in a comment header, comment lines indented by two or more spaces; lines continued with a backslash
are joined) or from an inline code span that starts with `uv run` or `python`. Lines of a shell
block that are not commands (`export ...`, `D=$(mktemp -d) ...`) run before the block's commands
that follow them, as they would in the user's shell. Each command
runs under bash in a copy of the repository that holds empty stand-ins for the files a user obtains
by hand (tests/workflow/test_config.py lists them), through `uv run` on this environment:

- `snakemake` commands run exactly as written plus `-n` (a dry run plans every job, submits none,
  also with `--profile profiles/slurm`); `--report` needs a finished run, so there the command must
  get as far as asking for the run's outputs;
- `torchrun ... -m vlbert_core.pretrain ...` is parsed by torchrun's and the module's own argument
  parsers (starting it would train);
- any other program runs with `--help` appended.

Inline `torchrun`/`srun` spans describe what a rule runs, with placeholders (N, P), and are not
collected.
Every mention of `uv run snakemake` in the files must belong to a collected command, so a command
added later is tested without touching this file.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from test_config import hand_obtained_inputs, load, merged

pytestmark = pytest.mark.workflow

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "Snakefile",
             *sorted((REPO / "config").glob("*.yaml")), *sorted((REPO / "profiles").glob("*/config.yaml"))]
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console"}
# [ \t]*, not \s*: a bare fence must not take the first word of its block's first line for its language
FENCE = re.compile(r"^(```+|~~~+)[ \t]*(\S*)[^\n]*\n(.*?)^\1[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=\S*\s+")
COMMAND_START = re.compile(r"^(uv run|python3?|torchrun) \S")
# What a run or the environment fills (as in .gitignore); the copy needs the code and configs, not them.
RUN_OUTPUTS = {REPO: {"results", "resources", "logs", ".snakemake", ".venv", ".git", ".pytest_cache", "report.html"},
               REPO / "benchmarks": {"rules"}}
# An option that only works after a run, and the error Snakemake gives before one.
NEEDS_A_FINISHED_RUN = {"--report": "marked for report but does not exist"}


@dataclass(frozen=True)
class Command:
    source: str   # file:line where it first appears
    setup: str    # shell lines of its code block that come before it
    text: str     # the command as written, continuation lines joined

    @property
    def program(self) -> str:
        words = program_words(self.text)
        if words[:2] == ["uv", "run"]:
            words = words[2:]
        if words[:2] in (["python", "-m"], ["python3", "-m"]):
            return words[2]
        return words[0] if words else ""


def without_prefixes(text: str) -> str:
    """The command without leading VAR=value assignments and `time`."""
    while True:
        shorter = ENV_ASSIGNMENT.sub("", text, count=1).removeprefix("time ")
        if shorter == text:
            return text
        text = shorter


def program_words(text: str) -> list[str]:
    return shlex.split(without_prefixes(text))


def is_command(text: str) -> bool:
    return bool(COMMAND_START.match(without_prefixes(text)))


def strip_comment(line: str) -> str:
    """The line without a trailing `# comment` (a # that starts a word, outside quotes)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def logical_lines(block: str) -> list[tuple[int, str]]:
    """(offset of the first physical line, text) with backslash continuations joined."""
    lines, current, start = [], "", 0
    for offset, line in enumerate(block.splitlines()):
        if not current:
            start = offset
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        lines.append((start, current + line))
        current = ""
    if current:
        lines.append((start, current))
    return lines


def block_commands(name: str, first_line: int, block: str) -> list[Command]:
    """The commands of a shell code block; each carries the block's other lines that precede it."""
    found, setup = [], []
    for offset, line in logical_lines(block):
        line = strip_comment(line.strip().removeprefix("$ "))
        if not line:
            continue
        if is_command(line):
            found.append(Command(f"{name}:{first_line + offset}", "\n".join(setup), line))
        else:
            setup.append(line)
    return found


def inline_commands(name: str, prose: str, first_line: int) -> list[Command]:
    found = []
    for span in INLINE.finditer(prose):
        code = span.group(2).strip()
        if is_command(code) and program_words(code)[0] != "torchrun":
            found.append(Command(f"{name}:{first_line + prose.count(chr(10), 0, span.start())}", "", code))
    return found


def markdown_commands(name: str, text: str) -> list[Command]:
    found, position = [], 0
    for fence in FENCE.finditer(text):
        found += inline_commands(name, text[position:fence.start()], text.count("\n", 0, position) + 1)
        position = fence.end()
        if fence.group(2).lower() in SHELL_LANGUAGES:
            found += block_commands(name, text.count("\n", 0, fence.start(3)) + 1, fence.group(3))
    return found + inline_commands(name, text[position:], text.count("\n", 0, position) + 1)


def comment_commands(name: str, text: str) -> list[Command]:
    """Commands in the # comments of a YAML file or the Snakefile: runs of comment lines indented
    by two or more spaces are shell blocks; the other comment lines are prose with inline code."""
    found, block, block_start = [], [], 0
    for number, line in enumerate(text.splitlines() + [""], start=1):
        comment = line[1:] if line.startswith("#") else None
        if comment is not None and comment.startswith("  ") and comment.strip():
            block_start = block_start if block else number
            block.append(comment)
            continue
        if block:
            found += block_commands(name, block_start, "\n".join(block))
            block = []
        if comment is not None:
            found += inline_commands(name, comment, number)
    return found


def commands_in(path: Path) -> list[Command]:
    name = path.relative_to(REPO).as_posix()
    text = path.read_text()
    found = markdown_commands(name, text) if path.suffix == ".md" else comment_commands(name, text)
    in_commands = sum(command.text.count("uv run snakemake") for command in found)
    assert text.count("uv run snakemake") == in_commands, (
        f"{name}: a `uv run snakemake` that is neither a line of a shell code block nor inline code starting with it")
    return found


def all_commands() -> list[Command]:
    unique: dict[str, Command] = {}
    for path in DOCUMENTS:
        for command in commands_in(path):
            unique.setdefault(command.text, command)  # where it first appears, with that block's setup
    return list(unique.values())


COMMANDS = all_commands()


def test_the_readme_shows_the_main_commands():
    texts = {c.text for c in COMMANDS if c.source.startswith("README.md")}
    assert "uv run snakemake --cores all results/tables/table4_ablation.csv" in texts
    assert "uv run pytest" in texts


def test_a_bare_fence_is_a_shell_block_whatever_its_first_line():
    found = markdown_commands("x.md", "```\nuv run snakemake --cores all T\n```\n\n```text\nuv run pytest\n```\n")
    assert [c.text for c in found] == ["uv run snakemake --cores all T"]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """A copy of the repository (code, configs, docs; no run outputs) with empty stand-ins for the
    files of every real-data config that a user obtains by hand."""
    copy = tmp_path_factory.mktemp("checkout") / "repo"

    def skip_run_outputs(folder, names):
        skipped = {"__pycache__"} | RUN_OUTPUTS.get(Path(folder), set())
        return [n for n in names if n in skipped]

    shutil.copytree(REPO, copy, ignore=skip_run_outputs)
    for config_file in sorted((REPO / "config").glob("*.yaml")):
        if config_file.name == "schema.yaml" or merged(load(config_file.name)).get("dataset") != "real":
            continue
        for path in hand_obtained_inputs(merged(load(config_file.name))):
            (copy / path).parent.mkdir(parents=True, exist_ok=True)
            (copy / path).touch()
    return copy


def run_in_bash(command: Command, text: str, checkout: Path, tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("UV_")}
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        TMPDIR=str(tmp_path),
        # `uv run` in the copy uses this test's environment as it is: no sync, no lock update, offline
        UV_PROJECT_ENVIRONMENT=sys.prefix, UV_NO_SYNC="1", UV_FROZEN="1", UV_OFFLINE="1",
    )
    # Without a uv executable (CI may only have `python -m uv`), `uv run X` runs X from this environment.
    fallback = "" if shutil.which("uv") else 'uv() { [ "$1" = run ] || return 2; shift; "$@"; }\n'
    script = f"set -eo pipefail\n{fallback}{command.setup}\n{text}\n"
    return subprocess.run(["bash", "-c", script], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=300)


def how_it_is_run(command: Command) -> str:
    """A documented command as the test runs it: snakemake as a dry run, anything else with --help."""
    return f"{command.text} -n" if command.program == "snakemake" else f"{command.text} --help"


@pytest.fixture(scope="module")
def command_runs(checkout, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every documented command (but torchrun's) run once, one per core at a time: each run is mostly Python
    starting and importing, and one after the other they took 4 minutes."""
    from concurrent.futures import ThreadPoolExecutor

    runnable = [c for c in COMMANDS if c.program != "torchrun"]
    tmp_dirs = [tmp_path_factory.mktemp("command") for _ in runnable]
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        runs = pool.map(lambda c, tmp: run_in_bash(c, how_it_is_run(c), checkout, tmp), runnable, tmp_dirs)
        return {c.text: proc for c, proc in zip(runnable, runs)}


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.source} {c.program}" for c in COMMANDS])
def test_command_runs_as_written(command, command_runs):
    if command.program == "torchrun":
        check_torchrun_arguments(command.text)
        return
    proc = command_runs[command.text]
    if command.program == "snakemake":
        output = proc.stdout + proc.stderr
        words = program_words(command.text)
        after_run = [message for option, message in NEEDS_A_FINISHED_RUN.items() if option in words]
        if after_run:
            assert proc.returncode != 0 and after_run[0] in output, output[-3000:]
            return
    else:
        output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{command.source}: {command.text}\n{output[-3000:]}"


def check_torchrun_arguments(text: str):
    """torchrun's options and the pre-training module's arguments parse (nothing is started)."""
    from torch.distributed.run import get_args_parser

    from vlbert_core.pretrain.__main__ import parse_args

    words = program_words(text)
    launcher = get_args_parser().parse_args(words[1:])
    assert launcher.module and launcher.training_script == "vlbert_core.pretrain", text
    parse_args(launcher.training_script_args)
