"""The README's "Use it from PyTorch" section is true: its install command is the one
launch/setup.sh --tests runs into .venv (so the package the tests import is installed that way),
its run command runs as printed (from the repository root: .venv/ and python/ are the
repository's; the run folder lands in WORK_DIR) with the installed package (no PYTHONPATH), its
code lines are those of python/examples/ddp_guard.py, the run prints the lines the README shows
(numbers may differ in value with the CPU, never in form), and `lockstep diag` names rank 1 and
the poisoned sample in its events.

    python tests/python/readme_example.py LOCKSTEP_BIN WORK_DIR
"""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
NUMBER = re.compile(r"-?\d+(\.\d+)?(e[-+]?\d+)?")


def section(text, title):
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start:end if end >= 0 else len(text)]


def blocks(text):
    return re.findall(r"```(\w*)\n(.*?)```", text, re.S)


def commands(readme):
    """The sh block's two commands: the install, checked against launch/setup.sh's, and the run
    as argv with the repository's relative paths made absolute."""
    install, run = [b for lang, b in blocks(readme) if lang == "sh"][0].strip().splitlines()
    assert install == ".venv/bin/pip install --no-build-isolation .", install
    with open(os.path.join(ROOT, "launch", "setup.sh"), encoding="utf-8") as f:
        setup = f.read()
    assert '"$venv/bin/pip" install --disable-pip-version-check --no-build-isolation .)' in setup
    argv = shlex.split(run)
    return [os.path.join(ROOT, a) if a.startswith((".venv/", "python/")) else a for a in argv]


def main():
    binary, work = sys.argv[1:3]
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = section(f.read(), "## Use it from PyTorch")
    example_path = os.path.join(ROOT, "python", "examples", "ddp_guard.py")
    with open(example_path, encoding="utf-8") as f:
        example = " ".join(f.read().split())
    (_, code), (_, shown) = [b for b in blocks(readme) if b[0] in ("python", "")][:2]
    for statement in re.split(r"\n(?= {0,12}\S)", code.strip()):  # continuations: deeper
        assert " ".join(statement.split()) in example, f"README code not in the example: {statement}"

    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the installed package
    run = subprocess.run(commands(readme), cwd=work, env=env, capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    printed = [NUMBER.sub("N", line) for line in (run.stdout + run.stderr).splitlines()]
    for line in shown.strip().splitlines():
        assert NUMBER.sub("N", line) in printed, f"README line not printed by the example:\n{line}"

    diag = subprocess.run([binary, "diag", "--json", "runs/ddp_guard"], cwd=work,
                          capture_output=True, text=True, check=True)
    summary = json.loads(diag.stdout)
    assert summary["skips"] == 1 and summary["events"][0]["culprit_ranks"] == [1], diag.stdout
    assert summary["quarantine"] == [30 * 100 + 8 + 7], summary["quarantine"]
    print("readme example: ok")


if __name__ == "__main__":
    main()
